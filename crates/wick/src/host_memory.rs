//! Honest host-memory figures. candle's CPU tensors are ordinary heap `Vec`s, so exact figures
//! need a global allocator that counts ([`CountingAllocator`], opt-in for binaries); everywhere
//! else the process's resident set and the container's cgroup are read. Every figure says where it
//! came from.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

use wick_memory::{record_heap_event, CachingHeap, HeapAction};

use crate::figure::FigureSource;

static ALLOCATED: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);
static ACTIVE: AtomicBool = AtomicBool::new(false);
/// Cumulative bytes allocated and freed, and allocations made and freed (a `realloc` counts as
/// a free and an allocation), for PyTorch's `allocated`/`freed` statistics.
static TOTAL_ALLOCATED: AtomicUsize = AtomicUsize::new(0);
static TOTAL_FREED: AtomicUsize = AtomicUsize::new(0);
static ALLOCATIONS: AtomicUsize = AtomicUsize::new(0);
static FREES: AtomicUsize = AtomicUsize::new(0);

/// A global allocator that counts live heap bytes and their peak. Install it in a binary:
///
/// ```no_run
/// #[global_allocator]
/// static ALLOC: wick::host_memory::CountingAllocator = wick::host_memory::CountingAllocator;
///
/// fn main() {
///     let engine = wick::Engine::cpu();
///     println!("{}", engine.allocated()); // "… (counting allocator (exact heap))"
/// }
/// ```
///
/// It never refuses memory itself (refusing would abort the process); caps on the CPU are
/// enforced by the engine's pre-flight checks instead. In evcxr notebooks statics exist once per
/// cell, so it is for binaries and tests, not notebooks.
pub struct CountingAllocator;

fn add(bytes: usize) {
    let now = ALLOCATED.fetch_add(bytes, Ordering::Relaxed) + bytes;
    PEAK.fetch_max(now, Ordering::Relaxed);
    TOTAL_ALLOCATED.fetch_add(bytes, Ordering::Relaxed);
    ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
}

fn sub(bytes: usize) {
    ALLOCATED.fetch_sub(bytes, Ordering::Relaxed);
    TOTAL_FREED.fetch_add(bytes, Ordering::Relaxed);
    FREES.fetch_add(1, Ordering::Relaxed);
}

// SAFETY: every call is forwarded to the system allocator unchanged; only counters are updated.
unsafe impl GlobalAlloc for CountingAllocator {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        ACTIVE.store(true, Ordering::Relaxed);
        // SAFETY: forwarded contract.
        let p = unsafe { System.alloc(layout) };
        if !p.is_null() {
            add(layout.size());
            record_heap_event(HeapAction::Alloc, p, layout.size());
        }
        p
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        ACTIVE.store(true, Ordering::Relaxed);
        // SAFETY: forwarded contract.
        let p = unsafe { System.alloc_zeroed(layout) };
        if !p.is_null() {
            add(layout.size());
            record_heap_event(HeapAction::Alloc, p, layout.size());
        }
        p
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // Recorded before the block can be handed to another thread.
        record_heap_event(HeapAction::Free, ptr, layout.size());
        // SAFETY: forwarded contract.
        unsafe { System.dealloc(ptr, layout) };
        sub(layout.size());
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // SAFETY: forwarded contract.
        record_heap_event(HeapAction::Free, ptr, layout.size());
        // SAFETY: forwarded contract.
        let p = unsafe { System.realloc(ptr, layout, new_size) };
        if p.is_null() {
            // The old block stays the program's.
            record_heap_event(HeapAction::Alloc, ptr, layout.size());
        } else {
            sub(layout.size());
            add(new_size);
            record_heap_event(HeapAction::Alloc, p, new_size);
        }
        p
    }
}

/// Exact heap bytes and their source: the counting allocator's, or the caching heap's, when
/// either is this process's global allocator.
pub fn exact_heap() -> Option<(usize, FigureSource)> {
    counted_heap()
        .map(|b| (b, FigureSource::CountingAllocator))
        .or_else(|| CachingHeap::installed().map(|h| (h.live_bytes(), FigureSource::CachingHeap)))
}

