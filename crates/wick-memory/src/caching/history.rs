//! An optional ring buffer of allocator events (PyTorch's `_record_memory_history`): every
//! alloc, free and segment change with the allocated/reserved totals after it, for timelines.

use std::collections::VecDeque;
use std::time::Instant;

/// What happened.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Action {
    /// A block was handed out.
    Alloc,
    /// The user returned a block (it may still await stream events).
    FreeRequested,
    /// The block went back into the cache.
    FreeCompleted,
    /// A segment was reserved from the backend.
    SegmentAlloc,
    /// A segment was returned to the backend.
    SegmentFree,
    /// A request failed with out-of-memory.
    Oom,
}

/// One recorded event.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct HistoryEntry {
    /// Position in the whole history (not reset when the ring drops old entries).
    pub seq: u64,
    /// Nanoseconds since recording started.
    pub time_ns: u64,
    /// What happened.
    pub action: Action,
    /// Address of the block or segment.
    pub addr: u64,
    /// Bytes of the block or segment (requested bytes for `Oom`).
    pub size: usize,
    /// Stream.
    pub stream: u64,
    /// Allocated bytes after the event.
    pub allocated: i64,
    /// Reserved bytes after the event.
    pub reserved: i64,
}

/// The ring buffer; disabled by default (one branch per event).
#[derive(Debug, Default)]
pub(crate) struct History {
    max_entries: usize,
    entries: VecDeque<HistoryEntry>,
    next_seq: u64,
    start: Option<Instant>,
}

impl History {
    pub fn enabled(&self) -> bool {
        self.max_entries > 0
    }

    /// Starts (max_entries > 0) or stops (0) recording; keeps what was recorded.
    pub fn set_max_entries(&mut self, max_entries: usize) {
        self.max_entries = max_entries;
        if self.start.is_none() {
            self.start = Some(Instant::now());
        }
        while self.entries.len() > max_entries {
            self.entries.pop_front();
        }
    }

    pub fn push(&mut self, action: Action, addr: u64, size: usize, stream: u64, allocated: i64, reserved: i64) {
        let time_ns = self.start.map_or(0, |s| s.elapsed().as_nanos() as u64);
        if self.entries.len() == self.max_entries {
            self.entries.pop_front();
        }
        self.entries.push_back(HistoryEntry {
            seq: self.next_seq,
            time_ns,
            action,
            addr,
            size,
            stream,
            allocated,
            reserved,
        });
        self.next_seq += 1;
    }

    pub fn entries(&self) -> Vec<HistoryEntry> {
        self.entries.iter().cloned().collect()
    }
}

/// The blocks live when allocated memory peaked in `history`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PeakLive {
    /// Allocated bytes at the peak (0 for an empty history).
    pub allocated: usize,
    /// The live blocks then, as (address, bytes), in address order.
    pub blocks: Vec<(u64, usize)>,
}

/// What was live at the allocated peak of `history` (the first entry reaching it): blocks enter
/// the live set when handed out and leave it when the user returns them, as PyTorch's memory
/// viewer counts them (a block awaiting stream events is no longer the user's).
pub fn peak_live(history: &[HistoryEntry]) -> PeakLive {
    let mut live = std::collections::BTreeMap::new();
    let mut peak: Option<(i64, Vec<(u64, usize)>)> = None;
    for e in history {
        match e.action {
            Action::Alloc => {
                live.insert(e.addr, e.size);
            }
            Action::FreeRequested => {
                live.remove(&e.addr);
            }
            _ => {}
        }
        if peak.as_ref().is_none_or(|(p, _)| e.allocated > *p) {
            peak = Some((e.allocated, live.iter().map(|(a, s)| (*a, *s)).collect()));
        }
    }
    peak.map_or_else(PeakLive::default, |(allocated, blocks)| PeakLive {
        allocated: usize::try_from(allocated).unwrap_or(0),
        blocks,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(action: Action, addr: u64, size: usize, allocated: i64) -> HistoryEntry {
        HistoryEntry { seq: 0, time_ns: 0, action, addr, size, stream: 0, allocated, reserved: 0 }
    }

    #[test]
    fn peak_live_is_the_live_set_when_allocated_peaked() {
        assert_eq!(peak_live(&[]), PeakLive::default());
        let h = [
            entry(Action::SegmentAlloc, 0, 4096, 0),
            entry(Action::Alloc, 0, 512, 512),
            entry(Action::Alloc, 512, 1024, 1536),
            entry(Action::FreeRequested, 0, 512, 1024),
            entry(Action::FreeCompleted, 0, 512, 1024),
            entry(Action::Alloc, 2048, 256, 1280),
            // A later equal peak does not replace the first.
            entry(Action::Alloc, 3000, 256, 1536),
        ];
        assert_eq!(peak_live(&h), PeakLive { allocated: 1536, blocks: vec![(0, 512), (512, 1024)] });
    }
}
