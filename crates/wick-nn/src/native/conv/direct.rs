//! bf16 and f32 convolutions computed directly on the images (`wick_kernels::cpu::conv`): no
//! column matrix and no packed copy of the columns. Used for the forward pass, the input
//! gradient (stride 1 as a convolution of its own, a larger stride one phase of the input
//! positions at a time) and the stride-1 weight gradient of dense convolutions wide enough to
//! fill their lanes of channels.

use candle_core::Result;
use half::bf16;
use wick_kernels::cpu::conv::{available, conv_direct, weight_grad_direct, ChannelsLast, ConvDims, Element};
use wick_kernels::cpu::conv::{
    input_grad_strided, pointwise_applies, pointwise_weight_grad, strided_applies, PaddedImages, PositionLanes,
    WeightLayout, Weights,
};

use super::Geometry;

fn candle(e: wick_kernels::cpu::KernelError) -> candle_core::Error {
    candle_core::Error::Msg(e.to_string())
}

/// Input channels below which the im2col products stay (a 3-channel stem would pad its lanes
/// and repeat each tap's short depth; the direct kernel pays off on ResNet's 64 and wider).
const MIN_CHANNELS: usize = 16;

/// True when [`forward`] computes this convolution of `E`s: a CPU with E's AVX-512 features
/// (AVX512-BF16 for bf16), at least [`MIN_CHANNELS`] input channels, and a kernel wider than 1×1.
/// A 1×1 convolution's depth (the input channels alone) is too short for this kernel's
/// rearranging and transposed stores to pay. At stride 1 the product multiplies the images
/// themselves: direct, ResNet-50's AMP step took 1.13–1.19× the time and MobileNetV2's 1.28×. At
/// stride 2 its columns are a quarter of the image, copied once, and the product took 0.41–0.83×
/// the direct kernel's time on ResNet-50's three projections at batch 32 (bf16's at 7² outputs
/// 1.03–1.14×; the three 0.66×), its eval pass 0.91–0.97× at batch 1 to 32 (BENCHMARKS.md).
pub(super) fn applies<E: Element>(g: &Geometry) -> bool {
    g.c_in >= MIN_CHANNELS && g.k > 1 && available::<E>()
}

fn dims(g: &Geometry) -> ConvDims {
    ConvDims { n: g.n, c_in: g.c_in, h: g.h, w: g.w, c_out: g.c_out, k: g.k, stride: g.stride, pad: g.pad }
}

/// The convolution of images `x` with weights `w` ((C_out, C_in, k, k), contiguous), each sum
/// stored once (bf16: rounded once).
pub(super) fn forward<E: Element>(g: &Geometry, x: &[E], w: &[E]) -> Result<Vec<E>> {
    convolve(g, x, w, WeightLayout::Forward)
}

/// The input gradient of the convolution `g` from its output gradient `dy`. Stride 1: the
/// convolution of `dy` with the weights transposed (C_in ↔ C_out) and flipped, padded by
/// `k − 1 − pad` (packed from the weights as they are: no flipped copy). A larger stride: one
/// stride-1 convolution of `dy` per phase of the input positions, with that phase's taps
/// (`input_grad_strided`). Only where [`gradients`] says so.
pub(super) fn input_gradient<E: Element>(g: &Geometry, w: &[E], dy: &[E]) -> Result<Vec<E>> {
    if g.stride == 1 {
        return convolve(&g.input_gradient(), dy, w, WeightLayout::FlippedTransposed);
    }
    let mut dx = vec![E::ZERO; g.n * g.c_in * g.h * g.w];
    input_grad_strided(&mut dx, dy, w, dims(g)).map_err(candle)?;
    Ok(dx)
}

/// The convolution `g` of `x` with weights `w` stored as `layout`, each sum rounded once.
fn convolve<E: Element>(g: &Geometry, x: &[E], w: &[E], layout: WeightLayout) -> Result<Vec<E>> {
    let d = dims(g);
    let weights = Weights::new(d, w, layout).map_err(candle)?;
    let images = ChannelsLast::new(x, d).map_err(candle)?;
    let mut y = vec![E::ZERO; g.n * g.c_out * g.oh * g.ow];
    conv_direct(&mut y, &images, &weights).map_err(candle)?;
    Ok(y)
}

/// Which of `g`'s gradients are computed here, for `E`s: (the input gradient, by
/// [`input_gradient`], when wanted; the weight gradient, by [`weight_gradient`]). The input
/// gradient where `g` has stride 1 and a padding below k (a convolution of its own) and
/// [`applies`] to that convolution, or, for bf16, where `g` is strided with at least
/// [`MIN_CHANNELS`] output channels (the lanes its phases sum over) and a geometry
/// `strided_applies` to; the weight gradient where `g` has stride 1, [`applies`] to `g`, and the
/// input gradient, when wanted, is computed here too (else the product computes both in one pass
/// over the columns). Strided f32 input gradients stay on the product: next to f32's
/// multiply-adds the columns cost little, and phase by phase ResNet-18's three stride-2 layers
/// took 0.99–1.13× their time (BENCHMARKS.md, "Stride-2 input gradients direct").
pub(super) fn gradients<E: Element>(g: &Geometry, want_dx: bool) -> (bool, bool) {
    let stride_1 = g.stride == 1 && g.pad < g.k && applies::<E>(&g.input_gradient());
    let strided =
        E::PER_LANE == 2 && g.stride > 1 && g.c_out >= MIN_CHANNELS && available::<E>() && strided_applies(&dims(g));
    let input = want_dx && (stride_1 || strided);
    (input, g.stride == 1 && applies::<E>(g) && (!want_dx || input))
}

/// The weight gradient of `g` ((C_out, C_in·k·k), f32 sums) from images `x` and output
/// gradient `dy`. Only where [`gradients`] says so.
pub(super) fn weight_gradient<E: Element>(g: &Geometry, x: &[E], dy: &[E]) -> Result<Vec<f32>> {
    let d = dims(g);
    let images = PaddedImages::new(x, d).map_err(candle)?;
    let grads = PositionLanes::new(dy, d).map_err(candle)?;
    let mut dw = vec![0f32; g.c_out * g.rows()];
    weight_grad_direct(&mut dw, &images, &grads).map_err(candle)?;
    Ok(dw)
}

/// True when [`pointwise_weight_gradient`] computes the weight gradient of `g`: a 1×1 stride-1
/// convolution over large planes with few channels on one side (`pointwise_applies`).
pub(super) fn pointwise(g: &Geometry) -> bool {
    g.pointwise() && pointwise_applies(g.c_in, g.c_out, g.h * g.w)
}

/// The weight gradient of a 1×1 stride-1 convolution `g` ((C_out, C_in), f32 sums) from bf16
/// images `x` and output gradient `dy`, summed along the positions in place
/// (`pointwise_weight_grad`). Only where [`pointwise`] says so.
pub(super) fn pointwise_weight_gradient(g: &Geometry, x: &[bf16], dy: &[bf16]) -> Result<Vec<f32>> {
    pointwise_weight_grad(x, dy, (g.n, g.c_in, g.c_out, g.h * g.w)).map_err(candle)
}
