//! The allocation history of a real run (PyTorch's `_record_memory_history` for the host heap):
//! every allocation and free of at least a threshold size that a counting global allocator
//! ([`crate::CachingHeap`], or wick's counting allocator) serves, with its address, size, time
//! and the allocating thread's label stack ([`crate::push_label`]).
//!
//! Off by default, and then one relaxed atomic load per allocation. On, an event is a lock, a
//! clock read and a store into a ring buffer made when recording starts: nothing is allocated
//! while a global allocator records (the ring is the only storage, and it never grows), so the
//! recorder cannot re-enter the allocator it is called from. When the ring is full the oldest
//! events are overwritten, as PyTorch's `max_entries` does; [`HeapHistory::dropped`] says how many.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::Instant;

use crate::error::{MemoryError, Result};
use crate::labels::{current_label, LabelId};

/// What happened to a heap block.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum HeapAction {
    /// The program was handed the block.
    Alloc,
    /// The program returned the block.
    Free,
}

/// One recorded allocation or free.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct HeapEvent {
    /// Nanoseconds since recording started.
    pub time_ns: u64,
    /// Allocation or free.
    pub action: HeapAction,
    /// The address the program was handed.
    pub addr: u64,
    /// Bytes the program asked for.
    pub size: usize,
    /// The allocating (or freeing) thread's label stack ([`crate::label_path`] resolves it).
    pub label: LabelId,
}

/// Allocations below this many bytes are not recorded unless asked (shapes, names and other
/// bookkeeping; a tensor of 256 f32 values is 1 KiB).
pub const DEFAULT_MIN_EVENT_SIZE: usize = 1024;

struct Ring {
    events: Vec<HeapEvent>,
    baseline: usize,
    /// Events written since recording started (the next one goes to `written % capacity`).
    written: u64,
    start: Option<Instant>,
}

