//! Timing shared by the kernel benches.

/// The fastest of `runs` batches of `reps` calls of `f`, in seconds a call.
pub fn best(runs: usize, reps: usize, f: &mut dyn FnMut()) -> f64 {
    let mut best = f64::MAX;
    for _ in 0..runs {
        let t = std::time::Instant::now();
        for _ in 0..reps {
            f();
        }
        best = best.min(t.elapsed().as_secs_f64() / reps as f64);
    }
    best
}

/// G multiply-adds a second of `f` (`macs` each): the fastest of three batches of about 2·10⁹
/// multiply-adds (at least three calls).
#[allow(dead_code)]
pub fn rate(macs: usize, f: &mut dyn FnMut()) -> f64 {
    let reps = (2e9 / macs as f64).max(3.0) as usize;
    macs as f64 / best(3, reps, f) / 1e9
}
