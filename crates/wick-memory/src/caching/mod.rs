//! The caching allocator: PyTorch's policy over any [`Backend`].
//!
//! Memory that users free stays reserved in the cache and is reused by the next request of a
//! similar size on the same stream; `empty_cache` gives the unused segments back. Requests that
//! do not fit return `Err(OutOfMemory)` after the cache has been flushed and the request retried.

mod blocks;
mod expandable;
mod history;
mod parking;
mod release;
mod state;
mod streams;

pub use history::{peak_live, Action, HistoryEntry, PeakLive};

use std::sync::{Mutex, MutexGuard};

use crate::backend::Backend;
use crate::config::{AllocatorConfig, MemoryLimit};
use crate::error::{MemoryError, Result};
use crate::resource::{AllocRequest, MemoryInfo, MemoryResource, RawBlock, ReleaseReport};
use crate::snapshot::{BlockSnapshot, BlockStateName, SegmentSnapshot, Snapshot};
use crate::stats::{MemoryStats, PoolKind};
use crate::stream::StreamId;
use blocks::BlockState;
use state::{Request, State};

/// Alignment every block has: blocks start at multiples of the 512 B rounding inside segments
/// whose own alignment is at least that.
pub const BLOCK_ALIGNMENT: usize = 512;

/// A caching allocator over backend `B`. Thread-safe; all methods take `&self`.
pub struct CachingAllocator<B: Backend> {
    backend: B,
    state: Mutex<State>,
    /// Identifies this allocator in the blocks it hands out: 64 random bits drawn at
    /// construction. Not an address (a dropped allocator's address is reused by the next one,
    /// whose blocks its stale handles would then free) and not a static counter (statics exist
    /// once per cell in notebooks).
    identity: u64,
}

/// A fresh identity: std's randomly keyed hasher (keys from the OS) over the time and a stack
/// address, so two allocators, in one process or across notebook cells, collide with
/// probability 2⁻⁶⁴.
fn fresh_identity() -> u64 {
    use std::hash::BuildHasher;
    let anchor = 0u8;
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos());
    std::collections::hash_map::RandomState::new().hash_one((now, &anchor as *const u8 as usize))
}

impl<B: Backend> CachingAllocator<B> {
    /// An allocator with wick's default policy ([`AllocatorConfig::default`]: PyTorch's with
    /// expandable segments) and no cap; PyTorch's classic segments on a backend that cannot
    /// reserve address space.
    pub fn new(backend: B) -> Self {
        let config =
            if backend.supports_expandable() { AllocatorConfig::default() } else { AllocatorConfig::pytorch() };
        Self::build(backend, config, None)
    }

    /// An allocator with `config` (validated; its `limit` resolved against the device).
    pub fn with_config(backend: B, config: AllocatorConfig) -> Result<Self> {
        config.validate()?;
        if backend.segment_alignment() < BLOCK_ALIGNMENT || !backend.segment_alignment().is_power_of_two() {
            return Err(MemoryError::InvalidConfig(format!(
                "backend {} aligns segments to {} bytes; the allocator needs a power of two ≥ {BLOCK_ALIGNMENT}",
                backend.device_name(),
                backend.segment_alignment()
            )));
        }
        if config.expandable_segments && !backend.supports_expandable() {
            return Err(MemoryError::InvalidConfig(format!(
                "expandable_segments (wick's default) needs a backend that can reserve address space; {} cannot: \
                 set expandable_segments:False (AllocatorConfig::pytorch())",
                backend.device_name()
            )));
        }
        let limit = config.limit.map(|l| l.resolve(backend.capacity())).transpose()?;
        Ok(Self::build(backend, config, limit))
    }

    /// An allocator with `config` as given: the caller has validated it and resolved `limit`.
    pub(crate) fn build(backend: B, config: AllocatorConfig, limit: Option<usize>) -> Self {
        CachingAllocator { backend, state: Mutex::new(State::new(config, limit)), identity: fresh_identity() }
    }

