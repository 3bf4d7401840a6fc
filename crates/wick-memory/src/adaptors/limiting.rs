//! A hard cap on bytes handed out (RMM's `limiting_resource_adaptor`), checked before the
//! upstream is asked, so an over-limit request never touches the device.

use std::sync::atomic::{AtomicUsize, Ordering};

use crate::error::{MemoryError, OutOfMemory, Result};
use crate::resource::{AllocRequest, MemoryInfo, MemoryResource, RawBlock};

/// Refuses requests that would take the bytes allocated through it above `limit`.
#[derive(Debug)]
pub struct Limiting<R: MemoryResource> {
    upstream: R,
    limit: usize,
    used: AtomicUsize,
}

impl<R: MemoryResource> Limiting<R> {
    /// Wraps `upstream` with a cap of `limit` bytes (counted in block sizes).
    pub fn new(upstream: R, limit: usize) -> Self {
        Limiting { upstream, limit, used: AtomicUsize::new(0) }
    }

    /// Bytes allocated through this adaptor now.
    pub fn used(&self) -> usize {
        self.used.load(Ordering::SeqCst)
    }

    /// The cap.
    pub fn limit(&self) -> usize {
        self.limit
    }

    /// The wrapped resource.
    pub fn inner(&self) -> &R {
        &self.upstream
    }
}

impl<R: MemoryResource> MemoryResource for Limiting<R> {
    fn allocate_raw(&self, request: AllocRequest) -> Result<RawBlock> {
        // Reserve the requested bytes first so concurrent callers cannot overshoot the cap.
        let before = self.used.fetch_add(request.size, Ordering::SeqCst);
        if before.checked_add(request.size).is_none_or(|total| total > self.limit) {
            self.used.fetch_sub(request.size, Ordering::SeqCst);
            let stats = self.upstream.memory_stats();
            let info = self.upstream.memory_info();
            return Err(MemoryError::OutOfMemory(Box::new(OutOfMemory {
                device: self.upstream.device_name(),
                requested: request.size,
                segment_size: request.size,
                capacity: info.capacity,
                device_free: info.device_free,
                allocated: stats.allocated_bytes.all.current as usize,
                reserved: stats.reserved_bytes.all.current as usize,
                limit: Some(self.limit),
                limited_by_cap: true,
                largest_free_block: 0,
            })));
        }
        match self.upstream.allocate_raw(request) {
            Ok(block) => {
                // Account the block's real size, not the request.
                let extra = block.block_size().saturating_sub(request.size);
                self.used.fetch_add(extra, Ordering::SeqCst);
                Ok(block)
            }
            Err(e) => {
                self.used.fetch_sub(request.size, Ordering::SeqCst);
                Err(e)
            }
        }
    }

    fn deallocate_raw(&self, block: RawBlock) -> Result<()> {
        let size = block.block_size();
        self.upstream.deallocate_raw(block)?;
        self.used.fetch_sub(size, Ordering::SeqCst);
        Ok(())
    }

    fn upstream(&self) -> Option<&dyn MemoryResource> {
        Some(&self.upstream)
    }

    fn memory_info(&self) -> MemoryInfo {
        let info = self.upstream.memory_info();
        MemoryInfo { limit: Some(info.limit.map_or(self.limit, |l| l.min(self.limit))), ..info }
    }
}
