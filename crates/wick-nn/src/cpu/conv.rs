//! Convolutions with closed-form backward passes.
//!
//! Dense (groups = 1): each image's windows are unfolded into a (C_in·k·k) × (OH·OW) column
//! matrix (im2col; a 1×1 stride-1 convolution uses the image itself), and the output is one gemm,
//! `W · col`. Backward: `dW = Σ_images dY · colᵀ` (the columns are unfolded again, not kept) and,
//! only when the input needs a gradient, `dcol = Wᵀ · dY` folded back onto the image (col2im).
//! Images run in parallel, one gemm per thread, when there are at least as many as threads.
//! With bf16 images, weights and gradients on a CPU with AVX512-BF16 the columns stay bf16 and
//! the products are bf16 with f32 sums (`gemm_bf16`; the `Gather` trait here, `Operand` and `Out`
//! in `gemm`).
//!
//! Depthwise convolutions are in [`super::depthwise`].

use std::sync::Mutex;

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp2, Layout, Result, Shape, Tensor};

use super::elem::{by_elem, elem_tensor, elems, with_elems, Elem};
use super::gemm::{Operand, Out};
use super::pool::out_len;
use super::{read, tensor, with, Mat, Real, SharedMut};
use half::bf16;

fn err(msg: String) -> candle_core::Error {
    candle_core::Error::Msg(msg)
}

/// The geometry of a convolution: square kernel, same stride and padding on both axes.
#[derive(Clone, Copy, Debug)]
pub(super) struct Geometry {
    pub(super) n: usize,
    pub(super) c_in: usize,
    pub(super) h: usize,
    pub(super) w: usize,
    pub(super) c_out: usize,
    pub(super) k: usize,
    pub(super) stride: usize,
    pub(super) pad: usize,
    pub(super) oh: usize,
    pub(super) ow: usize,
}

