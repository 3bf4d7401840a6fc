//! The memory-resource interface every allocator and adaptor implements (RMM's
//! `device_memory_resource`), and the RAII handle that gives memory back when it drops.

use std::marker::PhantomData;

use crate::error::{MemoryError, Result};
use crate::snapshot::Snapshot;
use crate::stats::MemoryStats;
use crate::stream::StreamId;

/// What a caller asks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AllocRequest {
    /// Bytes wanted (> 0).
    pub size: usize,
    /// Required alignment of the address (a power of two).
    pub align: usize,
    /// The stream the memory will first be used on.
    pub stream: StreamId,
}

impl AllocRequest {
    /// `size` bytes on the default stream with no alignment beyond what every block has (the
    /// allocator's 512 B, [`crate::BLOCK_ALIGNMENT`]; the request's own `align` is 1).
    pub fn new(size: usize) -> Self {
        AllocRequest { size, align: 1, stream: StreamId::DEFAULT }
    }

    /// The same request on `stream`.
    pub fn on_stream(mut self, stream: StreamId) -> Self {
        self.stream = stream;
        self
    }

    /// The same request with an alignment requirement.
    pub fn aligned(mut self, align: usize) -> Self {
        self.align = align;
        self
    }
}

/// A block handed out by a resource. It cannot be copied or forged outside this crate, so a block
/// can be returned at most once; returning it to a resource that did not allocate it is an error.
#[derive(Debug, PartialEq, Eq)]
pub struct RawBlock {
    pub(crate) owner: u64,
    pub(crate) slot: u32,
    pub(crate) generation: u32,
    pub(crate) addr: u64,
    pub(crate) block_size: usize,
    pub(crate) requested: usize,
    pub(crate) stream: StreamId,
}

impl RawBlock {
    /// Device address of the first byte.
    pub fn addr(&self) -> u64 {
        self.addr
    }
    /// Bytes the caller asked for.
    pub fn size(&self) -> usize {
        self.requested
    }
    /// Bytes of the block behind it (the request rounded up by the policy).
    pub fn block_size(&self) -> usize {
        self.block_size
    }
    /// The stream it was allocated on.
    pub fn stream(&self) -> StreamId {
        self.stream
    }
    /// What identifies the block among every block of every resource in the process (its
    /// allocator's identity, slot and generation); adaptors use it to know their own blocks.
    pub(crate) fn key(&self) -> (u64, u32, u32) {
        (self.owner, self.slot, self.generation)
    }
}

/// What a release (`empty_cache`, a scope's end) gave back.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct ReleaseReport {
    /// Segments returned to the backend.
    pub segments: usize,
    /// Bytes returned to the backend.
    pub bytes: usize,
}

/// Capacity figures of the device under a resource.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MemoryInfo {
    /// Total bytes of the device.
    pub capacity: usize,
    /// Bytes the device could still hand out.
    pub device_free: usize,
    /// The hard cap on reserved bytes, if any.
    pub limit: Option<usize>,
}

/// A source of device memory. Allocators implement all of it; adaptors implement
/// `allocate_raw`/`deallocate_raw` and forward the rest to `upstream()`.
pub trait MemoryResource: Send + Sync {
    /// Hands out a block, or explains why not. Never panics, never aborts.
    fn allocate_raw(&self, request: AllocRequest) -> Result<RawBlock>;

    /// Takes a block back. A block from another resource is refused with `ForeignBlock`.
    fn deallocate_raw(&self, block: RawBlock) -> Result<()>;

    /// The resource this one wraps, if it is an adaptor.
    fn upstream(&self) -> Option<&dyn MemoryResource> {
        None
    }

    /// Marks `block` as used on `stream` too: it is not reused until that stream's work is done.
    fn record_stream(&self, block: &RawBlock, stream: StreamId) -> Result<()> {
        match self.upstream() {
            Some(up) => up.record_stream(block, stream),
            None => Err(MemoryError::Unsupported("record_stream".into())),
        }
    }

    /// Returns every cached segment that holds no live block to the backend.
    fn empty_cache(&self) -> Result<ReleaseReport> {
        self.upstream().map_or(Ok(ReleaseReport::default()), |up| up.empty_cache())
    }

    /// PyTorch-named statistics of the underlying caching allocator.
    fn memory_stats(&self) -> MemoryStats {
        self.upstream().map(|up| up.memory_stats()).unwrap_or_default()
    }

    /// Resets peak statistics to current values.
    fn reset_peak_stats(&self) {
        if let Some(up) = self.upstream() {
            up.reset_peak_stats()
        }
    }

    /// Capacity, free memory and cap.
    fn memory_info(&self) -> MemoryInfo {
        self.upstream().map(|up| up.memory_info()).unwrap_or(MemoryInfo { capacity: 0, device_free: 0, limit: None })
    }

    /// Segments and blocks with their states.
    fn snapshot(&self) -> Snapshot {
        self.upstream().map(|up| up.snapshot()).unwrap_or_default()
    }

    /// True when block addresses are host pointers to initialised bytes.
    fn is_host_accessible(&self) -> bool {
        self.upstream().is_some_and(|up| up.is_host_accessible())
    }

    /// Device description, e.g. `host:0`.
    fn device_name(&self) -> String {
        self.upstream().map(|up| up.device_name()).unwrap_or_else(|| "unknown".into())
    }
}

