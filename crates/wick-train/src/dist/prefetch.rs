//! ZeRO stage 3's prefetch: which block's gather to start ahead, from the order the last step
//! gathered them in, and the gather in flight.

use super::pending::Pending;
use super::pieces::GatherLayout;

/// A block's gather in flight (prefetched).
pub(super) struct Gathering {
    pub(super) layout: GatherLayout,
    pub(super) pending: Pending<u8>,
}

/// The next block's gather started while the current one runs (FSDP's forward and backward
/// prefetch): the blocks are gathered in the same order every step (forward, then backward's
/// recomputations in reverse), so the last step's order says which block comes next.
#[derive(Default)]
pub(super) struct Prefetch {
    /// Whether it is on ([`super::DataParallelOptions::prefetch`]).
    pub(super) on: bool,
    /// The blocks gathered in the last step, in order.
    last: Vec<Vec<usize>>,
    /// This step's so far.
    this: Vec<Vec<usize>>,
    /// The next block's gather, in flight.
    pub(super) in_flight: Option<Gathering>,
}

impl Prefetch {
    /// Records that block `which` was gathered: the block that came after it in the last step,
    /// while this step has followed the last one's order so far.
    pub(super) fn follow(&mut self, which: Vec<usize>) -> Option<Vec<usize>> {
        let at = self.this.len();
        let next = if self.last.get(at) == Some(&which) { self.last.get(at + 1).cloned() } else { None };
        self.this.push(which);
        next
    }

    /// A step that did not end (it failed): its order so far forgotten (the last whole step's
    /// is kept), and a gather still in flight handed out.
    pub(super) fn abandon(&mut self) -> Option<Gathering> {
        self.this.clear();
        self.in_flight.take()
    }

    /// The end of a step: its order kept for the next, and a gather still in flight handed out.
    pub(super) fn end_step(&mut self) -> Option<Gathering> {
        self.last = std::mem::take(&mut self.this);
        self.in_flight.take()
    }
}
