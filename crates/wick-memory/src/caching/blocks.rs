//! Blocks, segments and the two free pools. A segment is one backend allocation; it is tiled
//! by blocks linked in address order. Free blocks sit in a pool ordered by (tag, size, address),
//! so a best fit for a stream is one ordered-set lookup.

use std::collections::BTreeSet;

use crate::stats::{signed, MemoryStats, PoolKind};
use crate::stream::{EventId, StreamId};

/// Pool tag of free blocks that are safe to hand to any stream (their last stream is done).
pub(crate) const SHARED: u64 = u64::MAX;

#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum BlockState {
    /// In a free pool.
    Free,
    /// Handed out.
    Allocated,
    /// Returned by the user but still awaiting these events (record_stream) before reuse.
    PendingFree(Vec<EventId>),
    /// Free, kept unmerged in the allocator's small exact-size cache for O(1) reuse.
    Parked,
}

#[derive(Debug, Clone)]
pub(crate) struct Block {
    pub segment: u32,
    /// The pool of its segment (kept here so the hot path needs no segment lookup).
    pub pool: PoolKind,
    /// True inside an expandable segment (split freely; released by unmapping pages).
    pub expandable: bool,
    pub addr: u64,
    pub size: usize,
    pub requested: usize,
    /// The stream that last used the block.
    pub stream: StreamId,
    /// Pool tag while free: the last stream's id, or `SHARED`.
    pub tag: u64,
    pub state: BlockState,
    pub prev: Option<u32>,
    pub next: Option<u32>,
    /// Bumped each time the slot is reused, so stale handles are detected.
    pub generation: u32,
    /// Value of the free counter when the block was last freed (cross-stream harvesting).
    pub free_epoch: u64,
    /// Value of the allocation counter when the block was last freed (garbage-collection age).
    pub freed_at: u64,
    /// Other streams the block was used on (record_stream).
    pub extra_streams: Vec<StreamId>,
}

impl Block {
    pub fn is_split(&self) -> bool {
        self.prev.is_some() || self.next.is_some()
    }
}

#[derive(Debug, Clone)]
pub(crate) struct Segment {
    pub addr: u64,
    /// Bytes mapped (for an expandable segment, the mapped prefix of its reservation).
    pub size: usize,
    /// Address space reserved, for expandable segments.
    pub reservation: Option<usize>,
    pub stream: StreamId,
    pub pool: PoolKind,
    pub first_block: u32,
}

/// Key of a free block in its pool.
pub(crate) type PoolKey = (u64, usize, u64, u32);

/// A vector with reusable slots; indices stay valid while the entry lives.
#[derive(Debug)]
pub(crate) struct Slab<T> {
    entries: Vec<Option<T>>,
    vacant: Vec<u32>,
}

impl<T> Default for Slab<T> {
    fn default() -> Self {
        Slab { entries: Vec::new(), vacant: Vec::new() }
    }
}

impl<T> Slab<T> {
    pub fn insert(&mut self, value: T) -> u32 {
        match self.vacant.pop() {
            Some(i) => {
                self.entries[i as usize] = Some(value);
                i
            }
            None => {
                self.entries.push(Some(value));
                (self.entries.len() - 1) as u32
            }
        }
    }

    pub fn remove(&mut self, index: u32) -> Option<T> {
        let value = self.entries.get_mut(index as usize)?.take();
        if value.is_some() {
            self.vacant.push(index);
        }
        value
    }

    pub fn get(&self, index: u32) -> Option<&T> {
        self.entries.get(index as usize)?.as_ref()
    }

    pub fn get_mut(&mut self, index: u32) -> Option<&mut T> {
        self.entries.get_mut(index as usize)?.as_mut()
    }

    pub fn iter(&self) -> impl Iterator<Item = (u32, &T)> {
        self.entries.iter().enumerate().filter_map(|(i, e)| e.as_ref().map(|v| (i as u32, v)))
    }
}

/// Blocks, segments and free pools, with the statistics that depend only on them.
#[derive(Debug, Default)]
pub(crate) struct BlockTable {
    pub blocks: Slab<Block>,
    pub segments: Slab<Segment>,
    pub small: BTreeSet<PoolKey>,
    pub large: BTreeSet<PoolKey>,
    /// Generation counters survive slot reuse.
    generations: Vec<u32>,
}

impl BlockTable {
    pub fn block(&self, slot: u32) -> &Block {
        // Slots come from the table's own links and pools, which only name live blocks.
        self.blocks.get(slot).unwrap_or_else(|| unreachable!("dangling block slot {slot}"))
    }

    pub fn block_mut(&mut self, slot: u32) -> &mut Block {
        self.blocks.get_mut(slot).unwrap_or_else(|| unreachable!("dangling block slot {slot}"))
    }

    pub fn segment_pool(&self, slot: u32) -> PoolKind {
        self.block(slot).pool
    }

    pub fn insert_block(&mut self, block: Block) -> u32 {
        let slot = self.blocks.insert(block);
        if self.generations.len() <= slot as usize {
            self.generations.resize(slot as usize + 1, 0);
        }
        let generation = self.generations[slot as usize].wrapping_add(1);
        self.generations[slot as usize] = generation;
        self.block_mut(slot).generation = generation;
        slot
    }

    pub fn remove_block(&mut self, slot: u32) -> Option<Block> {
        self.blocks.remove(slot)
    }

    pub fn pool_set(&mut self, pool: PoolKind) -> &mut BTreeSet<PoolKey> {
        match pool {
            PoolKind::Small => &mut self.small,
            PoolKind::Large => &mut self.large,
        }
    }

