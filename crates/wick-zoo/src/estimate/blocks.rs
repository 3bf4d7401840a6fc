//! The parameters a model's blocks take, which ZeRO stage 3 (wick-train's `Sharding::Parameters`)
//! gathers one block at a time, and the stand-in for stage 3's gather and reduce that a
//! profile runs the blocks through ([`BlockRecorder`]).
//!
//! A stage-3 rank runs every block through [`wick_nn::checkpoint::Checkpointing::sharded`]: the
//! block's parameters whole only while it runs (recomputed in backward, or kept and gathered
//! again into the tensors whose pages went back after its forward pass), its gradients handed
//! over as its backward ends and never kept in the gradient store. Profiled through the recorder, a training step holds
//! and frees what a rank's holds at the same points — the received bytes and the fresh
//! variables of a gather, the gradients widened into the reduce-scatter's send buffer and the
//! received section beside them — at the rank count it is made for, so the profile's backward
//! workspace is the stage-3 step's and not the replicated one's. The recorder also learns which
//! parameters the blocks take, and the largest block, from the same pass.

use std::collections::HashMap;
use std::hint::black_box;
use std::sync::Mutex;

use candle_core::{Result, Tensor, TensorId, Var};

use wick_nn::checkpoint::ShardedBlocks;
use wick_nn::params::Params;

/// Where a model's parameter bytes are under ZeRO stage 3.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct BlockBytes {
    /// Blocks (checkpoint segments) a forward pass runs.
    pub blocks: usize,
    /// Parameter tensors of the model.
    pub tensors: usize,
    /// The model's buffers (batch-norm statistics): whole on every rank.
    pub buffers: usize,
    /// Parameters read outside every block (embeddings, a head, a stem), in their dtypes: whole
    /// on every rank, as FSDP's root unit.
    pub outside: usize,
    /// The same at 4 bytes an element.
    pub outside_f32: usize,
    /// The largest parameter read outside every block, in its dtype (gathered back after the
    /// update beside the rest).
    pub outside_largest: usize,
    /// The same at 4 bytes an element (its gradient widened for the reduction).
    pub outside_largest_f32: usize,
    /// The largest send buffer the reduction of a parameter read outside the blocks fills: its
    /// gradient widened and padded to the ranks, or nothing for an f32 gradient that splits
    /// evenly over them (sent from where it lies).
    pub outside_largest_sent: usize,
    /// Every block's parameters at 4 bytes an element.
    pub inside_f32: usize,
    /// Bytes of the model's own copies of block parameters that stay after stage 3 hands them
    /// back: the heap returns whole pages of its large blocks only, so a parameter below
    /// `wick::memory::LARGE_REQUEST` stays whole, and a large one keeps its partial pages at
    /// either end (two pages counted).
    pub kept: usize,
    /// The largest block's parameters, in their dtypes (what one gather holds whole).
    pub largest: usize,
    /// The same at 4 bytes an element (what its reduce-scatter sends).
    pub largest_f32: usize,
}

impl BlockBytes {
    /// The same model with `layers` copies of its one block (a decoder profiled through one
    /// layer, see [`crate::registry::ModelSpec::profile_sharded`]).
    pub fn with_layers(&self, layers: usize) -> Self {
        // Counted high (every tensor once per layer): it bounds the pieces' rounding.
        let tensors = self.tensors.saturating_mul(layers.max(1));
        BlockBytes {
            blocks: layers,
            tensors,
            inside_f32: self.largest_f32.saturating_mul(layers),
            kept: self.kept.saturating_mul(layers),
            ..*self
        }
    }
}

/// The page size the estimate assumes (x86-64's and most ARM Linux kernels'; a larger page
/// only keeps more of a large parameter's ends, a few KiB per parameter).
const PAGE: usize = 4096;

struct Seen {
    /// The parameters of each block, in the order of the forward pass (first pass only).
    blocks: Vec<Vec<TensorId>>,
    known: HashMap<TensorId, usize>,
}

