//! Records every allocation and free that passes through it (RMM's logging adaptor), as a list
//! of [`TraceOp`]s: the operations of a trace, which the `wick-trace` crate saves and replays
//! through any policy and backend (`wick_trace::Trace::from_ops`).

use std::collections::HashMap;
use std::sync::Mutex;

use crate::error::Result;
use crate::resource::{AllocRequest, MemoryResource, RawBlock};

/// One recorded operation: the unit of an allocation trace (the `wick-trace` crate replays
/// lists of them).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(tag = "op", rename_all = "snake_case", deny_unknown_fields)]
pub enum TraceOp {
    /// Allocate `size` bytes on `stream` and call the result `id`.
    Alloc {
        /// Name of the allocation.
        id: u64,
        /// Bytes.
        size: usize,
        /// Stream (0 if omitted).
        #[serde(default)]
        stream: u64,
    },
    /// Free allocation `id`.
    Free {
        /// Name of the allocation.
        id: u64,
    },
}

#[derive(Debug, Default)]
struct Log {
    ops: Vec<TraceOp>,
    ids: HashMap<u64, u64>,
    next_id: u64,
}

/// Logs allocation events.
#[derive(Debug)]
pub struct EventLog<R: MemoryResource> {
    upstream: R,
    log: Mutex<Log>,
}

impl<R: MemoryResource> EventLog<R> {
    /// Wraps `upstream`.
    pub fn new(upstream: R) -> Self {
        EventLog { upstream, log: Mutex::new(Log::default()) }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Log> {
        self.log.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// The operations so far, in order.
    pub fn ops(&self) -> Vec<TraceOp> {
        self.lock().ops.clone()
    }

    /// The wrapped resource.
    pub fn inner(&self) -> &R {
        &self.upstream
    }
}

impl<R: MemoryResource> MemoryResource for EventLog<R> {
    fn allocate_raw(&self, request: AllocRequest) -> Result<RawBlock> {
        let block = self.upstream.allocate_raw(request)?;
        let mut log = self.lock();
        log.next_id += 1;
        let id = log.next_id;
        log.ids.insert(block.addr(), id);
        log.ops.push(TraceOp::Alloc { id, size: request.size, stream: request.stream.0 });
        Ok(block)
    }

    fn deallocate_raw(&self, block: RawBlock) -> Result<()> {
        let addr = block.addr();
        self.upstream.deallocate_raw(block)?;
        let mut log = self.lock();
        if let Some(id) = log.ids.remove(&addr) {
            log.ops.push(TraceOp::Free { id });
        }
        Ok(())
    }

    fn upstream(&self) -> Option<&dyn MemoryResource> {
        Some(&self.upstream)
    }
}
