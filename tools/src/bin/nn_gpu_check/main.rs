//! GPU check of wick-nn's CUDA op bodies (`wick_nn::native::cuda`, kernels `kernels/src/cuda/nn_*.cu`):
//!
//! 1. every op with a CUDA body against its host body on the same inputs — the forward output and
//!    the gradient of every input — in f32, bf16, f16 and f64, on shapes that cross the kernels'
//!    edges (rows longer than a block, more rows than a chunk of the weight-gradient sums, head
//!    dimensions that fill a warp's lanes in part, padding and causal masks, repeated and padding
//!    ids, PyTorch's kinks of ReLU and ReLU6 at exactly 0 and 6);
//! 2. that the CUDA pass went through the op's own node, forward and backward (the per-op call
//!    counts of `wick_nn::native::profile`, which only wick's ops report), not the composed fallback;
//! 3. the op beside the composed form of candle's ops it replaces on a GPU, at the zoo's sizes:
//!    time of forward + backward, and the bytes the output's graph keeps for backward (and bf16
//!    attention on tensor cores beside its CUDA-core kernels, which are checked in 1. as well).
//!
//! The convolutions' CUDA bodies are cuDNN's (checked with TF32 off, timed with it on, PyTorch's
//! default); `--expect-no-cudnn`, run with `WICK_CUDNN` naming no library, checks that a GPU
//! convolution without cuDNN is an error that says how to install it, and that the next op runs.
//!
//! `--capped-oom` runs the ops out of memory under a capped pool instead (`oom`);
//! `--time-attention SPEC …` times attention at the shapes given, for PyTorch's side by side
//! (`speed`).
//!
//! Prints one line per check and per timing; exits non-zero if a check fails. Run by
//! `scripts/gpu-check.sh` (needs candle's CUDA kernels: `scripts/build-gpu-binaries.sh` with the
//! real nvcc). With `--host` it needs no GPU: each op's composed form (the real fallback, under
//! `wick_nn::native::with_composed`) is checked against its host body on the CPU, which tests both
//! the fallbacks and this harness (its inputs, masks, tables and ids) before a device run;
//! `cargo run -p wick-tools --release --bin nn-gpu-check -- --host`.

mod cases;
mod oom;
mod speed;

use anyhow::{bail, Context, Result};
use candle_core::{DType, Device, Tensor, Var};
use cases::{estimates, Case, Op, CASES};
use wick_nn::cnn;
use wick_nn::native::profile;
use wick_nn::ops;
use wick_nn::params::normal_tensor;

/// Random inputs (host, f64) for `case`, with the kinks PyTorch's gradients define placed in them.
fn host_inputs(case: &Case, shapes: &[Vec<usize>], seed: u64) -> Result<Vec<Vec<f64>>> {
    let mut out = Vec::new();
    for (i, s) in shapes.iter().enumerate() {
        let std = if case.name == "relu6" { 4.0 } else { 1.0 };
        let mut v: Vec<f64> =
            normal_tensor(s, std, seed + i as u64, DType::F64, &Device::Cpu)?.flatten_all()?.to_vec1()?;
        if matches!(case.counted, "layer_norm" | "rms_norm" | "batch_norm") {
            if i == 1 {
                v.iter_mut().for_each(|w| *w += 1.0); // weights around 1, as trained norms have
            }
        } else if matches!(case.counted, "relu" | "relu6" | "add_relu") && v.len() > 2 {
            v[0] = 0.0;
            v[1] = 6.0;
        }
        out.push(v);
    }
    if case.name == "add_relu" && out[0].len() > 3 {
        out[1][2] = -out[0][2]; // a + b exactly 0
    }
    Ok(out)
}

fn vals(t: &Tensor) -> Result<Vec<f64>> {
    Ok(t.to_device(&Device::Cpu)?.to_dtype(DType::F64)?.flatten_all()?.to_vec1()?)
}

/// Largest |a − b| / (1 + |b|); NaN only where both are NaN.
fn max_rel_err(a: &[f64], b: &[f64]) -> f64 {
    if a.len() != b.len() {
        return f64::INFINITY;
    }
    a.iter()
        .zip(b)
        .map(|(x, y)| if x.is_nan() && y.is_nan() || x == y { 0.0 } else { (x - y).abs() / (1.0 + y.abs()) })
        .fold(0.0, f64::max)
}

/// A few units in the last place of `dtype` (the two bodies' exp and erf differ in the last bits,
/// and a value may round either way once).
fn tolerance(dtype: DType) -> f64 {
    match dtype {
        DType::BF16 => 1.6e-2,
        DType::F16 => 2e-3,
        DType::F64 => 1e-12,
        _ => 2e-5,
    }
}

