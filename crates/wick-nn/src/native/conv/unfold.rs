//! A convolution's geometry and its columns: im2col (any range of output rows of any images,
//! unfolded into product operands as they are gathered) and col2im.

use std::ops::Range;

use candle_core::{Result, Shape};
use half::bf16;

use super::super::elem::Elem;
use super::super::pool::out_len;
use super::super::Real;
use super::err;

/// The geometry of a convolution: square kernel, same stride and padding on both axes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(in crate::native) struct Geometry {
    pub(in crate::native) n: usize,
    pub(in crate::native) c_in: usize,
    pub(in crate::native) h: usize,
    pub(in crate::native) w: usize,
    pub(in crate::native) c_out: usize,
    pub(in crate::native) k: usize,
    pub(in crate::native) stride: usize,
    pub(in crate::native) pad: usize,
    pub(in crate::native) oh: usize,
    pub(in crate::native) ow: usize,
}

impl Geometry {
    pub(in crate::native) fn new(
        x: &Shape,
        weight: &Shape,
        stride: usize,
        pad: usize,
        depthwise: bool,
    ) -> Result<Self> {
        let (&[n, c_in, h, w], &[c_out, wc, kh, kw]) = (x.dims(), weight.dims()) else {
            return Err(err(format!("conv2d: input {x:?} and weight {weight:?} must be 4-D")));
        };
        let expected_wc = if depthwise { 1 } else { c_in };
        if wc != expected_wc || kh != kw || (depthwise && c_out != c_in) {
            return Err(err(format!("conv2d: weight {weight:?} does not fit input {x:?}")));
        }
        // As PyTorch: no rows or columns is an error (padding alone would give it an output).
        if h == 0 || w == 0 {
            return Err(err(format!("conv2d: input {x:?} has an empty spatial dimension")));
        }
        let (oh, ow) = (out_len(h, kh, stride, pad)?, out_len(w, kw, stride, pad)?);
        Ok(Geometry { n, c_in, h, w, c_out, k: kh, stride, pad, oh, ow })
    }

    /// Rows of the column matrix (C_in·k·k).
    pub(super) fn rows(&self) -> usize {
        self.c_in * self.k * self.k
    }

    /// Columns of the column matrix (OH·OW).
    pub(in crate::native) fn cols(&self) -> usize {
        self.oh * self.ow
    }

    /// True when the image itself is the column matrix.
    pub(super) fn pointwise(&self) -> bool {
        self.k == 1 && self.stride == 1 && self.pad == 0
    }

    /// The convolution that computes a stride-1 convolution's input gradient from its output
    /// gradient: channels swapped, stride 1, padded by `k − 1 − pad` (needs `pad < k`), with the
    /// weights transposed and flipped.
    pub(super) fn input_gradient(&self) -> Geometry {
        Geometry {
            n: self.n,
            c_in: self.c_out,
            h: self.oh,
            w: self.ow,
            c_out: self.c_in,
            k: self.k,
            stride: 1,
            pad: self.k - 1 - self.pad,
            oh: self.h,
            ow: self.w,
        }
    }

    /// The input row feeding output row `o` at kernel offset `d`, if inside the image.
    #[inline]
    pub(in crate::native) fn source(&self, o: usize, d: usize, len: usize) -> Option<usize> {
        (o * self.stride + d).checked_sub(self.pad).filter(|i| *i < len)
    }

    /// The outputs `o` (of `out` along an axis of `len` inputs) whose input `o·stride + d − pad`
    /// lies inside the image.
    #[inline]
    pub(in crate::native) fn valid(&self, d: usize, len: usize, out: usize) -> Range<usize> {
        let (s, p) = (self.stride, self.pad);
        let lo = if p > d { (p - d).div_ceil(s) } else { 0 };
        let hi = if len + p > d { ((len + p - d - 1) / s + 1).min(out) } else { 0 };
        lo.min(hi)..hi
    }

