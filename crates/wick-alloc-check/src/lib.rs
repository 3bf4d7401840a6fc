//! # wick-alloc-check
//!
//! What wick's patched candle-core (`vendor/candle-core`) asks before it allocates a CPU buffer,
//! and the host-memory figures the answer is made of. candle's CPU storage is a plain `Vec`: a
//! buffer larger than the host can give aborts the process (Rust's allocation-failure handler),
//! or the kernel's OOM killer ends it when the pages are touched — in a notebook, the kernel and
//! every variable with it. The patched candle-core calls [`check`] with each new CPU buffer's
//! size; a refusal becomes candle's `Err`, which `?` hands back with every earlier variable intact.
//!
//! **The check decides by itself.** It keeps nothing that has to be installed first: from
//! [`CHECKED_FROM`] up it reads the host's figures at that moment ([`HostMemory`]) and refuses
//! what they cannot give; smaller buffers are counted, and each time they add up to
//! [`CHECKED_FROM`] the one that does is checked for that much room. That matters where one
//! process holds several copies of this crate: an
//! evcxr notebook compiles every cell as a library of its own, with its own copy of every
//! dependency's statics, so a check that one cell installed would be unknown to the next. Here
//! each copy answers the same way, in every cell, on every thread, before or after any engine.
//! The one registration that changes an answer, [`set_heap_release`], only makes room (a caching
//! heap returns its freed blocks to the system before a refusal); a copy that never saw it
//! refuses slightly earlier, never later.
//!
//! Why a crate of its own: candle-core depends on it, so it must not depend on candle or on the
//! rest of wick; wick-memory re-exports its figures ([`cgroup`], [`meminfo_bytes`],
//! [`format_bytes`]), which have one owner here. Without the patch nothing asks.
//!
//! | item | what it is |
//! |---|---|
//! | [`check`] | what the patched candle-core calls: `Ok`, or the refusal's text |
//! | [`available`] | what a new CPU buffer can have now, and what limits it |
//! | [`host`] | [`HostMemory`]: the machine, the cgroup, `ulimit -v`, the commit limit |
//! | [`cgroup`] | the process's memory cgroup (v1 and v2) |
//! | [`set_freed_heap`], [`set_heap_release`] | a caching global allocator's freed bytes (reported), and how it returns them before a refusal |
//! | [`probe`] | tells the patched candle-core from the published one |
//! | [`format_bytes`] | byte counts as people read them (`1.50 GiB`) |

pub mod cgroup;
mod format;
pub mod host;