/// The forward output and every input's gradient of `op` on `dev`, for the loss Σ y·r (in f32).
fn run(
    op: Op,
    host: &[Vec<f64>],
    shapes: &[Vec<usize>],
    dtype: DType,
    r_seed: u64,
    dev: &Device,
) -> Result<Vec<Vec<f64>>> {
    let vars = host
        .iter()
        .zip(shapes)
        .map(|(v, s)| {
            Var::from_tensor(&Tensor::from_vec(v.clone(), s.as_slice(), &Device::Cpu)?.to_dtype(dtype)?.to_device(dev)?)
        })
        .collect::<candle_core::Result<Vec<_>>>()?;
    let ts: Vec<Tensor> = vars.iter().map(|v| v.as_tensor().clone()).collect();
    let y = op(&ts)?;
    let r = normal_tensor(y.dims(), 1.0, r_seed, DType::F32, &Device::Cpu)?.to_device(dev)?;
    let grads = (y.to_dtype(DType::F32)? * r)?.sum_all()?.backward()?;
    let mut out = vec![vals(&y)?];
    for v in &vars {
        let g = grads.get(v.as_tensor()).context("an input got no gradient")?;
        out.push(vals(g)?);
    }
    Ok(out)
}

/// Forward + backward of `op` on `dev`: milliseconds per pass (after warm-up, synchronised) and
/// the bytes the output's graph keeps.
fn time(op: Op, shapes: &[Vec<usize>], dtype: DType, dev: &Device, passes: usize) -> Result<(f64, usize)> {
    let vars = shapes
        .iter()
        .enumerate()
        .map(|(i, s)| Var::from_tensor(&normal_tensor(s, 1.0, 90 + i as u64, dtype, dev)?))
        .collect::<candle_core::Result<Vec<_>>>()?;
    let ts: Vec<Tensor> = vars.iter().map(|v| v.as_tensor().clone()).collect();
    let g = Tensor::ones(op(&ts)?.dims(), dtype, dev)?;
    let mut kept = 0;
    let ms = speed::per_pass_ms(dev, passes, || {
        let y = op(&ts)?;
        kept = wick_nn::graph::graph_bytes(&y).total;
        drop((y * &g)?.sum_all()?.backward()?);
        Ok(())
    })?;
    Ok((ms, kept))
}

/// One op checked on `dev` against the host body (`host`: its composed form, the real fallback
/// under `wick_nn::native::with_composed`, on the host
/// against the host body instead, a check of this harness that needs no GPU).
fn check(case: &Case, shapes: &[Vec<usize>], dtype: DType, dev: &Device, host: bool) -> Result<(bool, String)> {
    let inputs = host_inputs(case, shapes, 11 + shapes[0].iter().product::<usize>() as u64)?;
    let want = run(case.op, &inputs, shapes, dtype, 5, &Device::Cpu)?;
    profile::reset();
    let got = if host {
        wick_nn::native::with_composed(|| run(case.op, &inputs, shapes, dtype, 5, dev))?
    } else {
        run(case.op, &inputs, shapes, dtype, 5, dev)?
    };
    let counts = profile::totals();
    let calls =
        |phase: &str| counts.iter().filter(|(n, p, _, _)| n == case.counted && *p == phase).map(|r| r.2).sum::<u64>();
    let (fwd, bwd) = (calls("forward"), calls("backward"));
    let errs: Vec<f64> = got.iter().zip(&want).map(|(g, w)| max_rel_err(g, w)).collect();
    let worst = errs.iter().copied().fold(0.0, f64::max);
    // The composed forms round once more in low precision (each of their ops rounds), and candle's
    // f64 GELU gradient carries f32 constants (3.7e-7 from the host body's).
    // A dense convolution's or a linear layer's outputs and gradients are sums of hundreds of
    // products (576 for a 3×3 over 64 channels, 1 000 for a row of 1 000), added in another order
    // by each body: f32's rounding grows with the
    // sum's length (the half types round each output once, which dominates).
    let long_sums = matches!(case.counted, "conv2d" | "linear") && dtype == DType::F32;
    // On the CPU candle convolves f16 in f16 (its fallback's sums, and its transposed convolution
    // for the input gradient, round at every step): a bound 20 times wider.
    let f16_conv_on_host = host && dtype == DType::F16 && case.counted == "conv2d";
    let tol = match (host, dtype) {
        _ if f16_conv_on_host => 20.0 * tolerance(dtype),
        (true, DType::BF16 | DType::F16) => 8.0 * tolerance(dtype),
        (true, DType::F64) => 1e-6,
        _ if long_sums => 1e-4,
        _ => tolerance(dtype),
    };
    let ok = worst <= tol && got.len() == want.len() && (host || (fwd >= 1 && bwd >= 1));
    let errs = errs.iter().map(|e| format!("{e:.1e}")).collect::<Vec<_>>().join(" / ");
    Ok((
        ok,
        format!(
            "max rel err {errs} (output, then each gradient); op calls on the device: {fwd} forward, {bwd} backward"
        ),
    ))
}

