//! Device memory through the CUDA driver (feature `cuda`): segments from `cuMemAlloc`, streams
//! and events mapped onto the backend's stream/event model. Used by the caching allocator exactly
//! like the host and simulated backends.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use cudarc::driver::{result, sys, CudaContext, CudaStream, DriverError};

use super::{Backend, BackendError, MAP_GRANULARITY};
use crate::error::MemoryError;
use crate::stream::{EventId, StreamId};

/// A raw event handle; events are only touched under the backend's lock.
struct RawEvent(sys::CUevent);
// SAFETY: CUDA event handles may be used from any thread of the process; access is serialised
// by the backend's mutex.
unsafe impl Send for RawEvent {}

#[derive(Default)]
struct Tables {
    streams: HashMap<u64, Arc<CudaStream>>,
    events: HashMap<u64, RawEvent>,
    next_event: u64,
    /// Physical memory mapped into expandable segments: one handle per 2 MiB granule.
    granules: HashMap<u64, sys::CUmemGenericAllocationHandle>,
}

/// One CUDA device.
pub struct CudaBackend {
    ctx: Arc<CudaContext>,
    capacity: usize,
    in_segments: AtomicUsize,
    tables: Mutex<Tables>,
}

/// Opens the driver and device `ordinal`, with clear errors when either is missing. cudarc's
/// context constructor is only reached once the driver has answered.
pub fn open_device(ordinal: usize) -> Result<Arc<CudaContext>, MemoryError> {
    result::init().map_err(|e| MemoryError::Unavailable(format!("no usable CUDA driver: {e}")))?;
    let count =
        result::device::get_count().map_err(|e| MemoryError::Unavailable(format!("cannot count CUDA devices: {e}")))?;
    if ordinal >= count.max(0) as usize {
        return Err(MemoryError::Unavailable(format!("no CUDA device {ordinal}: {count} device(s) present")));
    }
    CudaContext::new(ordinal).map_err(|e| MemoryError::Unavailable(format!("cannot open CUDA device {ordinal}: {e}")))
}

/// The location of device `ordinal`'s memory, for allocation and pool properties.
///
/// CUDA 13.2 made `CUmemLocation::id` a member of a union (cudarc's bindings then name it
/// `__bindgen_anon_1.id`), so which field exists depends on the toolkit the build found. Both
/// layouts are `{ type_: enum (4 bytes), id: int }` in C, so the id is written at its C offset,
/// which builds against either.
pub fn device_location(ordinal: usize) -> Result<sys::CUmemLocation, MemoryError> {
    const ID_OFFSET: usize = std::mem::size_of::<sys::CUmemLocationType>();
    const _: () = assert!(std::mem::size_of::<sys::CUmemLocation>() == ID_OFFSET + 4);
    const _: () = assert!(std::mem::align_of::<sys::CUmemLocation>() == 4);
    let id = i32::try_from(ordinal).map_err(|_| MemoryError::Unavailable(format!("no CUDA device {ordinal}")))?;
    // SAFETY: zero is a valid bit pattern for this plain C struct.
    let mut location: sys::CUmemLocation = unsafe { std::mem::zeroed() };
    location.type_ = sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE;
    // SAFETY: the struct is repr(C), 8 bytes, 4-aligned (asserted above), and its bytes 4..8 are
    // the C `int id` in both binding layouts; the write stays inside `location`.
    unsafe {
        std::ptr::addr_of_mut!(location).cast::<u8>().add(ID_OFFSET).cast::<i32>().write(id);
    }
    Ok(location)
}

fn is_oom(e: &DriverError) -> bool {
    e.0 == sys::cudaError_enum::CUDA_ERROR_OUT_OF_MEMORY
}

fn backend_err(e: DriverError) -> BackendError {
    if is_oom(&e) {
        BackendError::OutOfMemory
    } else {
        BackendError::Other(e.to_string())
    }
}

impl CudaBackend {
    /// Device `ordinal`. `NoCudaDevice`-style `Unavailable` errors when there is no driver or
    /// device; never a panic.
    pub fn new(ordinal: usize) -> Result<Self, MemoryError> {
        let ctx = open_device(ordinal)?;
        Self::from_context(ctx)
    }

