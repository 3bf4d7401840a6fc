//! The caching policy: best-fit reuse, splitting and coalescing, stream-ordered reuse, the
//! release path and garbage collection. Mirrors PyTorch's `DeviceCachingAllocator::malloc/free`.

use std::collections::HashMap;

use super::blocks::{Block, BlockState, BlockTable, Segment, SHARED};
use super::history::{Action, History};
use crate::backend::{Backend, BackendError};
use crate::config::AllocatorConfig;
use crate::error::{MemoryError, OutOfMemory, Result};
use crate::stats::{signed, MemoryStats, PoolKind};
use crate::stream::{EventId, StreamId};

/// How many freed small blocks are kept unmerged for exact-size reuse.
pub(super) const PARK_CAPACITY: usize = 32;

/// Mutable allocator state, guarded by the allocator's mutex.
#[derive(Debug)]
pub(crate) struct State {
    pub config: AllocatorConfig,
    pub table: BlockTable,
    pub stats: MemoryStats,
    pub history: History,
    /// Hard cap on reserved bytes.
    pub limit: Option<usize>,
    /// Blocks returned by the user that await events (record_stream).
    pub(super) pending: Vec<u32>,
    /// Per stream with cached blocks: an event recorded on it and the free counter at that time.
    /// Once the event completes, blocks freed on that stream before it are safe on any stream.
    pub(super) harvest: HashMap<u64, (EventId, u64)>,
    /// Streams that have allocated (a handful; a vector beats a set here).
    pub(super) streams_seen: std::collections::BTreeSet<u64>,
    /// Recently freed small blocks, unmerged, for exact-size reuse without touching the pools
    /// (the steady state of a training loop frees and re-requests the same sizes).
    pub(super) parked: Vec<u32>,
    pub(super) free_counter: u64,
    pub(super) alloc_counter: u64,
}

/// One allocation request as the policy sees it (PyTorch's `AllocParams`): made once per malloc
/// and carried down the whole fallback chain, so each size keeps one name.
#[derive(Debug, Clone, Copy)]
pub(super) struct Request {
    /// The user's bytes.
    pub requested: usize,
    /// The block size they round to ([`AllocatorConfig::round_size`]).
    pub rounded: usize,
    /// The stream the block is for.
    pub stream: StreamId,
    /// The pool that block size belongs to.
    pub pool: PoolKind,
}

impl Request {
    pub fn new(config: &AllocatorConfig, requested: usize, rounded: usize, stream: StreamId) -> Self {
        let pool = if config.is_small(rounded) { PoolKind::Small } else { PoolKind::Large };
        Request { requested, rounded, stream, pool }
    }
}

/// Where a block for a request came from.
pub(super) enum Found {
    Cached(u32),
    NewSegment(u32),
}

impl State {
    pub fn new(config: AllocatorConfig, limit: Option<usize>) -> Self {
        let max_split = config.max_split_size;
        let mut state = State {
            config,
            table: BlockTable::default(),
            stats: MemoryStats::default(),
            history: History::default(),
            limit,
            pending: Vec::new(),
            harvest: HashMap::new(),
            streams_seen: std::collections::BTreeSet::from([StreamId::DEFAULT.0]),
            parked: Vec::with_capacity(PARK_CAPACITY),
            free_counter: 0,
            alloc_counter: 0,
        };
        state.stats.max_split_size = i64::try_from(max_split).unwrap_or(i64::MAX);
        state
    }

    pub(super) fn is_oversize(&self, size: usize) -> bool {
        size >= self.config.max_split_size
    }

    pub(super) fn record(&mut self, action: Action, addr: u64, size: usize, stream: StreamId) {
        if self.history.enabled() {
            let (allocated, reserved) = (self.stats.allocated_bytes.all.current, self.stats.reserved_bytes.all.current);
            self.history.push(action, addr, size, stream.0, allocated, reserved);
        }
    }