/// Batch norm's running estimates moved by a training step on `dev` (on the device there, no
/// host round trip) against their direct recomputation in f64 from the same input: PyTorch's
/// momentum 0.1 and unbiased variance, stored in f32.
fn running_estimates(dev: &Device) -> Result<(bool, String)> {
    let (n, c, side) = (4usize, 6usize, 11usize);
    let x = normal_tensor(&[n, c, side, side], 2.0, 77, DType::F32, &Device::Cpu)?;
    let host: Vec<f32> = x.flatten_all()?.to_vec1()?;
    let (mean0, var0) = estimates(c, &Device::Cpu)?;
    let running = cnn::RunningStats::register(
        &mut wick_nn::params::Params::default(),
        "bn",
        mean0.to_device(dev)?,
        var0.to_device(dev)?,
    );
    let (w, b) = (Tensor::ones(c, DType::F32, dev)?, Tensor::zeros(c, DType::F32, dev)?);
    running.normalize_act(&x.to_device(dev)?, &w, &b, true, true, cnn::Activation::Relu)?;
    let (got_mean, got_var) = running.get();
    let (m0, v0): (Vec<f32>, Vec<f32>) = (mean0.to_vec1()?, var0.to_vec1()?);
    let (mut want_mean, mut want_var) = (Vec::new(), Vec::new());
    let count = (n * side * side) as f64;
    for ch in 0..c {
        let plane = |b: usize| &host[(b * c + ch) * side * side..(b * c + ch + 1) * side * side];
        let xs: Vec<f64> = (0..n).flat_map(plane).map(|v| f64::from(*v)).collect();
        let m = xs.iter().sum::<f64>() / count;
        let v = xs.iter().map(|x| (x - m) * (x - m)).sum::<f64>() / (count - 1.0);
        want_mean.push(f64::from((f64::from(m0[ch]) * 0.9 + m * 0.1) as f32));
        want_var.push(f64::from((f64::from(v0[ch]) * 0.9 + v * 0.1) as f32));
    }
    let (em, ev) = (max_rel_err(&vals(&got_mean)?, &want_mean), max_rel_err(&vals(&got_var)?, &want_var));
    Ok((em <= 2.4e-7 && ev <= 2.4e-7, format!("max rel err {em:.1e} (mean) / {ev:.1e} (unbiased variance)")))
}

