//! Real, aligned host memory. The reference backend: segments are zero-initialised heap memory,
//! so a block's bytes can be written and read back to prove blocks never overlap.

use std::alloc::{alloc_zeroed, dealloc, Layout};
use std::sync::atomic::{AtomicUsize, Ordering};

use super::{Backend, BackendError, SimulatedStreams};
use crate::stream::{EventId, StreamId};

/// Host memory with a capacity budget. A failed heap allocation is reported as
/// `BackendError::OutOfMemory`, never as `handle_alloc_error` (which would abort a notebook).
#[derive(Debug)]
pub struct HostBackend {
    capacity: usize,
    used: AtomicUsize,
    streams: SimulatedStreams,
}

/// Segments are page aligned.
const HOST_ALIGNMENT: usize = 4096;

impl HostBackend {
    /// A host backend whose capacity is the memory this process may use: the cgroup limit when
    /// one is set, else the machine's physical memory.
    pub fn new() -> Self {
        Self::with_capacity(host_memory_budget())
    }

    /// A host backend that will hand out at most `capacity` bytes of segments.
    pub fn with_capacity(capacity: usize) -> Self {
        HostBackend { capacity, used: AtomicUsize::new(0), streams: SimulatedStreams::default() }
    }

    /// The stream model (launch/finish work) of this backend.
    pub fn streams(&self) -> &SimulatedStreams {
        &self.streams
    }

    /// Bytes currently held in segments (independent of the allocator's own accounting).
    pub fn bytes_in_segments(&self) -> usize {
        self.used.load(Ordering::SeqCst)
    }
}

impl Default for HostBackend {
    fn default() -> Self {
        Self::new()
    }
}

/// The memory this process may use: the tightest limit of its memory cgroup (v1 or v2, along its
/// own cgroup path; see [`super::cgroup_memory`]) when one is set, else `MemTotal`.
pub fn host_memory_budget() -> usize {
    let cgroup = super::cgroup_memory().and_then(|(_, limit)| limit);
    let meminfo = wick_alloc_check::meminfo_bytes("MemTotal");
    match (cgroup, meminfo) {
        (Some(c), Some(m)) => c.min(m),
        (Some(c), None) => c,
        (None, Some(m)) => m,
        // Without either source, fall back to a conservative 8 GiB.
        (None, None) => 8 << 30,
    }
}

#[cfg(unix)]
/// A failed mapping call as a backend error: ENOMEM (the kernel's commit limit, e.g. under
/// `vm.overcommit_memory=2`, or a cgroup) is out of memory, so the allocator flushes its cache
/// and retries, and the caller sees `OutOfMemory` with advice; anything else is reported as is.
fn mapping_error(call: &str, e: std::io::Error) -> BackendError {
    if e.raw_os_error() == Some(libc::ENOMEM) {
        BackendError::OutOfMemory
    } else {
        BackendError::Other(format!("{call}: {e}"))
    }
}

// SAFETY: segments are `alloc_zeroed` heap memory or read-write pages of an anonymous mapping
// (zero until written), valid until `free_segment`/`unmap_range`, handed to one block holder.
unsafe impl super::HostMemoryBackend for HostBackend {}

impl Backend for HostBackend {
    fn device_name(&self) -> String {
        "host:0".to_string()
    }

    fn capacity(&self) -> usize {
        self.capacity
    }

    fn free_memory(&self) -> usize {
        self.capacity.saturating_sub(self.used.load(Ordering::SeqCst))
    }

    fn segment_alignment(&self) -> usize {
        HOST_ALIGNMENT
    }

    fn is_host_accessible(&self) -> bool {
        true
    }

    fn allocate_segment(&self, size: usize, stream: StreamId) -> Result<u64, BackendError> {
        self.streams.check(stream)?;
        if size == 0 {
            return Err(BackendError::Other("zero-size segment".into()));
        }
        // Reserve the budget first so concurrent callers cannot overshoot it.
        let reserved = self.used.fetch_add(size, Ordering::SeqCst);
        if reserved.checked_add(size).is_none_or(|total| total > self.capacity) {
            self.used.fetch_sub(size, Ordering::SeqCst);
            return Err(BackendError::OutOfMemory);
        }
        let layout = match Layout::from_size_align(size, HOST_ALIGNMENT) {
            Ok(layout) => layout,
            Err(_) => {
                self.used.fetch_sub(size, Ordering::SeqCst);
                return Err(BackendError::OutOfMemory);
            }
        };
        // SAFETY: the layout has non-zero size.
        let ptr = unsafe { alloc_zeroed(layout) };
        if ptr.is_null() {
            self.used.fetch_sub(size, Ordering::SeqCst);
            return Err(BackendError::OutOfMemory);
        }
        Ok(ptr as u64)
    }

    unsafe fn free_segment(&self, addr: u64, size: usize) -> Result<(), BackendError> {
        let layout = Layout::from_size_align(size, HOST_ALIGNMENT)
            .map_err(|e| BackendError::Other(format!("bad segment layout: {e}")))?;
        // SAFETY: the caller guarantees addr/size come from allocate_segment with this layout.
        unsafe { dealloc(addr as *mut u8, layout) };
        self.used.fetch_sub(size, Ordering::SeqCst);
        Ok(())
    }