use std::cell::Cell;
use std::sync::atomic::{AtomicPtr, AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

pub use cgroup::{cgroup_memory, cgroup_memory_in, CgroupMemory};
pub use format::format_bytes;
pub use host::{meminfo_bytes, process_resident, Bound, HostMemory, Room};

/// Buffers from this size up are checked one by one; smaller ones are counted, and the one that
/// brings their count to this size is checked for the whole of it (see [`check`]).
///
/// Policy: one small buffer cannot exhaust the host, and reading the host's figures costs tens of
/// microseconds, so each small buffer is not read for. But many can: a model whose activations
/// are 2 MiB each (a 1024-wide decoder at 8 × 64 tokens) passes a cgroup's limit on small buffers
/// alone, and the kernel then ends the process. Counted, they overrun the room by at most this
/// much before a refusal.
pub const CHECKED_FROM: usize = 16 << 20;

/// Bytes of buffers below [`CHECKED_FROM`] since the last check of their sum.
static SMALL_SINCE_CHECK: AtomicUsize = AtomicUsize::new(0);

/// How long a reading of the host's room is reused to allow further buffers.
///
/// Policy: reading the figures costs 40–120 µs (more right after large memory traffic), which is
/// 7–15 % of making a 16 MiB buffer. A reading is therefore reused for 50 ms, for buffers adding
/// up to half the room it found: other processes may take memory meanwhile, and so may this
/// process's other buffers, and the half is the margin for both. Only allowing is reused — a
/// refusal always comes from a fresh reading — so a reused reading can never refuse what the host
/// has now. Per copy of this crate, like every static; a copy without a reading reads.
pub const READING_REUSE: Duration = Duration::from_millis(50);

/// The last reading: when, the room it found, the bytes allowed against it since.
struct Reading {
    at: Instant,
    room: usize,
    allowed: usize,
}

static LAST_READING: Mutex<Option<Reading>> = Mutex::new(None);

/// True when `bytes` fits in the reuse margin of a recent reading (and is counted against it).
fn allowed_by_recent_reading(bytes: usize) -> bool {
    let mut last = LAST_READING.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    match last.as_mut() {
        Some(r) if r.at.elapsed() < READING_REUSE && r.allowed.saturating_add(bytes) <= r.room / 2 => {
            r.allowed += bytes;
            true
        }
        _ => false,
    }
}

fn remember_reading(room: usize, allowed: usize) {
    let mut last = LAST_READING.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    *last = Some(Reading { at: Instant::now(), room, allowed });
}

/// The size [`probe`] asks about, and the refusal it gets from the patched candle-core.
const PROBE_BYTES: usize = 4099;
const PROBE_REFUSAL: &str = "wick: the probe of candle's CPU allocation check";

thread_local! {
    /// Set on a thread while it runs [`probe`]: only its probe-sized request is refused.
    static PROBING: Cell<bool> = const { Cell::new(false) };
}

/// The bytes a caching global allocator holds freed (reported beside a refusal and in
/// [`available`]).
pub type FreedHeap = fn() -> usize;

/// Returns a caching global allocator's freed memory to the operating system; the bytes it
/// returned.
pub type HeapRelease = fn() -> usize;

/// The registered [`FreedHeap`] and [`HeapRelease`] as pointers (null: none).
static FREED_HEAP: AtomicPtr<()> = AtomicPtr::new(std::ptr::null_mut());
static HEAP_RELEASE: AtomicPtr<()> = AtomicPtr::new(std::ptr::null_mut());

/// Registers (or with `None` removes) the function that says how many bytes this process's
/// caching global allocator holds freed. wick-memory's caching heap registers itself when it
/// becomes the global allocator. Per copy of this crate, like every static.
pub fn set_freed_heap(f: Option<FreedHeap>) {
    FREED_HEAP.store(f.map_or(std::ptr::null_mut(), |f| f as *mut ()), Ordering::Release);
}

/// Registers (or with `None` removes) the function that returns the caching global allocator's
/// freed memory to the operating system, which [`check`] calls before it refuses. Per copy of
/// this crate: a copy that never saw it refuses where the cached memory would have made room.
pub fn set_heap_release(f: Option<HeapRelease>) {
    HEAP_RELEASE.store(f.map_or(std::ptr::null_mut(), |f| f as *mut ()), Ordering::Release);
}

fn call_registered(slot: &AtomicPtr<()>) -> usize {
    let p = slot.load(Ordering::Acquire);
    if p.is_null() {
        return 0;
    }
    // SAFETY: the slots only ever hold null or a `fn() -> usize` pointer stored by
    // `set_freed_heap`/`set_heap_release`; function and data pointers have the same size on
    // every platform Rust's std supports.
    let f = unsafe { std::mem::transmute::<*mut (), fn() -> usize>(p) };
    f()
}

/// What the registered [`FreedHeap`] says now (0 when none is registered).
pub fn freed_heap() -> usize {
    call_registered(&FREED_HEAP)
}

/// What a new CPU buffer can have now: the host's room ([`HostMemory::room`]) plus the bytes
/// the caching heap holds freed, and the host's figures; `None` when the host gives no figure.
pub fn available() -> Option<(usize, Room, HostMemory)> {
    let host = HostMemory::read();
    let room = host.room()?;
    Some((room.bytes.saturating_add(freed_heap()), room, host))
}

/// Asks whether a CPU buffer of `bytes` may be allocated (`None`: the size overflowed, always
/// refused). `Err` carries the refusal's text: it starts `out of memory on cpu`, names every
/// figure's owner and ends with advice.
pub fn check(bytes: Option<usize>) -> Result<(), String> {
    let Some(bytes) = bytes else {
        return Err("out of memory: a CPU tensor whose size in bytes overflows usize".into());
    };
    let (mut asked, mut what) = (bytes, "a candle CPU tensor");
    if bytes < CHECKED_FROM {
        if bytes == PROBE_BYTES && PROBING.try_with(Cell::get).unwrap_or(false) {
            return Err(PROBE_REFUSAL.into());
        }
        let since = SMALL_SINCE_CHECK.fetch_add(bytes, Ordering::Relaxed).saturating_add(bytes);
        if since < CHECKED_FROM {
            return Ok(());
        }
        // This buffer brings the small ones to the checked size: the room must hold that much
        // more (they are already in the host's figures; the next ones are what is asked for).
        SMALL_SINCE_CHECK.store(0, Ordering::Relaxed);
        (asked, what) = (CHECKED_FROM, "the next candle CPU tensors below 16 MiB, counted together");
    }
    let bytes = asked;
    if allowed_by_recent_reading(bytes) {
        return Ok(());
    }
    let mut host = HostMemory::read();
    let Some(mut room) = host.room() else { return Ok(()) };
    // Policy (PyTorch's when an allocation fails): before refusing, the caching heap returns its
    // freed segments to the operating system and the figures are read again. Freed bytes are not
    // counted as room by themselves: a new buffer is served from them only where one freed
    // block is large enough, and otherwise takes new pages — which is how a process under a
    // cgroup limit was ended by the kernel instead of refused here.
    if bytes > room.bytes && call_registered(&HEAP_RELEASE) > 0 {
        host = HostMemory::read();
        match host.room() {
            Some(again) => room = again,
            None => return Ok(()),
        }
    }
    if bytes > room.bytes {
        return Err(host.with_resident().refusal(what, bytes, freed_heap(), room));
    }
    remember_reading(room.bytes, bytes);
    Ok(())
}

/// Runs `make`, which must make one CPU tensor of 4099 bytes through candle, and says whether
/// candle asked [`check`] first (wick's patched candle-core does; the published one does not):
/// while it runs, a request of that size from this thread is refused, and `make`'s error text
/// says so.
pub fn probe<E: std::fmt::Display, T>(make: impl FnOnce(usize) -> Result<T, E>) -> bool {
    struct Reset;
    impl Drop for Reset {
        fn drop(&mut self) {
            let _ = PROBING.try_with(|p| p.set(false));
        }
    }
    let _ = PROBING.try_with(|p| p.set(true));
    let _reset = Reset;
    matches!(make(PROBE_BYTES), Err(e) if e.to_string().contains(PROBE_REFUSAL))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn refuse(bytes: usize) -> Result<(), String> {
        check(Some(bytes))
    }

    fn plenty() -> usize {
        1 << 52
    }

    static RELEASES: AtomicUsize = AtomicUsize::new(0);

    fn counting_release() -> usize {
        RELEASES.fetch_add(1, Ordering::SeqCst);
        1 << 20
    }

    // One test: the registrations are process-wide, and the other cases read them.
    #[test]
    fn the_check_refuses_what_the_host_cannot_give_and_nothing_else() {
        assert_eq!(refuse(0), Ok(()));
        assert_eq!(refuse(CHECKED_FROM - 1), Ok(()));
        assert!(check(None).unwrap_err().contains("overflows"));
        // Far beyond any machine: refused with the host's figures, with nothing registered.
        let err = refuse(1 << 50).unwrap_err();
        assert!(err.starts_with("out of memory on cpu (a candle CPU tensor): tried to allocate 1.00 PiB"), "{err}");
        assert!(err.contains("Advice: "), "{err}");
        // Within what the host has now: allowed.
        let (room, _, _) = available().expect("this test runs on Linux, where /proc gives figures");
        assert_eq!(refuse(CHECKED_FROM.max(room / 4)), Ok(()));
        // A recent reading allows up to half its room without reading again, and never refuses.
        remember_reading(100 << 20, 0);
        assert!(allowed_by_recent_reading(30 << 20) && allowed_by_recent_reading(20 << 20));
        assert!(!allowed_by_recent_reading(1), "half the room is used up");
        remember_reading(100 << 20, 0);
        std::thread::sleep(READING_REUSE);
        assert!(!allowed_by_recent_reading(1), "the reading is too old");
        assert!(refuse(1 << 50).is_err());
        // A caching heap's freed bytes are not room by themselves: before refusing, the check has
        // the heap return them and reads again (here nothing changes, so it still refuses), and
        // the refusal reports what the heap holds freed.
        set_freed_heap(Some(plenty));
        set_heap_release(Some(counting_release));
        let err = refuse(1 << 50).unwrap_err();
        assert_eq!(RELEASES.load(Ordering::SeqCst), 1, "released once before refusing");
        assert!(err.contains("4.00 PiB freed for reuse"), "{err}");
        assert_eq!(refuse(CHECKED_FROM), Ok(()));
        assert_eq!(RELEASES.load(Ordering::SeqCst), 1, "nothing released where the host has room");
        set_freed_heap(None);
        set_heap_release(None);
        // Small buffers are counted: the one that brings them to CHECKED_FROM is checked for that.
        SMALL_SINCE_CHECK.store(0, Ordering::Relaxed);
        assert_eq!(refuse(CHECKED_FROM / 2), Ok(()));
        assert_eq!(SMALL_SINCE_CHECK.load(Ordering::Relaxed), CHECKED_FROM / 2);
        assert_eq!(refuse(CHECKED_FROM / 2), Ok(()), "the machine has 16 MiB");
        assert_eq!(SMALL_SINCE_CHECK.load(Ordering::Relaxed), 0, "checked, and counting again");
        // The probe's size is refused only on the probing thread, only while it probes.
        assert_eq!(refuse(PROBE_BYTES), Ok(()));
        assert!(probe(refuse));
        assert!(!probe(|_| Ok::<(), String>(())), "nothing asked: the published candle-core");
        assert_eq!(refuse(PROBE_BYTES), Ok(()), "the probe ended");
    }
}
