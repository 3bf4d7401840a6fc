//! # wick — the engine
//!
//! candle devices whose memory wick governs. This first layer covers CUDA governance (feature
//! `cuda`): candle's own allocations drawn from a wick-owned, capped driver pool, statistics,
//! `empty_cache`, and candle's CUDA out-of-memory turned into wick's typed `OutOfMemory` with a
//! free-cache-and-retry. The CPU device and step scopes over candle come with the engine issue.

pub use wick_memory as memory;

#[cfg(feature = "cuda")]
pub mod cuda;

/// True when a candle error is (or wraps) CUDA's out-of-memory. candle reports it as
/// `Error::Cuda(..)` holding cudarc's `DriverError(CUDA_ERROR_OUT_OF_MEMORY, ..)` (candle #1241)
/// and exposes no typed accessor, so the error text is inspected, including wrapped context.
pub fn is_out_of_memory(err: &candle_core::Error) -> bool {
    let text = format!("{err} {err:?}");
    text.contains("CUDA_ERROR_OUT_OF_MEMORY") || text.contains("out of memory")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn recognises_cuda_oom_text_only() {
        let oom = candle_core::Error::Msg("DriverError(CUDA_ERROR_OUT_OF_MEMORY, \"out of memory\")".into());
        assert!(is_out_of_memory(&oom));
        let wrapped = oom.context("while allocating a (4096, 4096) f32 tensor");
        assert!(is_out_of_memory(&wrapped));
        let other = candle_core::Error::Msg("shape mismatch".into());
        assert!(!is_out_of_memory(&other));
    }
}
