//! The process heap served by wick's caching allocator: a `GlobalAlloc` for binaries.
//!
//! candle's CPU tensors are heap `Vec`s. Through the system allocator (glibc), every buffer above
//! the mmap threshold is mapped on allocation and unmapped on free: each munmap interrupts the
//! other cores to flush their TLBs, and every page of the next buffer faults in again. A training
//! step allocates and frees hundreds of such buffers, and on a 2-core machine that cost a fifth
//! of every zoo model's step (BENCHMARKS.md, "Speed": "What was done, and what each bought").
//! [`CachingHeap`] serves those buffers from a [`CachingAllocator`] over host memory — PyTorch's
//! caching policy, the same code that serves devices — so a freed buffer stays mapped and is
//! handed to the next request of a similar size, and the figures of the heap are the
//! allocator's own (PyTorch-named statistics, [`CachingHeap::memory_summary`], and an
//! [`CachingHeap::empty_cache`] that really returns memory to the operating system).
//!
//! ```no_run
//! #[global_allocator]
//! static HEAP: wick_memory::CachingHeap = wick_memory::CachingHeap::new();
//! ```
//!
//! How it is built, and why it cannot fail where the system allocator would not:
//! - **Small requests** (below [`LARGE_REQUEST`]) go to the system allocator unchanged: glibc's
//!   thread caches serve them faster than any locked pool, and they are never unmapped.
//! - **Large requests** carry a 64-byte header just before the address handed out, which says
//!   where the block came from (the cache, with the block's identity, or the system allocator),
//!   so a free never depends on any other state than the header.
//! - **Re-entrancy**: the caching allocator's own bookkeeping allocates (tables, history). While a
//!   thread is inside the cache, its large requests go to the system allocator (a thread-local
//!   flag), so the cache's lock is never taken twice.
//! - `WICK_HEAP=system` in the environment makes every large request bypass the cache (the
//!   system allocator behind the same headers): the baseline to measure the cache against.
//! - **Never panics, never refuses more than the system would**: when the cache cannot serve a
//!   request (its budget is spent, an alignment above 512 B, the cache not yet built), the system
//!   allocator serves it, with a header saying so; a null return is the system's own answer.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::sync::atomic::{AtomicPtr, AtomicUsize, Ordering};
use std::sync::OnceLock;

use crate::backend::HostBackend;
use crate::caching::{CachingAllocator, BLOCK_ALIGNMENT};
use crate::config::AllocatorConfig;
use crate::heap_history::{record_heap_event, HeapAction};
use crate::resource::{AllocRequest, MemoryResource, RawBlock, ReleaseReport};
use crate::stats::MemoryStats;
use crate::stream::StreamId;

/// Requests of this many bytes or more are served from the cache (glibc's initial mmap
/// threshold: every smaller request stays on glibc's heap anyway).
pub const LARGE_REQUEST: usize = 128 << 10;

/// Bytes of the header in front of every large block (a cache line; it keeps 64-byte alignment).
const HEADER: usize = 64;

const MAGIC_CACHE: u64 = 0x7769_636B_6361_6368; // "wickcach"
const MAGIC_SYSTEM: u64 = 0x7769_636B_7379_7374; // "wicksyst"
/// A large request made from inside the cache (its segments, its bookkeeping): served by the
/// system allocator and not counted as the program's own bytes.
const MAGIC_RESERVE: u64 = 0x7769_636B_7265_7376; // "wickresv"

/// What the header of a large block records.
#[repr(C)]
struct Header {
    magic: u64,
    owner: u64,
    slot: u32,
    generation: u32,
    addr: u64,
    block_size: usize,
    requested: usize,
    stream: u64,
    /// Bytes of this block whose pages were handed back ([`release_pages`]): not counted live.
    released: usize,
}

const _: () = assert!(std::mem::size_of::<Header>() <= HEADER);

thread_local! {
    /// True while this thread is inside the cache (its bookkeeping must not re-enter it).
    static INSIDE: Cell<bool> = const { Cell::new(false) };
}

/// Runs `f` marked as inside the cache; `None` if this thread already is (or its thread-local
/// storage is gone).
fn enter<R>(f: impl FnOnce() -> R) -> Option<R> {
    let entered = INSIDE.try_with(|inside| !inside.replace(true)).unwrap_or(false);
    if !entered {
        return None;
    }
    let result = f();
    let _ = INSIDE.try_with(|inside| inside.set(false));
    Some(result)
}

/// The heap installed as the global allocator, once it has served its first large request.
static INSTALLED: AtomicPtr<CachingHeap> = AtomicPtr::new(std::ptr::null_mut());

