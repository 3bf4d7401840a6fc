//! # wick-alloc-check
//!
//! The meeting point of wick and its patched candle-core (`vendor/candle-core`) for CPU
//! allocations. candle's CPU storage is a plain `Vec`: a buffer larger than the machine can give
//! aborts the process (Rust's allocation-failure handler), or the kernel's OOM killer ends it
//! when the pages are touched — in a notebook, the kernel and every variable with it. The patched
//! candle-core calls [`check`] with a new CPU tensor's size before allocating it; wick
//! [`install`]s the check (the host's available memory, `wick::host_memory`), and a refusal
//! becomes candle's `Err`, which `?` hands back with every earlier variable intact.
//!
//! Why a crate of its own: wick must build against the published candle-core too (a project
//! without the `[patch]`), so it cannot call an API only the patched candle has; both depend on
//! this crate instead. Without the patch the check is installed and never asked.
//!
//! | item | what it is |
//! |---|---|
//! | [`Check`] | the check: bytes → `Ok`, or the refusal's text |
//! | [`install`] | sets (or clears) the process's check |
//! | [`check`] | what the patched candle-core calls |

use std::sync::atomic::{AtomicPtr, Ordering};

/// A check of a CPU allocation of `bytes`: `Err` carries the refusal's text (with advice).
pub type Check = fn(bytes: usize) -> Result<(), String>;

/// The installed check as a pointer (null: none).
static CHECK: AtomicPtr<()> = AtomicPtr::new(std::ptr::null_mut());

/// Installs `check` for the whole process (`None` removes it). Cheap and idempotent.
pub fn install(check: Option<Check>) {
    CHECK.store(check.map_or(std::ptr::null_mut(), |f| f as *mut ()), Ordering::Release);
}

/// True when a check is installed.
pub fn installed() -> bool {
    !CHECK.load(Ordering::Acquire).is_null()
}

/// Asks the installed check about an allocation of `bytes` (`None`: the size overflowed, always
/// refused); `Ok` when none is installed.
pub fn check(bytes: Option<usize>) -> Result<(), String> {
    let Some(bytes) = bytes else {
        return Err("out of memory: a CPU tensor whose size in bytes overflows usize".into());
    };
    let p = CHECK.load(Ordering::Acquire);
    if p.is_null() {
        return Ok(());
    }
    // SAFETY: CHECK only ever holds null or a `Check` function pointer stored by `install`;
    // function and data pointers have the same size on every platform Rust's std supports.
    let f = unsafe { std::mem::transmute::<*mut (), Check>(p) };
    f(bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn refuse_over_100(bytes: usize) -> Result<(), String> {
        if bytes > 100 {
            Err(format!("out of memory: {bytes} bytes"))
        } else {
            Ok(())
        }
    }

    #[test]
    fn the_installed_check_decides_and_an_overflow_is_refused() {
        install(None);
        assert!(!installed());
        assert_eq!(check(Some(usize::MAX)), Ok(()));
        assert!(check(None).unwrap_err().contains("overflows"));
        install(Some(refuse_over_100));
        assert!(installed());
        assert_eq!(check(Some(100)), Ok(()));
        assert_eq!(check(Some(101)), Err("out of memory: 101 bytes".into()));
        install(None);
        assert_eq!(check(Some(101)), Ok(()));
    }
}