    fn supports_expandable(&self) -> bool {
        cfg!(unix)
    }

    #[cfg(unix)]
    fn reserve_address_space(&self, size: usize) -> Result<u64, BackendError> {
        // SAFETY: an anonymous, inaccessible, unbacked mapping; no existing memory is touched.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                size,
                libc::PROT_NONE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
                -1,
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err(BackendError::OutOfMemory);
        }
        Ok(ptr as u64)
    }

    #[cfg(unix)]
    unsafe fn map_range(&self, addr: u64, size: usize) -> Result<(), BackendError> {
        let before = self.used.fetch_add(size, Ordering::SeqCst);
        if before.checked_add(size).is_none_or(|total| total > self.capacity) {
            self.used.fetch_sub(size, Ordering::SeqCst);
            return Err(BackendError::OutOfMemory);
        }
        // SAFETY: the caller guarantees the range lies in one of our reservations. Pages of an
        // anonymous mapping read as zero until written, so the bytes are initialised.
        if unsafe { libc::mprotect(addr as *mut libc::c_void, size, libc::PROT_READ | libc::PROT_WRITE) } != 0 {
            self.used.fetch_sub(size, Ordering::SeqCst);
            return Err(mapping_error("mprotect", std::io::Error::last_os_error()));
        }
        Ok(())
    }

    #[cfg(unix)]
    unsafe fn unmap_range(&self, addr: u64, size: usize) -> Result<(), BackendError> {
        // SAFETY: the caller guarantees the range is mapped and unused. MADV_DONTNEED returns the
        // pages to the system (they read as zero again if remapped).
        unsafe {
            if libc::madvise(addr as *mut libc::c_void, size, libc::MADV_DONTNEED) != 0
                || libc::mprotect(addr as *mut libc::c_void, size, libc::PROT_NONE) != 0
            {
                return Err(BackendError::Other(format!("unmap: {}", std::io::Error::last_os_error())));
            }
        }
        self.used.fetch_sub(size, Ordering::SeqCst);
        Ok(())
    }

    #[cfg(unix)]
    unsafe fn release_address_space(&self, addr: u64, size: usize) {
        // SAFETY: the caller guarantees this is one whole reservation.
        unsafe { libc::munmap(addr as *mut libc::c_void, size) };
    }

    fn check_stream(&self, stream: StreamId) -> Result<(), BackendError> {
        self.streams.check(stream)
    }

    fn record_event(&self, stream: StreamId) -> Result<EventId, BackendError> {
        self.streams.record(stream)
    }

    fn event_completed(&self, event: EventId) -> Result<bool, BackendError> {
        self.streams.completed(event)
    }

    fn destroy_event(&self, event: EventId) {
        self.streams.destroy(event)
    }

    fn synchronize(&self) -> Result<(), BackendError> {
        self.streams.finish_all();
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn segments_are_aligned_zeroed_and_budgeted() {
        let b = HostBackend::with_capacity(1 << 20);
        let a = b.allocate_segment(4096 * 3, StreamId::DEFAULT).unwrap();
        assert_eq!(a % HOST_ALIGNMENT as u64, 0);
        // SAFETY: the segment is 3 pages of zeroed memory we own.
        let bytes = unsafe { std::slice::from_raw_parts(a as *const u8, 4096 * 3) };
        assert!(bytes.iter().all(|&x| x == 0));
        assert_eq!(b.free_memory(), (1 << 20) - 4096 * 3);
        assert_eq!(b.allocate_segment(1 << 20, StreamId::DEFAULT), Err(BackendError::OutOfMemory));
        assert_eq!(b.bytes_in_segments(), 4096 * 3);
        // SAFETY: freeing the segment allocated above, once.
        unsafe { b.free_segment(a, 4096 * 3).unwrap() };
        assert_eq!(b.bytes_in_segments(), 0);
    }

    #[cfg(unix)]
    #[test]
    fn enomem_from_the_kernel_is_out_of_memory() {
        let enomem = std::io::Error::from_raw_os_error(libc::ENOMEM);
        assert_eq!(mapping_error("mprotect", enomem), BackendError::OutOfMemory);
        let einval = std::io::Error::from_raw_os_error(libc::EINVAL);
        assert!(matches!(mapping_error("mprotect", einval), BackendError::Other(m) if m.starts_with("mprotect")));
    }

    #[test]
    fn absurd_sizes_fail_cleanly() {
        let b = HostBackend::with_capacity(usize::MAX);
        assert_eq!(b.allocate_segment(usize::MAX - 10, StreamId::DEFAULT), Err(BackendError::OutOfMemory));
        assert!(b.host_budget_positive());
    }

    impl HostBackend {
        fn host_budget_positive(&self) -> bool {
            host_memory_budget() > 0
        }
    }
}
