//! The parking cache: freed small blocks are kept unmerged for a while, so the next request of
//! the same size on the same stream is served without touching the ordered pools. This is what
//! makes a steady-state alloc+free pair cost tens of nanoseconds.

use super::blocks::BlockState;
use super::history::Action;
use super::state::{State, PARK_CAPACITY};
use crate::stream::StreamId;

impl State {
    /// Keeps a freed small block unmerged for exact-size reuse; the oldest parked block is
    /// merged into its pool when the cache is full.
    pub(super) fn park(&mut self, slot: u32) {
        if self.parked.len() == PARK_CAPACITY {
            let oldest = self.parked.remove(0);
            self.unpark(oldest);
        }
        let b = self.retire(slot, BlockState::Parked);
        let (size, addr, stream) = (b.size, b.addr, b.stream);
        self.count_inactive_split(slot, 1);
        self.parked.push(slot);
        self.record(Action::FreeCompleted, addr, size, stream);
    }

    /// A parked block of exactly `rounded` bytes last used on `stream`, taken out of the cache.
    pub(super) fn take_parked(&mut self, stream: StreamId, rounded: usize) -> Option<u32> {
        let position = self.parked.iter().rposition(|&s| {
            let b = self.table.block(s);
            b.size == rounded && b.tag == stream.0
        })?;
        let slot = self.parked.swap_remove(position);
        self.leave_park(slot);
        Some(slot)
    }

    /// Moves a parked block into its pool, merging it with free neighbours.
    pub(super) fn unpark(&mut self, slot: u32) {
        self.leave_park(slot);
        self.merge_into_pool(slot);
    }

    /// A parked block becomes an ordinary free block (not yet in a pool).
    fn leave_park(&mut self, slot: u32) {
        self.table.block_mut(slot).state = BlockState::Free;
        self.count_inactive_split(slot, -1);
    }

    /// Parked blocks count as inactive-split while their segment is split, as pooled ones do.
    fn count_inactive_split(&mut self, slot: u32, sign: i64) {
        let b = self.table.block(slot);
        if b.is_split() {
            let (pool, size) = (b.pool, b.size as i64);
            self.stats.inactive_split.update(pool, sign);
            self.stats.inactive_split_bytes.update(pool, sign * size);
        }
    }

    /// Merges every parked block into its pool.
    pub(super) fn flush_parked(&mut self) {
        for slot in std::mem::take(&mut self.parked) {
            self.unpark(slot);
        }
    }
}