fn main() -> Result<()> {
    // The per-op counts are read from wick-nn's profile, which reads this once.
    if std::env::var_os("WICK_PROFILE_OPS").is_none() {
        std::env::set_var("WICK_PROFILE_OPS", "1");
    }
    let host = std::env::args().any(|a| a == "--host");
    let engine;
    let dev = if host {
        Device::Cpu
    } else {
        if !wick_kernels::COMPILED {
            bail!("this build has no CUDA kernels: build with WICK_KERNELS_NVCC=<path to nvcc>");
        }
        let capped = std::env::args().any(|a| a == "--capped-oom");
        engine = wick::Engine::cuda(0, capped.then_some(oom::CAP)).context("opening cuda:0")?;
        let args: Vec<String> = std::env::args().collect();
        if let Some(at) = args.iter().position(|a| a == "--time-attention") {
            return speed::run(&args[at + 1..], engine.device());
        }
        if capped {
            println!("== out of memory inside the ops, under a pool capped at {} MiB", oom::CAP >> 20);
            let failures = oom::run(&engine)?;
            if failures > 0 {
                bail!("{failures} out-of-memory case(s) failed");
            }
            return Ok(());
        }
        engine.device().clone()
    };
    if std::env::args().any(|a| a == "--expect-no-cudnn") {
        // Run with WICK_CUDNN naming no library: a GPU convolution must be an error that says how
        // to install cuDNN, and the process must go on (the next op runs).
        let x = Tensor::ones((1, 3, 8, 8), DType::F32, &dev)?;
        let w = Tensor::ones((4, 3, 3, 3), DType::F32, &dev)?;
        let outcome = cnn::conv2d(&x, &w, 1, 1).map(|_| ());
        let next = ops::relu(&x).and_then(|y| y.sum_all()?.to_scalar::<f32>());
        let advice = outcome.as_ref().err().map(|e| e.to_string()).unwrap_or_default();
        let ok = advice.contains("pip install nvidia-cudnn") && next.is_ok_and(|v| v == 192.0);
        println!(
            "{} a GPU convolution without cuDNN: {}",
            if ok { "PASS" } else { "FAIL" },
            if advice.is_empty() { "no error" } else { &advice }
        );
        if !ok {
            bail!("the missing-cuDNN path did not give its advice");
        }
        return Ok(());
    }
    let mut failures = 0usize;
    // The checks compare f32 exactly enough for f32's tolerance: cuDNN without TF32 (the timings
    // below run with it, PyTorch's default for convolutions).
    #[cfg(feature = "cuda")]
    wick_nn::native::cuda::conv::set_tf32(false);

    if host {
        println!("== (--host) the composed forms against the host bodies, on the CPU: a check of this harness");
    } else {
        println!("== each CUDA body against its host body (forward output, then each input's gradient)");
    }
    for case in &CASES {
        for &(rows, d) in case.sizes {
            let shapes = (case.shapes)(rows, d);
            for dtype in [DType::F32, DType::BF16, DType::F16, DType::F64] {
                // One failure (an error included) is reported and the others still run: a device
                // run is one shot.
                let (ok, detail) =
                    check(case, &shapes, dtype, &dev, host).unwrap_or_else(|e| (false, format!("error: {e:#}")));
                println!("{} {} {shapes:?} {dtype:?}: {detail}", if ok { "PASS" } else { "FAIL" }, case.name);
                failures += usize::from(!ok);
            }
            // f16/bf16 attention runs on tensor cores where the device has them; its CUDA-core
            // kernels (every other device) are checked here too.
            if !host && case.counted == "attention" {
                speed::use_tensor_cores(false);
                for dtype in [DType::BF16, DType::F16] {
                    let (ok, detail) =
                        check(case, &shapes, dtype, &dev, host).unwrap_or_else(|e| (false, format!("error: {e:#}")));
                    let verdict = if ok { "PASS" } else { "FAIL" };
                    println!("{verdict} {} (CUDA cores) {shapes:?} {dtype:?}: {detail}", case.name);
                    failures += usize::from(!ok);
                }
                speed::use_tensor_cores(true);
            }
        }
    }

    let (ok, detail) = running_estimates(&dev).unwrap_or_else(|e| (false, format!("error: {e:#}")));
    println!("{} batch_norm running estimates after a training step: {detail}", if ok { "PASS" } else { "FAIL" });
    failures += usize::from(!ok);

    #[cfg(feature = "cuda")]
    wick_nn::native::cuda::conv::set_tf32(true);
    #[cfg(feature = "cuda")]
    if !host {
        match wick_nn::native::cuda::conv::cudnn_version() {
            Ok(v) => println!("cuDNN {v} for the convolutions (TF32 on for the timings, off for the checks)"),
            Err(e) => println!("cuDNN: {e}"),
        }
    }
    if !host {
        println!("== the CUDA body beside the composed candle ops it replaces (forward + backward, ms a pass; bytes the graph keeps)");
        for case in &CASES {
            let (rows, d, what) = case.zoo;
            let shapes = (case.shapes)(rows, d);
            for dtype in [DType::F32, DType::BF16] {
                let timed = time(case.op, &shapes, dtype, &dev, 20).and_then(|fused| {
                    let composed = wick_nn::native::with_composed(|| time(case.op, &shapes, dtype, &dev, 20))?;
                    Ok((fused, composed))
                });
                match timed {
                    Ok(((fused_ms, fused_kept), (composed_ms, composed_kept))) => println!(
                        "TIME {} {shapes:?} {dtype:?} ({what}): CUDA body {fused_ms:.3} ms, composed {composed_ms:.3} ms ({:.2}× faster); graph keeps {:.1} MiB vs {:.1} MiB",
                        case.name,
                        composed_ms / fused_ms,
                        fused_kept as f64 / 1048576.0,
                        composed_kept as f64 / 1048576.0,
                    ),
                    Err(e) => println!("TIME {} {shapes:?} {dtype:?}: error: {e:#}", case.name),
                }
            }
            if case.counted == "attention" {
                speed::use_tensor_cores(false);
                let cores = time(case.op, &shapes, DType::BF16, &dev, 20);
                speed::use_tensor_cores(true);
                match (cores, time(case.op, &shapes, DType::BF16, &dev, 20)) {
                    (Ok((cores_ms, _)), Ok((tensor_ms, _))) => println!(
                        "TIME {} {shapes:?} BF16 ({what}): tensor cores {tensor_ms:.3} ms, CUDA cores {cores_ms:.3} ms ({:.2}× faster)",
                        case.name,
                        cores_ms / tensor_ms
                    ),
                    (Err(e), _) | (_, Err(e)) => println!("TIME {} {shapes:?} BF16 tensor vs CUDA cores: error: {e:#}", case.name),
                }
            }
        }
    }
    if failures > 0 {
        bail!("{failures} check(s) failed");
    }
    println!("all {} agree with their host bodies", if host { "composed forms" } else { "CUDA op bodies" });
    Ok(())
}
