//! How candle's CPU worker threads wait between ops.
//!
//! candle 0.11 runs its CPU ops on a pool of its own ("barrier pool") whose workers, after each
//! op, spin `CANDLE_BARRIER_POOL_SPIN_LIMIT` times (25 000 by default) before parking. wick's
//! kernels and the `gemm` crate run on rayon's threads; on a machine with few cores a candle
//! worker that is still spinning takes a core from them, so every op that follows a candle op
//! runs short of a thread. Parking at once costs a wake-up (a futex call) at the next candle op
//! instead. Measured with `zoo-speed` (training steps, interleaved, 2 cores, BENCHMARKS.md
//! "Speed"): the main job's decoder 1.35×, ResNet-18 1.20×, MobileNetV2 1.16×, ResNet-50 1.05×
//! faster; BERT and ViT unchanged.

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
