//! The ops nn-gpu-check runs: for each, its inputs' shapes at the sizes checked and timed, and the
//! op as wick-nn runs it. Its composed form — the candle ops a GPU ran before the op's CUDA body,
//! and still runs without wick's kernels — is the same call under
//! `wick_nn::native::with_composed`, so the comparison is with the real fallback.

use candle_core::{DType, Device, Tensor};
use wick_nn::cnn;
use wick_nn::ops;

pub(crate) type Op = fn(&[Tensor]) -> candle_core::Result<Tensor>;
pub(crate) type Shapes = fn(usize, usize) -> Vec<Vec<usize>>;

/// One op: its name, the name it reports in the per-op counts, its inputs' shapes for a size
/// (rows, width), the sizes checked and the zoo's size timed, and how to run it (its composed form
/// is the same call under `wick_nn::native::with_composed`).
pub(crate) struct Case {
    pub(crate) name: &'static str,
    pub(crate) counted: &'static str,
    pub(crate) shapes: Shapes,
    pub(crate) sizes: &'static [(usize, usize)],
    pub(crate) zoo: (usize, usize, &'static str),
    pub(crate) op: Op,
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

/// Embeddings summed (BERT's word + position + type): (2, r, d) tokens, (r, d) positions, (d) a type.
fn add_broadcast_shapes(r: usize, d: usize) -> Vec<Vec<usize>> {
    vec![vec![2, r, d], vec![r, d], vec![d]]
}
fn add_broadcast(t: &[Tensor]) -> candle_core::Result<Tensor> {
    ops::add_broadcast(&t[0], &t[1], &t[2])
}

/// Batch norm's images: (BN_BATCH, channels, side, side) and a weight and bias per channel.
const BN_BATCH: usize = 4;
fn batch_norm_shapes(c: usize, side: usize) -> Vec<Vec<usize>> {
    vec![vec![BN_BATCH, c, side, side], vec![c], vec![c]]
}
/// Running estimates for the eval-mode case: means spread around 0, variances from 0.5 up.
pub(crate) fn estimates(c: usize, dev: &Device) -> candle_core::Result<(Tensor, Tensor)> {
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

/// Linear layers: rows × d inputs, a square weight and its bias (2-D, or the rows of two sequences).
fn linear_shapes(r: usize, d: usize) -> Vec<Vec<usize>> {
    vec![vec![r, d], vec![d, d], vec![d]]
}
fn linear_3d(r: usize, d: usize) -> Vec<Vec<usize>> {
    vec![vec![2, r, d], vec![d, d], vec![d]]
}
fn linear_no_bias(r: usize, d: usize) -> Vec<Vec<usize>> {
    vec![vec![r, d], vec![d, d]]
}
fn linear(t: &[Tensor]) -> candle_core::Result<Tensor> {
    ops::linear(&t[0], &t[1], t.get(2))
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
pub(crate) const CASES: [Case; 31] = [
    Case { name: "relu", counted: "relu", shapes: one, sizes: ELEMENTS, zoo: (32 * 64 * 56, 56, "ResNet-18's first stage, batch 32"), op: relu },
    Case { name: "relu6", counted: "relu6", shapes: one, sizes: ELEMENTS, zoo: (32 * 96 * 56, 56, "MobileNetV2's expansion, batch 32"), op: relu6 },
    Case { name: "gelu", counted: "gelu", shapes: one, sizes: ELEMENTS, zoo: (32 * 128, 3072, "BERT-base's feed-forward, 32 × 128 tokens"), op: gelu },
    Case { name: "silu_mul", counted: "silu_mul", shapes: two, sizes: ELEMENTS, zoo: (8 * 256, 1408, "decoder-512's SwiGLU, 8 × 256 tokens"), op: silu_mul },
    Case { name: "silu_mul packed", counted: "silu_mul", shapes: packed_pair, sizes: ELEMENTS, zoo: (8 * 256, 1408, "the same, gate and up packed"), op: silu_mul_packed },
    Case { name: "add_relu", counted: "add_relu", shapes: two, sizes: ELEMENTS, zoo: (32 * 64 * 56, 56, "ResNet-18's residual end, batch 32"), op: add_relu },
    Case { name: "layer_norm", counted: "layer_norm", shapes: layer_norm_shapes, sizes: ROWS, zoo: (32 * 128, 768, "BERT-base, 32 × 128 tokens"), op: layer_norm },
    Case { name: "layer_norm 3-D", counted: "layer_norm", shapes: layer_norm_3d, sizes: &[(5, 768)], zoo: (1024, 384, "MiniLM, 2 × 1024 tokens"), op: layer_norm },
    Case { name: "rms_norm", counted: "rms_norm", shapes: rms_norm_shapes, sizes: ROWS, zoo: (8 * 256, 512, "decoder-512, 8 × 256 tokens"), op: rms_norm },
    Case { name: "attention", counted: "attention", shapes: qkv_apart, sizes: HEAD_SIZES, zoo: (8 * 512, 64, "512 tokens"), op: attention },
    Case { name: "attention masked", counted: "attention", shapes: qkv_apart, sizes: HEAD_SIZES, zoo: (8 * 512, 64, "512 tokens, padding mask"), op: attention_masked },
    Case { name: "attention causal", counted: "attention", shapes: qkv_apart, sizes: HEAD_SIZES, zoo: (8 * 1024, 64, "1 024 tokens, causal"), op: attention_causal },
    Case { name: "attention packed", counted: "attention", shapes: qkv_packed, sizes: HEAD_SIZES, zoo: (8 * 1024, 64, "packed q, k, v, causal"), op: attention_packed },
    Case { name: "rope", counted: "rope", shapes: heads_apart, sizes: HEAD_SIZES, zoo: (8 * 1024, 64, "1 024 tokens"), op: rope },
    Case { name: "rope packed", counted: "rope", shapes: qkv_packed, sizes: HEAD_SIZES, zoo: (8 * 1024, 64, "packed q, k, v"), op: rope_packed },
    Case { name: "cross_entropy", counted: "cross_entropy", shapes: one, sizes: ROWS, zoo: (8 * 256, 32_000, "decoder-512's head, 8 × 256 tokens"), op: cross_entropy },
    Case { name: "embedding", counted: "embedding", shapes: one, sizes: ROWS, zoo: (32_000, 512, "decoder-512's table, 48 000 lookups"), op: embedding },
    Case { name: "max_pool 3x3/2", counted: "max_pool2d", shapes: image, sizes: IMAGES, zoo: (32 * 64, 112, "ResNet's stem, batch 32"), op: max_pool_3x3 },
    Case { name: "max_pool 2x2/2", counted: "max_pool2d", shapes: image, sizes: IMAGES, zoo: (32 * 64, 56, "a 2×2 pool, batch 32"), op: max_pool_2x2 },
    Case { name: "global_avg_pool", counted: "global_avg_pool", shapes: image, sizes: IMAGES, zoo: (32 * 512, 7, "ResNet-18's head, batch 32"), op: global_avg_pool },
    Case { name: "batch_norm train + relu", counted: "batch_norm", shapes: batch_norm_shapes, sizes: BN_SIZES, zoo: (64, 112, "ResNet's stem (batch 4 here)"), op: batch_norm_train },
    Case { name: "batch_norm eval + relu6", counted: "batch_norm", shapes: batch_norm_shapes, sizes: BN_SIZES, zoo: (576, 14, "MobileNetV2's expansion at 14² (batch 4 here)"), op: batch_norm_eval },
    Case { name: "linear", counted: "linear", shapes: linear_shapes, sizes: ROWS, zoo: (32 * 128, 768, "BERT-base's attention output, 32 × 128 tokens"), op: linear },
    Case { name: "linear 3-D", counted: "linear", shapes: linear_3d, sizes: &[(5, 96)], zoo: (8 * 512, 768, "decoder-768, 8 × 512 tokens"), op: linear },
    Case { name: "linear no bias", counted: "linear", shapes: linear_no_bias, sizes: ROWS, zoo: (8 * 512, 768, "a projection without bias, 8 × 512 tokens"), op: linear },
    Case { name: "conv2d 3x3/1 64→64", counted: "conv2d", shapes: conv_3x3_64, sizes: CONV_SIZES, zoo: (32, 56, "ResNet-18's first stage, batch 32"), op: conv_3x3_s1 },
    Case { name: "conv2d 7x7/2 stem", counted: "conv2d", shapes: conv_7x7_stem, sizes: CONV_SIZES, zoo: (32, 224, "ResNet's stem, batch 32"), op: conv_7x7_s2 },
    Case { name: "conv2d 1x1 256→64", counted: "conv2d", shapes: conv_1x1_256, sizes: CONV_SIZES, zoo: (32, 56, "ResNet-50's bottleneck entry, batch 32"), op: conv_1x1 },
    Case { name: "depthwise 3x3/2 96", counted: "depthwise_conv2d", shapes: depthwise_96, sizes: CONV_SIZES, zoo: (32, 112, "MobileNetV2's first strided depthwise, batch 32"), op: depthwise_3x3_s2 },
    Case { name: "add_broadcast", counted: "add_broadcast", shapes: add_broadcast_shapes, sizes: ROWS, zoo: (128, 768, "BERT-base's embeddings, 2 × 128 tokens"), op: add_broadcast },
    Case { name: "embedding padded", counted: "embedding", shapes: one, sizes: ROWS, zoo: (1000, 64, "a small table, padding id 3"), op: embedding_padded },
];
