//! What an output's autograd graph keeps alive: the storages behind it, counted once, parameters
//! excluded. The estimator (`wick_zoo::estimate`) profiles activations with it, and the fused
//! ops' tests compare what a fused node keeps with its composed form.

use std::collections::HashMap;

use candle_core::Tensor;

/// Bytes of the graph behind a tensor: every non-parameter node's storage, counted once.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct GraphBytes {
    /// Sum over distinct storages.
    pub total: usize,
    /// The largest single storage.
    pub largest: usize,
}

/// Counts the storages an output keeps alive through its autograd graph (parameters excluded).
pub fn graph_bytes(output: &Tensor) -> GraphBytes {
    let nodes = output.sorted_nodes();
    let key = |t: &Tensor| std::ptr::from_ref(&*t.storage_and_layout().0).addr();
    // Views of a parameter (its transpose, a broadcast, an embedding table's slice) share the
    // parameter's storage: they are parameter memory, not activations.
    let parameter_storages: std::collections::HashSet<usize> =
        nodes.iter().filter(|n| n.is_variable()).map(|n| key(n)).collect();
    let mut storages: HashMap<usize, usize> = HashMap::new();
    for node in nodes {
        let (storage, layout) = node.storage_and_layout();
        let key = std::ptr::from_ref(&*storage).addr();
        if parameter_storages.contains(&key) {
            continue;
        }
        // The highest element a view reaches; the base tensor of a storage reaches its end.
        let reach = layout.start_offset()
            + layout.dims().iter().zip(layout.stride()).map(|(d, s)| d.saturating_sub(1) * s).sum::<usize>()
            + 1;
        let bytes = reach * node.dtype().size_in_bytes();
        let entry = storages.entry(key).or_insert(0);
        *entry = (*entry).max(bytes);
    }
    GraphBytes { total: storages.values().sum(), largest: storages.values().copied().max().unwrap_or(0) }
}
