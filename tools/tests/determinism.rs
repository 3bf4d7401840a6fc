//! Reproducibility of a training step on every zoo model (the trial's tasks).

use candle_core::Device;
use wick_nn::Autocast;
use wick_tools::trial::{task, MODELS};

/// The parallel kernels add their partial sums in a fixed order: the same step twice gives the
/// same gradients to the last bit (exact resume and reproducible runs depend on it).
#[test]
fn parallel_kernels_are_deterministic() {
    for model in MODELS {
        let t = task(model, Autocast::off(), &Device::Cpu).unwrap_or_else(|e| panic!("{model}: {e}"));
        let grads = || -> Vec<Vec<f32>> {
            let g = (t.loss)().unwrap().backward().unwrap();
            t.vars.iter().filter_map(|v| g.get(v)).map(|g| g.flatten_all().unwrap().to_vec1().unwrap()).collect()
        };
        let (a, b) = (grads(), grads());
        assert!(!a.is_empty());
        assert!(a == b, "{model}: two runs of the same step differ");
    }
}