    /// Allocates a block for `req`, down one fallback chain, cheapest first: an exact-size
    /// parked block (small pool); a cached block ([`State::cached_block`]); a new segment, with
    /// PyTorch's release order on a miss ([`State::allocate_with_release`]).
    pub fn malloc(&mut self, backend: &dyn Backend, req: &Request) -> Result<u32> {
        self.alloc_counter += 1;
        if !self.streams_seen.contains(&req.stream.0) {
            backend.check_stream(req.stream)?;
            self.streams_seen.insert(req.stream.0);
        }
        self.process_events(backend)?;
        let parked = if req.pool == PoolKind::Small { self.take_parked(req.stream, req.rounded) } else { None };
        let slot = match parked {
            Some(slot) => slot,
            None => {
                let found = match self.cached_block(backend, req)? {
                    Some(slot) => Found::Cached(slot),
                    None => self.allocate_with_release(backend, req)?,
                };
                match found {
                    Found::Cached(slot) => {
                        self.table.pool_remove(slot, &mut self.stats);
                        slot
                    }
                    Found::NewSegment(slot) => slot,
                }
            }
        };
        self.split_and_activate(slot, req);
        Ok(slot)
    }

    /// A cached block for `req` (still in its pool): the best fit; failing that, the best fit
    /// after merging the parked small blocks back; failing that, after harvesting the blocks
    /// other streams have finished with.
    fn cached_block(&mut self, backend: &dyn Backend, req: &Request) -> Result<Option<u32>> {
        if let Some(slot) = self.find_cached(req) {
            return Ok(Some(slot));
        }
        if req.pool == PoolKind::Small && !self.parked.is_empty() {
            self.flush_parked();
            if let Some(slot) = self.find_cached(req) {
                return Ok(Some(slot));
            }
        }
        Ok(if self.harvest_cross_stream(backend, req.stream)? { self.find_cached(req) } else { None })
    }

    /// Best fit among blocks tagged for this stream and blocks safe on any stream, honouring the
    /// `max_split_size` rules (an oversize block serves only requests close to its size).
    fn find_cached(&self, req: &Request) -> Option<u32> {
        let (pool, stream, rounded) = (req.pool, req.stream, req.rounded);
        let acceptable = |size: usize| {
            let max_split = self.config.max_split_size;
            if rounded < max_split && size >= max_split {
                return false;
            }
            !(rounded >= max_split && size >= rounded.saturating_add(self.config.max_non_split_rounding))
        };
        let own = self.table.best_fit(pool, stream.0, rounded).filter(|k| acceptable(k.1));
        let shared = self.table.best_fit(pool, SHARED, rounded).filter(|k| acceptable(k.1));
        match (own, shared) {
            (Some(a), Some(b)) => Some(if b.1 < a.1 { b.3 } else { a.3 }),
            (a, b) => a.or(b).map(|k| k.3),
        }
    }

    /// PyTorch's release order on a miss: GC → new segment → free oversize cached blocks →
    /// release every unused segment (synchronising streams) → retry → out-of-memory.
    fn allocate_with_release(&mut self, backend: &dyn Backend, req: &Request) -> Result<Found> {
        let (pool, stream, rounded, requested) = (req.pool, req.stream, req.rounded, req.requested);
        if self.config.garbage_collection_threshold.is_some() {
            self.garbage_collect(backend)?;
        }
        let segment_size = self.config.segment_size(rounded).ok_or_else(|| too_large(backend, requested))?;
        let transient = |o: &std::result::Result<Found, NewSegmentError>| {
            matches!(o, Err(NewSegmentError::Capped | NewSegmentError::DeviceFull))
        };
        let expandable = self.config.expandable_segments;
        let grow = |state: &mut Self| {
            if expandable {
                state.grow_expandable(backend, req).map(Found::Cached)
            } else {
                state.new_segment(backend, segment_size, pool, stream).map(Found::NewSegment)
            }
        };
        let mut outcome = grow(self);
        if transient(&outcome) && self.release_oversize(backend, rounded, stream)? {
            outcome = grow(self);
        }
        if transient(&outcome) {
            self.release_cached(backend)?;
            self.stats.num_alloc_retries += 1;
            // Synchronising made every cached block safe on any stream; one may fit now.
            if let Some(slot) = self.find_cached(req) {
                return Ok(Found::Cached(slot));
            }
            outcome = grow(self);
        }
        let capped = match outcome {
            Ok(found) => return Ok(found),
            Err(NewSegmentError::Backend(msg)) => return Err(MemoryError::Backend(msg)),
            Err(NewSegmentError::Capped) => true,
            Err(NewSegmentError::DeviceFull) => false,
        };
        self.stats.num_ooms += 1;
        self.record(Action::Oom, 0, requested, stream);
        Err(OutOfMemory::refused(backend.device_name(), requested)
            .with_segment(segment_size)
            .with_device(backend.capacity(), backend.free_memory())
            .with_usage(
                self.stats.allocated_bytes.all.unsigned_current(),
                self.stats.reserved_bytes.all.unsigned_current(),
            )
            .with_limit(self.limit, capped)
            .with_largest_free_block(self.table.largest_free())
            .into_error())
    }

