//! GPU check of wick-nn's CUDA op bodies (`wick_nn::cuda`, kernels `kernels/src/cuda/nn_*.cu`):
//!
//! 1. every op with a CUDA body against its host body on the same inputs — the forward output and
//!    the gradient of every input — in f32, bf16, f16 and f64, on shapes that cross the kernels'
//!    edges (rows longer than a block, more rows than a chunk of the weight-gradient sums, head
//!    dimensions that fill a warp's lanes in part, padding and causal masks, repeated and padding
//!    ids, PyTorch's kinks of ReLU and ReLU6 at exactly 0 and 6);
//! 2. that the CUDA pass went through the op's own node, forward and backward (the per-op call
//!    counts of `wick_nn::native::profile`, which only wick's ops report), not the composed fallback;
//! 3. the op beside the composed form of candle's ops it replaces on a GPU, at the zoo's sizes:
//!    time of forward + backward, and the bytes the output's graph keeps for backward.
//!
//! Prints one line per check and per timing; exits non-zero if a check fails. Run by
//! `scripts/gpu-check.sh` (needs candle's CUDA kernels: `scripts/build-gpu-binaries.sh` with the
//! real nvcc). With `--host` it needs no GPU: the composed forms are checked against the host
//! bodies on the CPU, which tests this harness (its inputs, masks, tables, ids and composed forms)
//! before a device run; `cargo run -p wick-tools --release --bin nn-gpu-check -- --host`.

use std::time::Instant;

use anyhow::{bail, Context, Result};
use candle_core::{DType, Device, Tensor, Var, D};
use wick_nn::autocast::fp32_compute;
use wick_nn::cnn;
use wick_nn::fused::node;
use wick_nn::native::profile;
use wick_nn::ops;
use wick_nn::params::normal_tensor;

type Op = fn(&[Tensor]) -> candle_core::Result<Tensor>;
type Shapes = fn(usize, usize) -> Vec<Vec<usize>>;

