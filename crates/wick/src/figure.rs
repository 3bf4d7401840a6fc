//! A memory figure and where it was read: every number wick reports says whether it is exact
//! (counted by an allocator or the CUDA pool) or an estimate from the operating system.

use wick_memory::format_bytes;

/// A figure with the source it was read from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct Figure {
    /// Bytes.
    pub bytes: usize,
    /// Where the number comes from.
    pub source: FigureSource,
}

impl std::fmt::Display for Figure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} ({})", format_bytes(self.bytes as u64), self.source)
    }
}

/// Where a figure was read.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub enum FigureSource {
    /// Counted by wick's tracking global allocator: exact heap bytes.
    CountingAllocator,
    /// Counted by wick's caching heap (`wick_memory::CachingHeap` as the global
    /// allocator): exact heap bytes, large buffers served from wick's caching allocator.
    CachingHeap,
    /// The process's resident set (`/proc/self/statm`): includes code, stacks and freed-but-kept heap.
    ProcessRss,
    /// The container's cgroup (`memory.current` / `memory.max`).
    Cgroup,
    /// Physical memory of the machine (`/proc/meminfo`).
    MemTotal,
    /// The CUDA memory pool wick installed (`USED/RESERVED_MEM_*`).
    CudaPool,
    /// A limit the user set.
    UserLimit,
}

impl std::fmt::Display for FigureSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let text = match self {
            FigureSource::CountingAllocator => "counting allocator (exact heap)",
            FigureSource::CachingHeap => "caching heap (exact heap)",
            FigureSource::ProcessRss => "process RSS",
            FigureSource::Cgroup => "cgroup",
            FigureSource::MemTotal => "MemTotal",
            FigureSource::CudaPool => "CUDA pool",
            FigureSource::UserLimit => "user limit",
        };
        f.write_str(text)
    }
}
