//! Expandable segments (PyTorch's `expandable_segments:True`): one address-space reservation per
//! stream and pool, into which memory is mapped page by page as the cache needs to grow, and from
//! which whole free pages at the end are unmapped on release. A request that does not fit extends
//! the free tail instead of reserving a new segment, so memory freed anywhere in the segment and
//! the growth at its end combine, and fragmentation stays near the page rounding.
//!
//! Rationale (as PyTorch's notes in `CUDACachingAllocator.cpp` give it, and what wick adds):
//! - *Why a reservation per stream and pool.* Blocks of one segment are only merged with
//!   neighbours of the same stream tag, and small and large requests are rounded differently;
//!   one address range per (stream, pool) keeps every merge legal and the page size uniform. The
//!   reservation is address space only (the device's capacity, rounded to pages), never memory.
//! - *Why pages of 2 MiB (small pool) and 20 MiB (large).* They are the sizes of the segments the
//!   classic policy would reserve for those pools, so one mapping call replaces one segment
//!   allocation, and a small pool's growth never maps 20 MiB for a 512 B request.
//! - *Why only whole free pages at the end are unmapped.* The tail can shrink without moving or
//!   splitting a live block, and the mapped prefix stays one contiguous range, so growth never has
//!   holes to track; free pages in the middle stay mapped and are reused by the next requests
//!   there, which is the point of the design.
//! - *Why it is wick's to choose.* PyTorch keeps expandable segments off by default because CUDA
//!   IPC cannot share such memory; wick offers no IPC, so the trade is fragmentation (lower here,
//!   measured in BENCHMARKS.md) against one driver mapping call per page of growth.

use super::blocks::{count_inactive_split, Block, BlockState, Segment};
use super::history::Action;
use super::state::{NewSegmentError, Request, State};
use crate::backend::{Backend, BackendError};
use crate::error::Result;
use crate::stats::{signed, PoolKind};
use crate::stream::StreamId;

impl State {
    /// Changes a block's links while keeping the inactive-split statistics right: a cached block
    /// counts as inactive-split only while it has a neighbour, so its count is taken out before the
    /// change and put back after.
    fn relink(&mut self, slot: u32, change: impl FnOnce(&mut Block)) {
        let b = self.table.block(slot);
        let (cached, pool) = (matches!(b.state, BlockState::Free | BlockState::Parked), b.pool);
        if cached {
            count_inactive_split(&mut self.stats, pool, self.table.block(slot), -1);
        }
        change(self.table.block_mut(slot));
        if cached {
            count_inactive_split(&mut self.stats, pool, self.table.block(slot), 1);
        }
    }

    fn page_size(&self, pool: PoolKind) -> usize {
        match pool {
            PoolKind::Small => self.config.small_buffer,
            PoolKind::Large => self.config.large_buffer,
        }
    }

    fn expandable_segment(&self, pool: PoolKind, stream: StreamId) -> Option<u32> {
        self.table
            .segments
            .iter()
            .find(|(_, s)| s.reservation.is_some() && s.pool == pool && s.stream == stream)
            .map(|(i, _)| i)
    }

