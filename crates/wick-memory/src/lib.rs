//! # wick-memory
//!
//! A caching device-memory allocator with PyTorch-grade policy, honest statistics, a hard cap,
//! deterministic release and out-of-memory as a typed `Result`.
//!
//! ```
//! use wick_memory::{AllocateExt, CachingAllocator, HostBackend, MemoryResource};
//!
//! let allocator = CachingAllocator::new(HostBackend::with_capacity(1 << 30));
//! {
//!     let block = allocator.allocate(3 << 20)?;          // reserves a 20 MiB segment
//!     assert_eq!(block.block_size(), 3 << 20);
//! }                                                        // back in the cache on drop
//! let stats = allocator.memory_stats();
//! assert_eq!(stats.allocated_bytes.all.current, 0);
//! assert_eq!(stats.reserved_bytes.all.current, 20 << 20);
//! assert_eq!(allocator.empty_cache()?.bytes, 20 << 20);  // and really returned
//! # Ok::<(), wick_memory::MemoryError>(())
//! ```
//!
//! Layout (one concern per file): [`backend`] (host, simulated, CUDA), [`caching`] (the policy),
//! [`adaptors`] (limiting, statistics, tracking, event log, failure callback), [`scope`],
//! [`snapshot`] and [`summary`]. Trace replay and synthetic workloads live in `wick-trace`.

pub mod adaptors;
pub mod backend;
pub mod caching;
pub mod config;
pub mod error;
pub mod format;
pub mod heap;
pub mod resource;
pub mod scope;
pub mod snapshot;
pub mod stats;
pub mod stream;
pub mod summary;

pub use adaptors::{EventLog, FailureCallback, Limiting, Statistics, TraceOp, Tracking};
#[cfg(feature = "cuda")]
pub use backend::CudaBackend;
pub use backend::{Backend, BackendError, HostBackend, HostMemoryBackend, SimulatedBackend};
pub use caching::{CachingAllocator, BLOCK_ALIGNMENT};
pub use config::{AllocatorConfig, MemoryLimit};
pub use error::{MemoryError, OutOfMemory, Result};
pub use resource::{
    AllocRequest, AllocateExt, Allocation, HostResource, MemoryInfo, MemoryResource, RawBlock, ReleaseReport,
};
pub use scope::{scoped, Scope, ScopeReport};
pub use snapshot::Snapshot;
pub use stats::MemoryStats;
pub use stream::{EventId, StreamId};
