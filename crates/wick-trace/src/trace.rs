//! Allocation traces: a JSON list of alloc/free operations that can be replayed through any
//! policy and backend to measure peak memory, fragmentation, retries, OOMs and speed.
//!
//! Format (`version` 1):
//! ```json
//! { "name": "gpt-train", "description": "…",
//!   "ops": [ {"op": "alloc", "id": 1, "size": 4096, "stream": 0}, {"op": "free", "id": 1} ] }
//! ```
//! `id`s name allocations; a `free` must name a live `id`.

use std::collections::HashMap;
use std::time::Instant;

use wick_memory::{
    AllocRequest, AllocatorConfig, Backend, CachingAllocator, MemoryError, MemoryResource, RawBlock, Result,
    SimulatedBackend, StreamId, TraceOp,
};

/// A named sequence of operations.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Trace {
    /// Short name.
    pub name: String,
    /// What workload it models.
    #[serde(default)]
    pub description: String,
    /// The operations in order.
    pub ops: Vec<TraceOp>,
}

impl Trace {
    /// A trace named `name` of recorded operations (e.g. [`wick_memory::EventLog::ops`]).
    pub fn from_ops(name: &str, ops: Vec<TraceOp>) -> Self {
        Trace { name: name.to_string(), description: String::new(), ops }
    }

    /// The trace of a recorded run ([`wick_memory::heap_history`], or the `heap` of a history an
    /// engine recorded): every allocation of at least `min_size` bytes the history saw made,
    /// and its free when the history saw it, in the order they happened (frees of blocks made
    /// before recording are left out). Replayed through a device policy it answers "how would
    /// this run's tensors sit on the device": pass [`wick_memory::LARGE_REQUEST`]-sized
    /// thresholds or so to leave out the host bookkeeping a device would never see.
    pub fn from_heap_history(name: &str, history: &wick_memory::HeapHistory, min_size: usize) -> Self {
        let mut ops: Vec<Option<TraceOp>> = vec![None; history.events.len() * 2];
        for (id, l) in history.lifetimes().into_iter().enumerate().filter(|(_, l)| l.size >= min_size && l.size > 0) {
            // Slot 2i for the allocation at event i, 2i + 1 for the free there.
            ops[2 * l.born] = Some(TraceOp::Alloc { id: id as u64, size: l.size, stream: 0 });
            if let Some(f) = l.freed {
                ops[2 * f + 1] = Some(TraceOp::Free { id: id as u64 });
            }
        }
        let mut trace = Trace::from_ops(name, ops.into_iter().flatten().collect());
        trace.description = format!(
            "recorded run: {} heap events of ≥ {} bytes, {} before the window dropped; allocations ≥ {min_size} bytes",
            history.events.len(),
            history.min_size,
            history.dropped
        );
        trace
    }

    /// Parses and validates a trace.
    pub fn from_json(text: &str) -> Result<Self> {
        let trace: Trace = serde_json::from_str(text).map_err(|e| MemoryError::InvalidTrace(e.to_string()))?;
        trace.validate()?;
        Ok(trace)
    }

    /// Reads and validates a trace file; errors name the file.
    pub fn from_file(path: &std::path::Path) -> Result<Self> {
        let text =
            std::fs::read_to_string(path).map_err(|e| MemoryError::InvalidTrace(format!("{}: {e}", path.display())))?;
        Self::from_json(&text).map_err(|e| MemoryError::InvalidTrace(format!("{}: {e}", path.display())))
    }

    /// Pretty JSON, one op per line.
    pub fn to_json(&self) -> String {
        let ops: Vec<String> = self.ops.iter().map(|op| serde_json::to_string(op).unwrap_or_default()).collect();
        format!(
            "{{\n  \"name\": {},\n  \"description\": {},\n  \"ops\": [\n    {}\n  ]\n}}\n",
            serde_json::Value::String(self.name.clone()),
            serde_json::Value::String(self.description.clone()),
            ops.join(",\n    ")
        )
    }

