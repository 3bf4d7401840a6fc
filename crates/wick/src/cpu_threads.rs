//! How candle's CPU worker threads wait between ops, and which thread runs wick's kernels.
//!
//! candle 0.11 runs its CPU ops on a pool of its own ("barrier pool") whose workers, after each
//! op, spin `CANDLE_BARRIER_POOL_SPIN_LIMIT` times (25 000 by default) before parking. wick's
//! kernels and the `gemm` crate run on rayon's threads; on a machine with few cores a candle
//! worker that is still spinning takes a core from them, so every op that follows a candle op
//! runs short of a thread. Parking at once costs a wake-up (a futex call) at the next candle op
//! instead. It made the decoder's and the CNNs' training steps faster on 2 cores and left BERT
//! and ViT unchanged: the interleaved figures are in BENCHMARKS.md ("Speed", "On an AMD EPYC
//! machine", the list of what the session changed).

/// The variable candle reads, once, when its CPU pool starts.
pub const CANDLE_SPIN_LIMIT_VAR: &str = "CANDLE_BARRIER_POOL_SPIN_LIMIT";

/// Makes candle's CPU workers park as soon as an op ends (a spin limit of 0), unless the
/// environment already sets [`CANDLE_SPIN_LIMIT_VAR`]. It must run before candle runs its first
/// CPU op (candle reads the variable once), so call it first thing in `main`.
///
/// # Safety
/// It writes the process environment: no other thread may read or write the environment while
/// it runs (call it before starting threads).
pub unsafe fn park_candle_workers() {
    if std::env::var_os(CANDLE_SPIN_LIMIT_VAR).is_none() {
        std::env::set_var(CANDLE_SPIN_LIMIT_VAR, "0");
    }
}

/// Makes the calling thread the first worker of rayon's global pool (the pool that wick's CPU
/// kernels and the `gemm` crate run on), with one more worker per further CPU. Call it first in
/// `main`, before anything uses rayon.
///
/// Why: without it the global pool's workers are threads of their own, so every parallel op
/// issued from `main` hands its work to them, sleeps, and is woken when they finish — two
/// context switches per op, each costing more than a small op's work on a machine with few
/// cores. As a worker, the main thread runs its share of every op itself and only the other
/// workers are woken. The interleaved figures (faster MobileNetV2 eval and CNN training, the
/// decoder unchanged within noise) are in BENCHMARKS.md ("Speed", "On a Xeon with AMX").
///
/// Work that other threads hand to the pool is run by the other workers (and by this thread
/// only while it is itself inside a parallel op). An error when the global pool already exists.
pub fn kernels_on_main_thread() -> Result<(), rayon::ThreadPoolBuildError> {
    rayon::ThreadPoolBuilder::new().use_current_thread().build_global()
}

/// What [`crate::main!`] runs first in `main`: [`park_candle_workers`], then
/// [`kernels_on_main_thread`] (whose only failure, a global pool that already exists, is
/// reported on stderr and otherwise ignored: the program runs, only slower).
///
/// # Safety
/// As [`park_candle_workers`]: no other thread may read or write the environment while it runs.
/// [`crate::main!`] calls it as the first statement of the `main` it writes, before the program's
/// own code can start a thread, which is what makes the macro safe to use.
pub unsafe fn enter_main() {
    // SAFETY: the caller's contract.
    unsafe { park_candle_workers() };
    if let Err(e) = kernels_on_main_thread() {
        eprintln!("wick: the kernels' thread pool was set up before `main` ran ({e}); continuing");
    }
}