/// Peak of [`exact_heap`] since start or the last [`reset_exact_peak`].
pub fn exact_peak() -> Option<(usize, FigureSource)> {
    counted_peak()
        .map(|b| (b, FigureSource::CountingAllocator))
        .or_else(|| CachingHeap::installed().map(|h| (h.peak_bytes(), FigureSource::CachingHeap)))
}

/// The process's heap in four figures, for progress bars and status files.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct HeapFigures {
    /// Bytes asked for and not freed ([`exact_heap`]).
    pub allocated: usize,
    /// Highest `allocated` since start or the last reset ([`exact_peak`]).
    pub peak: usize,
    /// Bytes the heap holds: with the caching heap, its segments (live and cached large blocks)
    /// plus the small requests; otherwise `allocated`.
    pub reserved: usize,
    /// The host budget ([`host_budget`]): the cgroup limit, else MemTotal.
    pub budget: usize,
}

/// `allocated A (peak P, reserved R) of budget B`.
impl std::fmt::Display for HeapFigures {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let b = |n: usize| wick_memory::format_bytes(n as u64);
        let (a, p, r, budget) = (b(self.allocated), b(self.peak), b(self.reserved), b(self.budget));
        write!(f, "allocated {a} (peak {p}, reserved {r}) of budget {budget}")
    }
}

/// [`HeapFigures`] now, against `budget` (read once with [`host_budget`]: a training loop asks
/// every step, and the budget's cgroup walk need not run each time), when this process's global
/// allocator counts (the caching heap or the counting allocator); `None` otherwise (then only the
/// resident set is known).
pub fn heap_figures(budget: usize) -> Option<HeapFigures> {
    let (allocated, _) = exact_heap()?;
    let (peak, _) = exact_peak()?;
    let reserved = match CachingHeap::installed() {
        Some(h) if counted_heap().is_none() => {
            let cached = h.memory_stats().reserved_bytes.all.unsigned_current();
            cached.saturating_add(h.small_bytes()).saturating_add(h.system_large_bytes())
        }
        _ => allocated,
    };
    Some(HeapFigures { allocated, peak, reserved, budget })
}

/// Sets the exact peaks to the current values.
pub fn reset_exact_peak() {
    reset_counted_peak();
    if let Some(heap) = CachingHeap::installed() {
        heap.reset_peak_stats();
    }
}

/// Exact heap bytes, when the counting allocator is installed in this process.
pub fn counted_heap() -> Option<usize> {
    ACTIVE.load(Ordering::Relaxed).then(|| ALLOCATED.load(Ordering::Relaxed))
}

/// Peak of `counted_heap` since start or the last `reset_counted_peak`.
pub fn counted_peak() -> Option<usize> {
    ACTIVE.load(Ordering::Relaxed).then(|| PEAK.load(Ordering::Relaxed))
}

/// The counting allocator's cumulative figures, when it is installed: (bytes allocated, bytes
/// freed, allocations, frees) since the process started.
pub fn counted_totals() -> Option<(usize, usize, usize, usize)> {
    ACTIVE.load(Ordering::Relaxed).then(|| {
        let load = |a: &AtomicUsize| a.load(Ordering::Relaxed);
        (load(&TOTAL_ALLOCATED), load(&TOTAL_FREED), load(&ALLOCATIONS), load(&FREES))
    })
}

/// Sets the tracked peak to the current value.
pub fn reset_counted_peak() {
    PEAK.store(ALLOCATED.load(Ordering::Relaxed), Ordering::Relaxed);
}

/// The process's resident set in bytes (read without allocating; owned by
/// [`wick_alloc_check::process_resident`]).
pub fn process_rss() -> Option<usize> {
    wick_alloc_check::process_resident()
}

