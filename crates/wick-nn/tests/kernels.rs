//! The CPU kernels (`wick_nn::cpu`) against the composed forms they replace (kept as the
//! oracle: candle's primitive ops under candle's autograd) and against finite differences, in
//! f64; and in bf16 against the f32 computation.

use candle_core::{DType, Device, Result, Tensor, Var, D};
use wick_nn::cnn::Activation;
use wick_nn::cpu;
use wick_nn::ops;
use wick_nn::params::normal_tensor;

fn values(t: &Tensor) -> Vec<f64> {
    t.flatten_all().unwrap().to_dtype(DType::F64).unwrap().to_vec1().unwrap()
}

fn randn(shape: &[usize], seed: u64) -> Tensor {
    normal_tensor(shape, 1.0, seed, DType::F64, &Device::Cpu).unwrap()
}

/// A fixed, non-uniform weighting of every output element.
fn weighted_sum(t: &Tensor) -> Result<Tensor> {
    let w = Tensor::arange(1u32, t.elem_count() as u32 + 1, t.device())?.to_dtype(t.dtype())?.reshape(t.shape())?;
    (t * w.sin()?)?.sum_all()
}

fn max_rel_diff(a: &[f64], b: &[f64]) -> f64 {
    assert_eq!(a.len(), b.len());
    let scale = b.iter().fold(1e-30f64, |m, v| m.max(v.abs()));
    a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f64::max) / scale
}

/// Runs `kernel` and `oracle` on the same f64 inputs (fresh `Var`s built from `inputs`): equal
/// values, equal gradients of a weighted sum for every input, and the kernel's gradients agree
/// with central finite differences.
fn check(
    name: &str,
    inputs: &[Tensor],
    kernel: impl Fn(&[Tensor]) -> Result<Tensor>,
    oracle: impl Fn(&[Tensor]) -> Result<Tensor>,
) {
    let vars: Vec<Var> = inputs.iter().map(|t| Var::from_tensor(t).unwrap()).collect();
    let ts: Vec<Tensor> = vars.iter().map(|v| v.as_tensor().clone()).collect();
    let (k, o) = (kernel(&ts).unwrap(), oracle(&ts).unwrap());
    assert_eq!(k.dims(), o.dims(), "{name}: shapes");
    let diff = max_rel_diff(&values(&k), &values(&o));
    assert!(diff < 1e-12, "{name}: values differ by {diff:e}");
    let gk = weighted_sum(&k).unwrap().backward().unwrap();
    let go = weighted_sum(&o).unwrap().backward().unwrap();
    for (i, v) in vars.iter().enumerate() {
        let (a, b) = (gk.get(v).map(values), go.get(v).map(values));
        let (Some(a), Some(b)) = (a, b) else { panic!("{name}: input {i} has a gradient in one form only") };
        let diff = max_rel_diff(&a, &b);
        assert!(diff < 1e-10, "{name}: gradient of input {i} differs by {diff:e}");
        assert!(a.iter().any(|g| g.abs() > 1e-8), "{name}: gradient of input {i} is zero");
    }
    check_finite_differences(name, inputs, kernel);
}

/// The kernel's gradients of a weighted sum agree with central finite differences on a spread
/// of coordinates of each input.
fn check_finite_differences(name: &str, inputs: &[Tensor], kernel: impl Fn(&[Tensor]) -> Result<Tensor>) {
    let probes = 6;
    let vars: Vec<Var> = inputs.iter().map(|t| Var::from_tensor(t).unwrap()).collect();
    let ts: Vec<Tensor> = vars.iter().map(|v| v.as_tensor().clone()).collect();
    let grads = weighted_sum(&kernel(&ts).unwrap()).unwrap().backward().unwrap();
    for (i, v) in vars.iter().enumerate() {
        let a = values(grads.get(v).unwrap_or_else(|| panic!("{name}: no gradient for input {i}")));
        let base = values(&inputs[i]);
        let h = 1e-6;
        for p in 0..probes.min(base.len()) {
            let at = p * base.len() / probes.min(base.len());
            let eval = |delta: f64| {
                let mut moved: Vec<Tensor> = inputs.to_vec();
                let mut vals = base.clone();
                vals[at] += delta;
                moved[i] = Tensor::from_vec(vals, inputs[i].shape(), &Device::Cpu).unwrap();
                weighted_sum(&kernel(&moved).unwrap()).unwrap().to_scalar::<f64>().unwrap()
            };
            let numeric = (eval(h) - eval(-h)) / (2.0 * h);
            assert!(
                (numeric - a[at]).abs() < 1e-5 * (1.0 + numeric.abs()),
                "{name}: d/d input {i}[{at}]: finite difference {numeric}, kernel {}",
                a[at]
            );
        }
    }
}

#[test]
fn linear_matches_matmul_plus_bias() {
    let (x, w, b) = (randn(&[2, 5, 7], 1), randn(&[4, 7], 2), randn(&[4], 3));
    let oracle = |t: &[Tensor]| t[0].broadcast_matmul(&t[1].t()?)?.broadcast_add(&t[2]);
    check("linear", &[x.clone(), w.clone(), b], |t| cpu::linear::linear(&t[0], &t[1], Some(&t[2])), oracle);
    let oracle = |t: &[Tensor]| t[0].broadcast_matmul(&t[1].t()?);
    check("linear without bias", &[x, w], |t| cpu::linear::linear(&t[0], &t[1], None), oracle);
}