thread_local! {
    /// True while this thread makes or frees a copy of the history (see [`OwnCopy`]).
    static UNRECORDED: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Runs `f` with this thread's allocations unrecorded.
fn unrecorded<R>(f: impl FnOnce() -> R) -> R {
    let was = UNRECORDED.try_with(|u| u.replace(true)).unwrap_or(true);
    let result = f();
    let _ = UNRECORDED.try_with(|u| u.set(was));
    result
}

/// An allocation history being recorded: a ring of events made when recording starts, a
/// threshold, and an on/off switch read with one relaxed load. The process heap has one
/// ([`start_heap_history`] and the functions beside it); a device whose allocations are seen
/// another way (the CUDA driver pool, through CUPTI's callbacks) keeps its own in a `static`.
pub struct HistoryRecorder {
    /// Names the memory in errors (`cpu`, `cuda:0`).
    what: &'static str,
    recording: AtomicBool,
    min_size: AtomicUsize,
    capacity: AtomicUsize,
    ring: Mutex<Ring>,
}

static HEAP: HistoryRecorder = HistoryRecorder::new("cpu");

impl HistoryRecorder {
    /// A recorder that is not recording, for memory named `what`.
    pub const fn new(what: &'static str) -> Self {
        HistoryRecorder {
            what,
            recording: AtomicBool::new(false),
            min_size: AtomicUsize::new(DEFAULT_MIN_EVENT_SIZE),
            capacity: AtomicUsize::new(0),
            ring: Mutex::new(Ring { events: Vec::new(), baseline: 0, written: 0, start: None }),
        }
    }

    fn ring(&self) -> std::sync::MutexGuard<'_, Ring> {
        // Every change to the ring is a single store or push that cannot panic half-way.
        self.ring.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Starts recording allocations of at least `min_size` bytes into a new ring of
    /// `max_entries` events (what was recorded before is dropped); `baseline` reads the bytes
    /// held as recording starts (called once the ring is made, just before recording starts).
    /// `OutOfMemory` when the ring itself cannot be allocated; `InvalidConfig` for zero entries.
    pub fn start(&self, max_entries: usize, min_size: usize, baseline: impl FnOnce() -> usize) -> Result<()> {
        if max_entries == 0 {
            return Err(MemoryError::InvalidConfig("record_memory_history: max_entries must be at least 1".into()));
        }
        let bytes = max_entries.saturating_mul(std::mem::size_of::<HeapEvent>());
        let mut events = Vec::new();
        events.try_reserve_exact(max_entries).map_err(|_| {
            crate::OutOfMemory::refused(format!("{} (a history of {max_entries} events)", self.what), bytes)
                .into_error()
        })?;
        self.recording.store(false, Ordering::SeqCst);
        let old = std::mem::replace(&mut self.ring().events, events);
        // Dropped outside the lock (a global allocator's free may call the recorder).
        drop(old);
        let baseline = baseline();
        {
            let mut ring = self.ring();
            ring.written = 0;
            ring.baseline = baseline;
            ring.start = Some(Instant::now());
        }
        self.min_size.store(min_size, Ordering::SeqCst);
        self.capacity.store(max_entries, Ordering::SeqCst);
        self.recording.store(true, Ordering::SeqCst);
        Ok(())
    }

    /// Stops recording; what was recorded stays readable ([`HistoryRecorder::history`]).
    pub fn stop(&self) {
        self.recording.store(false, Ordering::SeqCst);
    }

    /// Whether allocations are being recorded.
    pub fn is_recording(&self) -> bool {
        self.recording.load(Ordering::Relaxed)
    }

    /// Events recorded since recording started (overwritten ones included): a position in the
    /// history that [`HeapHistory::position_of`] maps back to an index of its events.
    pub fn position(&self) -> u64 {
        self.ring().written
    }

    /// Records one allocation or free, if recording and at least the threshold, under the
    /// calling thread's label stack. Allocation-free.
    #[inline]
    pub fn record(&self, action: HeapAction, addr: u64, size: usize) {
        if !self.recording.load(Ordering::Relaxed) || size < self.min_size.load(Ordering::Relaxed) {
            return;
        }
        if UNRECORDED.try_with(std::cell::Cell::get).unwrap_or(true) {
            return;
        }
        self.record_slow(action, addr, size);
    }

    #[cold]
    fn record_slow(&self, action: HeapAction, addr: u64, size: usize) {
        let label = current_label();
        let mut ring = self.ring();
        let capacity = ring.events.capacity();
        if capacity == 0 {
            return;
        }
        let time_ns = ring.start.map_or(0, |s| s.elapsed().as_nanos() as u64);
        let event = HeapEvent { time_ns, action, addr, size, label };
        let slot = (ring.written % capacity as u64) as usize;
        if ring.events.len() < capacity {
            // Within the reserved capacity: no reallocation.
            ring.events.push(event);
        } else {
            ring.events[slot] = event;
        }
        ring.written += 1;
    }

    /// A copy of what was recorded (recording goes on); see [`HeapHistory`] on why the copy
    /// is not itself recorded.
    pub fn history(&self) -> HeapHistory {
        let capacity = self.capacity.load(Ordering::SeqCst);
        // Made before the lock is taken (allocating under it would deadlock the recorder), and
        // not recorded (see `HeapHistory`).
        let mut events = unrecorded(|| Vec::with_capacity(capacity));
        let (written, baseline) = {
            let ring = self.ring();
            let n = ring.events.len().min(capacity);
            let split = if ring.written as usize > n { (ring.written % n.max(1) as u64) as usize } else { 0 };
            events.extend_from_slice(&ring.events[split..n]);
            events.extend_from_slice(&ring.events[..split.min(n)]);
            (ring.written, ring.baseline)
        };
        HeapHistory {
            dropped: written.saturating_sub(events.len() as u64),
            events,
            max_entries: capacity,
            min_size: self.min_size.load(Ordering::SeqCst),
            baseline,
            own_copy: OwnCopy(true),
        }
    }
}

/// Starts recording the heap's allocations of at least `min_size` bytes into a new ring of
/// `max_entries` events (what was recorded before is dropped); `baseline` reads the bytes the
/// program holds as recording starts, as the global allocator counts them. See
/// [`HistoryRecorder::start`].
pub fn start_heap_history(max_entries: usize, min_size: usize, baseline: impl FnOnce() -> usize) -> Result<()> {
    HEAP.start(max_entries, min_size, baseline)
}

/// Stops recording; what was recorded stays readable ([`heap_history`]).
pub fn stop_heap_history() {
    HEAP.stop()
}

/// Whether the heap's allocations are being recorded.
pub fn heap_history_recording() -> bool {
    HEAP.is_recording()
}

/// Events recorded since recording started (overwritten ones included): a position in the
/// history that [`HeapHistory::position_of`] maps back to an index of its events.
pub fn heap_history_position() -> u64 {
    HEAP.position()
}

/// Records one allocation or free, if recording and at least the threshold: for global
/// allocators, which call it for every request they serve. Allocation-free.
#[inline]
pub fn record_heap_event(action: HeapAction, addr: *const u8, size: usize) {
    HEAP.record(action, addr as u64, size)
}

/// What was recorded, oldest first.
///
/// The copy [`heap_history`] makes is not itself recorded — neither its allocation nor, when
/// it is dropped, its free — so reading the history does not show up in it (a copy of a large
/// ring would otherwise be the peak of every history read). Clones and deserialised histories
/// are ordinary allocations, recorded like any other.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct HeapHistory {
    /// The events still in the ring, in the order they happened.
    pub events: Vec<HeapEvent>,
    /// Events overwritten because the ring was full.
    pub dropped: u64,
    /// The ring's size.
    pub max_entries: usize,
    /// Allocations below this size were not recorded.
    pub min_size: usize,
    /// Bytes the program held when recording started.
    pub baseline: usize,
    #[serde(skip)]
    own_copy: OwnCopy,
}