    fn id(&self) -> u64 {
        self.identity
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // A panic while holding the lock cannot leave the table half-updated in a way that
        // matters more than refusing all further service would; keep serving.
        self.state.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// The backend.
    pub fn backend(&self) -> &B {
        &self.backend
    }

    /// The policy in force.
    pub fn config(&self) -> AllocatorConfig {
        self.lock().config.clone()
    }

    /// Sets or removes the hard cap on reserved memory. When the cache holds more than the new
    /// cap, unused segments are released to get under it.
    pub fn set_memory_limit(&self, limit: Option<MemoryLimit>) -> Result<()> {
        let bytes = limit.map(|l| l.resolve(self.backend.capacity())).transpose()?;
        let mut state = self.lock();
        state.limit = bytes;
        if let Some(cap) = bytes {
            if state.stats.reserved_bytes.all.current as usize > cap {
                state.release_cached(&self.backend)?;
            }
        }
        Ok(())
    }

    /// The cap in bytes, if any.
    pub fn memory_limit(&self) -> Option<usize> {
        self.lock().limit
    }

    /// Starts (`max_entries > 0`) or stops (0) recording the allocation history.
    pub fn record_history(&self, max_entries: usize) {
        self.lock().history.set_max_entries(max_entries);
    }

    /// The recorded history, oldest first.
    pub fn history(&self) -> Vec<HistoryEntry> {
        self.lock().history.entries()
    }

    /// Resets cumulative counters (allocated/freed totals, retries, OOMs).
    pub fn reset_accumulated_stats(&self) {
        self.lock().stats.reset_accumulated();
    }

    /// PyTorch's `memory_summary()`: a readable table of the statistics.
    pub fn memory_summary(&self) -> String {
        crate::summary::memory_summary(&self.backend.device_name(), &self.memory_stats(), self.memory_limit())
    }

    /// Validates a request and returns its rounded size. Called with the state lock held so the
    /// hot path takes the lock once.
    fn check_request(&self, config: &AllocatorConfig, request: &AllocRequest) -> Result<Request> {
        if request.size == 0 {
            return Err(MemoryError::ZeroSize);
        }
        // The last id tags cached blocks that any stream may use; no backend stream can have it.
        if request.stream.0 == blocks::SHARED {
            return Err(MemoryError::UnknownStream(request.stream));
        }
        if !request.align.is_power_of_two() {
            return Err(MemoryError::InvalidAlignment(request.align));
        }
        if request.align > BLOCK_ALIGNMENT {
            return Err(MemoryError::UnsupportedAlignment { requested: request.align, supported: BLOCK_ALIGNMENT });
        }
        let too_large = || MemoryError::TooLarge {
            requested: request.size,
            capacity: self.backend.capacity(),
            device: self.backend.device_name(),
        };
        if request.size > self.backend.capacity() {
            return Err(too_large());
        }
        let rounded = config.round_size(request.size).ok_or_else(too_large)?;
        let segment = config.segment_size(rounded).ok_or_else(too_large)?;
        if rounded > self.backend.capacity() || segment > self.backend.capacity() {
            return Err(too_large());
        }
        Ok(Request::new(config, request.size, rounded, request.stream))
    }

    fn owned_slot(&self, state: &State, block: &RawBlock) -> Result<u32> {
        let foreign = || MemoryError::ForeignBlock { addr: block.addr };
        if block.owner != self.id() {
            return Err(foreign());
        }
        let b = state.table.blocks.get(block.slot).ok_or_else(foreign)?;
        if b.generation != block.generation || b.addr != block.addr || b.state != BlockState::Allocated {
            return Err(foreign());
        }
        Ok(block.slot)
    }
}

// SAFETY: `owned_slot` succeeds only for a block this allocator handed out and has not taken
// back (identity, slot, generation and address match an allocated block), and the backend's own
// unsafe promise makes that block's `requested` bytes valid, initialised host memory.
unsafe impl<B: crate::backend::HostMemoryBackend> crate::resource::HostResource for CachingAllocator<B> {
    fn check_host_block(&self, block: &RawBlock) -> Result<()> {
        let state = self.lock();
        self.owned_slot(&state, block).map(|_| ())
    }
}

impl<B: Backend> MemoryResource for CachingAllocator<B> {
    fn allocate_raw(&self, request: AllocRequest) -> Result<RawBlock> {
        let mut state = self.lock();
        let req = self.check_request(&state.config, &request)?;
        let slot = state.malloc(&self.backend, &req)?;
        let b = state.table.block(slot);
        Ok(RawBlock {
            owner: self.id(),
            slot,
            generation: b.generation,
            addr: b.addr,
            block_size: b.size,
            requested: request.size,
            stream: request.stream,
        })
    }