/// Bytes the installed heap holds in cached blocks that no allocation uses (the
/// `wick_alloc_check::FreedHeap` it registers).
fn freed_cached_bytes() -> usize {
    CachingHeap::installed().map_or(0, |h| {
        let s = h.memory_stats();
        usize::try_from(s.reserved_bytes.all.current - s.allocated_bytes.all.current).unwrap_or(0)
    })
}

/// Returns the installed heap's cached segments that hold no live block to the operating system
/// (the `wick_alloc_check::HeapRelease` it registers); the bytes returned.
fn release_cached() -> usize {
    CachingHeap::installed().and_then(|h| h.empty_cache().ok()).map_or(0, |r| r.bytes)
}

/// A global allocator whose large blocks come from a caching allocator over host memory (see
/// the module documentation). Const-constructible for a `static`.
pub struct CachingHeap {
    cache: OnceLock<CachingAllocator<HostBackend>>,
    /// `WICK_HEAP=system`: large requests bypass the cache (a baseline to measure it against).
    bypass: OnceLock<bool>,
    /// Bytes of live small requests (system allocator).
    small: AtomicUsize,
    /// Bytes of live large requests the system allocator served (cache unavailable).
    system_large: AtomicUsize,
    /// Bytes of every live request, and their peak.
    live: AtomicUsize,
    peak: AtomicUsize,
}

impl Default for CachingHeap {
    fn default() -> Self {
        Self::new()
    }
}

impl CachingHeap {
    /// A heap whose cache is built on first use, with the policy of `WICK_ALLOC_CONF` (else
    /// `PYTORCH_CUDA_ALLOC_CONF`) when it is set and valid, read over PyTorch's classic policy.
    ///
    /// Why classic segments on the host, unlike wick's other allocators: the heap must hand
    /// memory back to the OS on `empty_cache`, and an expandable segment unmaps only its free
    /// tail, so one small live tensor mapped after a freed region keeps the whole region
    /// resident. Classic segments return every segment with no live block.
    /// `expandable_segments:True` turns them on here too.
    pub const fn new() -> Self {
        CachingHeap {
            cache: OnceLock::new(),
            bypass: OnceLock::new(),
            small: AtomicUsize::new(0),
            system_large: AtomicUsize::new(0),
            live: AtomicUsize::new(0),
            peak: AtomicUsize::new(0),
        }
    }

