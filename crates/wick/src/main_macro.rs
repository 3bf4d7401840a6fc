//! [`crate::main!`]: one line that sets a program up for wick's speed and exact memory figures.
//!
//! Without it a program needs three things at the top of `main`, in order: a
//! `#[global_allocator]` (wick's caching heap, so host tensors are reused and the engine's host
//! figures are exact), `unsafe { cpu_threads::park_candle_workers() }` before any thread starts,
//! and `cpu_threads::kernels_on_main_thread()` before anything uses rayon. The macro writes them,
//! with the `unsafe` call as the first statement of the `main` it generates — before the program's
//! own code runs, so no thread of the program can exist yet: the `unsafe` is sound by
//! construction, not by the caller's care (`#[tokio::main]` is the Rust precedent).
//!
//! ```
//! fn run() -> Result<(), Box<dyn std::error::Error>> {
//!     let engine = wick::Engine::cpu();
//!     println!("{}", engine.memory_report());
//!     Ok(())
//! }
//!
//! wick::main!(run);
//! # // rustdoc wraps a block with no `fn main` in one (and never calls `run`); this keeps the macro's.
//! # #[cfg(any())] fn main() {}
//! ```
//!
//! `run` is any function without arguments whose result a `main` may return (`()`, a `Result`
//! whose error is `Debug`, an `ExitCode`): an `Err` is printed as `main` prints it and the exit
//! status is 1. The heap is chosen after the function:
//!
//! | form | global allocator |
//! |---|---|
//! | `wick::main!(run)` or `wick::main!(run, heap = caching)` | [`crate::memory::CachingHeap`]: reuse, exact figures (the default) |
//! | `wick::main!(run, heap = counting)` | [`crate::CountingAllocator`]: the system allocator with exact counts and peaks (measurement harnesses) |
//! | `wick::main!(run, heap = none)` | none: the program brings its own `#[global_allocator]` (mimalloc, jemalloc …) or keeps the system's |
//!
//! A notebook cannot get all of it: an evcxr kernel is evcxr's own process, so neither its global
//! allocator nor its `main` is the notebook's, and it runs threads of its own before the first
//! cell (so setting the environment is not sound there). Candle's workers spin between ops and
//! the kernels' pool hands each op to its workers; results are the same, steps slower on few
//! cores (README, "Use wick in your project").

/// Declares the process's `#[global_allocator]`: `heap!(caching)` for
/// [`crate::memory::CachingHeap`], `heap!(counting)` for [`crate::CountingAllocator`]. The one
/// spelling of both, for [`crate::main!`] and for binaries that cannot use it (a test harness, whose
/// `main` libtest writes). The static is named `WICK_HEAP` (for its statistics, as
/// `WICK_HEAP.memory_stats()`).
#[macro_export]
macro_rules! heap {
    (caching) => {
        #[global_allocator]
        static WICK_HEAP: $crate::memory::CachingHeap = $crate::memory::CachingHeap::new();
    };
    (counting) => {
        #[global_allocator]
        static WICK_HEAP: $crate::CountingAllocator = $crate::CountingAllocator;
    };
}

/// Writes `main` for a program: wick's global allocator, then candle's workers parked and the
/// main thread made a worker of the kernels' pool (see the [module](crate::main_macro)), then
/// `$run()`, whose result is `main`'s.
#[macro_export]
macro_rules! main {
    ($run:path) => {
        $crate::main!($run, heap = caching);
    };
    ($run:path, heap = caching) => {
        $crate::heap!(caching);
        $crate::main!(@main $run);
    };
    ($run:path, heap = counting) => {
        $crate::heap!(counting);
        $crate::main!(@main $run);
    };
    ($run:path, heap = none) => {
        $crate::main!(@main $run);
    };
    (@main $run:path) => {
        fn main() -> ::std::process::ExitCode {
            // SAFETY: the first statement of `main`: the program's own code has not run, so none
            // of its threads exists to read or write the environment.
            unsafe { $crate::cpu_threads::enter_main() };
            ::std::process::Termination::report($run())
        }
    };
}
