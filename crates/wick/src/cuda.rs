//! Governance of candle's CUDA memory: a wick [`DriverPool`] installed as the device's current
//! pool before candle allocates, so every candle buffer is drawn from it, capped by it and
//! measured by it. Builds without the `cuda` feature get the stand-in of `dummy_cuda.rs` instead
//! (candle's `dummy_cuda_backend` pattern), so no caller needs a `cfg`.

use candle_core::{CudaDevice, Device};
use wick_memory::MemoryError;

use crate::DriverPool;

/// A candle CUDA device whose allocations come from a wick-owned, capped pool.
pub struct GovernedCuda {
    pool: DriverPool,
    device: Device,
}

impl GovernedCuda {
    /// Opens CUDA device `ordinal` with a cap of `limit` bytes on candle's memory. Errors (no
    /// driver, no device, no memory-pool support) are `MemoryError`s, never panics.
    pub fn new(ordinal: usize, limit: Option<usize>) -> Result<Self, MemoryError> {
        let ctx = wick_memory::open_device(ordinal)?;
        // Installed before candle allocates anything on the device.
        let pool = DriverPool::install(ctx, limit)?;
        let device = CudaDevice::new_with_stream(ordinal)
            .map(Device::Cuda)
            .map_err(|e| MemoryError::Unavailable(format!("candle could not open cuda:{ordinal}: {e}")))?;
        Ok(GovernedCuda { pool, device })
    }

    /// The candle device.
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// The pool governing it.
    pub fn pool(&self) -> &DriverPool {
        &self.pool
    }

    /// Bytes of live allocations from the pool.
    pub fn used(&self) -> usize {
        self.pool.used()
    }

    /// Bytes the pool holds from the device.
    pub fn reserved(&self) -> usize {
        self.pool.reserved()
    }

    /// Peak of [`GovernedCuda::used`] since creation or the last reset.
    pub fn used_peak(&self) -> usize {
        self.pool.used_peak()
    }

    /// Peak of the pool's reservation since creation or the last reset.
    pub fn reserved_peak(&self) -> usize {
        self.pool.reserved_peak()
    }

    /// Resets the pool's peaks to the current values.
    pub fn reset_peak_stats(&self) {
        self.pool.reset_peak_stats()
    }

    /// Free bytes on the device as the driver reports them (`cuMemGetInfo`; 0 if it fails).
    pub fn device_free(&self) -> usize {
        cudarc::driver::result::mem_get_info().map(|(free, _)| free).unwrap_or(0)
    }

    /// Returns every cached byte of the pool to the device. Returns the bytes released.
    pub fn empty_cache(&self) -> Result<usize, MemoryError> {
        self.pool.empty_cache()
    }

    /// Starts recording candle's allocations and frees on the device (CUPTI callbacks on the
    /// driver's allocation calls) into a ring of `max_entries` events, of `min_size` bytes or
    /// more. `Unsupported` when libcupti cannot be opened or subscribed to, saying why.
    pub fn record_history(&self, max_entries: usize, min_size: usize) -> Result<(), MemoryError> {
        crate::cuda_history::start(max_entries, min_size, self.used())
    }

    /// Stops recording; what was recorded stays readable.
    pub fn stop_history(&self) {
        crate::cuda_history::stop()
    }

    /// What has been recorded on the device so far.
    pub fn history(&self) -> wick_memory::HeapHistory {
        crate::cuda_history::history()
    }

    /// Runs a candle operation expected to need about `bytes`; on CUDA out-of-memory, empties the
    /// cache and retries once, then returns wick's typed `OutOfMemory` with the pool's figures.
    /// Other candle errors come back as `MemoryError::Backend` with candle's message.
    pub fn run<T>(
        &self,
        bytes: usize,
        mut op: impl FnMut(&Device) -> candle_core::Result<T>,
    ) -> Result<T, MemoryError> {
        match op(&self.device) {
            Ok(value) => Ok(value),
            Err(e) if crate::is_out_of_memory(&e) => {
                self.pool.empty_cache()?;
                match op(&self.device) {
                    Ok(value) => Ok(value),
                    Err(e) if crate::is_out_of_memory(&e) => Err(self.pool.out_of_memory(bytes)),
                    Err(e) => Err(MemoryError::Backend(wick_memory::BackendError::Other(e.to_string()))),
                }
            }
            Err(e) => Err(MemoryError::Backend(wick_memory::BackendError::Other(e.to_string()))),
        }
    }
}