#[test]
fn norms_match_their_composed_forms() {
    let (x, w, b) = (randn(&[3, 4, 10], 4), randn(&[10], 5), randn(&[10], 6));
    check(
        "layer_norm",
        &[x.clone(), w.clone(), b],
        |t| cpu::norm::layer_norm(&t[0], &t[1], &t[2], 1e-5),
        |t| ops::layer_norm_composed(&t[0], &t[1], &t[2], 1e-5),
    );
    check(
        "rms_norm",
        &[x, w],
        |t| cpu::norm::rms_norm(&t[0], &t[1], 1e-6),
        |t| ops::rms_norm_composed(&t[0], &t[1], 1e-6),
    );
}

/// Train-mode batch norm written out with candle's ops (per-channel batch statistics).
fn batch_norm_composed(x: &Tensor, w: &Tensor, b: &Tensor, eps: f64) -> Result<Tensor> {
    let shape = (1, x.dim(1)?, 1, 1);
    let mean = x.mean_keepdim(0)?.mean_keepdim(2)?.mean_keepdim(3)?;
    let centered = x.broadcast_sub(&mean)?;
    let var = centered.sqr()?.mean_keepdim(0)?.mean_keepdim(2)?.mean_keepdim(3)?;
    let normed = centered.broadcast_div(&(var + eps)?.sqrt()?)?;
    normed.broadcast_mul(&w.reshape(shape)?)?.broadcast_add(&b.reshape(shape)?)
}

#[test]
fn batch_norm_matches_its_composed_form_in_training_and_eval() {
    let (x, w, b) = (randn(&[3, 4, 5, 6], 7).affine(2.0, 1.0).unwrap(), randn(&[4], 8), randn(&[4], 9));
    let acts = [
        (Activation::Identity, "batch_norm"),
        (Activation::Relu, "batch_norm+relu"),
        (Activation::Relu6, "batch_norm+relu6"),
    ];
    for (act, name) in acts {
        let train = |t: &[Tensor]| {
            let (mean, var) = cpu::norm::batch_stats(&t[0].detach())?;
            cpu::norm::batch_norm(&t[0], &mean, &var, &t[1], &t[2], 1e-5, true, act)
        };
        let oracle = |t: &[Tensor]| {
            let y = batch_norm_composed(&t[0], &t[1], &t[2], 1e-5)?;
            match act {
                Activation::Identity => Ok(y),
                Activation::Relu => ops::relu_composed(&y, None),
                Activation::Relu6 => ops::relu_composed(&y, Some(6.0)),
            }
        };
        // Scales spread so that the outputs straddle 0 and 6.
        let wide = (&w * 4.0).unwrap();
        check(&format!("{name} (train)"), &[x.clone(), wide, b.clone()], train, oracle);
    }
    // Eval: fixed statistics.
    let (mean, var) = (vec![0.5, -1.0, 0.0, 2.0], vec![1.5, 0.25, 1.0, 4.0]);
    let (m, v) =
        (Tensor::new(mean.as_slice(), &Device::Cpu).unwrap(), Tensor::new(var.as_slice(), &Device::Cpu).unwrap());
    let eval =
        |t: &[Tensor]| cpu::norm::batch_norm(&t[0], &mean, &var, &t[1], &t[2], 1e-5, false, Activation::Identity);
    let oracle = |t: &[Tensor]| {
        let shape = (1, 4, 1, 1);
        let normed = t[0].broadcast_sub(&m.reshape(shape)?)?.broadcast_div(&(v.reshape(shape)? + 1e-5)?.sqrt()?)?;
        normed.broadcast_mul(&t[1].reshape(shape)?)?.broadcast_add(&t[2].reshape(shape)?)
    };
    check("batch_norm (eval)", &[x, w, b], eval, oracle);
}

#[test]
fn convolutions_match_candles() {
    // candle's conv2d backward fails when the windows leave input rows or columns unused (its
    // transposed convolution returns fewer), so the oracle runs on sizes the windows tile; the
    // kernel alone is checked on the others below.
    for (k, stride, pad) in [(3, 1, 1), (3, 2, 1), (1, 1, 0), (1, 2, 0), (7, 2, 3), (4, 4, 0)] {
        let (h, w) = match (k, stride) {
            (4, _) => (8, 8),
            (_, 1) => (9, 8),
            _ => (9, 9),
        };
        let (x, w) = (randn(&[3, 2, h, w], 10), randn(&[5, 2, k, k], 11));
        let name = format!("conv2d k{k} s{stride} p{pad}");
        check(
            &name,
            &[x, w],
            |t| cpu::conv::conv2d(&t[0], &t[1], pad, stride),
            |t| t[0].conv2d(&t[1], pad, stride, 1, 1),
        );
    }
    for (k, stride, pad) in [(3, 2, 1), (4, 4, 0), (2, 3, 1)] {
        let (x, w) = (randn(&[2, 2, 10, 9], 30), randn(&[3, 2, k, k], 31));
        check_finite_differences(&format!("conv2d k{k} s{stride} p{pad} on 10 × 9"), &[x, w], |t| {
            cpu::conv::conv2d(&t[0], &t[1], pad, stride)
        });
    }
    for (stride, pad) in [(1, 1), (2, 1), (2, 0)] {
        let (x, w) = (randn(&[2, 3, 7, 9], 12), randn(&[3, 1, 3, 3], 13));
        check(
            &format!("depthwise s{stride} p{pad}"),
            &[x, w],
            |t| cpu::depthwise::depthwise_conv2d(&t[0], &t[1], pad, stride),
            |t| wick_nn::cnn::depthwise_conv2d_composed(&t[0], &t[1], pad, stride),
        );
    }
}

