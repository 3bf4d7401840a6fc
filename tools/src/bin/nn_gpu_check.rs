//! GPU check of wick-nn's CUDA op bodies (`wick_nn::cuda`, kernels `kernels/src/cuda/nn_*.cu`):
//!
//! 1. every op with a CUDA body against its host body on the same inputs — the forward output and
//!    the gradient of every input — in f32, bf16, f16 and f64, on shapes that cross the kernels'
//!    edges (rows longer than a block, more rows than a chunk of the weight-gradient sums, PyTorch's
//!    kinks of ReLU and ReLU6 at exactly 0 and 6);
//! 2. that the CUDA pass went through the op's own node, forward and backward (the per-op call
//!    counts of `wick_nn::cpu::profile`, which only wick's ops report), not the composed fallback;
//! 3. the op beside the composed form of candle's ops it replaces on a GPU, at the zoo's sizes:
//!    time of forward + backward, and the bytes the output's graph keeps for backward.
//!
//! Prints one line per check and per timing; exits non-zero if a check fails. Run by
//! `scripts/gpu-check.sh` (needs candle's CUDA kernels: `scripts/build-gpu-binaries.sh` with the
//! real nvcc).

use std::time::Instant;

use anyhow::{bail, Context, Result};
use candle_core::{DType, Device, Tensor, Var, D};
use wick_nn::autocast::fp32_compute;
use wick_nn::cpu::profile;
use wick_nn::fused::node;
use wick_nn::ops;
use wick_nn::params::normal_tensor;

type Op = fn(&[Tensor]) -> candle_core::Result<Tensor>;

/// One op: its name in the per-op counts, how to run it, and the composed form it replaces on a GPU.
struct Case {
    name: &'static str,
    op: Op,
    composed: Op,
}

fn relu(t: &[Tensor]) -> candle_core::Result<Tensor> {
    ops::relu(&t[0])
}
fn relu6(t: &[Tensor]) -> candle_core::Result<Tensor> {
    ops::relu6(&t[0])
}
fn gelu(t: &[Tensor]) -> candle_core::Result<Tensor> {
    ops::gelu(&t[0])
}
fn silu_mul(t: &[Tensor]) -> candle_core::Result<Tensor> {
    ops::silu_mul(&t[0], &t[1])
}
fn silu_mul_packed(t: &[Tensor]) -> candle_core::Result<Tensor> {
    ops::silu_mul_packed(&t[0])
}
fn add_relu(t: &[Tensor]) -> candle_core::Result<Tensor> {
    ops::add_relu(&t[0], &t[1])
}
fn layer_norm(t: &[Tensor]) -> candle_core::Result<Tensor> {
    ops::layer_norm(&t[0], &t[1], &t[2], 1e-12)
}
fn rms_norm(t: &[Tensor]) -> candle_core::Result<Tensor> {
    ops::rms_norm(&t[0], &t[1], 1e-6)
}

// What a GPU ran before the CUDA bodies (wick-nn's `ops` without them).
fn relu_composed(t: &[Tensor]) -> candle_core::Result<Tensor> {
    let x = &t[0];
    node("relu", &[x], x.dtype(), x.dtype(), |t| ops::relu_composed(&t[0], None))
}
fn relu6_composed(t: &[Tensor]) -> candle_core::Result<Tensor> {
    let x = &t[0];
    node("relu6", &[x], x.dtype(), x.dtype(), |t| ops::relu_composed(&t[0], Some(6.0)))
}
fn gelu_composed(t: &[Tensor]) -> candle_core::Result<Tensor> {
    t[0].gelu_erf()
}
fn silu_mul_composed(t: &[Tensor]) -> candle_core::Result<Tensor> {
    t[0].silu()? * &t[1]
}
fn silu_mul_packed_composed(t: &[Tensor]) -> candle_core::Result<Tensor> {
    let half = t[0].dim(D::Minus1)? / 2;
    silu_mul_composed(&[t[0].narrow(D::Minus1, 0, half)?, t[0].narrow(D::Minus1, half, half)?])
}
fn add_relu_composed(t: &[Tensor]) -> candle_core::Result<Tensor> {
    relu_composed(&[(&t[0] + &t[1])?])
}
fn layer_norm_composed(t: &[Tensor]) -> candle_core::Result<Tensor> {
    let x = &t[0];
    node("layer_norm", &[x, &t[1], &t[2]], fp32_compute(x.dtype()), x.dtype(), |t| {
        ops::layer_norm_composed(&t[0], &t[1], &t[2], 1e-12)
    })
}
fn rms_norm_composed(t: &[Tensor]) -> candle_core::Result<Tensor> {
    let x = &t[0];
    node("rms_norm", &[x, &t[1]], fp32_compute(x.dtype()), x.dtype(), |t| ops::rms_norm_composed(&t[0], &t[1], 1e-6))
}

