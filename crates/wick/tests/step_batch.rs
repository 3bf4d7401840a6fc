//! Steps sized by their batch are refused before they run when the peak scaled from their last
//! run cannot fit (exact peaks from wick's caching heap as the global allocator; a test binary of
//! its own, so no other test's buffers move the figures).

use wick::Engine;

wick::heap!(caching);

#[test]
fn a_step_whose_scaled_peak_cannot_fit_is_refused_before_it_runs() {
    let engine = Engine::cpu();
    // A step whose transient memory is one MiB per sample.
    let step = |batch: usize| {
        move |_: &Engine| -> Result<usize, wick::Error> {
            let activations = vec![1u8; batch << 20];
            Ok(activations.iter().map(|&b| b as usize).sum())
        }
    };
    let (sum, report) = engine.try_step_batch("train", 8, step(8)).unwrap();
    assert_eq!(sum, 8 << 20);
    assert!(report.peak.unwrap() >= report.before + (8 << 20));
    // A batch that fits runs; one whose scaled peak (about a PiB) cannot is refused and the
    // closure never runs — on the CPU it would have aborted the process.
    assert!(engine.try_step_batch("train", 16, step(16)).is_ok());
    let ran = std::cell::Cell::new(false);
    let err = engine
        .try_step_batch("train", 1 << 30, |_| {
            ran.set(true);
            Ok(())
        })
        .unwrap_err();
    assert!(err.is_out_of_memory() && !ran.get(), "{err}");
    assert!(err.to_string().contains("step `train` at batch 1073741824"), "{err}");
    // Another label has no history: it runs.
    assert!(engine.try_step_batch("eval", 2, step(2)).is_ok());
}