    pub(super) fn new_segment(
        &mut self,
        backend: &dyn Backend,
        size: usize,
        pool: PoolKind,
        stream: StreamId,
    ) -> std::result::Result<u32, NewSegmentError> {
        let reserved = self.stats.reserved_bytes.all.current as usize;
        // The cap is enforced before the backend is asked, so it is never exceeded.
        if let Some(limit) = self.limit {
            if reserved.checked_add(size).is_none_or(|total| total > limit) {
                return Err(NewSegmentError::Capped);
            }
        }
        let addr = match backend.allocate_segment(size, stream) {
            Ok(addr) => addr,
            Err(BackendError::OutOfMemory) => return Err(NewSegmentError::DeviceFull),
            Err(other) => return Err(NewSegmentError::Backend(other)),
        };
        let segment =
            self.table.segments.insert(Segment { addr, size, reservation: None, stream, pool, first_block: u32::MAX });
        let slot = self.table.insert_block(Block {
            segment,
            pool,
            expandable: false,
            addr,
            size,
            requested: 0,
            stream,
            tag: stream.0,
            state: BlockState::Free,
            prev: None,
            next: None,
            generation: 0,
            free_epoch: 0,
            freed_at: self.alloc_counter,
            extra_streams: Vec::new(),
        });
        if let Some(seg) = self.table.segments.get_mut(segment) {
            seg.first_block = slot;
        }
        self.stats.segment.update(pool, 1);
        self.stats.reserved_bytes.update(pool, signed(size));
        self.stats.num_device_alloc += 1;
        if self.is_oversize(size) {
            self.stats.oversize_segments.update(1);
        }
        self.record(Action::SegmentAlloc, addr, size, stream);
        Ok(slot)
    }

    /// Splits off the unused tail when worthwhile (PyTorch's `should_split`) and hands out the block.
    fn split_and_activate(&mut self, slot: u32, req: &Request) {
        let (pool, rounded, requested, stream) = (req.pool, req.rounded, req.requested, req.stream);
        let (size, addr) = {
            let b = self.table.block(slot);
            (b.size, b.addr)
        };
        let remaining = size - rounded;
        let split = if pool == PoolKind::Small || self.table.block(slot).expandable {
            remaining >= self.config.min_block_size
        } else {
            rounded < self.config.max_split_size && remaining > self.config.small_size
        };
        if split {
            let o = self.table.block(slot);
            let rest_block = Block {
                segment: o.segment,
                pool: o.pool,
                expandable: o.expandable,
                addr: addr + rounded as u64,
                size: remaining,
                requested: 0,
                stream: o.stream,
                tag: o.tag,
                state: BlockState::Free,
                prev: Some(slot),
                next: o.next,
                generation: 0,
                free_epoch: o.free_epoch,
                freed_at: o.freed_at,
                extra_streams: Vec::new(),
            };
            let rest = self.table.insert_block(rest_block);
            if let Some(next) = self.table.block(rest).next {
                self.table.block_mut(next).prev = Some(rest);
            }
            let block = self.table.block_mut(slot);
            block.size = rounded;
            block.next = Some(rest);
            self.table.pool_insert(rest, &mut self.stats);
        }
        self.table.debug_assert_links(slot);
        let block = self.table.block_mut(slot);
        block.state = BlockState::Allocated;
        block.requested = requested;
        block.stream = stream;
        block.extra_streams.clear();
        let size = block.size;
        self.stats.allocation.update(pool, 1);
        self.stats.allocated_bytes.update(pool, signed(size));
        self.stats.active.update(pool, 1);
        self.stats.active_bytes.update(pool, signed(size));
        self.stats.requested_bytes.update(pool, signed(requested));
        if self.is_oversize(size) {
            self.stats.oversize_allocations.update(1);
        }
        self.record(Action::Alloc, addr, size, stream);
    }

