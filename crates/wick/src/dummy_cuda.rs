//! The CUDA device of builds without the `cuda` feature (candle's `dummy_cuda_backend` pattern):
//! the same type and methods as `cuda.rs`, so the engine has no `cfg` lines; it cannot be
//! constructed, and [`GovernedCuda::new`] says why.

use candle_core::Device;
use wick_memory::MemoryError;

/// Stands in for the governed CUDA device of `cuda` builds; no value of it can exist.
pub struct GovernedCuda {
    never: std::convert::Infallible,
}

impl GovernedCuda {
    /// Always `Unavailable`: this build has no CUDA support.
    pub fn new(ordinal: usize, _limit: Option<usize>) -> Result<Self, MemoryError> {
        Err(MemoryError::Unavailable(format!(
            "cuda:{ordinal}: wick was built without CUDA support; rebuild with the `cuda` feature \
             (`--features wick/cuda`)"
        )))
    }

    /// The candle device.
    pub fn device(&self) -> &Device {
        match self.never {}
    }

    /// Bytes of live allocations from the pool.
    pub fn used(&self) -> usize {
        match self.never {}
    }

    /// Bytes the pool holds from the device.
    pub fn reserved(&self) -> usize {
        match self.never {}
    }

    /// Peak of [`GovernedCuda::used`].
    pub fn used_peak(&self) -> usize {
        match self.never {}
    }

    /// Peak of the pool's reservation since creation or the last reset.
    pub fn reserved_peak(&self) -> usize {
        match self.never {}
    }

    /// Resets the pool's peaks.
    pub fn reset_peak_stats(&self) {
        match self.never {}
    }

    /// Free bytes on the device.
    pub fn device_free(&self) -> usize {
        match self.never {}
    }

    /// Starts recording the device's allocations.
    pub fn record_history(&self, _max_entries: usize, _min_size: usize) -> Result<(), MemoryError> {
        match self.never {}
    }

    /// Stops recording.
    pub fn stop_history(&self) {
        match self.never {}
    }

    /// What has been recorded on the device.
    pub fn history(&self) -> wick_memory::HeapHistory {
        match self.never {}
    }

    /// Returns the pool's cached bytes to the device.
    pub fn empty_cache(&self) -> Result<usize, MemoryError> {
        match self.never {}
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_cuda_engine_in_a_cpu_build_is_a_clear_error() {
        let err = crate::Engine::cuda(0, None).err().expect("no CUDA in this build").to_string();
        assert!(err.contains("built without CUDA support") && err.contains("--features wick/cuda"), "{err}");
    }
}