/// Marks the events vector [`heap_history`] allocated unrecorded, so its free goes unrecorded
/// too; a clone is an ordinary allocation (the mark is not cloned).
#[derive(Debug, Default)]
struct OwnCopy(bool);

impl Clone for OwnCopy {
    fn clone(&self) -> Self {
        OwnCopy(false)
    }
}

impl PartialEq for OwnCopy {
    fn eq(&self, _: &Self) -> bool {
        true
    }
}

impl Drop for HeapHistory {
    fn drop(&mut self) {
        if self.own_copy.0 {
            let events = std::mem::take(&mut self.events);
            unrecorded(move || drop(events));
        }
    }
}

/// A copy of the recorded history (recording goes on).
pub fn heap_history() -> HeapHistory {
    HEAP.history()
}

/// One allocation the history saw made, and when it was freed (if it was).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Lifetime {
    /// The address.
    pub addr: u64,
    /// Bytes.
    pub size: usize,
    /// The label stack it was allocated under.
    pub label: LabelId,
    /// Index of its allocation in [`HeapHistory::events`].
    pub born: usize,
    /// Index of its free, if recorded.
    pub freed: Option<usize>,
}

/// Live bytes at a point of the history, grouped by the label stack they were allocated under.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct LabelHolding {
    /// The label stack.
    pub label: LabelId,
    /// Bytes live.
    pub bytes: usize,
    /// Blocks live.
    pub blocks: usize,
}

impl HeapHistory {
    /// The index in [`HeapHistory::events`] of the event recorded at `position`
    /// ([`heap_history_position`] before it was recorded); `None` when it was overwritten or
    /// is not recorded yet.
    pub fn position_of(&self, position: u64) -> Option<usize> {
        let index = usize::try_from(position.checked_sub(self.dropped)?).ok()?;
        (index < self.events.len()).then_some(index)
    }

    /// Every allocation recorded, in order, paired with its free. A free of a block the history
    /// did not see allocated (made before recording started, or below the threshold) pairs with
    /// nothing and is left out.
    pub fn lifetimes(&self) -> Vec<Lifetime> {
        let mut open = std::collections::HashMap::new();
        let mut lifetimes = Vec::new();
        for (i, e) in self.events.iter().enumerate() {
            match e.action {
                HeapAction::Alloc => {
                    open.insert(e.addr, lifetimes.len());
                    lifetimes.push(Lifetime { addr: e.addr, size: e.size, label: e.label, born: i, freed: None });
                }
                HeapAction::Free => {
                    if let Some(k) = open.remove(&e.addr) {
                        let lifetime: &mut Lifetime = &mut lifetimes[k];
                        lifetime.freed = Some(i);
                    }
                }
            }
        }
        lifetimes
    }

    /// Bytes the program held after each event: the [`HeapHistory::baseline`] less the frees of
    /// blocks allocated before recording (frees the history cannot pair), plus the recorded
    /// allocations live. Allocations below the threshold are not in it.
    pub fn live_bytes(&self) -> Vec<usize> {
        let mut delta = vec![0i128; self.events.len()];
        for l in self.lifetimes() {
            delta[l.born] += l.size as i128;
            if let Some(f) = l.freed {
                delta[f] -= l.size as i128;
            }
        }
        let unseen = self.unseen_frees();
        let mut live = 0i128;
        delta
            .iter()
            .zip(&unseen)
            .map(|(d, &gone)| {
                live += d;
                (live.max(0) as usize).saturating_add(self.baseline.saturating_sub(gone))
            })
            .collect()
    }