impl Geometry {
    pub(super) fn new(x: &Shape, weight: &Shape, stride: usize, pad: usize, depthwise: bool) -> Result<Self> {
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
    fn rows(&self) -> usize {
        self.c_in * self.k * self.k
    }

    /// Columns of the column matrix (OH·OW).
    pub(super) fn cols(&self) -> usize {
        self.oh * self.ow
    }

    /// True when the image itself is the column matrix.
    fn pointwise(&self) -> bool {
        self.k == 1 && self.stride == 1 && self.pad == 0
    }

    /// The input row feeding output row `o` at kernel offset `d`, if inside the image.
    #[inline]
    pub(super) fn source(&self, o: usize, d: usize, len: usize) -> Option<usize> {
        (o * self.stride + d).checked_sub(self.pad).filter(|i| *i < len)
    }

    /// The outputs `o` (of `out` along an axis of `len` inputs) whose input `o·stride + d − pad`
    /// lies inside the image.
    #[inline]
    pub(super) fn valid(&self, d: usize, len: usize, out: usize) -> std::ops::Range<usize> {
        let (s, p) = (self.stride, self.pad);
        let lo = if p > d { (p - d).div_ceil(s) } else { 0 };
        let hi = if len + p > d { ((len + p - d - 1) / s + 1).min(out) } else { 0 };
        lo.min(hi)..hi
    }

    /// Per kernel column `dx`: the output columns whose input lies inside the image
    /// ([`Geometry::valid`] along a row) and the input column of the first of them (0 when there
    /// is none). They depend on neither the channel nor the row, so loops over rows take them
    /// from here instead of dividing again per row.
    pub(super) fn taps(&self) -> Vec<(std::ops::Range<usize>, usize)> {
        (0..self.k)
            .map(|dx| {
                let r = self.valid(dx, self.w, self.ow);
                let first = (r.start * self.stride + dx).saturating_sub(self.pad);
                (r, first)
            })
            .collect()
    }

    /// Unfolds one image (C_in × H × W, stored as `E`) into columns `at..at + cols` of `col`, a
    /// matrix of operands `P` with `ld` elements per row (each element converted as gathered).
    #[inline(always)]
    fn im2col<P: Copy + Default, E: Gather<P>>(&self, img: &[E], col: &mut [P], ld: usize, at: usize) {
        let (k, l) = (self.k, self.cols());
        // Worked out once: the divisions in `valid` per row were a third of the unfolding's time.
        let taps = self.taps();
        for ci in 0..self.c_in {
            let plane = &img[ci * self.h * self.w..(ci + 1) * self.h * self.w];
            for dy in 0..k {
                for (dx, (r, first)) in taps.iter().enumerate() {
                    let row = &mut col[((ci * k + dy) * k + dx) * ld + at..][..l];
                    for (oy, dst) in row.chunks_exact_mut(self.ow).enumerate() {
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

    /// Adds columns `at..at + cols` of `col` (`ld` elements per row) back onto one image's
    /// gradient (C_in × H × W).
    fn col2im<T: Real>(&self, col: &[T], ld: usize, at: usize, img: &mut [T]) {
        let (k, l) = (self.k, self.cols());
        let taps = self.taps();
        for ci in 0..self.c_in {
            let plane = &mut img[ci * self.h * self.w..(ci + 1) * self.h * self.w];
            for dy in 0..k {
                for (dx, (r, first)) in taps.iter().enumerate() {
                    let row = &col[((ci * k + dy) * k + dx) * ld + at..][..l];
                    for oy in 0..self.oh {
                        let Some(iy) = self.source(oy, dy, self.h) else { continue };
                        let dst = &mut plane[iy * self.w..(iy + 1) * self.w];
                        let src = &row[oy * self.ow + r.start..oy * self.ow + r.end];
                        for (v, ix) in src.iter().zip((*first..).step_by(self.stride)) {
                            dst[ix] = dst[ix] + *v;
                        }
                    }
                }
            }
        }
    }
}

/// Columns per gemm below which images are grouped: deep layers have few positions per image
/// (ResNet's last stage at 112² has 16), and gemm runs a 16-column product far below its
/// speed. On ResNet-18 (112², batch 16) groups of up to 64 columns beat one image at a time,
/// and groups of 256 or 1024 columns were slower than either (their column matrices no longer
/// fit the caches): BENCHMARKS.md, "Kernel design measurements".
const GROUP_COLUMNS: usize = 64;

/// How the images of a batch are split: `size` images per group, `groups` groups, `workers`
/// groups at a time (each on its own thread with single-threaded gemms; one worker runs its
/// gemms in parallel instead).
#[derive(Clone, Copy)]
struct Plan {
    size: usize,
    groups: usize,
    workers: usize,
}

impl Plan {
    fn new(g: &Geometry) -> Self {
        let size = GROUP_COLUMNS.div_ceil(g.cols().max(1)).clamp(1, g.n.max(1));
        let groups = g.n.div_ceil(size);
        Plan { size, groups, workers: groups.min(rayon::current_num_threads()).max(1) }
    }

    /// The images of group `i`.
    fn images(&self, i: usize, n: usize) -> std::ops::Range<usize> {
        i * self.size..((i + 1) * self.size).min(n)
    }

    /// Runs `f(worker, group, parallel_gemm)` for every group, `workers` at a time; the first
    /// error is returned.
    fn run(&self, f: impl Fn(usize, usize, bool) -> Result<()> + Send + Sync) -> Result<()> {
        let failure = Mutex::new(None);
        let parallel = self.workers == 1;
        let per = self.groups.div_ceil(self.workers);
        use rayon::prelude::*;
        (0..self.workers).into_par_iter().for_each(|w| {
            for group in w * per..((w + 1) * per).min(self.groups) {
                if let Err(e) = f(w, group, parallel) {
                    *failure.lock().unwrap_or_else(|p| p.into_inner()) = Some(e);
                    return;
                }
            }
        });
        match failure.into_inner().unwrap_or_else(|p| p.into_inner()) {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }
}

/// Per-worker scratch buffers, taken by one worker at a time.
struct Scratch<T>(Vec<Mutex<Vec<T>>>);

impl<T: Copy + Default> Scratch<T> {
    fn new(workers: usize, len: usize) -> Self {
        Scratch((0..workers).map(|_| Mutex::new(vec![T::default(); len])).collect())
    }

    fn get(&self, worker: usize) -> Result<std::sync::MutexGuard<'_, Vec<T>>> {
        let slot = self.0.get(worker).ok_or_else(|| err(format!("conv2d: no scratch for worker {worker}")))?;
        Ok(slot.lock().unwrap_or_else(|p| p.into_inner()))
    }
}

/// An image element type gathered into product operands `P`: widened to the compute type, or
/// bf16 kept as bf16 for bf16 products ([`Operand`]).
trait Gather<P>: Copy + Send + Sync + 'static {
    /// The element as an operand.
    fn gather(self) -> P;
    /// `src` gathered into `dst` (the same length).
    fn gather_into(src: &[Self], dst: &mut [P]);
    /// `v` itself when its elements are operands already (a 1×1 stride-1 convolution multiplies
    /// the image itself).
    fn as_operands(v: &[Self]) -> Option<&[P]>;
    /// Unfolds the images of `range` side by side into `col` ((C_in·k·k) × (images·OH·OW)).
    fn unfold(g: Geometry, x: &[Self], range: std::ops::Range<usize>, col: &mut [P]);
}

impl<T: Real, E: Elem<T>> Gather<T> for E {
    #[inline(always)]
    fn gather(self) -> T {
        self.load()
    }
    #[inline(always)]
    fn gather_into(src: &[E], dst: &mut [T]) {
        E::widen_into(src, dst)
    }
    fn as_operands(v: &[E]) -> Option<&[T]> {
        E::compute_slice(v)
    }
    fn unfold(g: Geometry, x: &[E], range: std::ops::Range<usize>, col: &mut [T]) {
        unfold_images::<T, E>(g, x, range, col)
    }
}

impl Gather<bf16> for bf16 {
    #[inline(always)]
    fn gather(self) -> bf16 {
        self
    }
    #[inline(always)]
    fn gather_into(src: &[bf16], dst: &mut [bf16]) {
        dst.copy_from_slice(src)
    }
    fn as_operands(v: &[bf16]) -> Option<&[bf16]> {
        Some(v)
    }
    fn unfold(g: Geometry, x: &[bf16], range: std::ops::Range<usize>, col: &mut [bf16]) {
        // Copies and strided gathers of 16-bit values: no widening to vectorise.
        let (img, l, ld) = (g.c_in * g.h * g.w, g.cols(), range.len() * g.cols());
        for (j, b) in range.enumerate() {
            g.im2col(&x[b * img..(b + 1) * img], col, ld, j * l);
        }
    }
}

/// True when bf16 tensors are multiplied as bf16 ([`super::gemm_bf16`]).
fn bf16_products(dtype: candle_core::DType) -> bool {
    dtype == candle_core::DType::BF16 && super::gemm_bf16::available()
}

struct Conv2d {
    stride: usize,
    pad: usize,
}

impl Conv2d {
    /// True when the images `x` must be widened to the compute type first: a 1×1 stride-1
    /// convolution multiplies the image itself, which the gemm reads in `T` only. Any other
    /// convolution widens each element as im2col gathers it (no widened copy of the input).
    fn widen_first<T: Real, E: Elem<T>>(g: &Geometry, x: &[E]) -> bool {
        g.pointwise() && E::compute_slice(x).is_none()
    }

    fn fwd<T: Real, E: Elem<T>>(
        &self,
        sx: &CpuStorage,
        lx: &Layout,
        sw: &CpuStorage,
        lw: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let g = Geometry::new(lx.shape(), lw.shape(), self.stride, self.pad, false)?;
        let (x, w) = (elems::<T, E>(sx, lx)?, read::<T>(sw, lw)?);
        let y = if Self::widen_first(&g, x) {
            Self::forward(&g, &read::<T>(sx, lx)?, &w)?
        } else {
            Self::forward(&g, x, &w)?
        };
        Ok((T::storage(y, sx.dtype())?, Shape::from((g.n, g.c_out, g.oh, g.ow))))
    }

    /// [`Conv2d::fwd`] for bf16 images and weights, multiplied as bf16 (f32 sums).
    fn fwd_bf16(&self, sx: &CpuStorage, lx: &Layout, sw: &CpuStorage, lw: &Layout) -> Result<(CpuStorage, Shape)> {
        let g = Geometry::new(lx.shape(), lw.shape(), self.stride, self.pad, false)?;
        let (x, w) = (elems::<f32, bf16>(sx, lx)?, elems::<f32, bf16>(sw, lw)?);
        let y = if super::gemm_bf16::rounds_directly(g.rows()) {
            // Each sum rounded as the product stores it: no f32 output, no rounding pass.
            CpuStorage::BF16(Self::forward::<f32, bf16, bf16, bf16>(&g, x, w)?)
        } else {
            f32::storage(Self::forward::<f32, bf16, bf16, f32>(&g, x, w)?, sx.dtype())?
        };
        Ok((y, Shape::from((g.n, g.c_out, g.oh, g.ow))))
    }

    /// The convolution of images `x` with weights `w` (row-major (C_out, C_in·k·k)).
    fn forward<T: Real, E: Gather<P>, P: Operand<T>, O: Out<T, P>>(g: &Geometry, x: &[E], w: &[P]) -> Result<Vec<O>> {
        Self::forward_by(g, x, Mat::rows(w, g.c_out, g.rows()))
    }

    /// [`Conv2d::forward`] with the weights as any (C_out × C_in·k·k) matrix view. A 1×1
    /// stride-1 convolution's images must be operands already ([`Conv2d::widen_first`]).
    fn forward_by<T: Real, E: Gather<P>, P: Operand<T>, O: Out<T, P>>(
        g: &Geometry,
        x: &[E],
        wm: Mat<'_, P>,
    ) -> Result<Vec<O>> {
        let (rows, cols, img) = (g.rows(), g.cols(), g.c_in * g.h * g.w);
        let mut y = vec![O::default(); g.n * g.c_out * cols];
        let out = SharedMut::new(&mut y);
        let plan = Plan::new(g);
        // One image at a time writes straight into the output; a group goes through a
        // (C_out × images·positions) buffer.
        let direct = plan.size == 1;
        let col = Scratch::<P>::new(plan.workers, if direct && g.pointwise() { 0 } else { rows * plan.size * cols });
        let ybuf = Scratch::<O>::new(plan.workers, if direct { 0 } else { g.c_out * plan.size * cols });
        plan.run(|worker, group, parallel| {
            let range = plan.images(group, g.n);
            let ld = range.len() * cols;
            let mut col = col.get(worker)?;
            let cm: &[P] = if direct && g.pointwise() {
                E::as_operands(&x[range.start * img..range.end * img])
                    .ok_or_else(|| err("conv2d: a 1×1 convolution's images were not widened".into()))?
            } else {
                E::unfold(*g, x, range.clone(), &mut col);
                &col
            };
            if direct {
                // SAFETY: one image's output per group.
                let dst = unsafe { out.range(range.start * g.c_out * cols, g.c_out * cols) };
                return O::product(dst, wm, Mat::rows(cm, rows, cols), parallel);
            }
            let mut yb = ybuf.get(worker)?;
            O::product(&mut yb, wm, Mat::rows(cm, rows, ld), parallel)?;
            for (j, b) in range.enumerate() {
                // SAFETY: image `b` belongs to this group only.
                let dst = unsafe { out.range(b * g.c_out * cols, g.c_out * cols) };
                for (c, row) in dst.chunks_mut(cols).enumerate() {
                    row.copy_from_slice(&yb[c * ld + j * cols..][..cols]);
                }
            }
            Ok(())
        })?;
        Ok(y)
    }

    /// The input gradient of a stride-1 convolution, as a convolution of the output gradient
    /// with the weights transposed (C_in ↔ C_out) and flipped, padded by `k − 1 − pad`: its gemm
    /// sums over C_out·k·k, where the col2im route's sums over C_out only (a short inner
    /// dimension that gemm runs at half speed) and then scatters k² copies back.
    fn input_gradient<T: Real, P: Operand<T> + Gather<P>, O: Out<T, P>>(
        g: &Geometry,
        w: &[P],
        dy: &[P],
    ) -> Result<Vec<O>> {
        let (k, kk) = (g.k, g.k * g.k);
        let back = Geometry {
            n: g.n,
            c_in: g.c_out,
            h: g.oh,
            w: g.ow,
            c_out: g.c_in,
            k,
            stride: 1,
            pad: k - 1 - g.pad,
            oh: g.h,
            ow: g.w,
        };
        if kk == 1 {
            // Nothing to flip: the transposed weights are a view (the copy was a strided
            // transpose of every 1×1 weight, a visible share of a ResNet-50 step).
            return Self::forward_by(&back, dy, Mat::rows(w, g.c_out, g.c_in).t());
        }
        // Written in order (each source run of k² taps read whole): the other loop order
        // scattered every write across the output.
        let mut flipped = vec![P::default(); w.len()];
        for (ci, dst) in flipped.chunks_exact_mut(g.c_out * kk).enumerate() {
            for (co, taps) in dst.chunks_exact_mut(kk).enumerate() {
                let src = &w[(co * g.c_in + ci) * kk..][..kk];
                for (d, s) in taps.iter_mut().zip(src.iter().rev()) {
                    *d = *s;
                }
            }
        }
        Self::forward(&back, dy, &flipped)
    }

    /// (dx when wanted, dw).
    fn bwd<T: Real, E: Elem<T>>(
        &self,
        x: &Tensor,
        w: &Tensor,
        dy: &Tensor,
        want_dx: bool,
    ) -> Result<(Option<Vec<T>>, Vec<T>)> {
        let g = Geometry::new(x.shape(), w.shape(), self.stride, self.pad, false)?;
        with::<T, _>(w, |w| {
            with::<T, _>(dy, |dy| {
                with_elems::<T, E, _>(x, |xe| {
                    if Self::widen_first(&g, xe) {
                        with::<T, _>(x, |x| Self::bwd_from::<T, T, T>(g, x, w, dy, want_dx))
                    } else {
                        Self::bwd_from::<T, E, T>(g, xe, w, dy, want_dx)
                    }
                })
            })
        })
    }

    /// [`Conv2d::bwd`] for bf16 images, weights and output gradients, multiplied as bf16.
    ///
    /// A stride-1 input gradient whose sums fit one slice of the product is written in bf16 as
    /// it is computed (no f32 result, no rounding pass).
    fn bwd_bf16(&self, x: &Tensor, w: &Tensor, dy: &Tensor, want_dx: bool) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let g = Geometry::new(x.shape(), w.shape(), self.stride, self.pad, false)?;
        let direct_dx =
            want_dx && Self::dx_by_convolution(&g) && super::gemm_bf16::rounds_directly(g.c_out * g.k * g.k);
        let (dx, dw) = with_elems::<f32, bf16, _>(w, |w| {
            with_elems::<f32, bf16, _>(dy, |dy| {
                let (dx, dw) = with_elems::<f32, bf16, _>(x, |x| {
                    Self::bwd_from::<f32, bf16, bf16>(g, x, w, dy, want_dx && !direct_dx)
                })?;
                let dx = match dx {
                    Some(dx) => Some(tensor(dx, x.shape(), x.dtype())?),
                    None if direct_dx => {
                        let dx = Self::input_gradient::<f32, bf16, bf16>(&g, w, dy)?;
                        Some(elem_tensor::<f32, bf16>(dx, x.shape())?)
                    }
                    None => None,
                };
                Ok((dx, dw))
            })
        })?;
        Ok((dx, super::weight_grad(w, dw)?))
    }

    /// True when the input gradient is a convolution of its own ([`Conv2d::input_gradient`]:
    /// stride 1) rather than columns folded back onto the image.
    fn dx_by_convolution(g: &Geometry) -> bool {
        g.stride == 1 && g.pad < g.k
    }

    /// [`Conv2d::bwd`] from the images as stored (`E`) or widened, with weights and output
    /// gradients as operands `P`.
    fn bwd_from<T: Real, E: Gather<P>, P: Operand<T> + Gather<P>>(
        g: Geometry,
        x: &[E],
        w: &[P],
        dy: &[P],
        want_dx: bool,
    ) -> Result<(Option<Vec<T>>, Vec<T>)> {
        let (rows, cols, img) = (g.rows(), g.cols(), g.c_in * g.h * g.w);
        let plan = Plan::new(&g);
        {
            {
                let width = plan.size * cols;
                let direct = plan.size == 1 && g.pointwise();
                let col = Scratch::<P>::new(plan.workers, if direct { 0 } else { rows * width });
                let gbuf = Scratch::<P>::new(plan.workers, if plan.size == 1 { 0 } else { g.c_out * width });
                // Stride 1: the input gradient is a convolution of its own (below).
                let by_columns = want_dx && !Self::dx_by_convolution(&g);
                let dcol = Scratch::<T>::new(plan.workers, if by_columns { rows * width } else { 0 });
                // dW: one partial sum per worker, added at the end.
                let dws = Scratch::<T>::new(plan.workers, g.c_out * rows);
                let mut dx = if by_columns { vec![T::zero(); x.len()] } else { Vec::new() };
                let sdx = SharedMut::new(&mut dx);
                plan.run(|worker, group, parallel| {
                    let range = plan.images(group, g.n);
                    let ld = range.len() * cols;
                    let (mut col, mut gb, mut dw) = (col.get(worker)?, gbuf.get(worker)?, dws.get(worker)?);
                    // A 1×1 stride-1 convolution's columns are the image itself (one image
                    // per group): no copy.
                    let cm: &[P] = if direct {
                        E::as_operands(&x[range.start * img..range.end * img])
                            .ok_or_else(|| err("conv2d: a 1×1 convolution's images were not widened".into()))?
                    } else {
                        E::unfold(g, x, range.clone(), &mut col);
                        &col[..rows * ld]
                    };
                    // The group's output gradient as (C_out × images·positions): one image's
                    // is its own slice.
                    let gm = if range.len() == 1 {
                        Mat::rows(&dy[range.start * g.c_out * cols..range.end * g.c_out * cols], g.c_out, cols)
                    } else {
                        for (j, b) in range.clone().enumerate() {
                            let src = &dy[b * g.c_out * cols..(b + 1) * g.c_out * cols];
                            for (c, row) in src.chunks(cols).enumerate() {
                                gb[c * ld + j * cols..][..cols].copy_from_slice(row);
                            }
                        }
                        Mat::rows(&gb[..g.c_out * ld], g.c_out, ld)
                    };
                    P::product(&mut dw, gm, Mat::rows(cm, rows, ld).t(), T::one(), true, parallel)?;
                    if by_columns {
                        let mut dc = dcol.get(worker)?;
                        P::product(&mut dc, Mat::rows(w, g.c_out, rows).t(), gm, T::one(), false, parallel)?;
                        for (j, b) in range.enumerate() {
                            // SAFETY: image `b` belongs to this group only.
                            let dst = unsafe { sdx.range(b * img, img) };
                            g.col2im(&dc, ld, j * cols, dst);
                        }
                    }
                    Ok(())
                })?;
                let mut parts = dws.0.into_iter().map(|m| m.into_inner().unwrap_or_else(|p| p.into_inner()));
                let mut dw = parts.next().unwrap_or_else(|| vec![T::zero(); g.c_out * rows]);
                for p in parts {
                    dw.iter_mut().zip(&p).for_each(|(a, b)| *a = *a + *b);
                }
                let dx = match (want_dx, by_columns) {
                    (false, _) => None,
                    (true, true) => Some(dx),
                    (true, false) => Some(Self::input_gradient(&g, w, dy)?),
                };
                Ok((dx, dw))
            }
        }
    }
}

wide_kernel! {
    /// [`Gather::unfold`] into the compute type, compiled for the CPU's widest vectors (its zero fills and strided
    /// gathers are loops of their own; the short row copies stay `memcpy` calls).
    fn unfold_images<T, E>(g: Geometry, x: &[E], range: std::ops::Range<usize>, col: &mut [T]) {
        let (img, l, ld) = (g.c_in * g.h * g.w, g.cols(), range.len() * g.cols());
        for (j, b) in range.enumerate() {
            g.im2col(&x[b * img..(b + 1) * img], col, ld, j * l);
        }
    }
}

impl CustomOp2 for Conv2d {
    fn name(&self) -> &'static str {
        "conv2d"
    }
    fn cpu_fwd(&self, sx: &CpuStorage, lx: &Layout, sw: &CpuStorage, lw: &Layout) -> Result<(CpuStorage, Shape)> {
        if bf16_products(sx.dtype()) && sw.dtype() == sx.dtype() {
            return self.fwd_bf16(sx, lx, sw, lw);
        }
        by_elem!(sx.dtype(), T, E => self.fwd::<T, E>(sx, lx, sw, lw))
    }
    fn bwd(&self, x: &Tensor, w: &Tensor, _res: &Tensor, dy: &Tensor) -> Result<(Option<Tensor>, Option<Tensor>)> {
        // The input image of a network needs no gradient: skip backward-input for it.
        let want_dx = x.track_op();
        if bf16_products(x.dtype()) && w.dtype() == x.dtype() && dy.dtype() == x.dtype() {
            return self.bwd_bf16(x, w, dy, want_dx);
        }
        by_elem!(x.dtype(), T, E => super::input_weight_grads::<T>(x, w, self.bwd::<T, E>(x, w, dy, want_dx)?))
    }
}

/// A dense convolution on the CPU (`weight` (C_out, C_in, k, k), square stride and padding),
/// computed in f32 (f64 for f64) and returned in `x`'s dtype.
pub fn conv2d(x: &Tensor, weight: &Tensor, pad: usize, stride: usize) -> Result<Tensor> {
    super::apply2(&x.contiguous()?, &weight.contiguous()?, Conv2d { stride, pad })
}