    /// The heap installed as this process's global allocator, if any (known once it has served
    /// a large request).
    pub fn installed() -> Option<&'static CachingHeap> {
        let p = INSTALLED.load(Ordering::Acquire);
        // SAFETY: only ever set from `&'static self` of a global allocator (a static).
        (!p.is_null()).then(|| unsafe { &*p })
    }

    fn cache(&self) -> &CachingAllocator<HostBackend> {
        self.cache.get_or_init(|| {
            let config = crate::config::alloc_conf_env()
                .and_then(|(_, text)| AllocatorConfig::parse_over(AllocatorConfig::pytorch(), &text).ok())
                .unwrap_or_else(AllocatorConfig::pytorch);
            // A setting the host refuses (e.g. a limit it cannot resolve) leaves the classic
            // policy, which is valid by construction and has no limit to resolve.
            CachingAllocator::with_config(HostBackend::new(), config)
                .unwrap_or_else(|_| CachingAllocator::build(HostBackend::new(), AllocatorConfig::pytorch(), None))
        })
    }

    fn count(&self, bytes: usize) {
        let now = self.live.fetch_add(bytes, Ordering::Relaxed) + bytes;
        self.peak.fetch_max(now, Ordering::Relaxed);
    }

    /// Bytes the process has asked for and not freed (small and large).
    pub fn live_bytes(&self) -> usize {
        self.live.load(Ordering::Relaxed)
    }

    /// Highest [`CachingHeap::live_bytes`] since start or the last reset.
    pub fn peak_bytes(&self) -> usize {
        self.peak.load(Ordering::Relaxed)
    }

    /// Sets the peak to the current value.
    pub fn reset_peak_stats(&self) {
        self.peak.store(self.live.load(Ordering::Relaxed), Ordering::Relaxed);
        let _ = enter(|| self.cache.get().map(|c| c.reset_peak_stats()));
    }

    /// Bytes of live small requests (served by the system allocator).
    pub fn small_bytes(&self) -> usize {
        self.small.load(Ordering::Relaxed)
    }

    /// Bytes of live large requests the cache could not serve.
    pub fn system_large_bytes(&self) -> usize {
        self.system_large.load(Ordering::Relaxed)
    }

    /// The cache's PyTorch-named statistics (large requests).
    pub fn memory_stats(&self) -> MemoryStats {
        enter(|| self.cache().memory_stats()).unwrap_or_default()
    }

    /// The cache's statistics as PyTorch's `memory_summary()` table.
    pub fn memory_summary(&self) -> String {
        enter(|| self.cache().memory_summary()).unwrap_or_default()
    }

    /// The cache's segments and blocks (large requests).
    pub fn snapshot(&self) -> crate::Snapshot {
        enter(|| self.cache().snapshot()).unwrap_or_else(|| crate::Snapshot {
            device: "host heap".into(),
            capacity: 0,
            limit: None,
            segments: Vec::new(),
            stats: MemoryStats::default(),
        })
    }

    /// Returns every cached segment that holds no live block to the operating system.
    pub fn empty_cache(&self) -> crate::Result<ReleaseReport> {
        enter(|| self.cache().empty_cache()).unwrap_or(Ok(ReleaseReport::default()))
    }

    /// Serves a large request from the cache, or `None` when it cannot.
    fn serve_cached(&self, layout: Layout, pre: usize) -> Option<*mut u8> {
        let bypass = *self
            .bypass
            .get_or_init(|| enter(|| std::env::var_os("WICK_HEAP").is_some_and(|v| v == "system")).unwrap_or(false));
        if bypass || layout.align() > BLOCK_ALIGNMENT {
            return None;
        }
        let total = layout.size().checked_add(pre)?;
        let block = enter(|| self.cache().allocate_raw(AllocRequest::new(total)).ok())??;
        let header = Header {
            magic: MAGIC_CACHE,
            owner: block.owner,
            slot: block.slot,
            generation: block.generation,
            addr: block.addr,
            block_size: block.block_size,
            requested: block.requested,
            stream: block.stream.0,
            released: 0,
        };
        debug_assert_eq!(block.addr as usize % BLOCK_ALIGNMENT, 0, "cache blocks are 512-aligned");
        let user = (block.addr as usize + pre) as *mut u8;
        // SAFETY: the block holds `pre + size` bytes starting at `addr`, `pre ≥ HEADER`, and
        // `addr` is 512-aligned, so the header slot is inside the block and aligned.
        unsafe { user.sub(HEADER).cast::<Header>().write(header) };
        Some(user)
    }

    /// Serves a large request from the system allocator, with a header; `counted` when it is
    /// the program's own request (not the cache's reservation or bookkeeping).
    ///
    /// # Safety
    /// `layout` has non-zero size.
    unsafe fn serve_system(&self, layout: Layout, pre: usize, zeroed: bool, counted: bool) -> *mut u8 {
        let Some(total) = layout.size().checked_add(pre) else { return std::ptr::null_mut() };
        let Ok(outer) = Layout::from_size_align(total, pre) else { return std::ptr::null_mut() };
        // SAFETY: non-zero size.
        let base = unsafe {
            if zeroed {
                System.alloc_zeroed(outer)
            } else {
                System.alloc(outer)
            }
        };
        if base.is_null() {
            return base;
        }
        // SAFETY: `base` holds `pre + size` bytes; the header sits in the `pre` bytes in front.
        let user = unsafe { base.add(pre) };
        let header = Header {
            magic: if counted { MAGIC_SYSTEM } else { MAGIC_RESERVE },
            owner: 0,
            slot: 0,
            generation: 0,
            addr: base as u64,
            block_size: total,
            requested: layout.size(),
            stream: 0,
            released: 0,
        };
        // SAFETY: as above; `pre ≥ HEADER` and `pre` is a multiple of 64.
        unsafe { user.sub(HEADER).cast::<Header>().write(header) };
        if counted {
            self.system_large.fetch_add(layout.size(), Ordering::Relaxed);
            self.count(layout.size());
            record_heap_event(HeapAction::Alloc, user, layout.size());
        }
        user
    }

    /// A large request: from the cache when possible, else from the system allocator.
    fn large(&self, layout: Layout, zeroed: bool) -> *mut u8 {
        let me = self as *const CachingHeap as *mut CachingHeap;
        if INSTALLED.swap(me, Ordering::AcqRel).is_null() {
            // The check candle asks (wick-alloc-check) reports the freed blocks, and has them
            // returned to the system before it refuses a buffer.
            wick_alloc_check::set_freed_heap(Some(freed_cached_bytes));
            wick_alloc_check::set_heap_release(Some(release_cached));
        }
        let pre = prefix(&layout);
        if INSIDE.try_with(|inside| inside.get()).unwrap_or(true) {
            // SAFETY: large requests have a non-zero size.
            return unsafe { self.serve_system(layout, pre, zeroed, false) };
        }
        match self.serve_cached(layout, pre) {
            Some(p) => {
                if zeroed {
                    // A reused block holds its last user's bytes.
                    // SAFETY: the block holds `size` bytes from `p`.
                    unsafe { std::ptr::write_bytes(p, 0, layout.size()) };
                }
                self.count(layout.size());
                record_heap_event(HeapAction::Alloc, p, layout.size());
                p
            }
            // SAFETY: large requests have a non-zero size.
            None => unsafe { self.serve_system(layout, pre, zeroed, true) },
        }
    }
}

