//! The CPU kernels against the composed forms they replace (kept as the oracle: candle's
//! primitive ops under candle's autograd) and against finite differences, in f64 (here); in
//! bf16 against the f32 computation ([`bf16`]); and the dtype conversions against the `half`
//! crate's. Child modules of `native`, so the kernels need not be public to be tested.

mod attention;
mod bf16;
mod linear;
mod loss;

use candle_core::{DType, Device, Result, Tensor, Var, D};

use crate::cnn::Activation;
use crate::native;
use crate::ops;
use crate::params::normal_tensor;

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
        let entries: Vec<usize> =
            (0..probes.min(base.len())).map(|p| p * base.len() / probes.min(base.len())).collect();
        let numeric = crate::gradcheck::central_differences(&base, &entries, &[1e-6], &a, |vals| {
            let mut moved: Vec<Tensor> = inputs.to_vec();
            moved[i] = Tensor::from_vec(vals.to_vec(), inputs[i].shape(), &Device::Cpu).unwrap();
            weighted_sum(&kernel(&moved).unwrap()).unwrap().to_scalar::<f64>().unwrap()
        });
        for (&at, numeric) in entries.iter().zip(numeric) {
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
    check("linear", &[x.clone(), w.clone(), b], |t| native::linear::linear(&t[0], &t[1], Some(&t[2])), oracle);
    let oracle = |t: &[Tensor]| t[0].broadcast_matmul(&t[1].t()?);
    check("linear without bias", &[x, w], |t| native::linear::linear(&t[0], &t[1], None), oracle);
}

#[test]
fn norms_match_their_composed_forms() {
    let (x, w, b) = (randn(&[3, 4, 10], 4), randn(&[10], 5), randn(&[10], 6));
    check(
        "layer_norm",
        &[x.clone(), w.clone(), b],
        |t| native::row_norm::layer_norm(&t[0], &t[1], &t[2], 1e-5),
        |t| ops::layer_norm_composed(&t[0], &t[1], &t[2], 1e-5),
    );
    check(
        "rms_norm",
        &[x, w],
        |t| native::row_norm::rms_norm(&t[0], &t[1], 1e-6),
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
            let (mean, var) = native::norm::batch_stats(&t[0].detach())?;
            native::norm::batch_norm(&t[0], &mean, &var, &t[1], &t[2], 1e-5, true, act)
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
        |t: &[Tensor]| native::norm::batch_norm(&t[0], &mean, &var, &t[1], &t[2], 1e-5, false, Activation::Identity);
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
            |t| native::conv::conv2d(&t[0], &t[1], pad, stride),
            |t| t[0].conv2d(&t[1], pad, stride, 1, 1),
        );
    }
    for (k, stride, pad) in [(3, 2, 1), (4, 4, 0), (2, 3, 1)] {
        let (x, w) = (randn(&[2, 2, 10, 9], 30), randn(&[3, 2, k, k], 31));
        check_finite_differences(&format!("conv2d k{k} s{stride} p{pad} on 10 × 9"), &[x, w], |t| {
            native::conv::conv2d(&t[0], &t[1], pad, stride)
        });
    }
    for (stride, pad) in [(1, 1), (2, 1), (2, 0)] {
        let (x, w) = (randn(&[2, 3, 7, 9], 12), randn(&[3, 1, 3, 3], 13));
        check(
            &format!("depthwise s{stride} p{pad}"),
            &[x, w],
            |t| native::depthwise::depthwise_conv2d(&t[0], &t[1], pad, stride),
            |t| crate::cnn::depthwise_conv2d_composed(&t[0], &t[1], pad, stride),
        );
    }
}

