//! # wick-trace
//!
//! Benchmark and replay machinery for wick's allocator, kept out of the allocator's own API (as
//! RAPIDS RMM keeps its replay tool beside the library): the trace format ([`Trace`]: a JSON list
//! of alloc/free operations, as [`wick_memory::EventLog`] records them), [`replay`] through any
//! caching policy and backend, and [`workloads`] that synthesise the allocation patterns of
//! training and serving. The committed traces are in `crates/wick-trace/traces/`.
//!
//! ```
//! use wick_trace::{replay_simulated, workloads};
//! let trace = &workloads::standard_suite()[0];
//! let report = replay_simulated(trace, 80 << 30, wick_memory::AllocatorConfig::default())?;
//! assert!(report.peak_reserved >= report.peak_allocated);
//! # Ok::<(), wick_memory::MemoryError>(())
//! ```

mod trace;
pub mod workloads;

pub use trace::{replay, replay_simulated, ReplayReport, Trace};
pub use wick_memory::TraceOp;