/// Bytes in front of a large block: the header, rounded up to keep the requested alignment.
fn prefix(layout: &Layout) -> usize {
    layout.align().max(HEADER)
}

// SAFETY: small requests are forwarded to the system allocator unchanged. Large blocks are
// either cache blocks of at least `pre + size` bytes (the allocator hands each out once until it
// is returned) or system allocations of exactly `pre + size` bytes aligned to `pre`; the
// address handed out is `pre` bytes in, aligned to the request, and the header in front of it
// says which, so `dealloc` returns each to where it came from, with its original layout.
unsafe impl GlobalAlloc for CachingHeap {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        if layout.size() >= LARGE_REQUEST {
            return self.large(layout, false);
        }
        // SAFETY: forwarded contract.
        let p = unsafe { System.alloc(layout) };
        if !p.is_null() {
            self.small.fetch_add(layout.size(), Ordering::Relaxed);
            self.count(layout.size());
            record_heap_event(HeapAction::Alloc, p, layout.size());
        }
        p
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        if layout.size() >= LARGE_REQUEST {
            return self.large(layout, true);
        }
        // SAFETY: forwarded contract.
        let p = unsafe { System.alloc_zeroed(layout) };
        if !p.is_null() {
            self.small.fetch_add(layout.size(), Ordering::Relaxed);
            self.count(layout.size());
            record_heap_event(HeapAction::Alloc, p, layout.size());
        }
        p
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        if layout.size() < LARGE_REQUEST {
            record_heap_event(HeapAction::Free, ptr, layout.size());
            self.small.fetch_sub(layout.size(), Ordering::Relaxed);
            self.live.fetch_sub(layout.size(), Ordering::Relaxed);
            // SAFETY: forwarded contract.
            return unsafe { System.dealloc(ptr, layout) };
        }
        let pre = prefix(&layout);
        // SAFETY: `ptr` came from `alloc`/`alloc_zeroed` with this layout, so a header written
        // by `serve_cached` or `serve_system` sits in front of it.
        let h = unsafe { ptr.sub(HEADER).cast::<Header>().read() };
        match h.magic {
            MAGIC_SYSTEM | MAGIC_RESERVE => {
                if h.magic == MAGIC_SYSTEM {
                    record_heap_event(HeapAction::Free, ptr, layout.size());
                    self.system_large.fetch_sub(layout.size(), Ordering::Relaxed);
                    self.live.fetch_sub(layout.size() - h.released, Ordering::Relaxed);
                }
                // SAFETY: `serve_system` allocated `pre + size` bytes aligned to `pre` at `ptr - pre`.
                unsafe { System.dealloc(ptr.sub(pre), Layout::from_size_align_unchecked(layout.size() + pre, pre)) }
            }
            MAGIC_CACHE => {
                record_heap_event(HeapAction::Free, ptr, layout.size());
                self.live.fetch_sub(layout.size() - h.released, Ordering::Relaxed);
                let block = RawBlock {
                    owner: h.owner,
                    slot: h.slot,
                    generation: h.generation,
                    addr: h.addr,
                    block_size: h.block_size,
                    requested: h.requested,
                    stream: StreamId(h.stream),
                };
                // Inside the cache already (impossible by construction: the cache's own
                // bookkeeping never holds cache blocks), leaking is the only safe answer.
                let _ = enter(|| self.cache().deallocate_raw(block));
            }
            // Not a header this heap wrote: the caller broke `dealloc`'s contract. Leak it.
            _ => {}
        }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        if layout.size() < LARGE_REQUEST && new_size < LARGE_REQUEST {
            // Recorded before the old block can be handed to another thread.
            record_heap_event(HeapAction::Free, ptr, layout.size());
            // SAFETY: forwarded contract (both sizes stay with the system allocator).
            let p = unsafe { System.realloc(ptr, layout, new_size) };
            if p.is_null() {
                record_heap_event(HeapAction::Alloc, ptr, layout.size());
            } else {
                record_heap_event(HeapAction::Alloc, p, new_size);
                self.small.fetch_add(new_size, Ordering::Relaxed);
                self.small.fetch_sub(layout.size(), Ordering::Relaxed);
                self.live.fetch_sub(layout.size(), Ordering::Relaxed);
                self.count(new_size);
            }
            return p;
        }
        // SAFETY: the contract of `realloc` guarantees a valid layout for `new_size`.
        let new_layout = unsafe { Layout::from_size_align_unchecked(new_size, layout.align()) };
        // SAFETY: non-zero size (GlobalAlloc's contract).
        let p = unsafe { self.alloc(new_layout) };
        if !p.is_null() {
            // SAFETY: both blocks hold at least the smaller size; they do not overlap.
            unsafe {
                std::ptr::copy_nonoverlapping(ptr, p, layout.size().min(new_size));
                self.dealloc(ptr, layout);
            }
        }
        p
    }
}