/// Max pooling composed from candle ops: the padded input's kernel² strided windows, stacked, and
/// their maximum (candle's `max` backward sends the gradient to every tied maximum).
fn max_pool2d_composed(x: &Tensor, kernel: usize, stride: usize, pad: usize) -> candle_core::Result<Tensor> {
    let (_, _, h, w) = x.dims4()?;
    let out = |len: usize| (len + 2 * pad - kernel) / stride + 1;
    let (oh, ow) = (out(h), out(w));
    let xp = wick_nn::cnn::pad_spatial(x, pad, -1e4)?;
    let mut windows = Vec::new();
    for dy in 0..kernel {
        for dx in 0..kernel {
            let rows: Vec<u32> = (0..oh).map(|i| (dy + i * stride) as u32).collect();
            let cols: Vec<u32> = (0..ow).map(|j| (dx + j * stride) as u32).collect();
            let rows = Tensor::new(rows, x.device())?;
            let cols = Tensor::new(cols, x.device())?;
            windows.push(xp.index_select(&rows, 2)?.index_select(&cols, 3)?);
        }
    }
    Tensor::stack(&windows, 0)?.max(0)
}

#[test]
fn pooling_matches_its_composed_forms() {
    // Continuous random values: no ties, so candle's max backward routes as the kernel does.
    let x = randn(&[2, 3, 9, 9], 14);
    check(
        "max_pool2d",
        std::slice::from_ref(&x),
        |t| cpu::pool::max_pool2d(&t[0], 3, 2, 1),
        |t| max_pool2d_composed(&t[0], 3, 2, 1),
    );
    check("global_avg_pool", &[x], |t| cpu::pool::global_avg_pool(&t[0]), |t| t[0].mean(D::Minus1)?.mean(D::Minus1));
}

/// Max pooling over planes with ties and NaN against a per-window reference written from
/// PyTorch's rule (`val > max || isnan(val)` in row-major order: the first maximum wins, a later
/// NaN replaces an earlier one): the values, and the gradient routed to that one input.
#[test]
fn max_pooling_routes_ties_and_nan_as_pytorch() {
    let (n, c, h, w) = (2, 3, 11, 12);
    // Five levels (many ties); two planes get NaNs, one of them two in one window.
    let mut data: Vec<f32> = (0..n * c * h * w).map(|i| ((i * 7919) % 5) as f32).collect();
    for i in [h * w + 5, h * w + 6, 4 * h * w + 3 * w + 7] {
        data[i] = f32::NAN;
    }
    data[h * w + w + 5] = f32::NAN;
    for (kernel, stride, pad) in [(3, 2, 1), (2, 2, 0), (3, 1, 1), (3, 3, 0)] {
        let x = Var::from_vec(data.clone(), (n, c, h, w), &Device::Cpu).unwrap();
        let y = cpu::pool::max_pool2d(x.as_tensor(), kernel, stride, pad).unwrap();
        let (oh, ow) = ((h + 2 * pad - kernel) / stride + 1, (w + 2 * pad - kernel) / stride + 1);
        let g: Vec<f32> = (0..n * c * oh * ow).map(|i| 1.0 + i as f32).collect();
        let grads = (&y * Tensor::from_vec(g.clone(), (n, c, oh, ow), &Device::Cpu).unwrap())
            .unwrap()
            .sum_all()
            .unwrap()
            .backward()
            .unwrap();
        let dx: Vec<f32> = grads.get(x.as_tensor()).unwrap().flatten_all().unwrap().to_vec1().unwrap();
        let got: Vec<f32> = y.flatten_all().unwrap().to_vec1().unwrap();
        let mut want_dx = vec![0f32; data.len()];
        for p in 0..n * c {
            for oy in 0..oh {
                for ox in 0..ow {
                    let mut at = None::<usize>;
                    for iy in (oy * stride).saturating_sub(pad)..(oy * stride + kernel).saturating_sub(pad).min(h) {
                        for ix in (ox * stride).saturating_sub(pad)..(ox * stride + kernel).saturating_sub(pad).min(w) {
                            let i = p * h * w + iy * w + ix;
                            if at.is_none_or(|a| data[i] > data[a] || data[i].is_nan()) {
                                at = Some(i);
                            }
                        }
                    }
                    let (at, o) = (at.unwrap(), (p * oh + oy) * ow + ox);
                    let want = data[at];
                    assert!(
                        got[o] == want || (got[o].is_nan() && want.is_nan()),
                        "k{kernel} s{stride} p{pad}: output {o} {} vs {want}",
                        got[o]
                    );
                    want_dx[at] += g[o];
                }
            }
        }
        assert_eq!(dx, want_dx, "k{kernel} s{stride} p{pad}: gradient routing");
    }
}

