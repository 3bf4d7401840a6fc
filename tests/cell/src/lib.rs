//! # wick-cell
//!
//! A stand-in for an evcxr notebook cell. evcxr compiles each cell as a shared library with its
//! dependencies linked in statically and opens it with `dlopen`, so one kernel process holds one
//! copy of wick, candle-core and `wick-alloc-check` — and of every `static` in them — per cell.
//! `tests/separate_copies.rs` opens this library twice, from two files, and drives the copies
//! the way a notebook does: the engine made in one, a plain candle tensor made in the other.
//!
//! | item | what it does in its own copy |
//! |---|---|
//! | [`cell_make_engine`] | makes a CPU engine and keeps it for the process's life |
//! | [`cell_register_release`], [`cell_release_calls`] | registers a heap release that counts its calls (shows whose statics a copy sees) |
//! | [`cell_check`] | asks this copy's `wick_alloc_check::check` |
//! | [`cell_zeros`] | makes a plain candle CPU tensor, here or on a thread of its own |
//! | [`cell_mark`] | the address of a static of this copy |

use candle_core::{DType, Device, Tensor};

/// What a call answered.
pub const ALLOCATED: i32 = 0;
/// candle's `Err`, recognised as out of memory by wick.
pub const REFUSED_OUT_OF_MEMORY: i32 = 1;
/// Any other `Err`.
pub const OTHER_ERROR: i32 = 2;
/// The thread the tensor was made on panicked.
pub const PANICKED: i32 = 3;

static MARK: u8 = 0;

/// The address of a static of this copy: two copies of the library give two addresses.
#[no_mangle]
pub extern "C" fn cell_mark() -> usize {
    &MARK as *const u8 as usize
}

/// Makes `wick::Engine::cpu()` in this copy and keeps it alive, as a notebook's first cell does.
#[no_mangle]
pub extern "C" fn cell_make_engine() -> i32 {
    Box::leak(Box::new(wick::Engine::cpu()));
    ALLOCATED
}

static RELEASE_CALLS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

fn counting_release() -> usize {
    RELEASE_CALLS.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
    0
}

/// Registers, in this copy's `wick-alloc-check`, a heap release that only counts its calls: this
/// copy's check calls it before each refusal, which [`cell_release_calls`] shows; another copy
/// never sees it.
#[no_mangle]
pub extern "C" fn cell_register_release() {
    wick_alloc_check::set_heap_release(Some(counting_release));
}

/// How many times this copy's check called the release [`cell_register_release`] registered.
#[no_mangle]
pub extern "C" fn cell_release_calls() -> usize {
    RELEASE_CALLS.load(std::sync::atomic::Ordering::SeqCst)
}

/// This copy's answer for a buffer of `bytes` (nothing is allocated).
#[no_mangle]
pub extern "C" fn cell_check(bytes: u64) -> i32 {
    match wick_alloc_check::check(usize::try_from(bytes).ok()) {
        Ok(()) => ALLOCATED,
        Err(_) => REFUSED_OUT_OF_MEMORY,
    }
}

/// Makes a plain candle CPU tensor of `bytes` bytes (`Tensor::zeros`, u8) — on a new thread when
/// `on_thread` is nonzero — and says what candle answered.
#[no_mangle]
pub extern "C" fn cell_zeros(bytes: u64, on_thread: i32) -> i32 {
    let make = move || match Tensor::zeros(usize::try_from(bytes).unwrap_or(usize::MAX), DType::U8, &Device::Cpu) {
        Ok(_) => ALLOCATED,
        Err(e) if wick::is_out_of_memory(&e) => REFUSED_OUT_OF_MEMORY,
        Err(_) => OTHER_ERROR,
    };
    if on_thread == 0 {
        make()
    } else {
        std::thread::spawn(make).join().unwrap_or(PANICKED)
    }
}
