//! # wick — the engine
//!
//! Memory governance for candle: devices whose memory wick accounts for, caps and reports. It owns
//! the figures and their sources ([`Engine`]), caps enforced by pre-flight checks before anything
//! is allocated, step scopes that release a step's tensors and report it, out-of-memory recovery
//! (retry, largest-batch finder), reports (text, HTML, evcxr rich display), the allocation history,
//! and the one-line set-up of a program ([`main!`]). With feature `cuda`, candle's CUDA allocations
//! are drawn from a capped wick pool. What runs on the devices is other crates': ops and layers
//! (`wick-nn`), training (`wick-train`), models (`wick-zoo`).
//!
//! | module | what it owns |
//! |---|---|
//! | [`engine`] | [`Engine`]: a governed candle device, its figures, budget, labels and history |
//! | [`tensors`] | tensors made through the engine, pre-flighted (an over-budget CPU tensor is an `Err`, not an abort) |
//! | [`step`] | step scopes ([`StepReport`]) |
//! | [`recovery`] | retry after freeing the cache, the largest batch that fits ([`BatchPlan`]) |
//! | [`host_memory`] | exact host figures ([`CountingAllocator`], the caching heap's), host pre-flight |
//! | [`leaks`] | the leak finder of training loops ([`LeakFinder`]) |
//! | [`span_labels`] | labels from the `tracing` spans a model's layers enter (candle-transformers') |
//! | [`memory_history`] | the recorded history with its labels, what is held at the peak ([`MemoryHistory`]) |
//! | [`report`] | text and HTML reports ([`MemoryReport`], [`HistoryReport`]) and evcxr display |
//! | [`engine_status`] | the status file every live engine keeps for `wick monitor` |
//! | [`cuda`], [`pool_stack`] | the governed CUDA device and its pools (feature `cuda`; a stand-in without it) |
//! | `cuda_graph` | a step captured as a CUDA graph and replayed, a forward pass likewise (`GraphForward`), their graph memory (feature `cuda`) |
//! | [`machine`], [`gpu`] | what the machine offers: CPU, memory, cgroup, GPUs through NVML |
//! | [`cpu_threads`] | candle's CPU workers and the kernels' thread pool |
//! | [`main_macro`] | [`main!`] and [`heap!`]: the program's set-up in one line |
//! | [`files`] | atomic writes and the output folder |
//! | [`tensor_files`] | safetensors files: their cost from the header, written whole and atomically |
//! | `error` | [`Error`] and [`is_out_of_memory`] |
//!
//! The allocator itself is `wick-memory`, re-exported as [`memory`].

pub use wick_memory as memory;

/// The governed CUDA device (`GovernedCuda`); without the `cuda` feature, a stand-in that cannot
/// be constructed and whose `new` says how to get CUDA support.
#[cfg(feature = "cuda")]
pub mod cuda;
#[cfg(not(feature = "cuda"))]
#[path = "dummy_cuda.rs"]
pub mod cuda;
#[cfg(feature = "cuda")]
pub mod cuda_graph;
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
mod error;
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
pub mod span_labels;
pub mod step;
pub mod tensor_files;
pub mod tensors;

/// Moved to [`tensor_files`] (the zoo's `weights` loads model weights; this module reads and
/// writes any tensor file).
#[deprecated(since = "0.1.0", note = "moved to `wick::tensor_files`")]
pub mod weights {
    pub use crate::tensor_files::*;
}

pub use engine::Engine;
pub use error::{is_out_of_memory, Error};
pub use figure::{Figure, FigureSource};
pub use host_memory::CountingAllocator;
pub use leaks::{LeakFinder, LeakReport};
pub use memory_history::{HeldAtPeak, MemoryHistory};
pub use recovery::BatchPlan;
pub use report::{HistoryReport, Holding, MemoryReport};
pub use step::StepReport;