const CASES: [Case; 8] = [
    Case { name: "relu", op: relu, composed: relu_composed },
    Case { name: "relu6", op: relu6, composed: relu6_composed },
    Case { name: "gelu", op: gelu, composed: gelu_composed },
    Case { name: "silu_mul", op: silu_mul, composed: silu_mul_composed },
    Case { name: "silu_mul packed", op: silu_mul_packed, composed: silu_mul_packed_composed },
    Case { name: "add_relu", op: add_relu, composed: add_relu_composed },
    Case { name: "layer_norm", op: layer_norm, composed: layer_norm_composed },
    Case { name: "rms_norm", op: rms_norm, composed: rms_norm_composed },
];

/// The name the op reports in the per-op counts (the packed SiLU·mul is `silu_mul`).
fn counted_name(case: &Case) -> &'static str {
    case.name.split(' ').next().unwrap_or(case.name)
}

/// The input shapes of `case` for rows of `d`: the correctness shapes and the zoo's.
fn inputs(case: &Case, rows: usize, d: usize) -> Vec<Vec<usize>> {
    match case.name {
        "silu_mul" | "add_relu" => vec![vec![rows, d], vec![rows, d]],
        "silu_mul packed" => vec![vec![rows, 2 * d]],
        "layer_norm" => vec![vec![rows, d], vec![d], vec![d]],
        "rms_norm" => vec![vec![rows, d], vec![d]],
        _ => vec![vec![rows, d]],
    }
}