/// Images large enough to be cut into chunks of output rows (the smallest chunk, 64 columns:
/// 7 rows of 9 here, the last one ragged), at batch 1 (one image split between workers; col2im
/// by one worker per image) and 2: against candle's convolution and finite differences in f64,
/// and against the unchunked kernel (kept as the oracle) in f32.
#[test]
fn chunked_convolutions_match_candles_and_the_unchunked_kernel() {
    for n in [1, 2] {
        for (k, stride, pad) in [(3, 1, 1), (3, 2, 1), (7, 2, 3), (1, 2, 0)] {
            let side = if stride == 1 { 9 } else { 17 };
            let (x, w) = (randn(&[n, 3, 17, side], 40), randn(&[4, 3, k, k], 41));
            let name = format!("chunked conv2d k{k} s{stride} p{pad} batch {n}");
            check(
                &name,
                &[x.clone(), w.clone()],
                |t| native::conv::conv2d_chunked(&t[0], &t[1], pad, stride, 1),
                |t| t[0].conv2d(&t[1], pad, stride, 1, 1),
            );
            let (x, w) = (x.to_dtype(DType::F32).unwrap(), w.to_dtype(DType::F32).unwrap());
            let run = |chunk: usize| {
                let (xv, wv) = (Var::from_tensor(&x).unwrap(), Var::from_tensor(&w).unwrap());
                let y = native::conv::conv2d_chunked(xv.as_tensor(), wv.as_tensor(), pad, stride, chunk).unwrap();
                let g = weighted_sum(&y.to_dtype(DType::F64).unwrap()).unwrap().backward().unwrap();
                let grad = |v: &Var| values(g.get(v).unwrap());
                (values(&y), grad(&xv), grad(&wv))
            };
            let (chunked, whole) = (run(1), run(usize::MAX));
            // The same products over the same depths: equal values and input gradients; the
            // weight gradient's sums over positions are split at the chunks (f32 rounding).
            assert!(max_rel_diff(&chunked.0, &whole.0) < 1e-6, "{name}: values");
            assert!(max_rel_diff(&chunked.1, &whole.1) < 1e-6, "{name}: input gradients");
            assert!(max_rel_diff(&chunked.2, &whole.2) < 1e-5, "{name}: weight gradients");
        }
    }
}

/// f32 convolutions wide enough for the direct kernels (`conv::direct`: 16 or more input
/// channels, wider than 1×1) against the same convolution in f64, which the product computes
/// (kept as the oracle): values, input and weight gradients within f32 rounding, at strides 1
/// and 2, kernels 3 and 5, odd widths and output channels that leave a block of 32 ragged; and a
/// 1×1 stride-2 one of the same width, which the product takes.
#[test]
fn direct_f32_convolutions_match_the_f64_product() {
    if !wick_kernels::cpu::conv::available::<f32>() {
        eprintln!("SKIPPED: this CPU has no AVX-512 BW/VL; f32 convolutions take the product");
        return;
    }
    // 9 × 11 images, and 10 × 12 ones, which leave no row or column unused at stride 2 (bf16
    // takes the strided input gradient there; f32 stays on the product).
    let cases = [
        (3, 1, 1, 16, 33, (9, 11)),
        (3, 2, 1, 20, 32, (9, 11)),
        (3, 2, 1, 20, 24, (10, 12)),
        (5, 1, 2, 17, 8, (9, 11)),
        (3, 1, 0, 24, 40, (9, 11)),
        (1, 2, 0, 16, 24, (9, 11)),
    ];
    for (k, stride, pad, c_in, c_out, (h, wd)) in cases {
        let name = format!("direct f32 conv2d k{k} s{stride} p{pad} {c_in} → {c_out} on {h} × {wd}");
        let (x, w) = (randn(&[2, c_in, h, wd], 50), randn(&[c_out, c_in, k, k], 51));
        let run = |dtype: DType| {
            let (xv, wv) = (
                Var::from_tensor(&x.to_dtype(dtype).unwrap()).unwrap(),
                Var::from_tensor(&w.to_dtype(dtype).unwrap()).unwrap(),
            );
            let y = native::conv::conv2d(xv.as_tensor(), wv.as_tensor(), pad, stride).unwrap();
            let g = weighted_sum(&y.to_dtype(DType::F64).unwrap()).unwrap().backward().unwrap();
            let grad = |v: &Var| values(g.get(v).unwrap());
            (values(&y), grad(&xv), grad(&wv))
        };
        let (direct, oracle) = (run(DType::F32), run(DType::F64));
        assert!(max_rel_diff(&direct.0, &oracle.0) < 1e-5, "{name}: values");
        assert!(max_rel_diff(&direct.1, &oracle.1) < 1e-5, "{name}: input gradients");
        assert!(max_rel_diff(&direct.2, &oracle.2) < 1e-5, "{name}: weight gradients");
    }
}