    /// Maps enough pages at the end of the (stream, pool) segment for a free block of at least
    /// `rounded` bytes at its tail, creating the reservation on first use. Returns the tail block,
    /// which is in the free pool.
    pub(super) fn grow_expandable(
        &mut self,
        backend: &dyn Backend,
        req: &Request,
    ) -> std::result::Result<u32, NewSegmentError> {
        let (pool, stream, rounded) = (req.pool, req.stream, req.rounded);
        let page = self.page_size(pool);
        let seg_index = match self.expandable_segment(pool, stream) {
            Some(index) => index,
            None => {
                let span = backend.capacity().div_ceil(page).saturating_mul(page);
                let addr = backend.reserve_address_space(span).map_err(|e| match e {
                    BackendError::OutOfMemory => NewSegmentError::DeviceFull,
                    other => NewSegmentError::Backend(other),
                })?;
                let seg = Segment { addr, size: 0, reservation: Some(span), stream, pool, first_block: u32::MAX };
                let index = self.table.segments.insert(seg);
                self.stats.segment.update(pool, 1);
                index
            }
        };
        let segment = self.table.segments.get(seg_index).cloned().ok_or(NewSegmentError::DeviceFull)?;
        let tail = self.table.last_block(&segment);
        let free_tail = tail.filter(|&t| {
            let b = self.table.block(t);
            b.state == BlockState::Free && (b.tag == stream.0 || b.tag == super::blocks::SHARED)
        });
        let have = free_tail.map_or(0, |t| self.table.block(t).size);
        // Checked throughout: a reservation near the top of the address space must fail, not
        // wrap around onto live blocks.
        let need = (rounded - have.min(rounded)).div_ceil(page).max(1).checked_mul(page);
        let need = need.ok_or(NewSegmentError::DeviceFull)?;
        if segment.size.checked_add(need).is_none_or(|end| end > segment.reservation.unwrap_or(0)) {
            return Err(NewSegmentError::DeviceFull);
        }
        let reserved = usize::try_from(self.stats.reserved_bytes.all.current).unwrap_or(0);
        if self.limit.is_some_and(|limit| reserved.checked_add(need).is_none_or(|r| r > limit)) {
            return Err(NewSegmentError::Capped);
        }
        let at = (segment.size as u64)
            .checked_add(segment.addr)
            .filter(|at| at.checked_add(need as u64).is_some())
            .ok_or(NewSegmentError::DeviceFull)?;
        // SAFETY: [at, at + need) lies inside this segment's reservation, past its mapped prefix.
        unsafe { backend.map_range(at, need) }.map_err(|e| match e {
            BackendError::OutOfMemory => NewSegmentError::DeviceFull,
            other => NewSegmentError::Backend(other),
        })?;
        self.stats.reserved_bytes.update(pool, signed(need));
        self.stats.num_device_alloc += 1;
        if let Some(seg) = self.table.segments.get_mut(seg_index) {
            seg.size += need;
        }
        self.record(Action::SegmentAlloc, at, need, stream);
        let slot = match free_tail {
            Some(t) => {
                self.table.pool_remove(t, &mut self.stats);
                self.table.block_mut(t).size += need;
                t
            }
            None => {
                let slot = self.table.insert_block(Block {
                    segment: seg_index,
                    pool,
                    expandable: true,
                    addr: at,
                    size: need,
                    requested: 0,
                    stream,
                    tag: stream.0,
                    state: BlockState::Free,
                    prev: tail,
                    next: None,
                    generation: 0,
                    free_epoch: 0,
                    freed_at: 0,
                    extra_streams: Vec::new(),
                });
                match tail {
                    Some(t) => self.relink(t, |b| b.next = Some(slot)),
                    None => {
                        if let Some(seg) = self.table.segments.get_mut(seg_index) {
                            seg.first_block = slot;
                        }
                    }
                }
                slot
            }
        };
        self.table.pool_insert(slot, &mut self.stats);
        Ok(slot)
    }

    /// Unmaps the whole free pages at the end of every expandable segment; a segment left with
    /// nothing mapped gives its reservation back. Returns (segments released, bytes unmapped).
    pub(super) fn trim_expandable(&mut self, backend: &dyn Backend) -> Result<(usize, usize)> {
        let segments: Vec<(u32, Segment)> =
            self.table.segments.iter().filter(|(_, s)| s.reservation.is_some()).map(|(i, s)| (i, s.clone())).collect();
        let mut released = (0, 0);
        for (index, seg) in segments {
            let page = self.page_size(seg.pool);
            if let Some(tail) = self.table.last_block(&seg) {
                let b = self.table.block(tail).clone();
                if b.state == BlockState::Free {
                    let offset = (b.addr - seg.addr) as usize;
                    let keep = offset.div_ceil(page) * page;
                    if keep < seg.size {
                        let unmap = seg.size - keep;
                        // SAFETY: whole pages at the end of the mapping, inside a free block.
                        unsafe { backend.unmap_range(seg.addr + keep as u64, unmap) }?;
                        self.table.pool_remove(tail, &mut self.stats);
                        if keep > offset {
                            self.table.block_mut(tail).size = keep - offset;
                            self.table.pool_insert(tail, &mut self.stats);
                        } else {
                            self.table.remove_block(tail);
                            match b.prev {
                                Some(p) => self.relink(p, |b| b.next = None),
                                None => {
                                    if let Some(s) = self.table.segments.get_mut(index) {
                                        s.first_block = u32::MAX;
                                    }
                                }
                            }
                        }
                        if let Some(s) = self.table.segments.get_mut(index) {
                            s.size = keep;
                        }
                        self.stats.reserved_bytes.update(seg.pool, -(signed(unmap)));
                        self.stats.num_device_free += 1;
                        released.1 += unmap;
                        self.record(Action::SegmentFree, seg.addr + keep as u64, unmap, seg.stream);
                    }
                }
            }
            if self.table.segments.get(index).is_some_and(|s| s.size == 0) {
                if let (Some(s), Some(span)) = (self.table.segments.remove(index), seg.reservation) {
                    // SAFETY: nothing of the reservation is mapped any more.
                    unsafe { backend.release_address_space(s.addr, span) };
                    self.stats.segment.update(seg.pool, -1);
                    released.0 += 1;
                }
            }
        }
        Ok(released)
    }
}
