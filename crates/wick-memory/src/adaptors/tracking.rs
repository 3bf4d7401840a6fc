//! Live-allocation tracking (RMM's `tracking_resource_adaptor`): which blocks are alive, how big,
//! on which stream, and optionally where they were allocated (a backtrace), to find leaks.

use std::collections::BTreeMap;
use std::sync::Mutex;

use crate::error::Result;
use crate::resource::{AllocRequest, MemoryResource, RawBlock};
use crate::stream::StreamId;

/// One live allocation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Tracked {
    /// Address.
    pub addr: u64,
    /// Bytes asked for.
    pub size: usize,
    /// Stream.
    pub stream: StreamId,
    /// Where it was allocated, when backtraces are on.
    pub backtrace: Option<String>,
}

/// Records every live allocation.
#[derive(Debug)]
pub struct Tracking<R: MemoryResource> {
    upstream: R,
    capture_backtraces: bool,
    live: Mutex<BTreeMap<u64, Tracked>>,
}

impl<R: MemoryResource> Tracking<R> {
    /// Wraps `upstream`; `capture_backtraces` records a backtrace per allocation (slow).
    pub fn new(upstream: R, capture_backtraces: bool) -> Self {
        Tracking { upstream, capture_backtraces, live: Mutex::new(BTreeMap::new()) }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, BTreeMap<u64, Tracked>> {
        self.live.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Live allocations by address.
    pub fn live(&self) -> Vec<Tracked> {
        self.lock().values().cloned().collect()
    }

    /// Bytes of live allocations.
    pub fn live_bytes(&self) -> usize {
        self.lock().values().map(|t| t.size).sum()
    }

    /// A readable list of live allocations (a leak report when called at the end).
    pub fn report(&self) -> String {
        let live = self.live();
        let mut out = format!("{} live allocation(s), {} bytes\n", live.len(), self.live_bytes());
        for t in live {
            out.push_str(&format!("  {:#x}: {} bytes on stream {}\n", t.addr, t.size, t.stream));
            if let Some(bt) = &t.backtrace {
                for line in bt.lines() {
                    out.push_str(&format!("      {line}\n"));
                }
            }
        }
        out
    }

    /// The wrapped resource.
    pub fn inner(&self) -> &R {
        &self.upstream
    }
}

impl<R: MemoryResource> MemoryResource for Tracking<R> {
    fn allocate_raw(&self, request: AllocRequest) -> Result<RawBlock> {
        let block = self.upstream.allocate_raw(request)?;
        let backtrace = self.capture_backtraces.then(|| std::backtrace::Backtrace::force_capture().to_string());
        self.lock().insert(
            block.addr(),
            Tracked { addr: block.addr(), size: block.size(), stream: block.stream(), backtrace },
        );
        Ok(block)
    }

    fn deallocate_raw(&self, block: RawBlock) -> Result<()> {
        let addr = block.addr();
        self.upstream.deallocate_raw(block)?;
        self.lock().remove(&addr);
        Ok(())
    }

    fn upstream(&self) -> Option<&dyn MemoryResource> {
        Some(&self.upstream)
    }
}