/// A resource whose blocks are host memory safe code may read and write.
///
/// # Safety
/// `check_host_block` may return `Ok` only when `block` is a block this resource handed out and
/// has not taken back, and its address is a valid host pointer to at least `block.size()`
/// initialised bytes that nothing else uses until the block is returned. Adaptors forward it to
/// the resource that allocated their blocks.
pub unsafe trait HostResource: MemoryResource {
    /// `Ok` when `block` is a live host block of this resource; an error saying why not otherwise.
    fn check_host_block(&self, block: &RawBlock) -> Result<()>;
}

/// A live allocation. Dropping it returns the block to its resource; it borrows the resource,
/// so it cannot outlive it:
///
/// ```compile_fail
/// use wick_memory::{AllocateExt, CachingAllocator, HostBackend};
/// let block = {
///     let allocator = CachingAllocator::new(HostBackend::with_capacity(1 << 30));
///     allocator.allocate(1024).unwrap()
/// }; // error[E0597]: `allocator` does not live long enough
/// ```
pub struct Allocation<'r, R: MemoryResource + ?Sized> {
    resource: &'r R,
    block: Option<RawBlock>,
    // Not Sync through the raw pointer it stands for; Send is fine (the block is owned).
    _not_sync: PhantomData<std::cell::Cell<()>>,
}

impl<'r, R: MemoryResource + ?Sized> Allocation<'r, R> {
    /// Wraps a raw block of `resource` so it is returned on drop.
    ///
    /// The block must come from `resource`; otherwise the drop's return is refused (and the block
    /// stays counted in the resource that allocated it).
    pub fn from_raw(resource: &'r R, block: RawBlock) -> Self {
        Allocation { resource, block: Some(block), _not_sync: PhantomData }
    }

    fn raw(&self) -> &RawBlock {
        // The block is present from construction until drop or into_raw (which consumes self).
        self.block.as_ref().unwrap_or_else(|| unreachable!("allocation without a block"))
    }

    /// Device address.
    pub fn addr(&self) -> u64 {
        self.raw().addr
    }
    /// Bytes asked for.
    pub fn size(&self) -> usize {
        self.raw().requested
    }
    /// Bytes of the underlying block.
    pub fn block_size(&self) -> usize {
        self.raw().block_size
    }
    /// The stream it was allocated on.
    pub fn stream(&self) -> StreamId {
        self.raw().stream
    }
    /// The resource it came from.
    pub fn resource(&self) -> &'r R {
        self.resource
    }

    /// Marks the block as used on another stream as well (PyTorch's `record_stream`).
    pub fn record_stream(&self, stream: StreamId) -> Result<()> {
        self.resource.record_stream(self.raw(), stream)
    }

    /// Gives up RAII: the caller must return the block with `deallocate_raw`.
    pub fn into_raw(mut self) -> RawBlock {
        self.block.take().unwrap_or_else(|| unreachable!("allocation without a block"))
    }
}

impl<R: HostResource + ?Sized> Allocation<'_, R> {
    /// The bytes of the allocation. An error when the resource does not own this block as a live
    /// host block (a block wrapped with [`Allocation::from_raw`] over another resource, or one
    /// already returned): the resource checks it, not the caller.
    ///
    /// Only resources over host memory have it:
    ///
    /// ```compile_fail
    /// use wick_memory::{AllocateExt, CachingAllocator, SimulatedBackend};
    /// let allocator = CachingAllocator::new(SimulatedBackend::new(1 << 30));
    /// let mut block = allocator.allocate(1024).unwrap();
    /// block.as_mut_slice(); // error: SimulatedBackend is not a HostMemoryBackend
    /// ```
    pub fn as_mut_slice(&mut self) -> Result<&mut [u8]> {
        let block = self.raw();
        self.resource.check_host_block(block)?;
        // SAFETY: `check_host_block` (an unsafe trait's promise) confirmed that the address is a
        // valid host pointer to `requested` initialised bytes owned by this block until it is
        // returned, which only happens when `self` is dropped or consumed; `&mut self` makes the
        // slice exclusive.
        Ok(unsafe { std::slice::from_raw_parts_mut(block.addr as *mut u8, block.requested) })
    }
}

impl<R: MemoryResource + ?Sized> Drop for Allocation<'_, R> {
    fn drop(&mut self) {
        if let Some(block) = self.block.take() {
            // Only a foreign block can be refused, and from_raw documents that it then stays
            // accounted where it came from; there is nothing better to do in a destructor.
            let _ = self.resource.deallocate_raw(block);
        }
    }
}

impl<R: MemoryResource + ?Sized> std::fmt::Debug for Allocation<'_, R> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Allocation")
            .field("addr", &format_args!("{:#x}", self.addr()))
            .field("size", &self.size())
            .field("block_size", &self.block_size())
            .field("stream", &self.stream())
            .finish()
    }
}

/// RAII allocation methods for every resource, trait objects included.
pub trait AllocateExt: MemoryResource {
    /// Allocates `size` bytes on the default stream.
    fn allocate(&self, size: usize) -> Result<Allocation<'_, Self>> {
        self.allocate_with(AllocRequest::new(size))
    }

    /// Allocates as described by `request`.
    fn allocate_with(&self, request: AllocRequest) -> Result<Allocation<'_, Self>> {
        let block = self.allocate_raw(request)?;
        Ok(Allocation::from_raw(self, block))
    }
}

impl<R: MemoryResource + ?Sized> AllocateExt for R {}