#[test]
fn attention_and_rope_match_their_composed_forms() {
    let (q, k, v) = (randn(&[2, 3, 5, 4], 15), randn(&[2, 3, 6, 4], 16), randn(&[2, 3, 6, 4], 17));
    // A BERT-style padding bias (batch, 1, 1, keys).
    let pad: Vec<f64> = (0..12).map(|i| if i % 6 == 5 && i > 6 { -1e4 } else { 0.0 }).collect();
    let bias = Tensor::from_vec(pad, (2, 1, 1, 6), &Device::Cpu).unwrap();
    check(
        "attention (padding bias)",
        &[q, k.clone(), v.clone()],
        |t| cpu::attention::attention(&t[0], &t[1], &t[2], Some(&bias)),
        |t| ops::attention_composed(&t[0], &t[1], &t[2], Some(&bias)),
    );
    let q = randn(&[2, 3, 6, 4], 18);
    let causal = ops::causal_bias(6, DType::F64, &Device::Cpu).unwrap();
    check(
        "attention (causal)",
        &[q.clone(), k, v],
        |t| cpu::attention::attention(&t[0], &t[1], &t[2], Some(&causal)),
        |t| ops::attention_composed(&t[0], &t[1], &t[2], Some(&causal)),
    );
    let (cos, sin) = ops::rope_tables(6, 4, 10_000.0, DType::F64, &Device::Cpu).unwrap();
    // q, k and v packed side by side (2 heads of width 3), as a fused projection writes them,
    // against splitting them into heads for the composed form and merging its heads back.
    let qkv = randn(&[2, 5, 18], 40);
    let split = |t: &Tensor, i: usize| t.narrow(2, i * 6, 6)?.reshape((2, 5, 2, 3))?.transpose(1, 2)?.contiguous();
    let merged = |o: Tensor| o.transpose(1, 2)?.reshape((2, 5, 6));
    let padding =
        Tensor::new(&[[0.0f64, 0.0, -1e4, 0.0, -1e4], [0.0; 5]], &Device::Cpu).unwrap().reshape((2, 1, 1, 5)).unwrap();
    for (name, bias) in [("attention (packed)", None), ("attention (packed, padding bias)", Some(&padding))] {
        check(
            name,
            std::slice::from_ref(&qkv),
            |t| cpu::attention::attention_packed(&t[0], 2, bias),
            |t| merged(ops::attention_composed(&split(&t[0], 0)?, &split(&t[0], 1)?, &split(&t[0], 2)?, bias)?),
        );
    }
    assert!(cpu::attention::attention_packed(&qkv, 4, None).is_err(), "18 is not 3 × 4 heads × a width");
    assert!(cpu::attention::attention_packed(&qkv, 0, None).is_err(), "no heads");
    check("rope", &[q], |t| cpu::attention::rope(&t[0], &cos, &sin), |t| ops::rope_composed(&t[0], &cos, &sin));
    // q and k rotated inside a packed (2, 6, 3·2·4) projection, v passed through, against
    // splitting the heads out, rotating q and k alone and packing them back.
    let qkv = randn(&[2, 6, 24], 41);
    let part = |t: &Tensor, i: usize| t.narrow(2, i * 8, 8)?.reshape((2, 6, 2, 4))?.transpose(1, 2)?.contiguous();
    let back = |t: Tensor| t.transpose(1, 2)?.reshape((2, 6, 8));
    check(
        "rope (packed)",
        &[qkv],
        |t| cpu::attention::rope_packed(&t[0], 2, &cos, &sin),
        |t| {
            let q = back(ops::rope_composed(&part(&t[0], 0)?, &cos, &sin)?)?;
            let k = back(ops::rope_composed(&part(&t[0], 1)?, &cos, &sin)?)?;
            Tensor::cat(&[q, k, t[0].narrow(2, 16, 8)?], 2)
        },
    );
    let wrong = randn(&[2, 6, 20], 42);
    assert!(cpu::attention::rope_packed(&wrong, 2, &cos, &sin).is_err(), "20 is not 3 × 2 heads × a width");
    assert!(
        cpu::attention::rope_packed(&randn(&[2, 5, 24], 43), 2, &cos, &sin).is_err(),
        "5 positions, 6 in the tables"
    );
}

#[test]
fn activations_match_candles() {
    let (a, b) = (randn(&[4, 9], 19), randn(&[4, 9], 20));
    // Composed from erf: candle's own `gelu_erf` backward uses 0.398942 for 1/√(2π) (a 7e-7
    // relative error); PyTorch's and the kernel's use the exact constant.
    let gelu_composed = |t: &[Tensor]| (&t[0] * 0.5)? * ((&t[0] / 2f64.sqrt())?.erf()? + 1.0)?;
    check("gelu", std::slice::from_ref(&a), |t| cpu::act::gelu(&t[0]), gelu_composed);
    check("silu_mul", &[a, b], |t| cpu::act::silu_mul(&t[0], &t[1]), |t| t[0].silu()? * &t[1]);
    // The halves of a packed (…, 2·I) projection, against narrowing them apart.
    let u = randn(&[2, 3, 10], 44);
    check(
        "silu_mul (packed)",
        &[u],
        |t| cpu::act::silu_mul_packed(&t[0]),
        |t| t[0].narrow(2, 0, 5)?.silu()? * t[0].narrow(2, 5, 5)?,
    );
    assert!(cpu::act::silu_mul_packed(&randn(&[2, 7], 45)).is_err(), "an odd last dimension does not halve");
    let (a, b) = (randn(&[4, 9], 32), randn(&[4, 9], 33));
    check("add", &[a.clone(), b.clone()], |t| cpu::act::add(&t[0], &t[1]), |t| &t[0] + &t[1]);
    assert!(cpu::act::add(&a, &b.narrow(1, 0, 8).unwrap()).is_err(), "shapes differ");
    check("add_relu", &[a, b], |t| cpu::act::add_relu(&t[0], &t[1]), |t| ops::relu_composed(&(&t[0] + &t[1])?, None));
}

