//! Governance of allocations wick does not make itself. candle allocates every CUDA buffer with
//! `cuMemAllocAsync` from the device's *current* memory pool and has no allocator hook, so wick
//! creates its own `CUmemoryPool`, caps it (`maxSize`), keeps freed memory cached (release
//! threshold at its maximum, where the default pool's 0 returns memory at every synchronise),
//! installs it with `cuDeviceSetMemPool`, and reads its statistics back. Needs CUDA ≥ 12.2.
//! Several pools on one device (a notebook cell run twice) follow [`PoolStack`]'s rules:
//! the newest live pool stays current, and a destroyed pool is never made current again. It
//! lives beside the engine's CUDA device (`crate::cuda`), its only user: it governs candle's
//! allocations, it is not a backend of wick's own allocator.

use std::sync::Arc;

use cudarc::driver::{result, sys, CudaContext};

use wick_memory::{MemoryError, MemoryStats, OutOfMemory};

use crate::pool_stack::{PoolDriver, PoolStack};

/// A byte count as a statistic's signed amount (`i64::MAX` beyond it).
fn signed(amount: usize) -> i64 {
    i64::try_from(amount).unwrap_or(i64::MAX)
}

/// The wick pools alive in this copy of the crate, per device (see [`PoolStack`] for what that
/// means across notebook cells).
static POOLS: PoolStack<usize> = PoolStack::new();

/// The driver's device-pool calls (handles as addresses, so the registry is `Send`).
struct Driver;

impl PoolDriver for Driver {
    type Pool = usize;
    fn current(&self, device: i32) -> usize {
        // SAFETY: `device` comes from a live context's `cu_device`.
        unsafe { result::device::get_mem_pool(device) }.map_or(0, |p| p as usize)
    }
    fn default_pool(&self, device: i32) -> usize {
        // SAFETY: as above.
        unsafe { result::device::get_default_mem_pool(device) }.map_or(0, |p| p as usize)
    }
    fn set_current(&self, device: i32, pool: usize) {
        // SAFETY: `pool` is a live wick pool of this device or its default pool (PoolStack's rules).
        let _ = unsafe { result::device::set_mem_pool(device, pool as sys::CUmemoryPool) };
    }
}

/// wick's memory pool, installed as the current pool of one device.
pub struct DriverPool {
    ctx: Arc<CudaContext>,
    pool: sys::CUmemoryPool,
    limit: Option<usize>,
}

// SAFETY: memory-pool handles may be used from any thread; the pool is only mutated through the
// driver, which synchronises internally.
unsafe impl Send for DriverPool {}
// SAFETY: as above; every method takes the driver's own locks.
unsafe impl Sync for DriverPool {}

fn driver(e: cudarc::driver::DriverError) -> MemoryError {
    MemoryError::Backend(wick_memory::BackendError::Other(e.to_string()))
}

