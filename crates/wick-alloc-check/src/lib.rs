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
//! what they cannot give. That matters where one process holds several copies of this crate: an
//! evcxr notebook compiles every cell as a library of its own, with its own copy of every
//! dependency's statics, so a check that one cell installed would be unknown to the next. Here
//! each copy answers the same way, in every cell, on every thread, before or after any engine.
//! The one registration, [`set_freed_heap`], only adds room (a caching heap's freed blocks, which
//! a new buffer is served from); a copy that never saw it refuses slightly earlier, never later.
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
//! | [`set_freed_heap`] | a caching global allocator's freed bytes, counted as room |
//! | [`probe`] | tells the patched candle-core from the published one |
//! | [`format_bytes`] | byte counts as people read them (`1.50 GiB`) |

pub mod cgroup;
mod format;
pub mod host;

use std::cell::Cell;
use std::sync::atomic::{AtomicPtr, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

pub use cgroup::{cgroup_memory, cgroup_memory_in, CgroupMemory};
pub use format::format_bytes;
pub use host::{meminfo_bytes, process_resident, Bound, HostMemory, Room};

/// Buffers smaller than this pass at once: one cannot exhaust the host by itself, and reading
/// the host's figures costs tens of microseconds.
pub const CHECKED_FROM: usize = 16 << 20;

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

/// The bytes a caching global allocator holds freed, which a new buffer would be served from.
pub type FreedHeap = fn() -> usize;

/// The registered [`FreedHeap`] as a pointer (null: none).
static FREED_HEAP: AtomicPtr<()> = AtomicPtr::new(std::ptr::null_mut());

/// Registers (or with `None` removes) the function that says how many bytes this process's
/// caching global allocator holds freed. wick-memory's caching heap registers itself when it
/// becomes the global allocator. Per copy of this crate, like every static: a copy that never
/// saw it counts no freed bytes, which only makes it refuse a little earlier.
pub fn set_freed_heap(f: Option<FreedHeap>) {
    FREED_HEAP.store(f.map_or(std::ptr::null_mut(), |f| f as *mut ()), Ordering::Release);
}

/// What the registered [`FreedHeap`] says now (0 when none is registered).
pub fn freed_heap() -> usize {
    let p = FREED_HEAP.load(Ordering::Acquire);
    if p.is_null() {
        return 0;
    }
    // SAFETY: FREED_HEAP only ever holds null or a `FreedHeap` function pointer stored by
    // `set_freed_heap`; function and data pointers have the same size on every platform Rust's
    // std supports.
    let f = unsafe { std::mem::transmute::<*mut (), FreedHeap>(p) };
    f()
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
    if bytes < CHECKED_FROM {
        if bytes == PROBE_BYTES && PROBING.try_with(Cell::get).unwrap_or(false) {
            return Err(PROBE_REFUSAL.into());
        }
        return Ok(());
    }
    let freed = freed_heap();
    if bytes <= freed || allowed_by_recent_reading(bytes - freed) {
        return Ok(());
    }
    let host = HostMemory::read();
    match host.room() {
        Some(room) if bytes - freed > room.bytes => {
            Err(host.with_resident().refusal("a candle CPU tensor", bytes, freed, room))
        }
        Some(room) => {
            remember_reading(room.bytes, bytes - freed);
            Ok(())
        }
        None => Ok(()),
    }
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

    // One test: the freed-heap registration is process-wide, and the other cases read it.
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
        // A caching heap's freed bytes are room.
        set_freed_heap(Some(plenty));
        assert_eq!(refuse(1 << 50), Ok(()), "served from the heap's freed blocks");
        set_freed_heap(None);
        assert!(refuse(1 << 50).is_err());
        // The probe's size is refused only on the probing thread, only while it probes.
        assert_eq!(refuse(PROBE_BYTES), Ok(()));
        assert!(probe(refuse));
        assert!(!probe(|_| Ok::<(), String>(())), "nothing asked: the published candle-core");
        assert_eq!(refuse(PROBE_BYTES), Ok(()), "the probe ended");
    }
}
