//! Byte and allocation counters at one layer (RMM's `statistics_resource_adaptor`): current,
//! peak and total, independent of the allocator's own statistics.

use std::collections::HashSet;
use std::sync::Mutex;

use crate::error::Result;
use crate::resource::{AllocRequest, HostResource, MemoryResource, RawBlock};

/// Counters kept by [`Statistics`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct Counters {
    /// Bytes outstanding (requested sizes).
    pub bytes_current: usize,
    /// Highest `bytes_current`.
    pub bytes_peak: usize,
    /// Bytes ever allocated.
    pub bytes_total: usize,
    /// Allocations outstanding.
    pub count_current: usize,
    /// Highest `count_current`.
    pub count_peak: usize,
    /// Allocations ever made.
    pub count_total: usize,
    /// Failed allocation requests.
    pub failures: usize,
}

/// The counters and the keys of the blocks they count.
type Counted = (Counters, HashSet<(u64, u32, u32)>);

/// Counts what passes through it.
#[derive(Debug)]
pub struct Statistics<R: MemoryResource> {
    upstream: R,
    counters: Mutex<Counted>,
}

impl<R: MemoryResource> Statistics<R> {
    /// Wraps `upstream`.
    pub fn new(upstream: R) -> Self {
        Statistics { upstream, counters: Mutex::new((Counters::default(), HashSet::new())) }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Counted> {
        self.counters.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// The counters now.
    pub fn counters(&self) -> Counters {
        self.lock().0
    }

    /// The wrapped resource.
    pub fn inner(&self) -> &R {
        &self.upstream
    }
}

impl<R: MemoryResource> MemoryResource for Statistics<R> {
    fn allocate_raw(&self, request: AllocRequest) -> Result<RawBlock> {
        let result = self.upstream.allocate_raw(request);
        let (c, own) = &mut *self.lock();
        match &result {
            Ok(block) => {
                own.insert(block.key());
                c.bytes_current += block.size();
                c.bytes_total += block.size();
                c.bytes_peak = c.bytes_peak.max(c.bytes_current);
                c.count_current += 1;
                c.count_total += 1;
                c.count_peak = c.count_peak.max(c.count_current);
            }
            Err(_) => c.failures += 1,
        }
        result
    }

    /// A block allocated around this adaptor (through [`Statistics::inner`]) is returned
    /// upstream without touching these counters, which never counted it.
    fn deallocate_raw(&self, block: RawBlock) -> Result<()> {
        let (size, key) = (block.size(), block.key());
        self.upstream.deallocate_raw(block)?;
        let (c, own) = &mut *self.lock();
        if own.remove(&key) {
            c.bytes_current -= size;
            c.count_current -= 1;
        }
        Ok(())
    }

    fn upstream(&self) -> Option<&dyn MemoryResource> {
        Some(&self.upstream)
    }

    /// Sets this layer's peaks to the current values, and the upstream's.
    fn reset_peak_stats(&self) {
        {
            let c = &mut self.lock().0;
            c.bytes_peak = c.bytes_current;
            c.count_peak = c.count_current;
        }
        self.upstream.reset_peak_stats();
    }
}

// SAFETY: blocks pass through unchanged; the upstream that allocated them answers.
unsafe impl<R: HostResource> HostResource for Statistics<R> {
    fn check_host_block(&self, block: &RawBlock) -> Result<()> {
        self.upstream.check_host_block(block)
    }
}
