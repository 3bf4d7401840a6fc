//! What engine operations fail with: wick's memory errors and candle's own, and the one place
//! that recognises out-of-memory in either.

use wick_memory::MemoryError;

/// Errors of engine operations: wick's memory errors and candle's own.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A memory error (out-of-memory included).
    #[error(transparent)]
    Memory(#[from] MemoryError),
    /// candle failed (CUDA out-of-memory included: [`Error::is_out_of_memory`] recognises it).
    #[error("candle: {0}")]
    Candle(candle_core::Error),
}

impl From<candle_core::Error> for Error {
    fn from(e: candle_core::Error) -> Self {
        Error::Candle(e)
    }
}

impl Error {
    /// True for out-of-memory, whether wick's or candle's.
    pub fn is_out_of_memory(&self) -> bool {
        match self {
            Error::Memory(e) => e.is_out_of_memory(),
            Error::Candle(e) => is_out_of_memory(e),
        }
    }
}

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
