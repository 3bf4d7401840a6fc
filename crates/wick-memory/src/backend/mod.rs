//! Backends provide raw segments of device memory plus the stream/event model the allocator
//! needs for stream-ordered reuse. The caching policy lives above them and is the same for all.
//!
//! - [`HostBackend`]: real, aligned host memory (the CPU device and the reference backend);
//! - [`SimulatedBackend`]: address space only, with a configurable capacity, for replaying
//!   GPU-scale workloads on a laptop;
//! - `CudaBackend` (feature `cuda`): device memory through the CUDA driver.

#[cfg(feature = "cuda")]
mod cuda;
#[cfg(feature = "cuda")]
mod cuda_pool;
mod host;
mod simulated;
mod simulated_streams;

#[cfg(feature = "cuda")]
pub use cuda::{open_device, CudaBackend};
#[cfg(feature = "cuda")]
pub use cuda_pool::DriverPool;
pub use host::HostBackend;
pub use simulated::SimulatedBackend;
pub use simulated_streams::SimulatedStreams;

use crate::stream::{EventId, StreamId};

/// Why a backend call failed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum BackendError {
    /// The device has no memory left for this segment (transient).
    OutOfMemory,
    /// The stream does not exist.
    UnknownStream(StreamId),
    /// Any other driver failure, with its message.
    Other(String),
}

impl std::fmt::Display for BackendError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            BackendError::OutOfMemory => write!(f, "device out of memory"),
            BackendError::UnknownStream(s) => write!(f, "unknown stream {s}"),
            BackendError::Other(msg) => write!(f, "{msg}"),
        }
    }
}

/// Source of raw segments. Implementations are thread-safe; the allocator serialises its own
/// calls but several allocators may share a device.
pub trait Backend: Send + Sync {
    /// Short device description, e.g. `host:0`, `sim:0`, `cuda:0`.
    fn device_name(&self) -> String;
    /// Total bytes of the device.
    fn capacity(&self) -> usize;
    /// Bytes the device could still hand out (as `cuMemGetInfo` reports).
    fn free_memory(&self) -> usize;
    /// Every segment address is a multiple of this (a power of two, at least 512).
    fn segment_alignment(&self) -> usize;
    /// True when segment addresses are valid host pointers to initialised bytes.
    fn is_host_accessible(&self) -> bool;
    /// Reserves a segment of exactly `size` bytes for use on `stream`.
    fn allocate_segment(&self, size: usize, stream: StreamId) -> Result<u64, BackendError>;
    /// Returns a segment to the device.
    ///
    /// # Safety
    /// `addr` and `size` must come from one earlier `allocate_segment` of this backend, the
    /// segment must not have been freed already, and no pending device work may still use it.
    unsafe fn free_segment(&self, addr: u64, size: usize) -> Result<(), BackendError>;
    /// Fails with `UnknownStream` when `stream` does not exist on this device.
    fn check_stream(&self, stream: StreamId) -> Result<(), BackendError>;
    /// Records an event at the current end of `stream`.
    fn record_event(&self, stream: StreamId) -> Result<EventId, BackendError>;
    /// True once all work recorded before `event` has finished.
    fn event_completed(&self, event: EventId) -> Result<bool, BackendError>;
    /// Releases an event's resources.
    fn destroy_event(&self, event: EventId);
    /// Waits for all work on all streams.
    fn synchronize(&self) -> Result<(), BackendError>;
}

impl<B: Backend + ?Sized> Backend for std::sync::Arc<B> {
    fn device_name(&self) -> String {
        (**self).device_name()
    }
    fn capacity(&self) -> usize {
        (**self).capacity()
    }
    fn free_memory(&self) -> usize {
        (**self).free_memory()
    }
    fn segment_alignment(&self) -> usize {
        (**self).segment_alignment()
    }
    fn is_host_accessible(&self) -> bool {
        (**self).is_host_accessible()
    }
    fn allocate_segment(&self, size: usize, stream: StreamId) -> Result<u64, BackendError> {
        (**self).allocate_segment(size, stream)
    }
    unsafe fn free_segment(&self, addr: u64, size: usize) -> Result<(), BackendError> {
        // SAFETY: the caller upholds the contract of the inner backend.
        unsafe { (**self).free_segment(addr, size) }
    }
    fn check_stream(&self, stream: StreamId) -> Result<(), BackendError> {
        (**self).check_stream(stream)
    }
    fn record_event(&self, stream: StreamId) -> Result<EventId, BackendError> {
        (**self).record_event(stream)
    }
    fn event_completed(&self, event: EventId) -> Result<bool, BackendError> {
        (**self).event_completed(event)
    }
    fn destroy_event(&self, event: EventId) {
        (**self).destroy_event(event)
    }
    fn synchronize(&self) -> Result<(), BackendError> {
        (**self).synchronize()
    }
}