#[test]
fn losses_and_lookups_match_their_composed_forms() {
    let logits = randn(&[6, 5], 21);
    let targets = Tensor::new(&[1u32, 0, 4, 2, 2, 3], &Device::Cpu).unwrap();
    check(
        "cross_entropy",
        &[logits],
        |t| cpu::loss::cross_entropy(&t[0], &targets),
        |t| ops::cross_entropy_composed(&t[0], &targets),
    );
    let table = randn(&[5, 3], 22);
    let ids = Tensor::new(&[4u32, 0, 4, 1, 3], &Device::Cpu).unwrap();
    check("embedding", &[table], |t| cpu::loss::embedding(&t[0], &ids, None), |t| t[0].embedding(&ids));
    let (x, a, b) = (randn(&[2, 3, 4], 23), randn(&[3, 4], 24), randn(&[1, 4], 25));
    check(
        "add_broadcast",
        &[x, a, b],
        |t| cpu::loss::add_broadcast(&t[0], &t[1], &t[2]),
        |t| t[0].broadcast_add(&t[1])?.broadcast_add(&t[2]),
    );
}

/// In bf16 each kernel computes in f32 and rounds its result once: within bf16's half spacing
/// (plus the rounding of its bf16 inputs) of the f32 computation on the same (rounded) inputs.
#[test]
fn bf16_inputs_compute_in_f32_and_round_once() {
    let bf = |t: &Tensor| t.to_dtype(DType::BF16).unwrap();
    let f32_of = |t: &Tensor| t.to_dtype(DType::F32).unwrap();
    let (x, w, b) = (bf(&randn(&[4, 8, 16], 26)), bf(&randn(&[12, 16], 27)), bf(&randn(&[12], 28)));
    let pairs = [
        (
            cpu::linear::linear(&x, &w, Some(&b)).unwrap(),
            cpu::linear::linear(&f32_of(&x), &f32_of(&w), Some(&f32_of(&b))).unwrap(),
        ),
        (cpu::act::gelu(&x).unwrap(), cpu::act::gelu(&f32_of(&x)).unwrap()),
        (
            cpu::norm::rms_norm(&x, &f32_of(&randn(&[16], 29)), 1e-6).unwrap(),
            cpu::norm::rms_norm(&f32_of(&x), &f32_of(&randn(&[16], 29)), 1e-6).unwrap(),
        ),
    ];
    for (low, reference) in pairs {
        assert_eq!(low.dtype(), DType::BF16);
        let (l, r) = (values(&low), values(&reference));
        for (a, b) in l.iter().zip(&r) {
            // Round-to-nearest: at most half a bf16 spacing (2⁻⁸ relative).
            assert!((a - b).abs() <= b.abs() * 2f64.powi(-8) + 1e-30, "{a} vs f32 {b}");
        }
    }
}

/// The kernels' own bf16 conversions: widening is exact, narrowing rounds to nearest even
/// (ties to even, carries into the exponent, overflow to infinity, NaN kept) exactly as the
/// `half` crate does. `x + a + b` of bf16 inputs is computed in f32 and narrowed once.
#[test]
fn bf16_conversions_round_to_nearest_even() {
    let dev = Device::Cpu;
    let bf = |v: f32| half::bf16::from_f32(v);
    let mut pairs: Vec<(f32, f32)> = vec![
        (1.0, 2f32.powi(-8)),       // a tie: to even (1.0)
        (1.0, 3.0 * 2f32.powi(-8)), // a tie: to even (1 + 2⁻⁶)
        (1.0, -2f32.powi(-9)),
        (3.3e38, 3.3e38), // overflows f32: infinity
        (f32::INFINITY, -1.0),
        (f32::NAN, 1.0),
        (-0.0, 0.0),
        (1e-40, 1e-40),
    ];
    pairs.extend((0..4000).map(|i| (((i as f32) * 0.7183).sin() * 10f32.powi(i % 20 - 10), (i as f32 * 0.37).cos())));
    let x: Vec<half::bf16> = pairs.iter().map(|p| bf(p.0)).collect();
    let a: Vec<half::bf16> = pairs.iter().map(|p| bf(p.1)).collect();
    let n = pairs.len();
    let xt = Tensor::from_vec(x.clone(), (1, n), &dev).unwrap();
    let at = Tensor::from_vec(a.clone(), (1, n), &dev).unwrap();
    let zero = Tensor::zeros((1, 1), DType::BF16, &dev).unwrap();
    let y: Vec<half::bf16> =
        cpu::loss::add_broadcast(&xt, &at, &zero).unwrap().flatten_all().unwrap().to_vec1().unwrap();
    for i in 0..n {
        let exact = x[i].to_f32() + a[i].to_f32() + 0.0;
        let expected = bf(exact);
        if exact.is_nan() {
            assert!(y[i].is_nan(), "NaN stays NaN");
        } else {
            assert_eq!(y[i].to_bits(), expected.to_bits(), "bf16 of {exact:e}");
        }
    }
}