    /// Checks that sizes are positive, ids are not reused while live, and frees name live ids.
    pub fn validate(&self) -> Result<()> {
        let mut live = std::collections::HashSet::new();
        for (index, op) in self.ops.iter().enumerate() {
            match op {
                TraceOp::Alloc { id, size, .. } => {
                    if *size == 0 {
                        return Err(MemoryError::InvalidTrace(format!("op {index}: alloc {id} has size 0")));
                    }
                    if !live.insert(*id) {
                        return Err(MemoryError::InvalidTrace(format!("op {index}: id {id} is already live")));
                    }
                }
                TraceOp::Free { id } => {
                    if !live.remove(id) {
                        return Err(MemoryError::InvalidTrace(format!("op {index}: free of unknown id {id}")));
                    }
                }
            }
        }
        Ok(())
    }

    /// The streams the trace uses.
    pub fn streams(&self) -> std::collections::BTreeSet<StreamId> {
        self.ops
            .iter()
            .filter_map(|op| match op {
                TraceOp::Alloc { stream, .. } => Some(StreamId(*stream)),
                TraceOp::Free { .. } => None,
            })
            .collect()
    }

    /// Largest number of bytes live at once (requested sizes): a lower bound on any allocator.
    pub fn peak_live_bytes(&self) -> usize {
        let mut sizes = HashMap::new();
        let (mut live, mut peak) = (0usize, 0usize);
        for op in &self.ops {
            match op {
                TraceOp::Alloc { id, size, .. } => {
                    sizes.insert(*id, *size);
                    live += size;
                    peak = peak.max(live);
                }
                TraceOp::Free { id } => live -= sizes.remove(id).unwrap_or(0),
            }
        }
        peak
    }
}

/// What a replay measured.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct ReplayReport {
    /// Trace name.
    pub name: String,
    /// Operations replayed.
    pub ops: usize,
    /// Peak of requested bytes live.
    pub peak_requested: usize,
    /// Peak of allocated bytes (block sizes).
    pub peak_allocated: usize,
    /// Peak of reserved bytes.
    pub peak_reserved: usize,
    /// `peak_reserved / peak_allocated`.
    pub fragmentation: f64,
    /// Cache flushes followed by a retry.
    pub retries: u64,
    /// Allocations that failed with out-of-memory.
    pub ooms: u64,
    /// Segments allocated from the backend.
    pub device_allocs: u64,
    /// Operations per second of the replay loop.
    pub ops_per_sec: f64,
}

/// Replays `trace` on a fresh simulated device of `capacity` bytes under `config`, with the
/// streams the trace names opened on it.
pub fn replay_simulated(trace: &Trace, capacity: usize, config: AllocatorConfig) -> Result<ReplayReport> {
    let backend = SimulatedBackend::new(capacity);
    for stream in trace.streams() {
        backend.streams().ensure_stream(stream);
    }
    replay(trace, &CachingAllocator::with_config(backend, config)?)
}

