//! Direct convolutions, bf16 with f32 sums on AVX512-BF16 and f32 on AVX-512: no column
//! matrix (im2col) and no packing of the images.
//!
//! Why: multiplied as a matrix product, a k×k convolution first unfolds every image into a
//! column matrix k² times its size, and the product then packs those columns into panels — two
//! passes over k² copies of the input for each product, a fifth of a ResNet AMP step and a
//! sixth of an f32 one (BENCHMARKS.md, issue 30). Here the images are rearranged once per call
//! into a padded channels-last layout of 32-bit lanes ([`ChannelsLast`]: a lane is a pair of
//! bf16 channels or one f32 channel, [`Element`]), and the micro-kernel reads them in place: its
//! tile is `MR` output positions × 32 output channels, and for each tap and lane it broadcasts
//! the lane straight from the image (`vdpbf16ps` multiplies pairs, `vfmadd231ps` single values)
//! against 32 output channels' weights, packed a block at a time by the worker using it
//! ([`Weights`]). Any stride
//! works the same way: a position's window starts wherever its offset says.
//!
//! The output is NCHW, as the caller's tensors are: each tile's sums are stored (bf16: rounded
//! once) as 32 runs of `MR` consecutive positions (one per output channel).
//!
//! Numerics: each output is one f32 sum over all taps and lanes, in a fixed order (bf16: rounded
//! once; the pair `(c, c+1)` at one tap added as one by the instruction, which treats subnormal
//! inputs and results as zero, as the bf16 products of [`super::gemm::bf16`] do).
//!
//! Modules: `element` (bf16 and f32, [`Element`]: the only code that differs between them),
//! `forward` (the images' lanes, the micro-kernel, [`conv_direct`]), `pack` (the weights,
//! [`Weights`]), `strided` (a strided convolution's input gradient as one stride-1 convolution
//! per phase of the input positions, [`input_grad_strided`]), `weight_grad` (a stride-1
//! convolution's weight gradient, [`weight_grad_direct`], summed over lanes of positions
//! instead), `pointwise` (a 1×1 stride-1 convolution's weight gradient over large planes,
//! [`pointwise_weight_grad`], summed along the positions in place).

mod element;
mod forward;
mod pack;
mod pointwise;
mod strided;
mod weight_grad;

use element::with_features;
pub use element::Element;
pub use forward::{conv_direct, ChannelsLast};
pub use pack::{WeightLayout, Weights};
pub use pointwise::{pointwise_applies, pointwise_weight_grad};
pub use strided::{input_grad_strided, strided_applies};
pub use weight_grad::{weight_grad_direct, PaddedImages, PositionLanes};

use crate::cpu::KernelError;

/// Output positions of a micro-tile (its rows).
const MR: usize = 12;
/// Output channels of a micro-tile (two 16-lane registers): weights are packed in blocks of it.
const NB: usize = 32;

fn error(message: String) -> KernelError {
    KernelError { kernel: "wick direct convolution", message }
}

/// An error unless `len` is the product of `sizes` (the elements `what` holds for `dims`).
fn expect_len(len: usize, sizes: &[usize], what: &str, dims: &ConvDims) -> Result<(), KernelError> {
    match sizes.iter().try_fold(1usize, |a, b| a.checked_mul(*b)) {
        Some(n) if n == len => Ok(()),
        _ => Err(error(format!("{len} {what} for {dims:?}"))),
    }
}

/// The length of a buffer of `sizes` elements, or an error naming `what` when it overflows.
fn buffer_len(sizes: &[usize], what: &str, dims: &ConvDims) -> Result<usize, KernelError> {
    sizes
        .iter()
        .try_fold(1usize, |a, b| a.checked_mul(*b))
        .ok_or_else(|| error(format!("the {what} of {dims:?} overflow")))
}

/// A convolution's dimensions: images (n, c_in, h, w), weights (c_out, c_in, k, k), the same
/// stride and zero padding along both axes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ConvDims {
    /// Images.
    pub n: usize,
    /// Input channels.
    pub c_in: usize,
    /// Image height.
    pub h: usize,
    /// Image width.
    pub w: usize,
    /// Output channels.
    pub c_out: usize,
    /// Kernel size (k × k).
    pub k: usize,
    /// Stride.
    pub stride: usize,
    /// Zero padding on every side.
    pub pad: usize,
}