/// A [`ShardedBlocks`] that keeps every parameter in the process and does at each gather and
/// reduce the allocations a stage-3 rank of `world` does there (see the module documentation),
/// recording which parameters each block takes.
pub struct BlockRecorder {
    world: usize,
    /// Each parameter's name, bytes and elements.
    params: HashMap<TensorId, (String, usize, usize)>,
    buffers: usize,
    seen: Mutex<Seen>,
    /// The reduced gradients' pieces, kept as a rank keeps them until its update.
    pieces: Mutex<Vec<Vec<f32>>>,
    /// The last block's reduce-scatter in flight: its send and receive buffers, and the sizes
    /// of the pieces it will give.
    in_flight: Mutex<Option<InFlight>>,
    /// Whether the blocks keep their activations (wick-train's `DataParallelOptions::recompute`
    /// off): the gathered values released after each block's forward pass and gathered again
    /// for its backward.
    keep: bool,
}

type InFlight = (Vec<f32>, Vec<f32>, Vec<usize>);

fn bytes_of(t: &Tensor) -> usize {
    t.elem_count() * t.dtype().size_in_bytes()
}

impl BlockRecorder {
    /// A recorder for the parameters `params`, standing in for a rank of `world`.
    pub fn new(params: &Params, world: usize) -> Self {
        let buffers = params.buffers().map(|(_, b)| bytes_of(&b.get())).sum();
        let params = params
            .iter()
            .map(|(name, v)| (v.as_tensor().id(), (name.clone(), bytes_of(v.as_tensor()), v.elem_count())))
            .collect();
        BlockRecorder {
            world: world.max(1),
            params,
            buffers,
            seen: Mutex::new(Seen { blocks: Vec::new(), known: HashMap::new() }),
            pieces: Mutex::new(Vec::new()),
            in_flight: Mutex::new(None),
            keep: false,
        }
    }

    /// The same recorder standing in for a rank whose blocks keep their activations (`true`)
    /// or recompute (`false`, the default).
    pub fn keeping_activations(self, keep: bool) -> Self {
        BlockRecorder { keep, ..self }
    }

