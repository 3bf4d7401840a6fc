//! On out-of-memory, call a user function that may free memory and ask for a retry (RMM's
//! `failure_callback_resource_adaptor`). Typical use: drop a cache of activations, empty the
//! allocator cache, or log the failure.

use crate::error::Result;
use crate::resource::{AllocRequest, MemoryResource, RawBlock};

/// The callback: `(upstream, failed request, attempt number from 1) -> retry?`.
pub type OomCallback<R> = Box<dyn Fn(&R, &AllocRequest, u32) -> bool + Send + Sync>;

/// Retries allocations for as long as the callback asks for it.
pub struct FailureCallback<R: MemoryResource> {
    upstream: R,
    callback: OomCallback<R>,
}

impl<R: MemoryResource> FailureCallback<R> {
    /// Wraps `upstream`; `callback` runs after each out-of-memory failure.
    pub fn new(upstream: R, callback: impl Fn(&R, &AllocRequest, u32) -> bool + Send + Sync + 'static) -> Self {
        FailureCallback { upstream, callback: Box::new(callback) }
    }

    /// The wrapped resource.
    pub fn inner(&self) -> &R {
        &self.upstream
    }
}

impl<R: MemoryResource> MemoryResource for FailureCallback<R> {
    fn allocate_raw(&self, request: AllocRequest) -> Result<RawBlock> {
        let mut attempt = 0;
        loop {
            match self.upstream.allocate_raw(request) {
                Err(e) if e.is_out_of_memory() => {
                    attempt += 1;
                    if !(self.callback)(&self.upstream, &request, attempt) {
                        return Err(e);
                    }
                }
                other => return other,
            }
        }
    }

    fn deallocate_raw(&self, block: RawBlock) -> Result<()> {
        self.upstream.deallocate_raw(block)
    }

    fn upstream(&self) -> Option<&dyn MemoryResource> {
        Some(&self.upstream)
    }
}