impl ConvDims {
    /// Output height and width; an error when the window does not fit or a size overflows.
    pub fn out_hw(&self) -> Result<(usize, usize), KernelError> {
        let out = |len: usize| {
            let padded = self.pad.checked_mul(2).and_then(|p| p.checked_add(len));
            match padded {
                Some(p) if self.k > 0 && self.stride > 0 && p >= self.k => Ok((p - self.k) / self.stride + 1),
                _ => Err(error(format!("a {}×{} window does not fit {len} padded by {}", self.k, self.k, self.pad))),
            }
        };
        Ok((out(self.h)?, out(self.w)?))
    }

    /// Lanes of input channels (bf16: pairs, the last one half zero when `c_in` is odd).
    fn lanes<E: Element>(&self) -> usize {
        self.c_in.div_ceil(E::PER_LANE)
    }

    /// (padded height, padded width).
    fn padded(&self) -> (usize, usize) {
        (self.h + 2 * self.pad, self.w + 2 * self.pad)
    }
}

/// True when this CPU runs the direct kernels for `E` ([`Element::available`]).
pub fn available<E: Element>() -> bool {
    E::available()
}

/// Sixteen registers of 16 32-bit lanes transposed: lane i of result j is lane j of row i.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
#[inline]
fn transpose16(r: [std::arch::x86_64::__m512i; 16]) -> [std::arch::x86_64::__m512i; 16] {
    use std::arch::x86_64::*;
    let z = _mm512_setzero_si512();
    // Rows 2k, 2k + 1 interleaved by lane, then rows 4k..4k + 3 by lane pairs: u[4k + m]'s
    // 128-bit part l holds column 4l + m of rows 4k..4k + 3.
    let mut t = [z; 16];
    for k in 0..8 {
        t[2 * k] = _mm512_unpacklo_epi32(r[2 * k], r[2 * k + 1]);
        t[2 * k + 1] = _mm512_unpackhi_epi32(r[2 * k], r[2 * k + 1]);
    }
    let mut u = [z; 16];
    for k in 0..4 {
        u[4 * k] = _mm512_unpacklo_epi64(t[4 * k], t[4 * k + 2]);
        u[4 * k + 1] = _mm512_unpackhi_epi64(t[4 * k], t[4 * k + 2]);
        u[4 * k + 2] = _mm512_unpacklo_epi64(t[4 * k + 1], t[4 * k + 3]);
        u[4 * k + 3] = _mm512_unpackhi_epi64(t[4 * k + 1], t[4 * k + 3]);
    }
    // The 128-bit parts gathered: column 4l + m is part l of u[m], u[4 + m], u[8 + m], u[12 + m].
    let mut out = [z; 16];
    for m in 0..4 {
        let even_a = _mm512_shuffle_i32x4::<0x88>(u[m], u[4 + m]);
        let even_b = _mm512_shuffle_i32x4::<0x88>(u[8 + m], u[12 + m]);
        let odd_a = _mm512_shuffle_i32x4::<0xdd>(u[m], u[4 + m]);
        let odd_b = _mm512_shuffle_i32x4::<0xdd>(u[8 + m], u[12 + m]);
        out[m] = _mm512_shuffle_i32x4::<0x88>(even_a, even_b);
        out[8 + m] = _mm512_shuffle_i32x4::<0xdd>(even_a, even_b);
        out[4 + m] = _mm512_shuffle_i32x4::<0x88>(odd_a, odd_b);
        out[12 + m] = _mm512_shuffle_i32x4::<0xdd>(odd_a, odd_b);
    }
    out
}

/// `rows` transposed ([`transpose16`]), and the first `lanes` lanes of each of the first `count`
/// results stored at `at + i·stride` of `dst` (result i); panics when one would lie outside.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
#[inline]
fn store_transposed(
    rows: [std::arch::x86_64::__m512i; 16],
    (count, lanes): (usize, usize),
    dst: &mut [u32],
    (at, stride): (usize, usize),
) {
    use std::arch::x86_64::*;
    assert!(lanes <= 16, "conv_direct: {lanes} lanes of a 16-lane register");
    let mask = ((1u32 << lanes) - 1) as u16;
    for (i, run) in transpose16(rows).iter().enumerate().take(count) {
        let start = at + i * stride;
        assert!(start + lanes <= dst.len(), "conv_direct: a transposed run outside its buffer");
        // SAFETY: lanes start..start + lanes of dst (checked).
        unsafe { _mm512_mask_storeu_epi32(dst.as_mut_ptr().add(start).cast(), mask, *run) };
    }
}

#[cfg(test)]
mod tests;
