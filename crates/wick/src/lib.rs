//! # wick — the engine
//!
//! candle devices whose memory wick governs: figures with their sources ([`Engine`]), caps
//! enforced by pre-flight checks before anything is allocated, step scopes that release a step's
//! tensors and report it, out-of-memory recovery (retry, largest-batch finder), and reports
//! (text, HTML, evcxr rich display). With feature `cuda`, candle's CUDA allocations are drawn from
//! a capped wick pool (`cuda::GovernedCuda`, feature `cuda`). Every engine publishes its figures
//! for `wick monitor` while it lives ([`engine_status`]). A program sets itself up for all of it
//! with one line, [`main!`].

pub use wick_memory as memory;

/// The governed CUDA device (`GovernedCuda`); without the `cuda` feature, a stand-in that cannot
/// be constructed and whose `new` says how to get CUDA support.
#[cfg(feature = "cuda")]
pub mod cuda;
#[cfg(not(feature = "cuda"))]
#[path = "dummy_cuda.rs"]
pub mod cuda;
#[cfg(feature = "cuda")]
mod cuda_history;
#[cfg(feature = "cuda")]
mod cuda_pool;
mod cupti_abi;
#[cfg(feature = "cuda")]
pub use cuda_pool::DriverPool;
pub mod cpu_threads;
pub mod engine;
pub mod engine_status;
mod figure;
pub mod files;
pub mod gpu;
pub mod host_memory;
pub mod leaks;
pub mod machine;
pub mod main_macro;
pub mod memory_history;
pub mod pool_stack;
pub mod recovery;
pub mod report;
pub mod step;
pub mod tensors;
pub mod weights;

pub use engine::Engine;
pub use figure::{Figure, FigureSource};
pub use host_memory::CountingAllocator;
pub use leaks::{LeakFinder, LeakReport};
pub use memory_history::{HeldAtPeak, MemoryHistory};
pub use recovery::BatchPlan;
pub use report::{HistoryReport, Holding, MemoryReport};
pub use step::{Error, StepReport};

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