    fn key(&self, slot: u32) -> PoolKey {
        let b = self.block(slot);
        (b.tag, b.size, b.addr, slot)
    }

    /// Puts a free block into its pool, counting it as inactive-split when its segment is split.
    pub fn pool_insert(&mut self, slot: u32, stats: &mut MemoryStats) {
        let pool = self.segment_pool(slot);
        let key = self.key(slot);
        let block = self.block(slot);
        debug_assert!(block.state == BlockState::Free, "pooling block {slot}, which is not free");
        self.debug_assert_links(slot);
        count_inactive_split(stats, pool, block, 1);
        let inserted = self.pool_set(pool).insert(key);
        debug_assert!(inserted, "block {slot} was already in its pool");
    }

    /// Takes a free block out of its pool (the inverse of `pool_insert`).
    pub fn pool_remove(&mut self, slot: u32, stats: &mut MemoryStats) {
        let pool = self.segment_pool(slot);
        let key = self.key(slot);
        count_inactive_split(stats, pool, self.block(slot), -1);
        let removed = self.pool_set(pool).remove(&key);
        debug_assert!(removed, "block {slot} was not in its pool (its key changed while pooled?)");
    }

    /// Checks, in debug builds, what every link and unlink must keep (as PyTorch's allocator
    /// asserts at each): a block's neighbours point back at it, share its segment, and touch it
    /// with no gap or overlap.
    pub fn debug_assert_links(&self, slot: u32) {
        if !cfg!(debug_assertions) {
            return;
        }
        let b = self.block(slot);
        if let Some(p) = b.prev {
            let p = self.block(p);
            debug_assert_eq!(p.next, Some(slot), "block {slot}: its previous block does not link back");
            debug_assert_eq!(p.segment, b.segment, "block {slot}: previous block in another segment");
            debug_assert_eq!(p.addr + p.size as u64, b.addr, "block {slot}: gap or overlap before it");
        }
        if let Some(n) = b.next {
            let n = self.block(n);
            debug_assert_eq!(n.prev, Some(slot), "block {slot}: its next block does not link back");
            debug_assert_eq!(n.segment, b.segment, "block {slot}: next block in another segment");
            debug_assert_eq!(b.addr + b.size as u64, n.addr, "block {slot}: gap or overlap after it");
        }
    }

    /// The smallest free block of `pool` tagged `tag` with at least `size` bytes.
    pub fn best_fit(&self, pool: PoolKind, tag: u64, size: usize) -> Option<PoolKey> {
        let set = match pool {
            PoolKind::Small => &self.small,
            PoolKind::Large => &self.large,
        };
        set.range((tag, size, 0, 0)..=(tag, usize::MAX, u64::MAX, u32::MAX)).next().copied()
    }

    /// All free blocks tagged `tag`, in both pools.
    pub fn free_with_tag(&self, tag: u64) -> Vec<u32> {
        let range = (tag, 0, 0, 0)..=(tag, usize::MAX, u64::MAX, u32::MAX);
        self.small.range(range.clone()).chain(self.large.range(range)).map(|k| k.3).collect()
    }

    /// True when any free block carries `tag`.
    pub fn has_free_with_tag(&self, tag: u64) -> bool {
        let range = (tag, 0, 0, 0)..=(tag, usize::MAX, u64::MAX, u32::MAX);
        self.small.range(range.clone()).next().is_some() || self.large.range(range).next().is_some()
    }

    /// Free blocks that fill a whole segment (releasable to the backend).
    pub fn unsplit_free(&self, pool: PoolKind) -> Vec<u32> {
        let set = match pool {
            PoolKind::Small => &self.small,
            PoolKind::Large => &self.large,
        };
        set.iter().map(|k| k.3).filter(|&s| !self.block(s).is_split() && !self.block(s).expandable).collect()
    }

    /// Size of the largest free block in either pool.
    pub fn largest_free(&self) -> usize {
        self.small.iter().chain(self.large.iter()).map(|k| k.1).max().unwrap_or(0)
    }

    /// The last block of a segment.
    pub fn last_block(&self, segment: &Segment) -> Option<u32> {
        if segment.first_block == u32::MAX {
            return None;
        }
        let mut slot = segment.first_block;
        while let Some(next) = self.block(slot).next {
            slot = next;
        }
        Some(slot)
    }

    /// Blocks of a segment in address order.
    pub fn segment_blocks(&self, segment: &Segment) -> Vec<u32> {
        let mut out = Vec::new();
        let mut cursor = (segment.first_block != u32::MAX).then_some(segment.first_block);
        while let Some(slot) = cursor {
            out.push(slot);
            cursor = self.block(slot).next;
        }
        out
    }
}

/// The one rule for the inactive-split statistics (PyTorch's `inactive_split`): a cached block —
/// free in a pool, or parked — counts while it has a neighbour in its segment. Every change that
/// makes a block cached or not, or gives a cached block a neighbour or takes one away, calls this
/// before (`sign` −1) and after (`sign` +1) or once with the sign of the change. Inlined, so the
/// parking fast path pays nothing for sharing it.
#[inline(always)]
pub(super) fn count_inactive_split(stats: &mut MemoryStats, pool: PoolKind, block: &Block, sign: i64) {
    if block.is_split() {
        stats.inactive_split.update(pool, sign);
        stats.inactive_split_bytes.update(pool, sign * signed(block.size));
    }
}