/// The element-wise ops and the norms read and write bf16 directly (no widened copies): their
/// outputs and input gradients are, bit for bit, the f32 computation on the same values rounded
/// once to bf16 (widening bf16 is exact, so the f32 path sees the same inputs), and the norms'
/// f32 parameter gradients are the f32 path's own. Backward runs through a weighted sum whose
/// weights are bf16 values, so both paths receive the same output gradient.
#[test]
fn bf16_element_kernels_equal_the_f32_computation_rounded_once() {
    let bits = |t: &Tensor| -> Vec<u16> {
        t.flatten_all()
            .unwrap()
            .to_dtype(DType::BF16)
            .unwrap()
            .to_vec1::<half::bf16>()
            .unwrap()
            .iter()
            .map(|v| v.to_bits())
            .collect()
    };
    let to = |t: &Tensor, d: DType| t.to_dtype(d).unwrap();
    type Op = Box<dyn Fn(&[Tensor]) -> Result<Tensor>>;
    let bn = |act: Activation| -> Op {
        Box::new(move |t: &[Tensor]| {
            let (mean, var) = cpu::norm::batch_stats(&t[0].detach())?;
            cpu::norm::batch_norm(&t[0], &mean, &var, &t[1], &t[2], 1e-5, true, act)
        })
    };
    // (name, op, input shapes, how many inputs are activations: the rest are f32 parameters)
    let cases: Vec<(&str, Op, Vec<Vec<usize>>, usize)> = vec![
        ("relu", Box::new(|t: &[Tensor]| cpu::act::relu(&t[0])), vec![vec![70_001]], 1),
        ("relu6", Box::new(|t: &[Tensor]| cpu::act::relu6(&(&t[0] * 4.0)?)), vec![vec![3, 5, 7]], 1),
        ("gelu", Box::new(|t: &[Tensor]| cpu::act::gelu(&t[0])), vec![vec![66_000]], 1),
        ("silu_mul", Box::new(|t: &[Tensor]| cpu::act::silu_mul(&t[0], &t[1])), vec![vec![40_000]; 2], 2),
        ("silu_mul (packed)", Box::new(|t: &[Tensor]| cpu::act::silu_mul_packed(&t[0])), vec![vec![30, 1_000]], 1),
        ("add_relu", Box::new(|t: &[Tensor]| cpu::act::add_relu(&t[0], &t[1])), vec![vec![2, 3, 50, 400]; 2], 2),
        ("add", Box::new(|t: &[Tensor]| cpu::act::add(&t[0], &t[1])), vec![vec![3, 70_000]; 2], 2),
        // Rows copied as stored; each used row's gradient summed in f32 (id 3 three times) and
        // rounded once, the padding row (1) getting none.
        (
            "embedding",
            Box::new(|t: &[Tensor]| {
                let ids = Tensor::new(&[3u32, 1, 3, 0, 6, 3, 1], &Device::Cpu)?;
                cpu::loss::embedding(&t[0], &ids, Some(1))
            }),
            vec![vec![7, 5]],
            1,
        ),
        // Depthwise convolutions widen images and output gradients as they read them.
        (
            "depthwise 3×3",
            Box::new(|t: &[Tensor]| cpu::depthwise::depthwise_conv2d(&t[0], &t[1], 1, 1)),
            vec![vec![2, 5, 9, 9], vec![5, 1, 3, 3]],
            1,
        ),
        (
            "depthwise 3×3 /2",
            Box::new(|t: &[Tensor]| cpu::depthwise::depthwise_conv2d(&t[0], &t[1], 1, 2)),
            vec![vec![2, 5, 10, 10], vec![5, 1, 3, 3]],
            1,
        ),
        (
            "depthwise 3×3 /3",
            Box::new(|t: &[Tensor]| cpu::depthwise::depthwise_conv2d(&t[0], &t[1], 1, 3)),
            vec![vec![2, 4, 10, 10], vec![4, 1, 3, 3]],
            1,
        ),
        // Rotations of the packed q and k (v copied as stored).
        (
            "rope (packed)",
            Box::new(|t: &[Tensor]| {
                let (cos, sin) = ops::rope_tables(5, 4, 10_000.0, DType::F32, &Device::Cpu)?;
                cpu::attention::rope_packed(&t[0], 2, &cos, &sin)
            }),
            vec![vec![3, 5, 24]],
            1,
        ),
        // Convolutions gather bf16 images straight into their f32 columns (a 1×1 stride-1 one
        // widens the image first); the same f32 products, rounded once.
        (
            "conv 3×3",
            Box::new(|t: &[Tensor]| cpu::conv::conv2d(&t[0], &t[1], 1, 1)),
            vec![vec![2, 3, 9, 9], vec![4, 3, 3, 3]],
            1,
        ),
        (
            "conv 3×3 /2",
            Box::new(|t: &[Tensor]| cpu::conv::conv2d(&t[0], &t[1], 1, 2)),
            vec![vec![2, 3, 10, 10], vec![5, 3, 3, 3]],
            1,
        ),
        (
            "conv 1×1",
            Box::new(|t: &[Tensor]| cpu::conv::conv2d(&t[0], &t[1], 0, 1)),
            vec![vec![2, 6, 5, 5], vec![4, 6, 1, 1]],
            1,
        ),
        (
            "conv 1×1 /2",
            Box::new(|t: &[Tensor]| cpu::conv::conv2d(&t[0], &t[1], 0, 2)),
            vec![vec![3, 6, 6, 6], vec![4, 6, 1, 1]],
            1,
        ),
        (
            "layer_norm",
            Box::new(|t: &[Tensor]| cpu::norm::layer_norm(&t[0], &t[1], &t[2], 1e-5)),
            vec![vec![6, 7, 48], vec![48], vec![48]],
            1,
        ),
        ("rms_norm", Box::new(|t: &[Tensor]| cpu::norm::rms_norm(&t[0], &t[1], 1e-6)), vec![vec![5, 40], vec![40]], 1),
        ("batch_norm", bn(Activation::Identity), vec![vec![3, 4, 9, 11], vec![4], vec![4]], 1),
        ("batch_norm+relu", bn(Activation::Relu), vec![vec![3, 4, 9, 11], vec![4], vec![4]], 1),
        ("batch_norm+relu6", bn(Activation::Relu6), vec![vec![2, 3, 40, 41], vec![3], vec![3]], 1),
    ];
    for (case, (name, op, shapes, activations)) in cases.into_iter().enumerate() {
        // The same values in both dtypes: bf16-representable ones.
        let inputs: Vec<Tensor> = shapes
            .iter()
            .enumerate()
            .map(|(i, s)| {
                let v = randn(s, 100 + 10 * case as u64 + i as u64);
                to(&to(&(v * if i == 0 { 2.0 } else { 1.0 }).unwrap(), DType::BF16), DType::F32)
            })
            .collect();
        let run = |dtype: DType| {
            let vars: Vec<Var> = inputs
                .iter()
                .enumerate()
                .map(|(i, t)| Var::from_tensor(&to(t, if i < activations { dtype } else { DType::F32 })).unwrap())
                .collect();
            let ts: Vec<Tensor> = vars.iter().map(|v| v.as_tensor().clone()).collect();
            let y = op(&ts).unwrap();
            assert_eq!(y.dtype(), dtype, "{name}: output dtype");
            let n = y.elem_count() as u32;
            let weights = to(
                &to(
                    &Tensor::arange(1u32, n + 1, &Device::Cpu).unwrap().to_dtype(DType::F32).unwrap().sin().unwrap(),
                    DType::BF16,
                ),
                dtype,
            );
            let grads = (&y * weights.reshape(y.shape()).unwrap()).unwrap().sum_all().unwrap().backward().unwrap();
            let g: Vec<Tensor> =
                vars.iter().map(|v| grads.get(v).unwrap_or_else(|| panic!("{name}: no gradient")).clone()).collect();
            (y, g)
        };
        let ((y_low, g_low), (y_ref, g_ref)) = (run(DType::BF16), run(DType::F32));
        assert_eq!(bits(&y_low), bits(&y_ref), "{name}: forward");
        for (i, (a, b)) in g_low.iter().zip(&g_ref).enumerate() {
            if i < activations {
                assert_eq!(a.dtype(), DType::BF16, "{name}: gradient {i} dtype");
                assert_eq!(bits(a), bits(b), "{name}: gradient of input {i}");
            } else {
                assert_eq!(values(a), values(b), "{name}: gradient of parameter {i}");
            }
        }
        assert!(values(&g_low[0]).iter().any(|v| *v != 0.0), "{name}: zero gradient");
    }
}