    /// Per kernel column `dx`: the output columns whose input lies inside the image
    /// ([`Geometry::valid`] along a row) and the input column of the first of them (0 when there
    /// is none). They depend on neither the channel nor the row, so loops over rows take them
    /// from here instead of dividing again per row.
    pub(in crate::native) fn taps(&self) -> Vec<(Range<usize>, usize)> {
        (0..self.k)
            .map(|dx| {
                let r = self.valid(dx, self.w, self.ow);
                let first = (r.start * self.stride + dx).saturating_sub(self.pad);
                (r, first)
            })
            .collect()
    }

    /// Unfolds output rows `out_rows` of one image (C_in × H × W, stored as `E`) into columns
    /// `at..at + out_rows.len()·OW` of `col`, a matrix of operands `P` with `ld` elements per
    /// row (each element converted as gathered).
    #[inline(always)]
    fn im2col<P: Copy + Default, E: Gather<P>>(
        &self,
        img: &[E],
        col: &mut [P],
        (ld, at): (usize, usize),
        out_rows: Range<usize>,
    ) {
        let (k, l) = (self.k, out_rows.len() * self.ow);
        // Worked out once: the divisions in `valid` per row were a third of the unfolding's time.
        let taps = self.taps();
        for ci in 0..self.c_in {
            let plane = &img[ci * self.h * self.w..(ci + 1) * self.h * self.w];
            for dy in 0..k {
                for (dx, (r, first)) in taps.iter().enumerate() {
                    let row = &mut col[((ci * k + dy) * k + dx) * ld + at..][..l];
                    for (oy, dst) in out_rows.clone().zip(row.chunks_exact_mut(self.ow)) {
                        let Some(iy) = self.source(oy, dy, self.h) else {
                            dst.fill(P::default());
                            continue;
                        };
                        let src = &plane[iy * self.w..(iy + 1) * self.w];
                        dst[..r.start].fill(P::default());
                        dst[r.end..].fill(P::default());
                        if r.is_empty() {
                            continue;
                        }
                        if self.stride == 1 {
                            // One shifted copy.
                            E::gather_into(&src[*first..*first + r.len()], &mut dst[r.clone()]);
                        } else if self.stride == 2 {
                            // Every other input: pairs, so the compiler vectorises the gather.
                            let (n, d) = (r.len(), &mut dst[r.clone()]);
                            for (v, pair) in
                                d[..n - 1].iter_mut().zip(src[*first..*first + 2 * (n - 1)].chunks_exact(2))
                            {
                                *v = pair[0].gather();
                            }
                            d[n - 1] = src[*first + 2 * (n - 1)].gather();
                        } else {
                            for (v, s) in dst[r.clone()].iter_mut().zip(src[*first..].iter().step_by(self.stride)) {
                                *v = s.gather();
                            }
                        }
                    }
                }
            }
        }
    }

    /// Adds columns `at..at + out_rows.len()·OW` of `col` (`ld` elements per row), output rows
    /// `out_rows` of one image, back onto the image's gradient (C_in × H × W).
    pub(super) fn col2im<T: Real>(&self, col: &[T], (ld, at): (usize, usize), out_rows: Range<usize>, img: &mut [T]) {
        let (k, l) = (self.k, out_rows.len() * self.ow);
        let taps = self.taps();
        for ci in 0..self.c_in {
            let plane = &mut img[ci * self.h * self.w..(ci + 1) * self.h * self.w];
            for dy in 0..k {
                for (dx, (r, first)) in taps.iter().enumerate() {
                    let row = &col[((ci * k + dy) * k + dx) * ld + at..][..l];
                    for (j, oy) in out_rows.clone().enumerate() {
                        let Some(iy) = self.source(oy, dy, self.h) else { continue };
                        let dst = &mut plane[iy * self.w..(iy + 1) * self.w];
                        let src = &row[j * self.ow + r.start..j * self.ow + r.end];
                        for (v, ix) in src.iter().zip((*first..).step_by(self.stride)) {
                            dst[ix] = dst[ix] + *v;
                        }
                    }
                }
            }
        }
    }
}