/// Max pooling composed from candle ops: the padded input's kernel² strided windows, stacked, and
/// their maximum (candle's `max` backward sends the gradient to every tied maximum).
fn max_pool2d_composed(x: &Tensor, kernel: usize, stride: usize, pad: usize) -> candle_core::Result<Tensor> {
    let (_, _, h, w) = x.dims4()?;
    let out = |len: usize| (len + 2 * pad - kernel) / stride + 1;
    let (oh, ow) = (out(h), out(w));
    let xp = crate::cnn::pad_spatial(x, pad, -1e4)?;
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
        |t| native::pool::max_pool2d(&t[0], 3, 2, 1),
        |t| max_pool2d_composed(&t[0], 3, 2, 1),
    );
    check("global_avg_pool", &[x], |t| native::pool::global_avg_pool(&t[0]), |t| t[0].mean(D::Minus1)?.mean(D::Minus1));
}

/// Max pooling over planes with ties and NaN against a per-window reference written from
/// PyTorch's rule (`val > max || isnan(val)` in row-major order: the first maximum wins, a later
/// NaN replaces an earlier one): the values, and the gradient routed to that one input.
#[test]
fn max_pooling_routes_ties_and_nan_as_pytorch() {
    // Rows of 40: past two 16-output vectors of the AVX-512 sweep at stride 1, one and a ragged
    // one at stride 2.
    let (n, c, h, w) = (2, 3, 11, 40);
    // Five levels (many ties); two planes get NaNs, one of them two in one window.
    let mut data: Vec<f32> = (0..n * c * h * w).map(|i| ((i * 7919) % 5) as f32).collect();
    for i in [h * w + 5, h * w + 6, 4 * h * w + 3 * w + 7] {
        data[i] = f32::NAN;
    }
    data[h * w + w + 5] = f32::NAN;
    for (kernel, stride, pad) in [(3, 2, 1), (2, 2, 0), (3, 1, 1), (3, 3, 0)] {
        let x = Var::from_vec(data.clone(), (n, c, h, w), &Device::Cpu).unwrap();
        let y = native::pool::max_pool2d(x.as_tensor(), kernel, stride, pad).unwrap();
        let (oh, ow) = ((h + 2 * pad - kernel) / stride + 1, (w + 2 * pad - kernel) / stride + 1);
        // Gradients that round when summed: an input that wins several windows must get their
        // gradients added in the outputs' order, as PyTorch's loop over outputs adds them.
        let g: Vec<f32> = (0..n * c * oh * ow).map(|i| 1.0 + i as f32 * 0.371_9 + (i % 7) as f32 * 1e-3).collect();
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

/// A bias of zeros (the padding mask of a batch without padding) is dropped: the output and
/// every gradient are those of attention without a bias, to the bit (f32); a bias with one
/// padded key is not.
#[test]
fn attention_with_a_zero_bias_is_attention_without_one() {
    let f32s = |shape: &[usize], seed| Var::from_tensor(&randn(shape, seed).to_dtype(DType::F32).unwrap()).unwrap();
    let (q, k, v) = (f32s(&[2, 3, 5, 8], 51), f32s(&[2, 3, 7, 8], 52), f32s(&[2, 3, 7, 8], 53));
    let run = |bias: Option<&Tensor>| {
        let y = native::attention::attention(q.as_tensor(), k.as_tensor(), v.as_tensor(), bias).unwrap();
        let grads = weighted_sum(&y).unwrap().backward().unwrap();
        let bits = |t: &Tensor| -> Vec<u32> {
            t.flatten_all().unwrap().to_vec1::<f32>().unwrap().iter().map(|x| x.to_bits()).collect()
        };
        let mut all = bits(&y);
        for var in [&q, &k, &v] {
            all.extend(bits(grads.get(var.as_tensor()).unwrap()));
        }
        all
    };
    let zeros = Tensor::zeros((2, 1, 1, 7), DType::F32, &Device::Cpu).unwrap();
    assert_eq!(run(Some(&zeros)), run(None));
    let mut one = vec![0f32; 14];
    one[13] = -1e4;
    let padded = Tensor::from_vec(one, (2, 1, 1, 7), &Device::Cpu).unwrap();
    assert_ne!(run(Some(&padded)), run(None));
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
        |t| native::attention::attention(&t[0], &t[1], &t[2], Some(&bias)),
        |t| ops::attention_composed(&t[0], &t[1], &t[2], Some(&bias)),
    );
    let q = randn(&[2, 3, 6, 4], 18);
    let causal = ops::causal_bias(6, DType::F64, &Device::Cpu).unwrap();
    check(
        "attention (causal)",
        &[q.clone(), k, v],
        |t| native::attention::attention(&t[0], &t[1], &t[2], Some(&causal)),
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
            |t| native::attention::attention_packed(&t[0], 2, bias),
            |t| merged(ops::attention_composed(&split(&t[0], 0)?, &split(&t[0], 1)?, &split(&t[0], 2)?, bias)?),
        );
    }
    assert!(native::attention::attention_packed(&qkv, 4, None).is_err(), "18 is not 3 × 4 heads × a width");
    assert!(native::attention::attention_packed(&qkv, 0, None).is_err(), "no heads");
    // No keys: an error in every dtype (a softmax over nothing; the f64 body split its rows by 0).
    for dtype in [DType::F64, DType::F32] {
        let empty = Tensor::zeros((1, 2, 0, 4), dtype, &Device::Cpu).unwrap();
        let q = Tensor::zeros((1, 2, 3, 4), dtype, &Device::Cpu).unwrap();
        assert!(native::attention::attention(&q, &empty, &empty, None).is_err(), "no keys ({dtype:?})");
        let packed = Tensor::zeros((1, 0, 24), dtype, &Device::Cpu).unwrap();
        assert!(native::attention::attention_packed(&packed, 2, None).is_err(), "no tokens ({dtype:?})");
    }
    check("rope", &[q], |t| native::rope::rope(&t[0], &cos, &sin), |t| ops::rope_composed(&t[0], &cos, &sin));
    // q and k rotated inside a packed (2, 6, 3·2·4) projection, v passed through, against
    // splitting the heads out, rotating q and k alone and packing them back.
    let qkv = randn(&[2, 6, 24], 41);
    let part = |t: &Tensor, i: usize| t.narrow(2, i * 8, 8)?.reshape((2, 6, 2, 4))?.transpose(1, 2)?.contiguous();
    let back = |t: Tensor| t.transpose(1, 2)?.reshape((2, 6, 8));
    check(
        "rope (packed)",
        &[qkv],
        |t| native::rope::rope_packed(&t[0], 2, &cos, &sin),
        |t| {
            let q = back(ops::rope_composed(&part(&t[0], 0)?, &cos, &sin)?)?;
            let k = back(ops::rope_composed(&part(&t[0], 1)?, &cos, &sin)?)?;
            Tensor::cat(&[q, k, t[0].narrow(2, 16, 8)?], 2)
        },
    );
    let wrong = randn(&[2, 6, 20], 42);
    assert!(native::rope::rope_packed(&wrong, 2, &cos, &sin).is_err(), "20 is not 3 × 2 heads × a width");
    assert!(native::rope::rope_packed(&randn(&[2, 5, 24], 43), 2, &cos, &sin).is_err(), "5 positions, 6 in the tables");
}