/// Replays `trace` through `allocator`. Allocations that fail with out-of-memory are counted and
/// their later frees skipped; any other error stops the replay.
pub fn replay<B: Backend>(trace: &Trace, allocator: &CachingAllocator<B>) -> Result<ReplayReport> {
    trace.validate()?;
    allocator.reset_peak_stats();
    let mut live: HashMap<u64, RawBlock> = HashMap::with_capacity(1024);
    let mut ooms = 0;
    let start = Instant::now();
    for op in &trace.ops {
        match op {
            TraceOp::Alloc { id, size, stream } => {
                match allocator.allocate_raw(AllocRequest::new(*size).on_stream(StreamId(*stream))) {
                    Ok(block) => {
                        live.insert(*id, block);
                    }
                    Err(e) if e.is_out_of_memory() => ooms += 1,
                    Err(e) => return Err(e),
                }
            }
            TraceOp::Free { id } => {
                if let Some(block) = live.remove(id) {
                    allocator.deallocate_raw(block)?;
                }
            }
        }
    }
    let elapsed = start.elapsed().as_secs_f64();
    for (_, block) in live.drain() {
        allocator.deallocate_raw(block)?;
    }
    let stats = allocator.memory_stats();
    let peak_allocated = stats.allocated_bytes.all.peak.max(0) as usize;
    let peak_reserved = stats.reserved_bytes.all.peak.max(0) as usize;
    Ok(ReplayReport {
        name: trace.name.clone(),
        ops: trace.ops.len(),
        peak_requested: stats.requested_bytes.all.peak.max(0) as usize,
        peak_allocated,
        peak_reserved,
        fragmentation: if peak_allocated > 0 { peak_reserved as f64 / peak_allocated as f64 } else { 0.0 },
        retries: stats.num_alloc_retries,
        ooms,
        device_allocs: stats.num_device_alloc,
        ops_per_sec: if elapsed > 0.0 { trace.ops.len() as f64 / elapsed } else { f64::INFINITY },
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn malformed_traces_are_clear_errors() {
        for (text, needle) in [
            ("not json", "expected"),
            (r#"{"name":"x","ops":[{"op":"free","id":1}]}"#, "unknown id 1"),
            (r#"{"name":"x","ops":[{"op":"alloc","id":1,"size":0}]}"#, "size 0"),
            (r#"{"name":"x","ops":[{"op":"alloc","id":1,"size":5},{"op":"alloc","id":1,"size":5}]}"#, "already live"),
            (r#"{"name":"x","ops":[{"op":"alloc","id":1,"size":-5}]}"#, "invalid value"),
            (r#"{"name":"x","ops":[{"op":"grow","id":1}]}"#, "unknown variant"),
            (r#"{"name":"x","ops":[],"extra":1}"#, "unknown field"),
        ] {
            let err = Trace::from_json(text).unwrap_err().to_string();
            assert!(err.contains(needle), "{text}: {err}");
        }
    }

    #[test]
    fn round_trips_and_counts_peak() {
        let trace = Trace {
            name: "t".into(),
            description: "d".into(),
            ops: vec![
                TraceOp::Alloc { id: 1, size: 10, stream: 0 },
                TraceOp::Alloc { id: 2, size: 20, stream: 1 },
                TraceOp::Free { id: 1 },
                TraceOp::Alloc { id: 3, size: 5, stream: 0 },
            ],
        };
        assert_eq!(Trace::from_json(&trace.to_json()).unwrap(), trace);
        assert_eq!(trace.peak_live_bytes(), 30);
    }
}

#[cfg(test)]
mod history_tests {
    use wick_memory::{HeapAction, HeapEvent, HeapHistory, LabelId};

    use super::*;

    #[test]
    fn a_recorded_history_becomes_a_valid_trace_of_its_live_set() {
        let e = |action, addr, size| HeapEvent { time_ns: 0, action, addr, size, label: LabelId::ROOT };
        let mut history = HeapHistory::default();
        history.events = vec![
            e(HeapAction::Free, 7, 4096), // made before recording: not in the trace
            e(HeapAction::Alloc, 1, 1 << 20),
            e(HeapAction::Alloc, 2, 2048), // below the threshold
            e(HeapAction::Alloc, 3, 3 << 20),
            e(HeapAction::Free, 1, 1 << 20),
            e(HeapAction::Alloc, 1, 2 << 20), // the address reused: a new id
            e(HeapAction::Free, 2, 2048),
        ];
        let trace = Trace::from_heap_history("run", &history, 4096);
        trace.validate().unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(trace.ops.len(), 4);
        assert_eq!(trace.peak_live_bytes(), 5 << 20);
        let again = Trace::from_json(&trace.to_json()).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(again, trace);
        let report = replay_simulated(&trace, 1 << 30, AllocatorConfig::default()).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(report.peak_requested, 5 << 20);
    }
}