impl DriverPool {
    /// Creates a pool on `ctx`'s device capped at `limit` bytes (none: the device's size) and makes
    /// it the device's current pool. Fails with `Unsupported` on devices or drivers without pools.
    pub fn install(ctx: Arc<CudaContext>, limit: Option<usize>) -> Result<Self, MemoryError> {
        if limit == Some(0) {
            // The driver reads a `maxSize` of 0 as "no cap": say so rather than run uncapped.
            return Err(MemoryError::InvalidConfig(
                "a pool cap of 0 bytes would mean no cap to the driver; give a positive cap or none".into(),
            ));
        }
        ctx.bind_to_thread().map_err(driver)?;
        let supported =
            ctx.attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED).map_err(driver)?;
        if supported == 0 {
            return Err(MemoryError::Unsupported(format!(
                "cuda:{} or its driver does not support memory pools (cuMemAllocAsync); wick cannot govern candle's allocations there",
                ctx.ordinal()
            )));
        }
        // SAFETY: zero is a valid bit pattern for this plain C struct; the fields that matter are set.
        let mut props: sys::CUmemPoolProps = unsafe { std::mem::zeroed() };
        props.allocType = sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
        props.handleTypes = sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_NONE;
        props.location = wick_memory::device_location(ctx.ordinal())?;
        props.maxSize = limit.unwrap_or(0);
        // SAFETY: props is fully initialised.
        let pool = unsafe { result::mem_pool::create(&props) }.map_err(driver)?;
        let mut threshold: u64 = u64::MAX;
        // SAFETY: the attribute takes a u64.
        unsafe {
            result::mem_pool::set_attribute(
                pool,
                sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
                &mut threshold as *mut u64 as *mut _,
            )
        }
        .map_err(driver)?;
        POOLS.install(&Driver, ctx.cu_device(), pool as usize);
        if !POOLS.is_current(&Driver, ctx.cu_device(), pool as usize) {
            let _ = POOLS.remove(&Driver, ctx.cu_device(), pool as usize);
            // SAFETY: the pool was just created and nothing has allocated from it.
            let _ = unsafe { result::mem_pool::destroy(pool) };
            return Err(MemoryError::Backend(wick_memory::BackendError::Other(format!(
                "cuda:{}: the driver did not install wick's pool",
                ctx.ordinal()
            ))));
        }
        Ok(DriverPool { ctx, pool, limit })
    }

    /// True while this pool is the device's current pool, i.e. candle's allocations come from it
    /// (false after a newer engine installed its own pool on the device).
    pub fn is_current(&self) -> bool {
        POOLS.is_current(&Driver, self.ctx.cu_device(), self.pool as usize)
    }

    fn attribute(&self, attr: sys::CUmemPool_attribute) -> u64 {
        let mut value: u64 = 0;
        // SAFETY: these attributes are u64.
        let _ = unsafe { result::mem_pool::get_attribute(self.pool, attr, &mut value as *mut u64 as *mut _) };
        value
    }

    /// Bytes of live allocations from the pool (`USED_MEM_CURRENT`).
    pub fn used(&self) -> usize {
        self.attribute(sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_USED_MEM_CURRENT) as usize
    }

    /// Bytes the pool holds from the device (`RESERVED_MEM_CURRENT`).
    pub fn reserved(&self) -> usize {
        self.attribute(sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT) as usize
    }

    /// Peak of `used` since creation or `reset_peak_stats`.
    pub fn used_peak(&self) -> usize {
        self.attribute(sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_USED_MEM_HIGH) as usize
    }

    /// Peak of `reserved`.
    pub fn reserved_peak(&self) -> usize {
        self.attribute(sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH) as usize
    }

    /// Resets both peaks to the current values.
    pub fn reset_peak_stats(&self) {
        for attr in [
            sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_USED_MEM_HIGH,
            sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH,
        ] {
            let mut zero: u64 = 0;
            // SAFETY: the high-water attributes are u64 and may be reset to 0.
            let _ = unsafe { result::mem_pool::set_attribute(self.pool, attr, &mut zero as *mut u64 as *mut _) };
        }
    }

    /// The cap in bytes, if any.
    pub fn limit(&self) -> Option<usize> {
        self.limit
    }

    /// Waits for the device, then returns every unused byte of the pool to the device
    /// (`cuMemPoolTrimTo(pool, 0)`). Returns the bytes released.
    pub fn empty_cache(&self) -> Result<usize, MemoryError> {
        self.ctx.bind_to_thread().map_err(driver)?;
        self.ctx.synchronize().map_err(driver)?;
        let before = self.reserved();
        // SAFETY: the pool is live.
        unsafe { result::mem_pool::trim_to(self.pool, 0) }.map_err(driver)?;
        Ok(before.saturating_sub(self.reserved()))
    }

    /// The pool's figures under PyTorch's statistic names (allocated = used, reserved = reserved).
    pub fn memory_stats(&self) -> MemoryStats {
        let mut stats = MemoryStats::default();
        let (used, reserved) = (signed(self.used()), signed(self.reserved()));
        for (array, current, peak) in [
            (&mut stats.allocated_bytes, used, signed(self.used_peak())),
            (&mut stats.reserved_bytes, reserved, signed(self.reserved_peak())),
        ] {
            array.all.current = current;
            array.all.peak = peak;
            array.large_pool.current = current;
            array.large_pool.peak = peak;
        }
        stats.max_split_size = i64::MAX;
        stats
    }

    /// A readable table of the pool's figures.
    pub fn memory_summary(&self) -> String {
        wick_memory::memory_summary(
            &format!("cuda:{} (driver pool)", self.ctx.ordinal()),
            &self.memory_stats(),
            self.limit,
        )
    }

    /// The typed error for a request of `requested` bytes that the pool or device refused, with
    /// `cuMemGetInfo` numbers and the pool's used/reserved bytes.
    pub fn out_of_memory(&self, requested: usize) -> MemoryError {
        let _ = self.ctx.bind_to_thread();
        let (free, total) = result::mem_get_info().unwrap_or((0, 0));
        let reserved = self.reserved();
        let capped = self.limit.is_some_and(|l| reserved.saturating_add(requested) > l && free >= requested);
        OutOfMemory::refused(format!("cuda:{}", self.ctx.ordinal()), requested)
            .with_device(total, free)
            .with_usage(self.used(), reserved)
            .with_limit(self.limit, capped)
            .with_largest_free_block(reserved.saturating_sub(self.used()))
            .into_error()
    }
}

impl Drop for DriverPool {
    /// Hands the device over (to the newest live wick pool, else the default pool; nothing
    /// changes if a newer pool is current), then destroys the pool when nothing in it is in use.
    /// When candle tensors outlive the engine, the pool cannot be destroyed: its release
    /// threshold drops to 0 and it is trimmed, so the memory of those tensors goes back to the
    /// device as they are freed instead of staying cached until the process exits.
    fn drop(&mut self) {
        let _ = self.ctx.bind_to_thread();
        let _ = POOLS.remove(&Driver, self.ctx.cu_device(), self.pool as usize);
        let _ = self.ctx.synchronize();
        // SAFETY: the pool is live; it is no longer current (PoolStack moved the device off it),
        // and it is destroyed only when no allocation from it is in use.
        unsafe {
            if self.used() == 0 {
                let _ = result::mem_pool::destroy(self.pool);
            } else {
                let mut zero: u64 = 0;
                let _ = result::mem_pool::set_attribute(
                    self.pool,
                    sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
                    &mut zero as *mut u64 as *mut _,
                );
                let _ = result::mem_pool::trim_to(self.pool, 0);
            }
        }
    }
}