#[test]
fn activations_match_candles() {
    let (a, b) = (randn(&[4, 9], 19), randn(&[4, 9], 20));
    // Composed from erf: candle's own `gelu_erf` backward uses 0.398942 for 1/√(2π) (a 7e-7
    // relative error); PyTorch's and the kernel's use the exact constant.
    let gelu_composed = |t: &[Tensor]| (&t[0] * 0.5)? * ((&t[0] / 2f64.sqrt())?.erf()? + 1.0)?;
    check("gelu", std::slice::from_ref(&a), |t| native::act::gelu(&t[0]), gelu_composed);
    check("silu_mul", &[a, b], |t| native::act::silu_mul(&t[0], &t[1]), |t| t[0].silu()? * &t[1]);
    // The halves of a packed (…, 2·I) projection, against narrowing them apart.
    let u = randn(&[2, 3, 10], 44);
    check(
        "silu_mul (packed)",
        &[u],
        |t| native::act::silu_mul_packed(&t[0]),
        |t| t[0].narrow(2, 0, 5)?.silu()? * t[0].narrow(2, 5, 5)?,
    );
    // Halves of 40: two whole blocks of the backward's local outputs and a tail.
    let u = randn(&[2, 80], 46);
    check(
        "silu_mul (packed, 40 wide)",
        &[u],
        |t| native::act::silu_mul_packed(&t[0]),
        |t| t[0].narrow(1, 0, 40)?.silu()? * t[0].narrow(1, 40, 40)?,
    );
    assert!(native::act::silu_mul_packed(&randn(&[2, 7], 45)).is_err(), "an odd last dimension does not halve");
    let (a, b) = (randn(&[4, 9], 32), randn(&[4, 9], 33));
    check("add", &[a.clone(), b.clone()], |t| native::act::add(&t[0], &t[1]), |t| &t[0] + &t[1]);
    assert!(native::act::add(&a, &b.narrow(1, 0, 8).unwrap()).is_err(), "shapes differ");
    check(
        "add_relu",
        &[a, b],
        |t| native::act::add_relu(&t[0], &t[1]),
        |t| ops::relu_composed(&(&t[0] + &t[1])?, None),
    );
}