    /// Over an existing context (shared with candle, for example).
    pub fn from_context(ctx: Arc<CudaContext>) -> Result<Self, MemoryError> {
        ctx.bind_to_thread().map_err(|e| MemoryError::Backend(BackendError::Other(e.to_string())))?;
        let (_, total) =
            result::mem_get_info().map_err(|e| MemoryError::Backend(BackendError::Other(e.to_string())))?;
        let mut tables = Tables::default();
        tables.streams.insert(StreamId::DEFAULT.0, ctx.default_stream());
        Ok(CudaBackend { ctx, capacity: total, in_segments: AtomicUsize::new(0), tables: Mutex::new(tables) })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Tables> {
        self.tables.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// The context.
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// Creates a stream and returns its id.
    pub fn create_stream(&self) -> Result<StreamId, MemoryError> {
        let stream = self.ctx.new_stream().map_err(|e| MemoryError::Backend(BackendError::Other(e.to_string())))?;
        let mut tables = self.lock();
        let id = tables.streams.keys().max().copied().unwrap_or(0) + 1;
        tables.streams.insert(id, stream);
        Ok(StreamId(id))
    }

    /// The cudarc stream behind `id`.
    pub fn stream(&self, id: StreamId) -> Option<Arc<CudaStream>> {
        self.lock().streams.get(&id.0).cloned()
    }

    /// Bytes currently held in segments.
    pub fn bytes_in_segments(&self) -> usize {
        self.in_segments.load(Ordering::SeqCst)
    }

    fn allocation_prop(&self) -> Result<sys::CUmemAllocationProp, BackendError> {
        // SAFETY: zero is valid for this plain C struct; the fields that matter are set.
        let mut prop: sys::CUmemAllocationProp = unsafe { std::mem::zeroed() };
        prop.type_ = sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
        prop.location = device_location(self.ctx.ordinal()).map_err(|e| BackendError::Other(e.to_string()))?;
        Ok(prop)
    }

    fn granularity(&self) -> Result<usize, BackendError> {
        self.bind()?;
        let prop = self.allocation_prop()?;
        let mut granularity = 0usize;
        // SAFETY: prop is initialised; the result is written to a local.
        unsafe {
            sys::cuMemGetAllocationGranularity(
                &mut granularity,
                &prop,
                sys::CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_MINIMUM,
            )
        }
        .result()
        .map_err(backend_err)?;
        Ok(granularity)
    }

    fn bind(&self) -> Result<(), BackendError> {
        self.ctx.bind_to_thread().map_err(|e| BackendError::Other(e.to_string()))
    }
}

impl Backend for CudaBackend {
    fn device_name(&self) -> String {
        format!("cuda:{}", self.ctx.ordinal())
    }

    fn capacity(&self) -> usize {
        self.capacity
    }

    fn free_memory(&self) -> usize {
        if self.bind().is_err() {
            return 0;
        }
        result::mem_get_info().map(|(free, _)| free).unwrap_or(0)
    }

    fn segment_alignment(&self) -> usize {
        // cuMemAlloc aligns to at least 256 B; in practice 512 B or more. The allocator needs 512.
        512
    }

    fn is_host_accessible(&self) -> bool {
        false
    }

    fn allocate_segment(&self, size: usize, stream: StreamId) -> Result<u64, BackendError> {
        self.check_stream(stream)?;
        self.bind()?;
        // SAFETY: a plain device allocation; the memory is uninitialised device memory, which the
        // allocator never reads.
        let ptr = unsafe { result::malloc_sync(size) }.map_err(backend_err)?;
        if ptr % 512 != 0 {
            // SAFETY: freeing the allocation just made.
            let _ = unsafe { result::free_sync(ptr) };
            return Err(BackendError::Other(format!("cuMemAlloc returned a pointer aligned below 512 B: {ptr:#x}")));
        }
        self.in_segments.fetch_add(size, Ordering::SeqCst);
        Ok(ptr)
    }

    unsafe fn free_segment(&self, addr: u64, size: usize) -> Result<(), BackendError> {
        self.bind()?;
        // SAFETY: the caller guarantees addr came from allocate_segment and is unused.
        unsafe { result::free_sync(addr) }.map_err(backend_err)?;
        self.in_segments.fetch_sub(size, Ordering::SeqCst);
        Ok(())
    }

    fn supports_expandable(&self) -> bool {
        // Virtual memory management is on every device this crate's driver API targets; the
        // granularity must divide the 2 MiB unit the allocator maps in.
        self.granularity().is_ok_and(|g| g > 0 && MAP_GRANULARITY.is_multiple_of(g))
    }

    fn reserve_address_space(&self, size: usize) -> Result<u64, BackendError> {
        self.bind()?;
        let mut ptr: sys::CUdeviceptr = 0;
        // SAFETY: reserves address space only.
        unsafe { sys::cuMemAddressReserve(&mut ptr, size, MAP_GRANULARITY, 0, 0) }.result().map_err(backend_err)?;
        Ok(ptr)
    }

    unsafe fn map_range(&self, addr: u64, size: usize) -> Result<(), BackendError> {
        self.bind()?;
        let prop = self.allocation_prop()?;
        let mut mapped = Vec::new();
        let mut result = Ok(());
        for offset in (0..size).step_by(MAP_GRANULARITY) {
            let at = addr + offset as u64;
            let mut handle: sys::CUmemGenericAllocationHandle = 0;
            // SAFETY: creates physical memory, maps it into our reservation at an unmapped
            // granule, and makes it readable and writable by this device.
            let step = unsafe {
                sys::cuMemCreate(&mut handle, MAP_GRANULARITY, &prop, 0).result().and_then(|()| {
                    if let Err(e) = sys::cuMemMap(at, MAP_GRANULARITY, 0, handle, 0).result() {
                        let _ = sys::cuMemRelease(handle);
                        return Err(e);
                    }
                    mapped.push((at, handle));
                    let access = sys::CUmemAccessDesc {
                        location: prop.location,
                        flags: sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
                    };
                    sys::cuMemSetAccess(at, MAP_GRANULARITY, &access, 1).result()
                })
            };
            if let Err(e) = step {
                result = Err(backend_err(e));
                break;
            }
        }
        if result.is_err() {
            // Undo a partial mapping so the range is either wholly mapped or not at all.
            for (at, handle) in mapped {
                // SAFETY: unmapping and releasing what this call mapped.
                unsafe {
                    let _ = sys::cuMemUnmap(at, MAP_GRANULARITY);
                    let _ = sys::cuMemRelease(handle);
                }
            }
            return result;
        }
        let mut tables = self.lock();
        tables.granules.extend(mapped);
        self.in_segments.fetch_add(size, Ordering::SeqCst);
        Ok(())
    }

    unsafe fn unmap_range(&self, addr: u64, size: usize) -> Result<(), BackendError> {
        self.bind()?;
        // Pending work may still use the pages; the allocator only unmaps after synchronising.
        let mut tables = self.lock();
        for offset in (0..size).step_by(MAP_GRANULARITY) {
            let at = addr + offset as u64;
            let handle =
                tables.granules.remove(&at).ok_or_else(|| BackendError::Other(format!("{at:#x} is not mapped")))?;
            // SAFETY: the granule was mapped by map_range and is unused.
            unsafe {
                sys::cuMemUnmap(at, MAP_GRANULARITY).result().map_err(backend_err)?;
                sys::cuMemRelease(handle).result().map_err(backend_err)?;
            }
            self.in_segments.fetch_sub(MAP_GRANULARITY, Ordering::SeqCst);
        }
        Ok(())
    }

    unsafe fn release_address_space(&self, addr: u64, size: usize) {
        if self.bind().is_ok() {
            // SAFETY: the caller guarantees the reservation is fully unmapped.
            let _ = unsafe { sys::cuMemAddressFree(addr, size) };
        }
    }

    fn check_stream(&self, stream: StreamId) -> Result<(), BackendError> {
        if self.lock().streams.contains_key(&stream.0) {
            Ok(())
        } else {
            Err(BackendError::UnknownStream(stream))
        }
    }

    fn record_event(&self, stream: StreamId) -> Result<EventId, BackendError> {
        self.bind()?;
        let mut tables = self.lock();
        let cu_stream = tables.streams.get(&stream.0).ok_or(BackendError::UnknownStream(stream))?.cu_stream();
        let event = result::event::create(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING).map_err(backend_err)?;
        // SAFETY: both handles are live.
        if let Err(e) = unsafe { result::event::record(event, cu_stream) } {
            // SAFETY: destroying the event just created.
            let _ = unsafe { result::event::destroy(event) };
            return Err(backend_err(e));
        }
        tables.next_event += 1;
        let id = tables.next_event;
        tables.events.insert(id, RawEvent(event));
        Ok(EventId(id))
    }

    fn event_completed(&self, event: EventId) -> Result<bool, BackendError> {
        self.bind()?;
        let tables = self.lock();
        let raw =
            tables.events.get(&event.0).ok_or_else(|| BackendError::Other(format!("unknown event {}", event.0)))?;
        // SAFETY: the event is live until destroy_event.
        match unsafe { result::event::query(raw.0) } {
            Ok(()) => Ok(true),
            Err(e) if e.0 == sys::cudaError_enum::CUDA_ERROR_NOT_READY => Ok(false),
            Err(e) => Err(backend_err(e)),
        }
    }

    fn destroy_event(&self, event: EventId) {
        if let Some(raw) = self.lock().events.remove(&event.0) {
            // SAFETY: removed from the table, so destroyed once.
            let _ = unsafe { result::event::destroy(raw.0) };
        }
    }

    fn synchronize(&self) -> Result<(), BackendError> {
        self.bind()?;
        self.ctx.synchronize().map_err(backend_err)
    }
}

impl Drop for CudaBackend {
    fn drop(&mut self) {
        let events: Vec<RawEvent> = self.lock().events.drain().map(|(_, e)| e).collect();
        for raw in events {
            // SAFETY: each event is destroyed once.
            let _ = unsafe { result::event::destroy(raw.0) };
        }
    }
}
