//! Backends provide raw segments of device memory plus the stream/event model the allocator
//! needs for stream-ordered reuse. The caching policy lives above them and is the same for all.
//!
//! - [`HostBackend`]: real, aligned host memory (the CPU device and the reference backend);
//! - [`SimulatedBackend`]: address space only, with a configurable capacity, for replaying
//!   GPU-scale workloads on a laptop;
//! - `CudaBackend` (feature `cuda`): device memory through the CUDA driver.

#[cfg(feature = "cuda")]
mod cuda;
mod host;
mod simulated;
mod simulated_streams;

#[cfg(feature = "cuda")]
pub use cuda::{device_location, open_device, CudaBackend};
pub use host::{host_memory_budget, HostBackend};
pub use simulated::SimulatedBackend;
pub use simulated_streams::SimulatedStreams;
pub use wick_alloc_check::{cgroup_memory, cgroup_memory_in, meminfo_bytes};

pub use crate::error::BackendError;
use crate::stream::{EventId, StreamId};

/// Granularity in which expandable segments are mapped and unmapped.
pub const MAP_GRANULARITY: usize = 2 << 20;

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
    /// True when the backend can reserve address space and map memory into it on demand
    /// (expandable segments). The three methods below are used only then.
    fn supports_expandable(&self) -> bool {
        false
    }
    /// Reserves `size` bytes of address space with no memory behind it.
    fn reserve_address_space(&self, _size: usize) -> Result<u64, BackendError> {
        Err(BackendError::Other(format!("{} cannot reserve address space", self.device_name())))
    }
    /// Maps memory at `[addr, addr + size)` inside a reservation; `size` is a multiple of 2 MiB.
    ///
    /// # Safety
    /// The range must lie in a reservation of this backend and must not be mapped already.
    unsafe fn map_range(&self, _addr: u64, _size: usize) -> Result<(), BackendError> {
        Err(BackendError::Other("map_range is not supported".into()))
    }
    /// Unmaps `[addr, addr + size)`, returning its memory to the device.
    ///
    /// # Safety
    /// The range must have been mapped by `map_range` in whole 2 MiB units and be unused.
    unsafe fn unmap_range(&self, _addr: u64, _size: usize) -> Result<(), BackendError> {
        Err(BackendError::Other("unmap_range is not supported".into()))
    }
    /// Gives a reservation back; nothing in it may be mapped.
    ///
    /// # Safety
    /// `addr`/`size` must be one reservation of this backend, fully unmapped.
    unsafe fn release_address_space(&self, _addr: u64, _size: usize) {}
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

/// A backend whose segments are host memory the process may read and write.
///
/// # Safety
/// Every address `allocate_segment` (or `map_range`) hands out must be a valid, writable host
/// pointer to `size` initialised bytes that stay valid and unused by anything else until the
/// segment is freed (unmapped). [`crate::CachingAllocator`] relies on this to give safe code
/// byte slices of its blocks ([`crate::Allocation::as_mut_slice`]); a safe `is_host_accessible`
/// answer alone is never trusted for that.
pub unsafe trait HostMemoryBackend: Backend {}

// SAFETY: forwards to a backend that makes the promise.
unsafe impl<B: HostMemoryBackend + ?Sized> HostMemoryBackend for std::sync::Arc<B> {}

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
    fn supports_expandable(&self) -> bool {
        (**self).supports_expandable()
    }
    fn reserve_address_space(&self, size: usize) -> Result<u64, BackendError> {
        (**self).reserve_address_space(size)
    }
    unsafe fn map_range(&self, addr: u64, size: usize) -> Result<(), BackendError> {
        // SAFETY: forwarded contract.
        unsafe { (**self).map_range(addr, size) }
    }
    unsafe fn unmap_range(&self, addr: u64, size: usize) -> Result<(), BackendError> {
        // SAFETY: forwarded contract.
        unsafe { (**self).unmap_range(addr, size) }
    }
    unsafe fn release_address_space(&self, addr: u64, size: usize) {
        // SAFETY: forwarded contract.
        unsafe { (**self).release_address_space(addr, size) }
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
