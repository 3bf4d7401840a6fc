//! Giving memory back: oversize blocks, every unused segment, garbage collection and teardown.
//!
//! Rationale for the order on a cache miss (PyTorch's `malloc`, kept step for step): look in the
//! cache; with a garbage-collection threshold, reclaim the oldest cached blocks first; ask the
//! device; on failure free *one* cached oversize block (≥ `max_split_size`, the smallest that is
//! large enough) and ask again; then free every unused segment (after synchronising the streams)
//! and ask a last time; then `OutOfMemory`. Each step costs more than the one before — a device
//! call, then losing one cached block, then losing the whole cache and a synchronisation — and is
//! taken only when the cheaper ones failed. Oversize blocks go first because the policy never
//! splits them, so a cached oversize block can only ever serve a request of about its own size:
//! it is the cached memory least likely to be reused, and freeing the one that suffices keeps the
//! rest of the cache warm.

use super::blocks::{Segment, SHARED};
use super::history::Action;
use super::state::State;
use crate::backend::Backend;
use crate::error::Result;
use crate::stats::{signed, PoolKind};
use crate::stream::StreamId;

impl State {
    /// Frees cached oversize blocks (≥ `max_split_size`) that could make room for `rounded`.
    pub(super) fn release_oversize(&mut self, backend: &dyn Backend, rounded: usize, stream: StreamId) -> Result<bool> {
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
        backend.synchronize()?;
        self.stats.num_sync_all_streams += 1;
        self.process_events(backend)?;
        self.flush_parked();
        // After a full synchronisation every cached block is safe on any stream.
        for (_, (event, _)) in self.harvest.drain() {
            backend.destroy_event(event);
        }
        for stream in self.streams_seen.clone() {
            for slot in self.table.free_with_tag(stream) {
                self.share(slot);
            }
        }
        let mut released = self.trim_expandable(backend)?;
        for pool in [PoolKind::Small, PoolKind::Large] {
            for slot in self.table.unsplit_free(pool) {
                released.0 += 1;
                released.1 += self.release_segment_of(backend, slot)?;
            }
        }
        Ok(released)
    }

    /// Returns the segment of a free, unsplit block to the backend. Returns its size.
    pub(super) fn release_segment_of(&mut self, backend: &dyn Backend, slot: u32) -> Result<usize> {
        let seg_index = self.table.block(slot).segment;
        let Some(segment) = self.table.segments.get(seg_index).cloned() else { return Ok(0) };
        // SAFETY: the segment came from this backend, its one block is free (no user holds it),
        // and it is removed from the table right after, so it is freed exactly once.
        unsafe { backend.free_segment(segment.addr, segment.size) }?;
        self.table.pool_remove(slot, &mut self.stats);
        self.table.remove_block(slot);
        self.table.segments.remove(seg_index);
        self.stats.segment.update(segment.pool, -1);
        self.stats.reserved_bytes.update(segment.pool, -(signed(segment.size)));
        self.stats.num_device_free += 1;
        if self.is_oversize(segment.size) {
            self.stats.oversize_segments.update(-1);
        }
        self.record(Action::SegmentFree, segment.addr, segment.size, segment.stream);
        Ok(segment.size)
    }

    /// PyTorch's `garbage_collect_cached_blocks`: above the threshold fraction of the cap, free
    /// unsplit cached large blocks, oldest (in allocation calls since their free) first.
    pub(super) fn garbage_collect(&mut self, backend: &dyn Backend) -> Result<()> {
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
            unsafe {
                match segment.reservation {
                    Some(span) => {
                        if segment.size > 0 {
                            let _ = backend.unmap_range(segment.addr, segment.size);
                        }
                        backend.release_address_space(segment.addr, span);
                    }
                    None => {
                        let _ = backend.free_segment(segment.addr, segment.size);
                    }
                }
            }
        }
    }
}