    /// Bytes of the baseline freed up to and including each event (frees that pair with no
    /// recorded allocation).
    pub fn unseen_frees(&self) -> Vec<usize> {
        let mut open = std::collections::HashSet::new();
        let mut gone = 0usize;
        self.events
            .iter()
            .map(|e| {
                match e.action {
                    HeapAction::Alloc => {
                        open.insert(e.addr);
                    }
                    HeapAction::Free => {
                        if !open.remove(&e.addr) {
                            gone = gone.saturating_add(e.size);
                        }
                    }
                }
                gone
            })
            .collect()
    }

    /// The event after which the program held the most ([`HeapHistory::live_bytes`]), and those bytes (the first
    /// such event when several tie); `None` for an empty history.
    pub fn peak(&self) -> Option<(usize, usize)> {
        let live = self.live_bytes();
        let mut best: Option<(usize, usize)> = None;
        for (i, &bytes) in live.iter().enumerate() {
            if best.is_none_or(|(_, b)| bytes > b) {
                best = Some((i, bytes));
            }
        }
        best
    }

    /// The allocations live just after event `index`.
    pub fn live_after(&self, index: usize) -> Vec<Lifetime> {
        self.lifetimes().into_iter().filter(|l| l.born <= index && l.freed.is_none_or(|f| f > index)).collect()
    }

    /// Recorded bytes live just after event `index` grouped by label stack, largest first (the
    /// rest of [`HeapHistory::live_bytes`] there is the baseline still held:
    /// `baseline - unseen_frees()[index]`).
    pub fn held_after(&self, index: usize) -> Vec<LabelHolding> {
        let mut by_label: std::collections::BTreeMap<LabelId, LabelHolding> = Default::default();
        for l in self.live_after(index) {
            let h = by_label.entry(l.label).or_insert(LabelHolding { label: l.label, bytes: 0, blocks: 0 });
            h.bytes += l.size;
            h.blocks += 1;
        }
        let mut held: Vec<LabelHolding> = by_label.into_values().collect();
        held.sort_by(|a, b| b.bytes.cmp(&a.bytes).then(a.label.cmp(&b.label)));
        held
    }

    /// [`HeapHistory::held_after`] at the [`HeapHistory::peak`] (empty for an empty history).
    pub fn held_at_peak(&self) -> Vec<LabelHolding> {
        self.peak().map(|(i, _)| self.held_after(i)).unwrap_or_default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn event(action: HeapAction, addr: u64, size: usize, label: u32) -> HeapEvent {
        HeapEvent { time_ns: 0, action, addr, size, label: LabelId(label) }
    }

    #[test]
    fn an_empty_ring_is_refused_and_changes_nothing() {
        let was = heap_history_recording();
        assert!(matches!(start_heap_history(0, 0, || 0), Err(MemoryError::InvalidConfig(_))));
        assert_eq!(heap_history_recording(), was);
    }

    #[test]
    fn live_sets_pair_frees_with_the_latest_allocation_at_an_address() {
        use HeapAction::{Alloc, Free};
        let mut history = HeapHistory::default();
        history.events = vec![
            event(Free, 9, 100, 0), // allocated before recording: ignored
            event(Alloc, 1, 10, 1),
            event(Alloc, 2, 20, 2),
            event(Free, 1, 10, 0),
            event(Alloc, 1, 30, 1), // the address again
            event(Alloc, 3, 5, 2),
            event(Free, 1, 30, 0),
        ];
        history.baseline = 120;
        assert_eq!(history.live_bytes(), [20, 30, 50, 40, 70, 75, 45]);
        assert_eq!(history.unseen_frees()[6], 100);
        assert_eq!(history.peak(), Some((5, 75)));
        let held = history.held_at_peak();
        assert_eq!(held[0], LabelHolding { label: LabelId(1), bytes: 30, blocks: 1 });
        assert_eq!(held[1], LabelHolding { label: LabelId(2), bytes: 25, blocks: 2 });
    }
}