/// The process's memory cgroup (usage, limit), v2 or v1, the limit the tightest along its own
/// cgroup path (`None` when unlimited); owned by [`wick_memory::cgroup_memory`].
pub fn cgroup_memory() -> Option<(usize, Option<usize>)> {
    wick_memory::cgroup_memory()
}

/// Bytes a new buffer can have now ([`wick_alloc_check::available`]): the tightest of the
/// machine's available memory, the cgroup's limit less its working set, `ulimit -v` and the
/// commit limit, plus what the caching heap holds freed; the budget ([`host_budget`]) when the
/// host gives no figure. The same figure decides the check candle asks before a CPU buffer.
pub fn host_available() -> usize {
    wick_alloc_check::available().map_or_else(|| host_budget().0, |(bytes, _, _)| bytes)
}

/// Pre-flight on the host without an engine: `OutOfMemory` (with advice) when `bytes` for `what`
/// exceed [`host_available`], before anything is allocated. candle's CPU allocations cannot fail
/// (an over-budget `Vec` aborts the process), so constructors and loaders call this first. The
/// refusal's figures are the limit's that refused (the machine's, the cgroup's, ...) and say so,
/// with this process's resident set beside them.
pub fn preflight_host(bytes: usize, what: &str) -> Result<(), wick_memory::MemoryError> {
    use wick_alloc_check::Bound;
    use wick_memory::UsageOwner;
    let Some((available, room, _)) = wick_alloc_check::available() else {
        return Ok(());
    };
    if bytes <= available {
        return Ok(());
    }
    // Whose memory the limit that refused counts.
    let owner = match room.bound {
        Bound::Machine => UsageOwner::Machine,
        Bound::Cgroup => UsageOwner::Cgroup,
        Bound::AddressSpace => UsageOwner::AddressSpace,
        Bound::CommitLimit => UsageOwner::Committed,
    };
    Err(wick_memory::OutOfMemory::refused(format!("cpu ({what})"), bytes)
        .with_device(room.limit, available)
        .with_usage(room.used, room.used)
        .with_owner(owner)
        .with_process_resident(process_rss())
        .with_limit(None, room.bound == Bound::Cgroup)
        .with_largest_free_block(available)
        .into_error())
}

pub use wick_alloc_check::CHECKED_FROM;

/// True when the candle-core built into this program is wick's patched copy, which asks
/// [`wick_alloc_check::check`] before allocating a CPU buffer — so an over-memory CPU tensor is
/// candle's `Err`, in every notebook cell and on every thread, with or without an engine — and
/// stores gradients instead of adding them into zeros. Found once, by a probe
/// ([`wick_alloc_check::probe`]).
pub fn candle_checks_cpu_allocations() -> bool {
    static PATCHED: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *PATCHED.get_or_init(|| {
        wick_alloc_check::probe(|bytes| {
            candle_core::Tensor::zeros(bytes, candle_core::DType::U8, &candle_core::Device::Cpu)
        })
    })
}

/// The host memory budget and its source: the cgroup limit when set, else MemTotal.
pub fn host_budget() -> (usize, FigureSource) {
    let total = wick_memory::host_memory_budget();
    match cgroup_memory().and_then(|(_, limit)| limit) {
        Some(limit) if limit <= total => (limit, FigureSource::Cgroup),
        _ => (total, FigureSource::MemTotal),
    }
}

/// Returns freed heap memory to the operating system: the caching heap's unused segments when it
/// is installed, then `malloc_trim(0)`; true if anything was released.
pub fn trim_heap() -> bool {
    let cached = CachingHeap::installed().and_then(|h| h.empty_cache().ok()).is_some_and(|r| r.bytes > 0);
    trim_system_heap() || cached
}

fn trim_system_heap() -> bool {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        // SAFETY: malloc_trim only returns free memory at the heap's top and in free chunks.
        unsafe { libc::malloc_trim(0) == 1 }
    }
    #[cfg(not(all(target_os = "linux", target_env = "gnu")))]
    {
        false
    }
}
