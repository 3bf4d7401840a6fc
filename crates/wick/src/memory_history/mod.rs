//! A recorded allocation history with its label stacks resolved ([`crate::Engine::memory_history`]),
//! and what can be made of it: the live bytes "held at the peak" grouped by label, a snapshot
//! that PyTorch's memory_viz (pytorch.org/memory_viz) opens, JSON for `wick report`, and a wick
//! trace for `wick replay` (`wick_trace::Trace::from_heap_history`).

use std::collections::BTreeMap;
use std::path::Path;

mod html;

pub use html::DRAWN_ALLOCATIONS;

use wick_memory::{format_bytes, HeapAction, HeapHistory, LabelId};

/// The text for allocations made under no label.
pub const NO_LABEL: &str = "(no label)";

/// What an engine recorded: the heap's allocation history and the label stack of every label
/// id it names.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct MemoryHistory {
    /// The engine's device (`cpu`).
    pub device: String,
    /// The events, oldest first.
    pub heap: HeapHistory,
    /// Label id → label stack, outermost first.
    pub labels: BTreeMap<u32, Vec<String>>,
}

/// Live bytes at the peak of a history, by the label stack they were allocated under.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct HeldAtPeak {
    /// Milliseconds after recording started.
    pub time_ms: f64,
    /// Index of the event after which the peak was reached.
    pub event: usize,
    /// Bytes the program held then ([`HeapHistory::live_bytes`]).
    pub total: usize,
    /// Of those, bytes allocated before recording started and still held, less the history's
    /// own ring.
    pub before_recording: usize,
    /// Of those, the ring the history is recorded into (allocated as recording started).
    pub history_ring: usize,
    /// The rest, by label stack, largest first: (label stack joined by `/`, bytes, blocks).
    pub rows: Vec<(String, usize, usize)>,
}

impl std::fmt::Display for HeldAtPeak {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let share = |b: usize| 100.0 * b as f64 / self.total.max(1) as f64;
        writeln!(f, "held at the peak: {} at {:.1} ms", format_bytes(self.total as u64), self.time_ms)?;
        write!(f, "{:>12} {:>7} {:>7}  label", "bytes", "share", "blocks")?;
        for (label, bytes, blocks) in &self.rows {
            write!(f, "\n{:>12} {:>6.1}% {:>7}  {label}", format_bytes(*bytes as u64), share(*bytes), blocks)?;
        }
        for (what, bytes) in
            [("held before recording started", self.before_recording), ("the history's own ring", self.history_ring)]
        {
            write!(f, "\n{:>12} {:>6.1}% {:>7}  ({what})", format_bytes(bytes as u64), share(bytes), "")?;
        }
        Ok(())
    }
}

impl MemoryHistory {
    /// A label stack as text (`step/forward/layer1.0`), [`NO_LABEL`] for the empty stack.
    pub fn label_text(&self, id: LabelId) -> String {
        match self.labels.get(&id.0) {
            Some(path) if !path.is_empty() => path.join("/"),
            _ => NO_LABEL.to_string(),
        }
    }

    /// The live bytes at the history's peak grouped by label stack; `None` for an empty history.
    pub fn held_at_peak(&self) -> Option<HeldAtPeak> {
        let (event, total) = self.heap.peak()?;
        let gone = self.heap.unseen_frees().get(event).copied().unwrap_or(0);
        let before = self.heap.baseline.saturating_sub(gone);
        let ring = self.heap.max_entries.saturating_mul(std::mem::size_of::<wick_memory::HeapEvent>()).min(before);
        let rows =
            self.heap.held_after(event).into_iter().map(|h| (self.label_text(h.label), h.bytes, h.blocks)).collect();
        Some(HeldAtPeak {
            time_ms: self.heap.events[event].time_ns as f64 / 1e6,
            event,
            total,
            before_recording: before - ring,
            history_ring: ring,
            rows,
        })
    }

