//! A hard cap on bytes handed out (RMM's `limiting_resource_adaptor`), checked before the
//! upstream is asked, so an over-limit request never touches the device.

use std::collections::HashSet;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

use crate::error::{OutOfMemory, Result};
use crate::resource::{AllocRequest, HostResource, MemoryInfo, MemoryResource, RawBlock};

/// Refuses requests that would take the bytes allocated through it above `limit`.
#[derive(Debug)]
pub struct Limiting<R: MemoryResource> {
    upstream: R,
    limit: usize,
    used: AtomicUsize,
    /// Keys of the blocks counted in `used`.
    own: Mutex<HashSet<(u64, u32, u32)>>,
}

impl<R: MemoryResource> Limiting<R> {
    /// Wraps `upstream` with a cap of `limit` bytes (counted in block sizes).
    pub fn new(upstream: R, limit: usize) -> Self {
        Limiting { upstream, limit, used: AtomicUsize::new(0), own: Mutex::new(HashSet::new()) }
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
            return Err(OutOfMemory::refused(self.upstream.device_name(), request.size)
                .with_device(info.capacity, info.device_free)
                .with_usage(stats.allocated_bytes.all.unsigned_current(), stats.reserved_bytes.all.unsigned_current())
                .with_limit(Some(self.limit), true)
                .into_error());
        }
        match self.upstream.allocate_raw(request) {
            Ok(block) => {
                // Account the block's real size, not the request.
                let extra = block.block_size().saturating_sub(request.size);
                self.used.fetch_add(extra, Ordering::SeqCst);
                self.own.lock().unwrap_or_else(|p| p.into_inner()).insert(block.key());
                Ok(block)
            }
            Err(e) => {
                self.used.fetch_sub(request.size, Ordering::SeqCst);
                Err(e)
            }
        }
    }

    /// A block allocated around this adaptor (through [`Limiting::inner`]) is returned upstream
    /// without touching `used`, which never counted it.
    fn deallocate_raw(&self, block: RawBlock) -> Result<()> {
        let (size, key) = (block.block_size(), block.key());
        self.upstream.deallocate_raw(block)?;
        if self.own.lock().unwrap_or_else(|p| p.into_inner()).remove(&key) {
            self.used.fetch_sub(size, Ordering::SeqCst);
        }
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

// SAFETY: blocks pass through unchanged; the upstream that allocated them answers.
unsafe impl<R: HostResource> HostResource for Limiting<R> {
    fn check_host_block(&self, block: &RawBlock) -> Result<()> {
        self.upstream.check_host_block(block)
    }
}