#[test]
fn losses_and_lookups_match_their_composed_forms() {
    let logits = randn(&[6, 5], 21);
    let targets = Tensor::new(&[1u32, 0, 4, 2, 2, 3], &Device::Cpu).unwrap();
    check(
        "cross_entropy",
        &[logits],
        |t| native::loss::cross_entropy(&t[0], &targets),
        |t| ops::cross_entropy_composed(&t[0], &targets),
    );
    let table = randn(&[5, 3], 22);
    let ids = Tensor::new(&[4u32, 0, 4, 1, 3], &Device::Cpu).unwrap();
    check("embedding", &[table], |t| native::loss::embedding(&t[0], &ids, None), |t| t[0].embedding(&ids));
    let (x, a, b) = (randn(&[2, 3, 4], 23), randn(&[3, 4], 24), randn(&[1, 4], 25));
    check(
        "add_broadcast",
        &[x, a, b],
        |t| native::loss::add_broadcast(&t[0], &t[1], &t[2]),
        |t| t[0].broadcast_add(&t[1])?.broadcast_add(&t[2]),
    );
    // The longer repeat second, and one as long as x itself.
    for (a, b) in [(&[1, 4][..], &[3, 4][..]), (&[4][..], &[2, 3, 4][..])] {
        let (x, a, b) = (randn(&[2, 3, 4], 26), randn(a, 27), randn(b, 28));
        check(
            "add_broadcast",
            &[x, a, b],
            |t| native::loss::add_broadcast(&t[0], &t[1], &t[2]),
            |t| t[0].broadcast_add(&t[1])?.broadcast_add(&t[2]),
        );
    }
}

/// The parallel conversions over several chunks and a ragged tail, from an offset, against
/// per-element `half` conversions, in bf16 and f16.
#[test]
fn widen_and_narrow_match_elementwise_conversion() -> Result<()> {
    let n = 2 * native::CONVERT_CHUNK + 123;
    let wide: Vec<f32> = (0..n).map(|i| ((i as f32) * 0.377).sin() * 1e3 / (1.0 + i as f32)).collect();
    let narrow: Vec<half::bf16> = native::narrow_elems(&wide);
    assert_eq!(narrow.len(), n);
    assert!(narrow.iter().zip(&wide).all(|(a, b)| a.to_bits() == half::bf16::from_f32(*b).to_bits()));
    let mut into = vec![half::bf16::ONE; n];
    native::narrow_into(&wide, &mut into);
    assert_eq!(into, narrow);
    let back = native::widen_elems(&narrow, 7, n - 7)?;
    assert_eq!(back.len(), n - 7);
    assert!(back.iter().zip(&narrow[7..]).all(|(a, b)| a.to_bits() == b.to_f32().to_bits()));
    assert!(native::widen_elems(&narrow, 8, n).is_err(), "a range past the end is refused");
    let f16s: Vec<half::f16> = native::narrow_elems(&wide);
    assert!(f16s.iter().zip(&wide).all(|(a, b)| a.to_bits() == half::f16::from_f32(*b).to_bits()));
    let back = native::widen_elems(&f16s, 0, n)?;
    assert!(back.iter().zip(&f16s).all(|(a, b)| a.to_bits() == b.to_f32().to_bits()));
    Ok(())
}

