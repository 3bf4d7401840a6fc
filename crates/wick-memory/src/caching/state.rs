//! The caching policy: best-fit reuse, splitting and coalescing, stream-ordered reuse, the
//! release path and garbage collection. Mirrors PyTorch's `DeviceCachingAllocator::malloc/free`.

use std::collections::{BTreeSet, HashMap};

use super::blocks::{Block, BlockState, BlockTable, Segment, SHARED};
use super::history::{Action, History};
use crate::backend::{Backend, BackendError};
use crate::config::AllocatorConfig;
use crate::error::{MemoryError, OutOfMemory, Result};
use crate::stats::{MemoryStats, PoolKind};
use crate::stream::{EventId, StreamId};

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
    pending: Vec<u32>,
    /// Per stream with cached blocks: an event recorded on it and the free counter at that time.
    /// Once the event completes, blocks freed on that stream before it are safe on any stream.
    harvest: HashMap<u64, (EventId, u64)>,
    streams_seen: BTreeSet<u64>,
    free_counter: u64,
    alloc_counter: u64,
}

/// Where a block for a request came from.
enum Found {
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
            streams_seen: BTreeSet::from([StreamId::DEFAULT.0]),
            free_counter: 0,
            alloc_counter: 0,
        };
        state.stats.max_split_size = i64::try_from(max_split).unwrap_or(i64::MAX);
        state
    }

    fn is_oversize(&self, size: usize) -> bool {
        size >= self.config.max_split_size
    }

    fn record(&mut self, action: Action, addr: u64, size: usize, stream: StreamId) {
        if self.history.enabled() {
            let (allocated, reserved) =
                (self.stats.allocated_bytes.all.current, self.stats.reserved_bytes.all.current);
            self.history.push(action, addr, size, stream.0, allocated, reserved);
        }
    }

    /// Allocates a block of at least `rounded` bytes for `requested` user bytes on `stream`.
    pub fn malloc(&mut self, backend: &dyn Backend, rounded: usize, requested: usize, stream: StreamId) -> Result<u32> {
        let pool = if self.config.is_small(rounded) { PoolKind::Small } else { PoolKind::Large };
        self.alloc_counter += 1;
        self.streams_seen.insert(stream.0);
        self.process_events(backend)?;

        let found = match self.find_cached(pool, stream, rounded) {
            Some(slot) => Found::Cached(slot),
            None => {
                if self.harvest_cross_stream(backend, stream)? {
                    self.find_cached(pool, stream, rounded).map(Found::Cached)
                } else {
                    None
                }
                .map_or_else(|| self.allocate_with_release(backend, pool, stream, rounded, requested), Ok)?
            }
        };
        let slot = match found {
            Found::Cached(slot) => {
                self.table.pool_remove(slot, &mut self.stats);
                slot
            }
            Found::NewSegment(slot) => slot,
        };
        self.split_and_activate(slot, pool, rounded, requested, stream);
        Ok(slot)
    }

    /// Best fit among blocks tagged for this stream and blocks safe on any stream, honouring the
    /// `max_split_size` rules (an oversize block serves only requests close to its size).
    fn find_cached(&self, pool: PoolKind, stream: StreamId, rounded: usize) -> Option<u32> {
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
    fn allocate_with_release(
        &mut self,
        backend: &dyn Backend,
        pool: PoolKind,
        stream: StreamId,
        rounded: usize,
        requested: usize,
    ) -> Result<Found> {
        if self.config.garbage_collection_threshold.is_some() {
            self.garbage_collect(backend)?;
        }
        let segment_size = self
            .config
            .segment_size(rounded)
            .ok_or_else(|| too_large(backend, requested))?;
        let transient = |o: &std::result::Result<u32, NewSegmentError>| {
            matches!(o, Err(NewSegmentError::Capped | NewSegmentError::DeviceFull))
        };
        let mut outcome = self.new_segment(backend, segment_size, pool, stream);
        if transient(&outcome) && self.release_oversize(backend, rounded, stream)? {
            outcome = self.new_segment(backend, segment_size, pool, stream);
        }
        if transient(&outcome) {
            self.release_cached(backend)?;
            self.stats.num_alloc_retries += 1;
            // Synchronising made every cached block safe on any stream; one may fit now.
            if let Some(slot) = self.find_cached(pool, stream, rounded) {
                return Ok(Found::Cached(slot));
            }
            outcome = self.new_segment(backend, segment_size, pool, stream);
        }
        let capped = match outcome {
            Ok(slot) => return Ok(Found::NewSegment(slot)),
            Err(NewSegmentError::Backend(msg)) => return Err(MemoryError::Backend(msg)),
            Err(NewSegmentError::Capped) => true,
            Err(NewSegmentError::DeviceFull) => false,
        };
        self.stats.num_ooms += 1;
        self.record(Action::Oom, 0, requested, stream);
        Err(MemoryError::OutOfMemory(Box::new(OutOfMemory {
            device: backend.device_name(),
            requested,
            segment_size,
            capacity: backend.capacity(),
            device_free: backend.free_memory(),
            allocated: self.stats.allocated_bytes.all.current as usize,
            reserved: self.stats.reserved_bytes.all.current as usize,
            limit: self.limit,
            limited_by_cap: capped,
            largest_free_block: self.table.largest_free(),
        })))
    }

    fn new_segment(
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
            Err(other) => return Err(NewSegmentError::Backend(other.to_string())),
        };
        let segment = self.table.segments.insert(Segment { addr, size, stream, pool, first_block: u32::MAX });
        let slot = self.table.insert_block(Block {
            segment,
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
        self.stats.reserved_bytes.update(pool, size as i64);
        self.stats.num_device_alloc += 1;
        if self.is_oversize(size) {
            self.stats.oversize_segments.update(1);
        }
        self.record(Action::SegmentAlloc, addr, size, stream);
        Ok(slot)
    }

    /// Splits off the unused tail when worthwhile (PyTorch's `should_split`) and hands out the block.
    fn split_and_activate(&mut self, slot: u32, pool: PoolKind, rounded: usize, requested: usize, stream: StreamId) {
        let (size, addr) = {
            let b = self.table.block(slot);
            (b.size, b.addr)
        };
        let remaining = size - rounded;
        let split = match pool {
            PoolKind::Small => remaining >= self.config.min_block_size,
            PoolKind::Large => rounded < self.config.max_split_size && remaining > self.config.small_size,
        };
        if split {
            let original = self.table.block(slot).clone();
            let rest = self.table.insert_block(Block {
                addr: addr + rounded as u64,
                size: remaining,
                prev: Some(slot),
                state: BlockState::Free,
                extra_streams: Vec::new(),
                ..original
            });
            if let Some(next) = self.table.block(rest).next {
                self.table.block_mut(next).prev = Some(rest);
            }
            let block = self.table.block_mut(slot);
            block.size = rounded;
            block.next = Some(rest);
            self.table.pool_insert(rest, &mut self.stats);
        }
        let block = self.table.block_mut(slot);
        block.state = BlockState::Allocated;
        block.requested = requested;
        block.stream = stream;
        block.extra_streams.clear();
        let size = block.size;
        self.stats.allocation.update(pool, 1);
        self.stats.allocated_bytes.update(pool, size as i64);
        self.stats.active.update(pool, 1);
        self.stats.active_bytes.update(pool, size as i64);
        self.stats.requested_bytes.update(pool, requested as i64);
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
        self.stats.allocated_bytes.update(pool, -(size as i64));
        self.stats.requested_bytes.update(pool, -(requested as i64));
        if self.is_oversize(size) {
            self.stats.oversize_allocations.update(-1);
        }
        self.record(Action::FreeRequested, addr, size, stream);
        if !extra.is_empty() {
            let events: std::result::Result<Vec<EventId>, _> =
                extra.iter().map(|s| backend.record_event(*s)).collect();
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
        self.free_block(slot, pool);
    }

    /// Puts a block into its pool, merging it with free neighbours.
    fn free_block(&mut self, slot: u32, pool: PoolKind) {
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
        self.stats.active_bytes.update(pool, -(size as i64));
        self.merge_neighbours(slot);
        self.table.pool_insert(slot, &mut self.stats);
        self.record(Action::FreeCompleted, addr, size, stream);
    }

    /// Merges a free block (not in a pool) with free neighbours whose stream tags allow it.
    fn merge_neighbours(&mut self, slot: u32) {
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
    }

    /// Makes a cached block usable on any stream, coalescing it with free neighbours that the
    /// old tag kept apart.
    fn share(&mut self, slot: u32) {
        if self.table.blocks.get(slot).is_none_or(|b| b.state != BlockState::Free) {
            return;
        }
        self.table.pool_remove(slot, &mut self.stats);
        self.table.block_mut(slot).tag = SHARED;
        self.merge_neighbours(slot);
        self.table.pool_insert(slot, &mut self.stats);
    }

    /// Moves blocks whose record_stream events have completed into the free pools.
    fn process_events(&mut self, backend: &dyn Backend) -> Result<()> {
        if self.pending.is_empty() {
            return Ok(());
        }
        let mut still_pending = Vec::new();
        for slot in std::mem::take(&mut self.pending) {
            let BlockState::PendingFree(events) = &self.table.block(slot).state else { continue };
            let mut done = true;
            for event in events {
                done &= backend.event_completed(*event).map_err(|e| MemoryError::Backend(e.to_string()))?;
            }
            if done {
                for event in events.clone() {
                    backend.destroy_event(event);
                }
                let pool = self.table.segment_pool(slot);
                self.free_block(slot, pool);
            } else {
                still_pending.push(slot);
            }
        }
        self.pending = still_pending;
        Ok(())
    }

    /// Makes blocks cached on other streams available to `stream` once an event shows the
    /// stream that freed them has finished. Records such events on a miss. True if any moved.
    fn harvest_cross_stream(&mut self, backend: &dyn Backend, stream: StreamId) -> Result<bool> {
        let mut moved = false;
        let recorded: Vec<(u64, EventId, u64)> = self.harvest.iter().map(|(s, (e, n))| (*s, *e, *n)).collect();
        for (other, event, epoch) in recorded {
            if backend.event_completed(event).map_err(|e| MemoryError::Backend(e.to_string()))? {
                backend.destroy_event(event);
                self.harvest.remove(&other);
                for slot in self.table.free_with_tag(other) {
                    // Earlier iterations may have merged this block into a neighbour.
                    if self.table.blocks.get(slot).is_some_and(|b| b.free_epoch <= epoch && b.tag == other) {
                        self.share(slot);
                        moved = true;
                    }
                }
            }
        }
        let others: Vec<u64> = self.streams_seen.iter().copied().filter(|s| *s != stream.0).collect();
        for other in others {
            if !self.harvest.contains_key(&other) && self.table.has_free_with_tag(other) {
                if let Ok(event) = backend.record_event(StreamId(other)) {
                    self.harvest.insert(other, (event, self.free_counter));
                }
            }
        }
        Ok(moved)
    }

    /// Frees cached oversize blocks (≥ `max_split_size`) that could make room for `rounded`.
    fn release_oversize(&mut self, backend: &dyn Backend, rounded: usize, stream: StreamId) -> Result<bool> {
        if self.config.max_split_size == usize::MAX {
            return Ok(false);
        }
        let key = rounded.max(self.config.max_split_size);
        let mut candidates: Vec<(usize, u32)> = self
            .table
            .unsplit_free(PoolKind::Large)
            .into_iter()
            .map(|s| (self.table.block(s).size, s))
            .filter(|(size, s)| {
                let tag = self.table.block(*s).tag;
                *size >= self.config.max_split_size && (tag == stream.0 || tag == SHARED)
            })
            .collect();
        candidates.sort_unstable();
        if let Some(&(_, slot)) = candidates.iter().find(|(size, _)| *size >= key) {
            self.release_segment_of(backend, slot)?;
            return Ok(true);
        }
        let mut released = 0;
        for &(size, slot) in candidates.iter().rev() {
            if released >= rounded {
                break;
            }
            self.release_segment_of(backend, slot)?;
            released += size;
        }
        Ok(released > 0)
    }

    /// Synchronises all streams, then returns every segment that holds no live block.
    pub fn release_cached(&mut self, backend: &dyn Backend) -> Result<(usize, usize)> {
        backend.synchronize().map_err(|e| MemoryError::Backend(e.to_string()))?;
        self.stats.num_sync_all_streams += 1;
        self.process_events(backend)?;
        // After a full synchronisation every cached block is safe on any stream.
        for (_, (event, _)) in self.harvest.drain() {
            backend.destroy_event(event);
        }
        for stream in self.streams_seen.clone() {
            for slot in self.table.free_with_tag(stream) {
                self.share(slot);
            }
        }
        let mut released = (0, 0);
        for pool in [PoolKind::Small, PoolKind::Large] {
            for slot in self.table.unsplit_free(pool) {
                released.0 += 1;
                released.1 += self.release_segment_of(backend, slot)?;
            }
        }
        Ok(released)
    }

    /// Returns the segment of a free, unsplit block to the backend. Returns its size.
    fn release_segment_of(&mut self, backend: &dyn Backend, slot: u32) -> Result<usize> {
        let seg_index = self.table.block(slot).segment;
        let Some(segment) = self.table.segments.get(seg_index).cloned() else { return Ok(0) };
        // SAFETY: the segment came from this backend, its one block is free (no user holds it),
        // and it is removed from the table right after, so it is freed exactly once.
        unsafe { backend.free_segment(segment.addr, segment.size) }.map_err(|e| MemoryError::Backend(e.to_string()))?;
        self.table.pool_remove(slot, &mut self.stats);
        self.table.remove_block(slot);
        self.table.segments.remove(seg_index);
        self.stats.segment.update(segment.pool, -1);
        self.stats.reserved_bytes.update(segment.pool, -(segment.size as i64));
        self.stats.num_device_free += 1;
        if self.is_oversize(segment.size) {
            self.stats.oversize_segments.update(-1);
        }
        self.record(Action::SegmentFree, segment.addr, segment.size, segment.stream);
        Ok(segment.size)
    }

    /// PyTorch's `garbage_collect_cached_blocks`: above the threshold fraction of the cap, free
    /// unsplit cached large blocks, oldest (in allocation calls since their free) first.
    fn garbage_collect(&mut self, backend: &dyn Backend) -> Result<()> {
        let Some(threshold) = self.config.garbage_collection_threshold else { return Ok(()) };
        let allowed = self.limit.unwrap_or_else(|| backend.capacity());
        let gc_threshold = (allowed as f64 * threshold) as usize;
        let reserved = self.stats.reserved_bytes.all.current as usize;
        if reserved <= gc_threshold {
            return Ok(());
        }
        let target = reserved - gc_threshold;
        let mut freeable: Vec<(u64, u32)> = self
            .table
            .unsplit_free(PoolKind::Large)
            .into_iter()
            .map(|s| (self.alloc_counter - self.table.block(s).freed_at, s))
            .collect();
        let mut reclaimed = 0;
        while reclaimed < target && !freeable.is_empty() {
            let average = freeable.iter().map(|(age, _)| *age).sum::<u64>() / freeable.len() as u64;
            let (old, young): (Vec<_>, Vec<_>) = freeable.into_iter().partition(|(age, _)| *age >= average);
            freeable = young;
            for (_, slot) in old {
                if reclaimed >= target {
                    break;
                }
                reclaimed += self.release_segment_of(backend, slot)?;
            }
        }
        Ok(())
    }

    /// Marks a live block as used on another stream.
    pub fn record_stream(&mut self, slot: u32, stream: StreamId) {
        let block = self.table.block_mut(slot);
        if block.stream != stream && !block.extra_streams.contains(&stream) {
            block.extra_streams.push(stream);
        }
        self.streams_seen.insert(stream.0);
    }

    /// Frees everything that is left when the allocator is dropped: waits for the device, then
    /// returns every segment (live blocks cannot exist then, their handles borrow the allocator).
    pub fn release_all(&mut self, backend: &dyn Backend) {
        let _ = backend.synchronize();
        for (_, (event, _)) in self.harvest.drain() {
            backend.destroy_event(event);
        }
        let segments: Vec<Segment> = self.table.segments.iter().map(|(_, s)| s.clone()).collect();
        for segment in segments {
            // SAFETY: each segment came from this backend and is freed once, at teardown.
            let _ = unsafe { backend.free_segment(segment.addr, segment.size) };
        }
    }
}

enum NewSegmentError {
    Capped,
    DeviceFull,
    Backend(String),
}

fn too_large(backend: &dyn Backend, requested: usize) -> MemoryError {
    MemoryError::TooLarge { requested, capacity: backend.capacity(), device: backend.device_name() }
}