/// One op: its name, the name it reports in the per-op counts, its inputs' shapes for a size
/// (rows, width), the sizes checked and the zoo's size timed, how to run it, and the composed form
/// of candle's ops it replaces on a GPU.
struct Case {
    name: &'static str,
    counted: &'static str,
    shapes: Shapes,
    sizes: &'static [(usize, usize)],
    zoo: (usize, usize, &'static str),
    op: Op,
    composed: Op,
}

fn one(r: usize, d: usize) -> Vec<Vec<usize>> {
    vec![vec![r, d]]
}
fn two(r: usize, d: usize) -> Vec<Vec<usize>> {
    vec![vec![r, d], vec![r, d]]
}
fn packed_pair(r: usize, d: usize) -> Vec<Vec<usize>> {
    vec![vec![r, 2 * d]]
}
fn layer_norm_shapes(r: usize, d: usize) -> Vec<Vec<usize>> {
    vec![vec![r, d], vec![d], vec![d]]
}
fn layer_norm_3d(r: usize, d: usize) -> Vec<Vec<usize>> {
    vec![vec![2, r, d], vec![d], vec![d]]
}
fn rms_norm_shapes(r: usize, d: usize) -> Vec<Vec<usize>> {
    vec![vec![r, d], vec![d]]
}

/// Images (N, C, side, side) of `planes` = N·C planes (C up to 8).
fn image(planes: usize, side: usize) -> Vec<Vec<usize>> {
    vec![vec![(planes / 8).max(1), planes.min(8), side, side]]
}

/// Heads of attention and RoPE: (batch 2, HEADS, seq, head_dim) from (2·HEADS·seq, head_dim).
const HEADS: usize = 4;

fn heads_apart(r: usize, d: usize) -> Vec<Vec<usize>> {
    vec![vec![2, HEADS, (r / (2 * HEADS)).max(1), d]]
}
fn qkv_apart(r: usize, d: usize) -> Vec<Vec<usize>> {
    let s = heads_apart(r, d).remove(0);
    vec![s.clone(), s.clone(), s]
}
/// The packed (batch 2, seq, 3·HEADS·head_dim) projection of the same sizes.
fn qkv_packed(r: usize, d: usize) -> Vec<Vec<usize>> {
    vec![vec![2, (r / (2 * HEADS)).max(1), 3 * HEADS * d]]
}

fn tables(seq: usize, d: usize, dev: &Device) -> candle_core::Result<(Tensor, Tensor)> {
    let half = d / 2;
    let angle = |p: usize, i: usize| p as f64 / 10_000f64.powf(2.0 * i as f64 / d as f64);
    let cos: Vec<f32> = (0..seq * half).map(|k| angle(k / half, k % half).cos() as f32).collect();
    let sin: Vec<f32> = (0..seq * half).map(|k| angle(k / half, k % half).sin() as f32).collect();
    Ok((Tensor::from_vec(cos, (seq, half), dev)?, Tensor::from_vec(sin, (seq, half), dev)?))
}

/// Batch 0 attends to every key, batch 1 to all but its last three (a padded sentence).
fn padding_bias(seq: usize, dtype: DType, dev: &Device) -> candle_core::Result<Tensor> {
    let masked = |k: usize| k >= seq && k % seq >= seq.saturating_sub(3) && !k.is_multiple_of(seq);
    let v: Vec<f32> = (0..2 * seq).map(|k| if masked(k) { -1e4 } else { 0.0 }).collect();
    Tensor::from_vec(v, (2, 1, 1, seq), dev)?.to_dtype(dtype)
}

/// `n` targets or ids spread over `0..range`, repeating when `n` > `range`.
fn spread(n: usize, range: usize, dev: &Device) -> candle_core::Result<Tensor> {
    Tensor::from_vec((0..n).map(|k| ((k * 7919 + 3) % range.max(1)) as u32).collect::<Vec<_>>(), n, dev)
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
fn attention(t: &[Tensor]) -> candle_core::Result<Tensor> {
    ops::attention(&t[0], &t[1], &t[2], None)
}
fn attention_masked(t: &[Tensor]) -> candle_core::Result<Tensor> {
    let bias = padding_bias(t[0].dim(2)?, t[0].dtype(), t[0].device())?;
    ops::attention(&t[0], &t[1], &t[2], Some(&bias))
}
fn attention_causal(t: &[Tensor]) -> candle_core::Result<Tensor> {
    let bias = ops::causal_bias(t[0].dim(2)?, t[0].dtype(), t[0].device())?;
    ops::attention(&t[0], &t[1], &t[2], Some(&bias))
}
fn attention_packed(t: &[Tensor]) -> candle_core::Result<Tensor> {
    let bias = ops::causal_bias(t[0].dim(1)?, t[0].dtype(), t[0].device())?;
    ops::attention_packed(&t[0], HEADS, Some(&bias))
}
fn rope(t: &[Tensor]) -> candle_core::Result<Tensor> {
    let (cos, sin) = tables(t[0].dim(2)?, t[0].dim(3)?, t[0].device())?;
    ops::rope(&t[0], &cos, &sin)
}
fn rope_packed(t: &[Tensor]) -> candle_core::Result<Tensor> {
    let (cos, sin) = tables(t[0].dim(1)?, t[0].dim(2)? / (3 * HEADS), t[0].device())?;
    ops::rope_packed(&t[0], HEADS, &cos, &sin)
}
fn cross_entropy(t: &[Tensor]) -> candle_core::Result<Tensor> {
    let (n, c) = t[0].dims2()?;
    ops::cross_entropy(&t[0], &spread(n, c, t[0].device())?)
}
/// A table of `rows` rows looked up 1.5 × `rows` times (some rows twice).
fn embedding(t: &[Tensor]) -> candle_core::Result<Tensor> {
    let v = t[0].dim(0)?;
    ops::embedding(&t[0], &spread(v + v / 2, v, t[0].device())?)
}
fn embedding_padded(t: &[Tensor]) -> candle_core::Result<Tensor> {
    let v = t[0].dim(0)?;
    ops::embedding_with_padding(&t[0], &spread(v + v / 2, v, t[0].device())?, Some(3))
}

/// Batch norm's images: (BN_BATCH, channels, side, side) and a weight and bias per channel.
const BN_BATCH: usize = 4;
fn batch_norm_shapes(c: usize, side: usize) -> Vec<Vec<usize>> {
    vec![vec![BN_BATCH, c, side, side], vec![c], vec![c]]
}
/// Running estimates for the eval-mode case: means spread around 0, variances from 0.5 up.
fn estimates(c: usize, dev: &Device) -> candle_core::Result<(Tensor, Tensor)> {
    let mean: Vec<f32> = (0..c).map(|k| (k as f32 * 0.37).sin()).collect();
    let var: Vec<f32> = (0..c).map(|k| 0.5 + (k % 7) as f32 / 4.0).collect();
    Ok((Tensor::from_vec(mean, c, dev)?, Tensor::from_vec(var, c, dev)?))
}
/// Batch norm as a model runs it (`cnn::RunningStats`), in training (this batch's statistics, the
/// running estimates not moved: each check runs the op twice) or eval mode.
fn batch_norm_with(t: &[Tensor], train: bool, act: cnn::Activation) -> candle_core::Result<Tensor> {
    let (mean, var) = estimates(t[1].elem_count(), t[0].device())?;
    let running = cnn::RunningStats::register(&mut wick_nn::params::Params::default(), "bn", mean, var);
    running.normalize_act(&t[0], &t[1], &t[2], train, false, act)
}
fn batch_norm_train(t: &[Tensor]) -> candle_core::Result<Tensor> {
    batch_norm_with(t, true, cnn::Activation::Relu)
}
fn batch_norm_eval(t: &[Tensor]) -> candle_core::Result<Tensor> {
    batch_norm_with(t, false, cnn::Activation::Relu6)
}

/// Convolutions: images (batch, C_in, side, side) from (batch, side), and their filters.
fn conv_3x3_64(n: usize, side: usize) -> Vec<Vec<usize>> {
    vec![vec![n, 64, side, side], vec![64, 64, 3, 3]]
}
fn conv_7x7_stem(n: usize, side: usize) -> Vec<Vec<usize>> {
    vec![vec![n, 3, side, side], vec![64, 3, 7, 7]]
}
fn conv_1x1_256(n: usize, side: usize) -> Vec<Vec<usize>> {
    vec![vec![n, 256, side, side], vec![64, 256, 1, 1]]
}
fn depthwise_96(n: usize, side: usize) -> Vec<Vec<usize>> {
    vec![vec![n, 96, side, side], vec![96, 1, 3, 3]]
}
fn conv_3x3_s1(t: &[Tensor]) -> candle_core::Result<Tensor> {
    cnn::conv2d(&t[0], &t[1], 1, 1)
}
fn conv_7x7_s2(t: &[Tensor]) -> candle_core::Result<Tensor> {
    cnn::conv2d(&t[0], &t[1], 3, 2)
}
fn conv_1x1(t: &[Tensor]) -> candle_core::Result<Tensor> {
    cnn::conv2d(&t[0], &t[1], 0, 1)
}
fn depthwise_3x3_s2(t: &[Tensor]) -> candle_core::Result<Tensor> {
    cnn::depthwise_conv2d(&t[0], &t[1], 1, 2)
}

fn max_pool_3x3(t: &[Tensor]) -> candle_core::Result<Tensor> {
    cnn::max_pool2d(&t[0], 3, 2, 1)
}
fn max_pool_2x2(t: &[Tensor]) -> candle_core::Result<Tensor> {
    cnn::max_pool2d(&t[0], 2, 2, 0)
}
fn global_avg_pool(t: &[Tensor]) -> candle_core::Result<Tensor> {
    cnn::global_avg_pool(&t[0])
}

// What a GPU ran before the CUDA bodies (wick-nn's `ops` without them).
fn max_pool_3x3_composed(t: &[Tensor]) -> candle_core::Result<Tensor> {
    cnn::max_pool2d_composed(&t[0], 3, 2, 1)
}
fn max_pool_2x2_composed(t: &[Tensor]) -> candle_core::Result<Tensor> {
    cnn::max_pool2d_composed(&t[0], 2, 2, 0)
}
fn global_avg_pool_composed(t: &[Tensor]) -> candle_core::Result<Tensor> {
    cnn::global_avg_pool_composed(&t[0])
}
/// Batch norm as wick-nn's `cnn` composes it without the op (statistics from candle's means, in
/// f32 inside one node), then the activation.
fn batch_norm_composed(t: &[Tensor], given: Option<(Tensor, Tensor)>, six: bool) -> candle_core::Result<Tensor> {
    let x = &t[0];
    node("batch_norm", &[x, &t[1], &t[2]], fp32_compute(x.dtype()), x.dtype(), move |t| {
        let shape = (1, t[0].dim(1)?, 1, 1);
        let (mean, var) = match &given {
            Some((m, v)) => (m.to_dtype(t[0].dtype())?.reshape(shape)?, v.to_dtype(t[0].dtype())?.reshape(shape)?),
            None => {
                let mean = t[0].mean_keepdim(0)?.mean_keepdim(2)?.mean_keepdim(3)?;
                let var = t[0].broadcast_sub(&mean)?.sqr()?.mean_keepdim(0)?.mean_keepdim(2)?.mean_keepdim(3)?;
                (mean, var)
            }
        };
        let normed = t[0].broadcast_sub(&mean)?.broadcast_div(&(var + 1e-5)?.sqrt()?)?;
        let y = normed.broadcast_mul(&t[1].reshape(shape)?)?.broadcast_add(&t[2].reshape(shape)?)?;
        ops::relu_composed(&y, six.then_some(6.0))
    })
}
fn batch_norm_train_composed(t: &[Tensor]) -> candle_core::Result<Tensor> {
    batch_norm_composed(t, None, false)
}
fn batch_norm_eval_composed(t: &[Tensor]) -> candle_core::Result<Tensor> {
    batch_norm_composed(t, Some(estimates(t[1].elem_count(), t[0].device())?), true)
}
/// candle's own convolution (what a GPU ran before cuDNN), in f32 for half types on the CPU
/// (which candle cannot convolve in them), as one node.
fn conv_composed(t: &[Tensor], pad: usize, stride: usize) -> candle_core::Result<Tensor> {
    let x = &t[0];
    let half = matches!(x.dtype(), DType::BF16 | DType::F16);
    let compute = if half && x.device().is_cpu() { DType::F32 } else { x.dtype() };
    node("conv2d", &[x, &t[1]], compute, x.dtype(), move |t| t[0].conv2d(&t[1], pad, stride, 1, 1))
}
fn conv_3x3_s1_composed(t: &[Tensor]) -> candle_core::Result<Tensor> {
    conv_composed(t, 1, 1)
}
fn conv_7x7_s2_composed(t: &[Tensor]) -> candle_core::Result<Tensor> {
    conv_composed(t, 3, 2)
}
fn conv_1x1_composed(t: &[Tensor]) -> candle_core::Result<Tensor> {
    conv_composed(t, 0, 1)
}
fn depthwise_3x3_s2_composed(t: &[Tensor]) -> candle_core::Result<Tensor> {
    let x = &t[0];
    node("depthwise_conv2d", &[x, &t[1]], fp32_compute(x.dtype()), x.dtype(), |t| {
        cnn::depthwise_conv2d_composed(&t[0], &t[1], 1, 2)
    })
}
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
fn attention_with(t: &[Tensor], bias: Option<Tensor>) -> candle_core::Result<Tensor> {
    let q = &t[0];
    node("attention", &[q, &t[1], &t[2]], q.dtype(), q.dtype(), move |t| {
        ops::attention_composed(&t[0], &t[1], &t[2], bias.as_ref())
    })
}
fn attention_composed(t: &[Tensor]) -> candle_core::Result<Tensor> {
    attention_with(t, None)
}
fn attention_masked_composed(t: &[Tensor]) -> candle_core::Result<Tensor> {
    attention_with(t, Some(padding_bias(t[0].dim(2)?, t[0].dtype(), t[0].device())?))
}
fn attention_causal_composed(t: &[Tensor]) -> candle_core::Result<Tensor> {
    attention_with(t, Some(ops::causal_bias(t[0].dim(2)?, t[0].dtype(), t[0].device())?))
}
fn attention_packed_composed(t: &[Tensor]) -> candle_core::Result<Tensor> {
    let (n, s, e) = t[0].dims3()?;
    let (h, hd) = (e / 3, e / (3 * HEADS));
    let split = |i: usize| t[0].narrow(2, i * h, h)?.reshape((n, s, HEADS, hd))?.transpose(1, 2)?.contiguous();
    let bias = ops::causal_bias(s, t[0].dtype(), t[0].device())?;
    attention_with(&[split(0)?, split(1)?, split(2)?], Some(bias))?.transpose(1, 2)?.reshape((n, s, h))
}
fn rope_composed(t: &[Tensor]) -> candle_core::Result<Tensor> {
    let x = &t[0];
    let (cos, sin) = tables(x.dim(2)?, x.dim(3)?, x.device())?;
    // The tables follow the input's dtype inside the node (its backward recomputes in f32).
    node("rope", &[x], x.dtype(), x.dtype(), move |t| {
        ops::rope_composed(&t[0], &cos.to_dtype(t[0].dtype())?, &sin.to_dtype(t[0].dtype())?)
    })
}
fn rope_packed_composed(t: &[Tensor]) -> candle_core::Result<Tensor> {
    let (n, s, e) = t[0].dims3()?;
    let (h, hd) = (e / 3, e / (3 * HEADS));
    let part = |i: usize| t[0].narrow(2, i * h, h)?.reshape((n, s, HEADS, hd))?.transpose(1, 2)?.contiguous();
    let rotated = |i: usize| rope_composed(&[part(i)?])?.transpose(1, 2)?.reshape((n, s, h));
    Tensor::cat(&[rotated(0)?, rotated(1)?, t[0].narrow(2, 2 * h, h)?], 2)
}
fn cross_entropy_composed(t: &[Tensor]) -> candle_core::Result<Tensor> {
    let (n, c) = t[0].dims2()?;
    let targets = spread(n, c, t[0].device())?;
    let compute = fp32_compute(t[0].dtype());
    node("cross_entropy", &[&t[0]], compute, compute, move |t| ops::cross_entropy_composed(&t[0], &targets))
}
fn embedding_composed(t: &[Tensor]) -> candle_core::Result<Tensor> {
    let v = t[0].dim(0)?;
    let ids = spread(v + v / 2, v, t[0].device())?;
    node("embedding", &[&ids, &t[0]], t[0].dtype(), t[0].dtype(), |t| t[1].embedding(&t[0]))
}
/// The padded lookup as wick-nn's `ops` composes it: the padding id's rows from a detached table.
fn embedding_padded_composed(t: &[Tensor]) -> candle_core::Result<Tensor> {
    let v = t[0].dim(0)?;
    let ids = spread(v + v / 2, v, t[0].device())?;
    node("embedding", &[&ids, &t[0]], t[0].dtype(), t[0].dtype(), |t| {
        let (ids, table) = (&t[0], &t[1]);
        let rows = table.embedding(ids)?;
        let frozen = table.detach().embedding(ids)?;
        let is_pad = ids.eq(3f64)?.unsqueeze(D::Minus1)?.broadcast_as(rows.shape())?;
        is_pad.where_cond(&frozen, &rows)
    })
}

/// Rows longer than a block (1000 > 256 threads), more rows than a chunk (130 > 64).
const ROWS: &[(usize, usize)] = &[(130, 37), (3, 1000), (70, 768)];
const ELEMENTS: &[(usize, usize)] = &[(3, 37), (64, 1000)];
/// Sequences of 1, 16, 33 and 8 tokens; head dimensions 8, 32, 64 and 100 (a warp's lanes in part).
/// Planes and sides: odd and even sides, more planes than a block's threads cover at once.
const IMAGES: &[(usize, usize)] = &[(6, 9), (24, 16)];
/// Convolutions' (batch, side): odd and even sides, one image and two.
const CONV_SIZES: &[(usize, usize)] = &[(2, 9), (1, 14)];
/// Batch norm's (channels, side): one segment a channel; more channels than a block's threads;
/// five segments a channel (4 × 100² elements, over 8 192 each).
const BN_SIZES: &[(usize, usize)] = &[(5, 9), (300, 7), (3, 100)];
const HEAD_SIZES: &[(usize, usize)] = &[(8, 8), (128, 32), (264, 64), (64, 100)];

#[rustfmt::skip]
const CASES: [Case; 27] = [
    Case { name: "relu", counted: "relu", shapes: one, sizes: ELEMENTS, zoo: (32 * 64 * 56, 56, "ResNet-18's first stage, batch 32"), op: relu, composed: relu_composed },
    Case { name: "relu6", counted: "relu6", shapes: one, sizes: ELEMENTS, zoo: (32 * 96 * 56, 56, "MobileNetV2's expansion, batch 32"), op: relu6, composed: relu6_composed },
    Case { name: "gelu", counted: "gelu", shapes: one, sizes: ELEMENTS, zoo: (32 * 128, 3072, "BERT-base's feed-forward, 32 × 128 tokens"), op: gelu, composed: gelu_composed },
    Case { name: "silu_mul", counted: "silu_mul", shapes: two, sizes: ELEMENTS, zoo: (8 * 256, 1408, "decoder-512's SwiGLU, 8 × 256 tokens"), op: silu_mul, composed: silu_mul_composed },
    Case { name: "silu_mul packed", counted: "silu_mul", shapes: packed_pair, sizes: ELEMENTS, zoo: (8 * 256, 1408, "the same, gate and up packed"), op: silu_mul_packed, composed: silu_mul_packed_composed },
    Case { name: "add_relu", counted: "add_relu", shapes: two, sizes: ELEMENTS, zoo: (32 * 64 * 56, 56, "ResNet-18's residual end, batch 32"), op: add_relu, composed: add_relu_composed },
    Case { name: "layer_norm", counted: "layer_norm", shapes: layer_norm_shapes, sizes: ROWS, zoo: (32 * 128, 768, "BERT-base, 32 × 128 tokens"), op: layer_norm, composed: layer_norm_composed },
    Case { name: "layer_norm 3-D", counted: "layer_norm", shapes: layer_norm_3d, sizes: &[(5, 768)], zoo: (1024, 384, "MiniLM, 2 × 1024 tokens"), op: layer_norm, composed: layer_norm_composed },
    Case { name: "rms_norm", counted: "rms_norm", shapes: rms_norm_shapes, sizes: ROWS, zoo: (8 * 256, 512, "decoder-512, 8 × 256 tokens"), op: rms_norm, composed: rms_norm_composed },
    Case { name: "attention", counted: "attention", shapes: qkv_apart, sizes: HEAD_SIZES, zoo: (8 * 512, 64, "512 tokens"), op: attention, composed: attention_composed },
    Case { name: "attention masked", counted: "attention", shapes: qkv_apart, sizes: HEAD_SIZES, zoo: (8 * 512, 64, "512 tokens, padding mask"), op: attention_masked, composed: attention_masked_composed },
    Case { name: "attention causal", counted: "attention", shapes: qkv_apart, sizes: HEAD_SIZES, zoo: (8 * 1024, 64, "1 024 tokens, causal"), op: attention_causal, composed: attention_causal_composed },
    Case { name: "attention packed", counted: "attention", shapes: qkv_packed, sizes: HEAD_SIZES, zoo: (8 * 1024, 64, "packed q, k, v, causal"), op: attention_packed, composed: attention_packed_composed },
    Case { name: "rope", counted: "rope", shapes: heads_apart, sizes: HEAD_SIZES, zoo: (8 * 1024, 64, "1 024 tokens"), op: rope, composed: rope_composed },
    Case { name: "rope packed", counted: "rope", shapes: qkv_packed, sizes: HEAD_SIZES, zoo: (8 * 1024, 64, "packed q, k, v"), op: rope_packed, composed: rope_packed_composed },
    Case { name: "cross_entropy", counted: "cross_entropy", shapes: one, sizes: ROWS, zoo: (8 * 256, 32_000, "decoder-512's head, 8 × 256 tokens"), op: cross_entropy, composed: cross_entropy_composed },
    Case { name: "embedding", counted: "embedding", shapes: one, sizes: ROWS, zoo: (32_000, 512, "decoder-512's table, 48 000 lookups"), op: embedding, composed: embedding_composed },
    Case { name: "max_pool 3x3/2", counted: "max_pool2d", shapes: image, sizes: IMAGES, zoo: (32 * 64, 112, "ResNet's stem, batch 32"), op: max_pool_3x3, composed: max_pool_3x3_composed },
    Case { name: "max_pool 2x2/2", counted: "max_pool2d", shapes: image, sizes: IMAGES, zoo: (32 * 64, 56, "a 2×2 pool, batch 32"), op: max_pool_2x2, composed: max_pool_2x2_composed },
    Case { name: "global_avg_pool", counted: "global_avg_pool", shapes: image, sizes: IMAGES, zoo: (32 * 512, 7, "ResNet-18's head, batch 32"), op: global_avg_pool, composed: global_avg_pool_composed },
    Case { name: "batch_norm train + relu", counted: "batch_norm", shapes: batch_norm_shapes, sizes: BN_SIZES, zoo: (64, 112, "ResNet's stem (batch 4 here)"), op: batch_norm_train, composed: batch_norm_train_composed },
    Case { name: "batch_norm eval + relu6", counted: "batch_norm", shapes: batch_norm_shapes, sizes: BN_SIZES, zoo: (576, 14, "MobileNetV2's expansion at 14² (batch 4 here)"), op: batch_norm_eval, composed: batch_norm_eval_composed },
    Case { name: "conv2d 3x3/1 64→64", counted: "conv2d", shapes: conv_3x3_64, sizes: CONV_SIZES, zoo: (32, 56, "ResNet-18's first stage, batch 32"), op: conv_3x3_s1, composed: conv_3x3_s1_composed },
    Case { name: "conv2d 7x7/2 stem", counted: "conv2d", shapes: conv_7x7_stem, sizes: CONV_SIZES, zoo: (32, 224, "ResNet's stem, batch 32"), op: conv_7x7_s2, composed: conv_7x7_s2_composed },
    Case { name: "conv2d 1x1 256→64", counted: "conv2d", shapes: conv_1x1_256, sizes: CONV_SIZES, zoo: (32, 56, "ResNet-50's bottleneck entry, batch 32"), op: conv_1x1, composed: conv_1x1_composed },
    Case { name: "depthwise 3x3/2 96", counted: "depthwise_conv2d", shapes: depthwise_96, sizes: CONV_SIZES, zoo: (32, 112, "MobileNetV2's first strided depthwise, batch 32"), op: depthwise_3x3_s2, composed: depthwise_3x3_s2_composed },
    Case { name: "embedding padded", counted: "embedding", shapes: one, sizes: ROWS, zoo: (1000, 64, "a small table, padding id 3"), op: embedding_padded, composed: embedding_padded_composed },
];

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

/// One op checked on `dev` against the host body (`host`: the composed form on the host
/// against the host body instead, a check of this harness that needs no GPU).
fn check(case: &Case, shapes: &[Vec<usize>], dtype: DType, dev: &Device, host: bool) -> Result<(bool, String)> {
    let inputs = host_inputs(case, shapes, 11 + shapes[0].iter().product::<usize>() as u64)?;
    let want = run(case.op, &inputs, shapes, dtype, 5, &Device::Cpu)?;
    profile::reset();
    let got = run(if host { case.composed } else { case.op }, &inputs, shapes, dtype, 5, dev)?;
    let counts = profile::totals();
    let calls =
        |phase: &str| counts.iter().filter(|(n, p, _, _)| n == case.counted && *p == phase).map(|r| r.2).sum::<u64>();
    let (fwd, bwd) = (calls("forward"), calls("backward"));
    let errs: Vec<f64> = got.iter().zip(&want).map(|(g, w)| max_rel_err(g, w)).collect();
    let worst = errs.iter().copied().fold(0.0, f64::max);
    // The composed forms round once more in low precision (each of their ops rounds), and candle's
    // f64 GELU gradient carries f32 constants (3.7e-7 from the host body's).
    // A dense convolution's outputs and gradients are sums of hundreds of products (576 for a
    // 3×3 over 64 channels), added in another order by each body: f32's rounding grows with the
    // sum's length (the half types round each output once, which dominates).
    let long_sums = case.counted == "conv2d" && dtype == DType::F32;
    let tol = match (host, dtype) {
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
        engine = wick::Engine::cuda(0, None).context("opening cuda:0")?;
        engine.device().clone()
    };
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
                let timed = time(case.op, &shapes, dtype, &dev, 20)
                    .and_then(|fused| Ok((fused, time(case.composed, &shapes, dtype, &dev, 20)?)));
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
        }
    }
    if failures > 0 {
        bail!("{failures} check(s) failed");
    }
    println!("all {} agree with their host bodies", if host { "composed forms" } else { "CUDA op bodies" });
    Ok(())
}
