//! Out of memory inside wick-nn's CUDA ops, under a capped pool (`--capped-oom`): each op's
//! forward and backward on inputs that fit the cap but whose outputs or gradients do not must end
//! in an error that says "out of memory" — from the op's own output, cuDNN's workspace or a
//! cuBLAS product — never a crash; afterwards the pool's allocated bytes are back at their
//! baseline and the next step (a small one) runs.

use anyhow::Result;
use candle_core::{DType, Device, Tensor, Var};
use wick_nn::{cnn, ops};

/// The pool's cap for these cases.
pub(crate) const CAP: usize = 256 << 20;

type Step = fn(&Device) -> candle_core::Result<()>;

/// Forward and backward of one op on inputs of about 100 MiB (the graph and gradients exceed
/// the 256 MiB cap).
const CASES: [(&str, Step); 5] = [
    ("conv2d 3x3 (cuDNN), 32 × 64 × 112² f32", |dev| {
        let x = Var::randn(0f32, 1.0, (32, 64, 112, 112), dev)?;
        let w = Var::randn(0f32, 0.1, (64, 64, 3, 3), dev)?;
        let y = cnn::conv2d(x.as_tensor(), w.as_tensor(), 1, 1)?;
        y.sum_all()?.backward().map(drop)
    }),
    ("depthwise 3x3 (cuDNN), 32 × 96 × 112² f32", |dev| {
        let x = Var::randn(0f32, 1.0, (32, 96, 112, 112), dev)?;
        let w = Var::randn(0f32, 0.1, (96, 1, 3, 3), dev)?;
        let y = cnn::depthwise_conv2d(x.as_tensor(), w.as_tensor(), 1, 1)?;
        y.sum_all()?.backward().map(drop)
    }),
    ("batch norm + ReLU, 32 × 64 × 112² f32", |dev| {
        let x = Var::randn(0f32, 1.0, (32, 64, 112, 112), dev)?;
        let (w, b) = (Var::ones(64, DType::F32, dev)?, Var::zeros(64, DType::F32, dev)?);
        let mut params = wick_nn::params::Params::default();
        let running = cnn::RunningStats::register(
            &mut params,
            "bn",
            Tensor::zeros(64, DType::F32, dev)?,
            Tensor::ones(64, DType::F32, dev)?,
        );
        let y =
            running.normalize_act(x.as_tensor(), w.as_tensor(), b.as_tensor(), true, true, cnn::Activation::Relu)?;
        (y.sum_all()? * 2.0)?.backward().map(drop)
    }),
    ("linear (cuBLAS), 8 192 × 4 096 by 4 096² f32", |dev| {
        let x = Var::randn(0f32, 1.0, (8192, 4096), dev)?;
        let w = Var::randn(0f32, 0.01, (4096, 4096), dev)?;
        let y = ops::linear(x.as_tensor(), w.as_tensor(), None)?;
        y.sum_all()?.backward().map(drop)
    }),
    ("attention, 8 × 12 × 4 096 × 64 bf16", |dev| {
        let shape = (8, 12, 4096, 64);
        let q = Var::from_tensor(&Tensor::randn(0f32, 1.0, shape, dev)?.to_dtype(DType::BF16)?)?;
        let k = Var::from_tensor(&Tensor::randn(0f32, 1.0, shape, dev)?.to_dtype(DType::BF16)?)?;
        let v = Var::from_tensor(&Tensor::randn(0f32, 1.0, shape, dev)?.to_dtype(DType::BF16)?)?;
        let y = ops::attention(q.as_tensor(), k.as_tensor(), v.as_tensor(), None)?;
        y.sum_all()?.backward().map(drop)
    }),
];

/// Runs every case under `engine` (capped at [`CAP`]); the number that failed.
pub(crate) fn run(engine: &wick::Engine) -> Result<usize> {
    let dev = engine.device().clone();
    let mut failures = 0;
    for (name, step) in CASES {
        dev.synchronize()?;
        let baseline = engine.allocated().bytes;
        let outcome = step(&dev);
        dev.synchronize()?;
        let after = engine.allocated().bytes;
        // The next step: a small op, forward and backward.
        let next = Var::randn(0f32, 1.0, (64, 64), &dev)
            .and_then(|x| ops::relu(x.as_tensor())?.sum_all()?.backward().map(drop));
        let message = match &outcome {
            Ok(()) => "no error".to_string(),
            Err(e) => e.to_string().lines().next().unwrap_or_default().chars().take(240).collect(),
        };
        let oom = outcome.is_err() && message.to_lowercase().contains("out of memory");
        let ok = oom && after == baseline && next.is_ok();
        println!(
            "{} {name}: {message}; allocated {:.1} MiB before, {:.1} MiB after; next step {}",
            if ok { "PASS" } else { "FAIL" },
            baseline as f64 / 1048576.0,
            after as f64 / 1048576.0,
            if next.is_ok() { "ran" } else { "failed" }
        );
        failures += usize::from(!ok);
    }
    Ok(failures)
}
