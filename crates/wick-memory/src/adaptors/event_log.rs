//! Records every allocation and free that passes through it (RMM's logging adaptor), as a
//! [`Trace`] that `replay` can run through any policy and backend.

use std::collections::HashMap;
use std::sync::Mutex;

use crate::error::Result;
use crate::resource::{AllocRequest, MemoryResource, RawBlock};
use crate::trace::{Trace, TraceOp};

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

    /// The events so far as a replayable trace named `name`.
    pub fn trace(&self, name: &str) -> Trace {
        Trace { name: name.to_string(), description: String::new(), ops: self.lock().ops.clone() }
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