/// The one-pass inference op refuses a residual of another shape and norm parameters of
/// another width (errors, not panics), and leaves bf16 images to the separate ops.
#[test]
fn fused_inference_refuses_what_does_not_fit() -> Result<()> {
    let (x, w) = (randn(&[1, 2, 8, 8], 50).to_dtype(DType::F32)?, randn(&[3, 2, 3, 3], 51).to_dtype(DType::F32)?);
    let ones = |c: usize| Tensor::ones(c, DType::F32, &Device::Cpu);
    let (o3, z3, o4) = (ones(3)?, ones(3)?.zeros_like()?, ones(4)?);
    let norm = |weight| native::conv::EvalNorm { weight, bias: &z3, mean: &z3, var: &o3, eps: 1e-5 };
    let act = Activation::Relu;
    let wrong = Tensor::zeros((1, 3, 7, 8), DType::F32, &Device::Cpu)?;
    assert!(native::conv::conv_norm_eval(&x, &w, (1, 1), norm(&o3), Some(&wrong), act).is_err());
    assert!(native::conv::conv_norm_eval(&x, &w, (1, 1), norm(&o4), None, act).is_err());
    let (xb, wb) = (x.to_dtype(DType::BF16)?, w.to_dtype(DType::BF16)?);
    assert!(native::conv::conv_norm_eval(&xb, &wb, (1, 1), norm(&o3), None, act)?.is_none());
    // What it computes: with unit scale, zero shift and ReLU, the ReLU of the convolution.
    let y = native::conv::conv_norm_eval(&x, &w, (1, 1), norm(&o3), None, act)?.expect("f32 is taken");
    let reference = native::conv::conv2d(&x, &w, 1, 1)?.relu()?.affine(1.0 / (1.0f64 + 1e-5).sqrt(), 0.0)?;
    assert!(max_rel_diff(&values(&y), &values(&reference)) < 1e-6);
    Ok(())
}

/// Batch norm's fused activation reads its input as the op stores it: the gradient passes strictly
/// between the largest value that rounds to 0 and the least that rounds to the upper kink, in the
/// output's dtype (each bound checked against the dtype's own rounding, one f32 step either side).
#[test]
fn activation_masks_read_the_stored_value() {
    use half::{bf16, f16};
    let next = |v: f32| f32::from_bits(v.to_bits() + 1);
    let prev = |v: f32| f32::from_bits(v.to_bits() - 1);
    assert_eq!(native::norm::mask_bounds::<f32, f32>(6.0), (0.0, 6.0));
    assert_eq!(native::norm::mask_bounds::<f64, f64>(6.0), (0.0, 6.0));
    assert_eq!(native::norm::mask_bounds::<f32, f32>(f32::INFINITY), (0.0, f32::INFINITY));
    let (lo, hi) = native::norm::mask_bounds::<f32, bf16>(6.0);
    assert_eq!(hi, 5.984375, "bf16: the midpoint below 6 rounds to 6 (ties to even)");
    assert_eq!((bf16::from_f32(hi).to_f32(), bf16::from_f32(prev(hi)).to_f32()), (6.0, 5.96875));
    assert_eq!((bf16::from_f32(lo).to_f32(), bf16::from_f32(next(lo)).to_f32() > 0.0), (0.0, true));
    let (lo, hi) = native::norm::mask_bounds::<f32, f16>(6.0);
    assert_eq!(hi, 6.0 - 2f32.powi(-9), "f16: the midpoint below 6");
    assert!(f16::from_f32(hi).to_f32() == 6.0 && f16::from_f32(prev(hi)).to_f32() < 6.0);
    assert!(f16::from_f32(lo).to_f32() == 0.0 && f16::from_f32(next(lo)).to_f32() > 0.0);
    assert_eq!(lo, 2f32.powi(-25), "f16: half its least subnormal rounds to 0 (ties to even)");
    let (_, hi) = native::norm::mask_bounds::<f32, bf16>(f32::INFINITY);
    assert_eq!(hi, f32::INFINITY);
}