    /// A rank's gather buffers for `weights`: its pieces packed into a send buffer in the
    /// parameters' dtypes (grown as it goes), then every rank's received — the block whole, in
    /// bytes; the send buffer freed. Returns the received bytes, to be dropped by the caller.
    fn gather_buffers(&self, weights: &[Tensor]) -> Vec<u8> {
        let (bytes, _) = self.elems(weights);
        let mut send: Vec<u8> = Vec::new();
        for w in weights {
            let piece = w.elem_count().div_ceil(self.world);
            send.resize(send.len() + piece * w.dtype().size_in_bytes(), 0);
        }
        let recv = black_box(vec![0u8; bytes]);
        drop(black_box(send));
        recv
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Seen> {
        self.seen.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn record(&self, weights: &[Tensor]) {
        let mut seen = self.lock();
        let Some(first) = weights.first() else { return };
        if seen.known.contains_key(&first.id()) {
            return;
        }
        let index = seen.blocks.len();
        for w in weights {
            seen.known.insert(w.id(), index);
        }
        seen.blocks.push(weights.iter().map(Tensor::id).collect());
    }

    /// The bytes recorded so far, and the largest block's name (its parameters' common prefix).
    pub fn bytes(&self) -> (BlockBytes, String) {
        let seen = self.lock();
        let mut out = BlockBytes {
            blocks: seen.blocks.len(),
            tensors: self.params.len(),
            buffers: self.buffers,
            ..BlockBytes::default()
        };
        for (id, (_, bytes, elems)) in &self.params {
            if !seen.known.contains_key(id) {
                out.outside += bytes;
                out.outside_f32 += elems * 4;
                out.outside_largest = out.outside_largest.max(*bytes);
                out.outside_largest_f32 = out.outside_largest_f32.max(elems * 4);
                let even = *bytes == elems * 4 && elems % self.world == 0;
                let sent = if even { 0 } else { elems.div_ceil(self.world) * self.world * 4 };
                out.outside_largest_sent = out.outside_largest_sent.max(sent);
            } else {
                out.inside_f32 += elems * 4;
                out.kept += if *bytes < wick::memory::LARGE_REQUEST { *bytes } else { 2 * PAGE };
            }
        }
        let mut largest_name = String::new();
        for block in &seen.blocks {
            let of = |id: &TensorId| self.params.get(id);
            let bytes: usize = block.iter().filter_map(of).map(|p| p.1).sum();
            if bytes > out.largest {
                out.largest = bytes;
                out.largest_f32 = block.iter().filter_map(of).map(|p| p.2 * 4).sum();
                largest_name = common_prefix(block.iter().filter_map(of).map(|p| p.0.as_str()));
            }
        }
        (out, largest_name)
    }

    /// Drops the reduced gradients' pieces kept since the last call (the end of a step); their
    /// bytes.
    pub fn take_pieces(&self) -> usize {
        self.finish();
        let pieces = std::mem::take(&mut *self.pieces.lock().unwrap_or_else(|p| p.into_inner()));
        pieces.iter().map(|p| p.len() * 4).sum()
    }

    /// Completes the reduce-scatter in flight, as a rank does before the next one (and after
    /// backward): its pieces kept, then its buffers freed.
    fn finish(&self) {
        let Some((send, recv, sizes)) = self.in_flight.lock().unwrap_or_else(|p| p.into_inner()).take() else {
            return;
        };
        let kept = sizes.into_iter().map(|n| black_box(vec![0f32; n]));
        self.pieces.lock().unwrap_or_else(|p| p.into_inner()).extend(kept);
        drop(black_box(send));
        drop(black_box(recv));
    }

    fn elems(&self, weights: &[Tensor]) -> (usize, usize) {
        weights.iter().fold((0, 0), |(b, e), w| (b + bytes_of(w), e + w.elem_count()))
    }
}

/// The dotted prefix the names share (`layers.3` of `layers.3.attn.q` and `layers.3.mlp.up`).
fn common_prefix<'a>(mut names: impl Iterator<Item = &'a str>) -> String {
    let Some(first) = names.next() else { return String::new() };
    let mut parts: Vec<&str> = first.split('.').collect();
    for name in names {
        let same = parts.iter().zip(name.split('.')).take_while(|(a, b)| *a == b).count();
        parts.truncate(same);
    }
    parts.join(".")
}

impl ShardedBlocks for BlockRecorder {
    fn gather(&self, weights: &[Tensor]) -> Result<Vec<Tensor>> {
        self.record(weights);
        // A rank packs each piece (its f32 master, read where it lies) and receives every
        // rank's.
        let recv = self.gather_buffers(weights);
        // Then one fresh variable per parameter, made from the pieces where they lie.
        let mut out = Vec::with_capacity(weights.len());
        for w in weights {
            out.push(Var::from_tensor(&w.detach())?.as_tensor().clone());
        }
        drop(recv);
        Ok(out)
    }

    fn reduce(&self, weights: &[Tensor], grads: Vec<Option<Tensor>>) -> Result<()> {
        // The previous block's reduction completes first.
        self.finish();
        let (_, elems) = self.elems(weights);
        // Every rank's section of the block's gradients in f32 (the block, padded), each
        // gradient copied into it where it lies (a low-precision one widened on its own first);
        // then the reduce-scatter started, its receive buffer beside the send buffer, both in
        // flight until the next block's reduction.
        let section = elems.div_ceil(self.world) + weights.len();
        let send = black_box(vec![0f32; section * self.world]);
        for g in grads.iter().flatten().filter(|g| g.dtype() != candle_core::DType::F32) {
            drop(black_box(vec![0f32; g.elem_count()]));
        }
        let recv = black_box(vec![0f32; section]);
        let sizes = weights.iter().map(|w| w.elem_count().div_ceil(self.world)).collect();
        *self.in_flight.lock().unwrap_or_else(|p| p.into_inner()) = Some((send, recv, sizes));
        drop(grads);
        Ok(())
    }

    fn keeps_activations(&self) -> bool {
        self.keep
    }

    fn regather(&self, weights: &[Tensor], into: &[Tensor]) -> Result<()> {
        // The gather's buffers again, and the released tensors counted live before a rank
        // writes them (their values stay zeros here: a profile reads only sizes).
        let recv = self.gather_buffers(weights);
        into.iter().try_for_each(wick_nn::pages::reclaim)?;
        drop(recv);
        Ok(())
    }
}