    /// The history as PyTorch's memory snapshot (`torch.cuda.memory._snapshot()`, pickled as
    /// `_dump_snapshot` writes it), which pytorch.org/memory_viz opens: `device_traces[0]` holds
    /// one `alloc` per allocation and `free_requested` + `free_completed` per free, times in
    /// microseconds, and frames made from the label stack (innermost first, as Python's are;
    /// `filename` "wick label", `line` the depth). `segments` is empty: the heap has no
    /// device segments to show, so the "Active Memory Timeline" view is the one to open.
    pub fn to_memory_viz(&self) -> Result<Vec<u8>, serde_pickle::Error> {
        let frames_of = |id: LabelId| -> Vec<VizFrame> {
            let path = self.labels.get(&id.0).cloned().unwrap_or_default();
            path.into_iter()
                .enumerate()
                .rev()
                .map(|(i, name)| VizFrame { filename: "wick label".into(), line: i as i64 + 1, name })
                .collect()
        };
        let mut trace = Vec::with_capacity(self.heap.events.len() * 2);
        for e in &self.heap.events {
            let entry = |action: &'static str| VizTraceEntry {
                action,
                addr: e.addr as i64,
                size: e.size as i64,
                stream: 0,
                time_us: (e.time_ns / 1000) as i64,
                frames: frames_of(e.label),
            };
            match e.action {
                HeapAction::Alloc => trace.push(entry("alloc")),
                HeapAction::Free => {
                    trace.push(entry("free_requested"));
                    trace.push(entry("free_completed"));
                }
            }
        }
        let snapshot = VizSnapshot {
            segments: Vec::new(),
            device_traces: vec![trace],
            allocator_settings: BTreeMap::from([("recorded_by".to_string(), format!("wick ({})", self.device))]),
            categories: Vec::new(),
        };
        serde_pickle::to_vec(&snapshot, serde_pickle::SerOptions::new().proto_v2())
    }

    /// evcxr rich display: the HTML report ([`MemoryHistory::to_html`]), and what was held at
    /// the peak as text.
    pub fn evcxr_display(&self) {
        let text = self.held_at_peak().map_or_else(|| "no events recorded".to_string(), |h| h.to_string());
        crate::report::display(&text, &self.to_html(&format!("recorded run on {}", self.device)));
    }

    /// Writes [`MemoryHistory::to_memory_viz`] to `path` (atomically).
    pub fn write_memory_viz(&self, path: &Path) -> std::io::Result<()> {
        let bytes = self.to_memory_viz().map_err(std::io::Error::other)?;
        crate::files::write_atomic(path, &bytes)
    }

    /// Writes the history as JSON (atomically), for `wick report` and `wick replay`.
    pub fn write_json(&self, path: &Path) -> std::io::Result<()> {
        let text = serde_json::to_vec(self).map_err(std::io::Error::other)?;
        crate::files::write_atomic(path, &text)
    }

    /// Reads a history written by [`MemoryHistory::write_json`].
    pub fn from_json(text: &str) -> Result<Self, serde_json::Error> {
        serde_json::from_str(text)
    }

    /// Whether parsed JSON has the shape of a recorded run (an object with `heap` and
    /// `labels`), so readers of several saved formats can tell it from the others.
    pub fn is_recorded_run(value: &serde_json::Value) -> bool {
        value.get("heap").is_some() && value.get("labels").is_some()
    }
}

#[derive(serde::Serialize)]
struct VizSnapshot {
    segments: Vec<()>,
    device_traces: Vec<Vec<VizTraceEntry>>,
    allocator_settings: BTreeMap<String, String>,
    categories: Vec<String>,
}

#[derive(serde::Serialize)]
struct VizTraceEntry {
    action: &'static str,
    addr: i64,
    size: i64,
    stream: i64,
    time_us: i64,
    frames: Vec<VizFrame>,
}

#[derive(serde::Serialize)]
struct VizFrame {
    filename: String,
    line: i64,
    name: String,
}