/// `dst.copy_from_slice(src)` (the same length) for im2col's runs — an image row, 7 to 224
/// elements in ResNet — as fixed-size moves (16, 8 or 4 elements, the last one overlapping the
/// one before) instead of a call to `memmove` per run, whose cost on runs this short was most of
/// the copying (BENCHMARKS.md, "Kernel design measurements").
#[inline(always)]
fn copy_run<T: Copy>(src: &[T], dst: &mut [T]) {
    #[inline(always)]
    fn block<T: Copy, const N: usize>(src: &[T], dst: &mut [T], at: usize) {
        let mut run = [src[at]; N];
        run.copy_from_slice(&src[at..at + N]);
        dst[at..at + N].copy_from_slice(&run);
    }
    let n = dst.len().min(src.len());
    if n >= 16 {
        for at in (0..n - 15).step_by(16) {
            block::<T, 16>(src, dst, at);
        }
        if !n.is_multiple_of(16) {
            block::<T, 16>(src, dst, n - 16);
        }
    } else if n >= 8 {
        block::<T, 8>(src, dst, 0);
        block::<T, 8>(src, dst, n - 8);
    } else if n >= 4 {
        block::<T, 4>(src, dst, 0);
        block::<T, 4>(src, dst, n - 4);
    } else {
        for (d, s) in dst[..n].iter_mut().zip(src) {
            *d = *s;
        }
    }
}

/// An image element type gathered into product operands `P`: widened to the compute type, or
/// bf16 kept as bf16 for bf16 products ([`Operand`]).
pub(super) trait Gather<P>: Copy + Send + Sync + 'static {
    /// The element as an operand.
    fn gather(self) -> P;
    /// `src` gathered into `dst` (the same length).
    fn gather_into(src: &[Self], dst: &mut [P]);
    /// `v` itself when its elements are operands already (a 1×1 stride-1 convolution multiplies
    /// the image itself).
    fn as_operands(v: &[Self]) -> Option<&[P]>;
    /// Unfolds output rows `out_rows` of the images of `range`, side by side, into `col`
    /// ((C_in·k·k) × (images·rows·OW)).
    fn unfold(g: Geometry, x: &[Self], range: Range<usize>, out_rows: Range<usize>, col: &mut [P]);
}

impl<T: Real, E: Elem<T>> Gather<T> for E {
    #[inline(always)]
    fn gather(self) -> T {
        self.load()
    }
    #[inline(always)]
    fn gather_into(src: &[E], dst: &mut [T]) {
        match E::compute_slice(src) {
            Some(src) => copy_run(src, dst),
            None => E::widen_into(src, dst),
        }
    }
    fn as_operands(v: &[E]) -> Option<&[T]> {
        E::compute_slice(v)
    }
    fn unfold(g: Geometry, x: &[E], range: Range<usize>, out_rows: Range<usize>, col: &mut [T]) {
        unfold_images::<T, E>(g, x, range, out_rows, col)
    }
}

impl Gather<bf16> for bf16 {
    #[inline(always)]
    fn gather(self) -> bf16 {
        self
    }
    #[inline(always)]
    fn gather_into(src: &[bf16], dst: &mut [bf16]) {
        copy_run(src, dst)
    }
    fn as_operands(v: &[bf16]) -> Option<&[bf16]> {
        Some(v)
    }
    fn unfold(g: Geometry, x: &[bf16], range: Range<usize>, out_rows: Range<usize>, col: &mut [bf16]) {
        // Copies and strided gathers of 16-bit values: no widening to vectorise.
        let (img, l) = (g.c_in * g.h * g.w, out_rows.len() * g.ow);
        let ld = range.len() * l;
        for (j, b) in range.enumerate() {
            g.im2col(&x[b * img..(b + 1) * img], col, (ld, j * l), out_rows.clone());
        }
    }
}

wide_kernel! {
    /// [`Gather::unfold`] into the compute type, compiled for the CPU's widest vectors (its zero fills and strided
    /// gathers are loops of their own; the short row copies stay `memcpy` calls).
    fn unfold_images<T, E>(g: Geometry, x: &[E], range: Range<usize>, out_rows: Range<usize>, col: &mut [T]) {
        let (img, l) = (g.c_in * g.h * g.w, out_rows.len() * g.ow);
        let ld = range.len() * l;
        for (j, b) in range.enumerate() {
            g.im2col(&x[b * img..(b + 1) * img], col, (ld, j * l), out_rows.clone());
        }
    }
}