/// The page size, read once.
fn page_size() -> usize {
    static PAGE: OnceLock<usize> = OnceLock::new();
    // SAFETY: sysconf has no preconditions.
    *PAGE.get_or_init(|| usize::try_from(unsafe { libc::sysconf(libc::_SC_PAGESIZE) }).unwrap_or(4096).max(1))
}

/// The header of the live large block at `start` when the installed caching heap served it.
///
/// # Safety
/// `start` is the address a global-allocator request of `bytes` bytes returned, still live.
unsafe fn own_header(start: *mut u8, bytes: usize) -> Option<*mut Header> {
    CachingHeap::installed()?;
    if bytes < LARGE_REQUEST {
        return None;
    }
    // SAFETY: the installed caching heap is the global allocator and served this large
    // request, so its header sits in front of `start`.
    let h = unsafe { start.sub(HEADER).cast::<Header>() };
    // SAFETY: as above.
    let magic = unsafe { (*h).magic };
    (magic == MAGIC_CACHE || magic == MAGIC_SYSTEM).then_some(h)
}

/// Hands the whole pages inside the live allocation at `start` (`bytes` long) back to the
/// operating system (`madvise(MADV_DONTNEED)`): the allocation stays valid and reads as zeros
/// until written again, and the caching heap, when it is the global allocator, no longer counts
/// those bytes as live ([`reclaim_pages`] counts them again before they are written). Returns
/// the bytes handed back (0 for a buffer smaller than a page).
///
/// Why pages and not a smaller buffer: a tensor's storage cannot shrink under the shapes that
/// refer to it, and a storage that reads as zeros is never undefined behaviour, where a
/// shorter one would be for any kernel that trusts the shape.
///
/// # Safety
/// `start` is the address a request of `bytes` bytes to the global allocator returned, still
/// live and not accessed by anyone else during the call, and all-zero bytes are a valid value
/// of what it holds.
pub unsafe fn release_pages(start: *mut u8, bytes: usize) -> usize {
    let page = page_size();
    let (lo, hi) = ((start as usize).next_multiple_of(page), (start as usize + bytes) / page * page);
    if hi <= lo {
        return 0;
    }
    // SAFETY: [lo, hi) lies inside the allocation, which the caller holds exclusively; private
    // anonymous pages read as zeros after this.
    if unsafe { libc::madvise(lo as *mut libc::c_void, hi - lo, libc::MADV_DONTNEED) } != 0 {
        return 0;
    }
    // SAFETY: forwarded contract.
    if let Some(h) = unsafe { own_header(start, bytes) } {
        // SAFETY: the header is the block's own and the caller holds the block exclusively.
        let newly = (hi - lo).saturating_sub(unsafe { (*h).released });
        // SAFETY: as above.
        unsafe { (*h).released += newly };
        if let Some(heap) = CachingHeap::installed() {
            heap.live.fetch_sub(newly, Ordering::Relaxed);
        }
    }
    hi - lo
}

/// Counts again, as live, the bytes [`release_pages`] handed back from the allocation at
/// `start` (call it before writing the allocation again). Returns those bytes.
///
/// # Safety
/// As [`release_pages`].
pub unsafe fn reclaim_pages(start: *mut u8, bytes: usize) -> usize {
    // SAFETY: forwarded contract.
    let Some(h) = (unsafe { own_header(start, bytes) }) else { return 0 };
    // SAFETY: the header is the block's own and the caller holds the block exclusively.
    let released = std::mem::take(unsafe { &mut (*h).released });
    if let Some(heap) = CachingHeap::installed() {
        heap.count(released);
    }
    released
}