    /// Returns a block from the user. Blocks used on other streams wait for their events.
    pub fn free(&mut self, backend: &dyn Backend, slot: u32) {
        let pool = self.table.segment_pool(slot);
        let (size, requested, addr, stream, extra) = {
            let b = self.table.block_mut(slot);
            (b.size, b.requested, b.addr, b.stream, std::mem::take(&mut b.extra_streams))
        };
        self.stats.allocation.update(pool, -1);
        self.stats.allocated_bytes.update(pool, -(signed(size)));
        self.stats.requested_bytes.update(pool, -(signed(requested)));
        if self.is_oversize(size) {
            self.stats.oversize_allocations.update(-1);
        }
        self.record(Action::FreeRequested, addr, size, stream);
        if !extra.is_empty() {
            let events: std::result::Result<Vec<EventId>, _> = extra.iter().map(|s| backend.record_event(*s)).collect();
            match events {
                Ok(events) => {
                    self.table.block_mut(slot).state = BlockState::PendingFree(events);
                    self.pending.push(slot);
                    return;
                }
                // Without events the only safe choice is to wait for the device.
                Err(_) => {
                    let _ = backend.synchronize();
                    self.stats.num_sync_all_streams += 1;
                }
            }
        }
        if pool == PoolKind::Small {
            self.park(slot);
        } else {
            self.free_block(slot, pool);
        }
    }

    /// Puts a block into its pool, merging it with free neighbours.
    pub(super) fn free_block(&mut self, slot: u32, pool: PoolKind) {
        self.free_counter += 1;
        let (size, addr, stream) = {
            let counter = (self.free_counter, self.alloc_counter);
            let b = self.table.block_mut(slot);
            b.state = BlockState::Free;
            b.tag = b.stream.0;
            b.free_epoch = counter.0;
            b.freed_at = counter.1;
            (b.size, b.addr, b.stream)
        };
        self.stats.active.update(pool, -1);
        self.stats.active_bytes.update(pool, -(signed(size)));
        self.merge_into_pool(slot);
        self.record(Action::FreeCompleted, addr, size, stream);
    }

    pub(super) fn merge_into_pool(&mut self, slot: u32) {
        self.merge_neighbours(slot);
        self.table.pool_insert(slot, &mut self.stats);
    }

    /// Merges a free block (not in a pool) with free neighbours whose stream tags allow it.
    pub(super) fn merge_neighbours(&mut self, slot: u32) {
        for forward in [false, true] {
            let block = self.table.block(slot);
            let Some(neighbour) = (if forward { block.next } else { block.prev }) else { continue };
            let n = self.table.block(neighbour);
            let compatible = n.tag == block.tag || n.tag == SHARED || block.tag == SHARED;
            if n.state != BlockState::Free || !compatible {
                continue;
            }
            self.table.pool_remove(neighbour, &mut self.stats);
            let Some(n) = self.table.remove_block(neighbour) else { continue };
            let block = self.table.block_mut(slot);
            if block.tag == SHARED {
                block.tag = n.tag;
            }
            block.size += n.size;
            block.free_epoch = block.free_epoch.max(n.free_epoch);
            if forward {
                block.next = n.next;
                if let Some(after) = n.next {
                    self.table.block_mut(after).prev = Some(slot);
                }
            } else {
                block.addr = n.addr;
                block.prev = n.prev;
                match n.prev {
                    Some(before) => self.table.block_mut(before).next = Some(slot),
                    None => {
                        let seg = self.table.block(slot).segment;
                        if let Some(s) = self.table.segments.get_mut(seg) {
                            s.first_block = slot;
                        }
                    }
                }
            }
        }
        self.table.debug_assert_links(slot);
    }
}

pub(super) enum NewSegmentError {
    Capped,
    DeviceFull,
    Backend(BackendError),
}

fn too_large(backend: &dyn Backend, requested: usize) -> MemoryError {
    MemoryError::TooLarge { requested, capacity: backend.capacity(), device: backend.device_name() }
}