/// With every operand in bf16 (AMP's case), linear layers and convolutions multiply bf16 values
/// with f32 sums (AVX512-BF16 where the CPU has it, widened f32 products elsewhere): outputs and
/// every gradient within one bf16 spacing of the f32 products on the same values (each side
/// rounds its own f32 sum once; the sums differ only in their f32 rounding), over the geometries
/// whose code paths differ: 1×1 stride 1 (the image is the column matrix), 3×3 stride 1 (input
/// gradient as a convolution), 3×3 stride 2 and 7×7 stride 2 (col2im), and images grouped per
/// gemm (few output positions).
#[test]
fn bf16_products_are_within_a_bf16_spacing_of_f32_products() {
    type Op = Box<dyn Fn(&[Tensor]) -> Result<Tensor>>;
    let cases: Vec<(&str, Op, Vec<Vec<usize>>)> = vec![
        (
            "linear",
            Box::new(|t: &[Tensor]| cpu::linear::linear(&t[0], &t[1], Some(&t[2]))),
            vec![vec![3, 37, 70], vec![45, 70], vec![45]],
        ),
        (
            "conv 1×1",
            Box::new(|t: &[Tensor]| cpu::conv::conv2d(&t[0], &t[1], 0, 1)),
            vec![vec![2, 24, 9, 9], vec![40, 24, 1, 1]],
        ),
        (
            "conv 3×3",
            Box::new(|t: &[Tensor]| cpu::conv::conv2d(&t[0], &t[1], 1, 1)),
            vec![vec![2, 13, 12, 12], vec![16, 13, 3, 3]],
        ),
        (
            "conv 3×3 /2",
            Box::new(|t: &[Tensor]| cpu::conv::conv2d(&t[0], &t[1], 1, 2)),
            vec![vec![3, 8, 11, 11], vec![20, 8, 3, 3]],
        ),
        (
            "conv 7×7 /2",
            Box::new(|t: &[Tensor]| cpu::conv::conv2d(&t[0], &t[1], 3, 2)),
            vec![vec![2, 3, 20, 20], vec![8, 3, 7, 7]],
        ),
        (
            "conv grouped",
            Box::new(|t: &[Tensor]| cpu::conv::conv2d(&t[0], &t[1], 1, 1)),
            vec![vec![9, 32, 4, 4], vec![24, 32, 3, 3]],
        ),
        // Deeper than one slice of the product (576 > 512): f32 sums, rounded afterwards.
        (
            "conv deep",
            Box::new(|t: &[Tensor]| cpu::conv::conv2d(&t[0], &t[1], 1, 1)),
            vec![vec![2, 64, 5, 5], vec![8, 64, 3, 3]],
        ),
        // An input gradient summed over 64·9 = 576 > 512 output channels and taps.
        (
            "conv deep input gradient",
            Box::new(|t: &[Tensor]| cpu::conv::conv2d(&t[0], &t[1], 1, 1)),
            vec![vec![2, 8, 5, 5], vec![64, 8, 3, 3]],
        ),
        // Without a bias the sums are rounded as stored; deeper than a slice, afterwards.
        (
            "linear (no bias)",
            Box::new(|t: &[Tensor]| cpu::linear::linear(&t[0], &t[1], None)),
            vec![vec![2, 19, 70], vec![33, 70]],
        ),
        (
            "linear (deep)",
            Box::new(|t: &[Tensor]| cpu::linear::linear(&t[0], &t[1], None)),
            vec![vec![5, 600], vec![20, 600]],
        ),
        // A weight gradient summed over 600 rows (deeper than a slice).
        (
            "linear (many rows)",
            Box::new(|t: &[Tensor]| cpu::linear::linear(&t[0], &t[1], None)),
            vec![vec![2, 300, 16], vec![8, 16]],
        ),
    ];
    for (name, op, shapes) in cases {
        // The same bf16 values as bf16 and as f32 tensors.
        let inputs: Vec<Tensor> =
            shapes.iter().enumerate().map(|(i, s)| randn(s, 40 + i as u64).to_dtype(DType::BF16).unwrap()).collect();
        let run = |dtype: DType| {
            let vars: Vec<candle_core::Var> =
                inputs.iter().map(|t| candle_core::Var::from_tensor(&t.to_dtype(dtype).unwrap()).unwrap()).collect();
            let ts: Vec<Tensor> = vars.iter().map(|v| v.as_tensor().clone()).collect();
            let y = op(&ts).unwrap();
            assert_eq!(y.dtype(), dtype, "{name}: output dtype");
            // Output-gradient weights that bf16 holds exactly: both runs backpropagate the same.
            let n = y.elem_count() as u32;
            let weights =
                Tensor::arange(1u32, n + 1, &Device::Cpu).unwrap().to_dtype(DType::F32).unwrap().sin().unwrap();
            let weights =
                weights.to_dtype(DType::BF16).unwrap().to_dtype(DType::F32).unwrap().reshape(y.shape()).unwrap();
            let loss = (y.to_dtype(DType::F32).unwrap() * weights).unwrap().sum_all().unwrap();
            let grads = loss.backward().unwrap();
            let g: Vec<Tensor> =
                vars.iter().map(|v| grads.get(v).unwrap_or_else(|| panic!("{name}: no gradient")).clone()).collect();
            (y, g)
        };
        let ((y_low, g_low), (y_ref, g_ref)) = (run(DType::BF16), run(DType::F32));
        let close = |what: &str, low: &Tensor, reference: &Tensor| {
            assert_eq!(low.dtype(), DType::BF16, "{name} {what}: dtype");
            // The reference rounded to bf16 as the low-precision path rounds its own sum.
            let r = values(&reference.to_dtype(DType::BF16).unwrap());
            let scale = r.iter().fold(0f64, |m, v| m.max(v.abs()));
            for (i, (a, b)) in values(low).iter().zip(&r).enumerate() {
                // One bf16 spacing (2⁻⁷ relative) where the f32 sums round to neighbours, plus a
                // floor for sums that cancel to far below the tensor's scale.
                assert!(
                    (a - b).abs() <= b.abs() * 2f64.powi(-7) + scale * 2f64.powi(-16),
                    "{name} {what}[{i}]: {a} vs {b}"
                );
            }
            assert!(scale > 0.0, "{name} {what}: all zero");
        };
        close("forward", &y_low, &y_ref);
        for (i, (a, b)) in g_low.iter().zip(&g_ref).enumerate() {
            close(&format!("gradient {i}"), a, b);
        }
    }
}