/// Random inputs (host, f64) for `case`, with the kinks PyTorch's gradients define placed in them.
fn host_inputs(case: &Case, shapes: &[Vec<usize>], seed: u64) -> Result<Vec<Vec<f64>>> {
    let mut out = Vec::new();
    for (i, s) in shapes.iter().enumerate() {
        let std = if matches!(case.name, "relu6") { 4.0 } else { 1.0 };
        let mut v: Vec<f64> =
            normal_tensor(s, std, seed + i as u64, DType::F64, &Device::Cpu)?.flatten_all()?.to_vec1()?;
        if case.name == "layer_norm" || case.name == "rms_norm" {
            if i == 1 {
                v.iter_mut().for_each(|w| *w += 1.0); // weights around 1, as trained norms have
            }
        } else if v.len() > 2 {
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
    let pass = || -> Result<usize> {
        let y = op(&ts)?;
        let kept = wick_nn::graph::graph_bytes(&y).total;
        let grads = (y * &g)?.sum_all()?.backward()?;
        drop(grads);
        Ok(kept)
    };
    for _ in 0..3 {
        pass()?;
    }
    dev.synchronize()?;
    let start = Instant::now();
    let mut kept = 0;
    for _ in 0..passes {
        kept = pass()?;
    }
    dev.synchronize()?;
    Ok((start.elapsed().as_secs_f64() * 1e3 / passes as f64, kept))
}

fn main() -> Result<()> {
    // The per-op counts are read from wick-nn's profile, which reads this once.
    if std::env::var_os("WICK_PROFILE_OPS").is_none() {
        std::env::set_var("WICK_PROFILE_OPS", "1");
    }
    if !wick_kernels::COMPILED {
        bail!("this build has no CUDA kernels: build with WICK_KERNELS_NVCC=<path to nvcc>");
    }
    let engine = wick::Engine::cuda(0, None).context("opening cuda:0")?;
    let dev = engine.device().clone();
    let mut failures = 0usize;

    println!("== each CUDA body against its host body (forward output, then each input's gradient)");
    for case in &CASES {
        let norm = matches!(case.name, "layer_norm" | "rms_norm");
        // Rows longer than a block (1000 > 256 threads), more rows than a chunk (130 > 64).
        let sizes: &[(usize, usize)] = if norm { &[(130, 37), (3, 1000), (70, 768)] } else { &[(3, 37), (64, 1000)] };
        for &(rows, d) in sizes {
            let shapes = inputs(case, rows, d);
            let host = host_inputs(case, &shapes, 11 + rows as u64)?;
            for dtype in [DType::F32, DType::BF16, DType::F16, DType::F64] {
                let want = run(case.op, &host, &shapes, dtype, 5, &Device::Cpu)?;
                profile::reset();
                let got = run(case.op, &host, &shapes, dtype, 5, &dev)?;
                let counts = profile::totals();
                let calls = |phase: &str| {
                    counts
                        .iter()
                        .filter(|(n, p, _, _)| n == counted_name(case) && *p == phase)
                        .map(|r| r.2)
                        .sum::<u64>()
                };
                let (fwd, bwd) = (calls("forward"), calls("backward"));
                let errs: Vec<f64> = got.iter().zip(&want).map(|(g, w)| max_rel_err(g, w)).collect();
                let worst = errs.iter().copied().fold(0.0, f64::max);
                let ok = worst <= tolerance(dtype) && fwd >= 1 && bwd >= 1;
                println!(
                    "{} {} {rows}×{d} {dtype:?}: max rel err {} (output, then each gradient); op calls on the device: {fwd} forward, {bwd} backward",
                    if ok { "PASS" } else { "FAIL" },
                    case.name,
                    errs.iter().map(|e| format!("{e:.1e}")).collect::<Vec<_>>().join(" / "),
                );
                failures += usize::from(!ok);
            }
        }
    }

    println!("== the CUDA body beside the composed candle ops it replaces (forward + backward, ms a pass; bytes the graph keeps)");
    let zoo: [(&str, usize, usize); 8] = [
        ("relu", 32 * 64 * 56, 56),         // ResNet-18's first stage at batch 32
        ("relu6", 32 * 96 * 56, 56),        // MobileNetV2's expansion at batch 32
        ("gelu", 32 * 128, 3072),           // BERT-base feed-forward at 32 × 128 tokens
        ("silu_mul", 8 * 256, 1408),        // decoder-512's SwiGLU at 8 × 256 tokens
        ("silu_mul packed", 8 * 256, 1408), // the same, gate and up fused
        ("add_relu", 32 * 64 * 56, 56),     // ResNet-18's residual end
        ("layer_norm", 32 * 128, 768),      // BERT-base at 32 × 128 tokens
        ("rms_norm", 8 * 256, 512),         // decoder-512 at 8 × 256 tokens
    ];
    for (name, rows, d) in zoo {
        let case = CASES.iter().find(|c| c.name == name).context("a case without its op")?;
        let shapes = inputs(case, rows, d);
        for dtype in [DType::F32, DType::BF16] {
            let (fused_ms, fused_kept) = time(case.op, &shapes, dtype, &dev, 20)?;
            let (composed_ms, composed_kept) = time(case.composed, &shapes, dtype, &dev, 20)?;
            println!(
                "TIME {name} {rows}×{d} {dtype:?}: CUDA body {fused_ms:.3} ms, composed {composed_ms:.3} ms ({:.2}× faster); graph keeps {:.1} MiB vs {:.1} MiB",
                composed_ms / fused_ms,
                fused_kept as f64 / 1048576.0,
                composed_kept as f64 / 1048576.0,
            );
        }
    }
    if failures > 0 {
        bail!("{failures} check(s) failed");
    }
    println!("all CUDA op bodies agree with their host bodies");
    Ok(())
}
