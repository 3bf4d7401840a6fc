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
//! The API is flat: every public item is at the crate root (`wick_memory::CachingAllocator`,
//! `wick_memory::Scope`, ...) and the modules are private, one concern per file: backends (host,
//! simulated, CUDA, the cgroup budget), the caching policy and its history, adaptors (limiting,
//! statistics, tracking, event log, failure callback), scopes, snapshots, statistics, the text
//! summary and the caching heap (a `GlobalAlloc`). Trace replay and synthetic workloads live in
//! `wick-trace`.

mod adaptors;
mod backend;
mod caching;
mod config;
mod error;
mod heap;
mod heap_history;
mod labels;
mod resource;
mod scope;
mod snapshot;
mod stats;
mod stream;
mod summary;

pub use adaptors::{Counters, EventLog, FailureCallback, Limiting, Statistics, TraceOp, Tracked, Tracking};
pub use backend::{
    cgroup_memory, cgroup_memory_in, host_memory_budget, meminfo_bytes, Backend, BackendError, HostBackend,
    HostMemoryBackend, SimulatedBackend, SimulatedStreams, MAP_GRANULARITY,
};
#[cfg(feature = "cuda")]
pub use backend::{device_location, open_device, CudaBackend};
pub use caching::{peak_live, Action, CachingAllocator, HistoryEntry, PeakLive, BLOCK_ALIGNMENT};
pub use config::{
    alloc_conf_env, AllocatorConfig, MemoryLimit, ALLOC_CONF_VARS, MAX_POWER2_DIVISIONS, POWER2_INTERVALS,
};
pub use error::{MemoryError, OutOfMemory, Result, UsageOwner};
pub use heap::{reclaim_pages, release_pages, CachingHeap, LARGE_REQUEST};
pub use heap_history::{
    heap_history, heap_history_position, heap_history_recording, record_heap_event, start_heap_history,
    stop_heap_history, HeapAction, HeapEvent, HeapHistory, HistoryRecorder, LabelHolding, Lifetime,
    DEFAULT_MIN_EVENT_SIZE,
};
pub use labels::{current_label, label_path, push_label, LabelGuard, LabelId, MAX_LABEL_LEN, MAX_LABEL_NODES};
pub use resource::{
    AllocRequest, AllocateExt, Allocation, HostResource, MemoryInfo, MemoryResource, RawBlock, ReleaseReport,
};
pub use scope::{scoped, Scope, ScopeReport, ScopedBlock};
pub use snapshot::{BlockSnapshot, BlockStateName, SegmentSnapshot, Snapshot};
pub use stats::{MemoryStats, PoolKind, Stat, StatArray};
pub use stream::{EventId, StreamId};
pub use summary::{memory_summary, memory_summary_of_map};
pub use wick_alloc_check::format_bytes;