    fn deallocate_raw(&self, block: RawBlock) -> Result<()> {
        let mut state = self.lock();
        let slot = self.owned_slot(&state, &block)?;
        state.free(&self.backend, slot);
        Ok(())
    }

    fn record_stream(&self, block: &RawBlock, stream: StreamId) -> Result<()> {
        if stream.0 == blocks::SHARED {
            return Err(MemoryError::UnknownStream(stream));
        }
        let mut state = self.lock();
        let slot = self.owned_slot(&state, block)?;
        if !state.streams_seen.contains(&stream.0) {
            self.backend.check_stream(stream)?;
        }
        state.record_stream(slot, stream);
        Ok(())
    }

    fn empty_cache(&self) -> Result<ReleaseReport> {
        let (segments, bytes) = self.lock().release_cached(&self.backend)?;
        Ok(ReleaseReport { segments, bytes })
    }

    fn memory_stats(&self) -> MemoryStats {
        self.lock().stats.clone()
    }

    fn reset_peak_stats(&self) {
        self.lock().stats.reset_peak_stats();
    }

    fn memory_info(&self) -> MemoryInfo {
        MemoryInfo {
            capacity: self.backend.capacity(),
            device_free: self.backend.free_memory(),
            limit: self.memory_limit(),
        }
    }

    fn snapshot(&self) -> Snapshot {
        let state = self.lock();
        let mut segments: Vec<SegmentSnapshot> = state
            .table
            .segments
            .iter()
            .map(|(_, seg)| {
                let blocks: Vec<BlockSnapshot> = state
                    .table
                    .segment_blocks(seg)
                    .into_iter()
                    .map(|slot| {
                        let b = state.table.block(slot);
                        let (state_name, requested) = match b.state {
                            BlockState::Allocated => (BlockStateName::ActiveAllocated, b.requested),
                            BlockState::PendingFree(_) => (BlockStateName::ActivePendingFree, b.requested),
                            BlockState::Free | BlockState::Parked => (BlockStateName::Inactive, 0),
                        };
                        BlockSnapshot {
                            address: b.addr,
                            size: b.size,
                            requested_size: requested,
                            state: state_name,
                            stream: b.stream.0,
                        }
                    })
                    .collect();
                let sum = |pred: fn(BlockStateName) -> bool| {
                    blocks.iter().filter(|b| pred(b.state)).map(|b| b.size).sum::<usize>()
                };
                SegmentSnapshot {
                    address: seg.addr,
                    total_size: seg.size,
                    stream: seg.stream.0,
                    segment_type: match seg.pool {
                        PoolKind::Small => "small".into(),
                        PoolKind::Large => "large".into(),
                    },
                    allocated_size: sum(|s| s == BlockStateName::ActiveAllocated),
                    active_size: sum(|s| s != BlockStateName::Inactive),
                    blocks,
                }
            })
            .collect();
        segments.sort_by_key(|s| s.address);
        Snapshot {
            device: self.backend.device_name(),
            capacity: self.backend.capacity(),
            limit: state.limit,
            segments,
            stats: state.stats.clone(),
        }
    }

    fn is_host_accessible(&self) -> bool {
        self.backend.is_host_accessible()
    }

    fn device_name(&self) -> String {
        self.backend.device_name()
    }
}

impl<B: Backend> Drop for CachingAllocator<B> {
    fn drop(&mut self) {
        // No Allocation can be alive here (they borrow the allocator); raw blocks that were
        // leaked with into_raw lose their memory now, which is what dropping the device means.
        let state = self.state.get_mut().unwrap_or_else(|poisoned| poisoned.into_inner());
        state.release_all(&self.backend);
    }
}

impl<B: Backend> std::fmt::Debug for CachingAllocator<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let stats = self.memory_stats();
        f.debug_struct("CachingAllocator")
            .field("device", &self.backend.device_name())
            .field("allocated", &stats.allocated_bytes.all.current)
            .field("reserved", &stats.reserved_bytes.all.current)
            .finish()
    }
}

#[cfg(test)]
mod tests;
