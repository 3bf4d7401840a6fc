//! Convolutions with closed-form backward passes.
//!
//! Dense (groups = 1): each image's windows are unfolded into a (C_in·k·k) × (OH·OW) column
//! matrix (im2col, [`unfold`]; a 1×1 stride-1 convolution uses the image itself), and the output
//! is `W · col`. Backward: `dW = Σ_images dY · colᵀ` (the columns are unfolded again, not kept)
//! and, only when the input needs a gradient, either a convolution of its own (stride 1) or
//! `dcol = Wᵀ · dY` folded back onto the image (col2im). A large image's columns are unfolded
//! and multiplied in chunks of output rows that stay in the cache, small images' in groups
//! ([`plan`]). With bf16 images, weights and gradients on a CPU with AVX512-BF16 the columns stay
//! bf16 and the products are bf16 with f32 sums (`gemm_bf16`; the `Gather` trait in [`unfold`],
//! `Operand` and `Out` in `gemm`). Where [`direct`] applies (bf16 or f32 on AVX-512, 16 or more
//! input channels, kernels wider than 1×1) it convolves the images in place instead: the forward pass,
//! the input gradient (a strided one phase by phase) and a stride-1 convolution's weight
//! gradient — no columns.
//!
//! Depthwise convolutions are in [`super::depthwise`].

mod direct;
mod fused;
mod plan;
mod unfold;

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp2, DType, Layout, Result, Shape, Tensor};
use half::bf16;

use super::elem::{by_elem, elem_tensor, elems, with_elems, Elem};
use super::gemm::{Operand, Out};
use super::{read, tensor, with, Mat, Real, SharedMut};
pub(crate) use fused::{conv_norm_eval, EvalNorm};
use fused::{Epilogue, Plain};
use plan::{Plan, Scratch, CHUNK_BYTES};
use unfold::Gather;
pub(super) use unfold::Geometry;

fn err(msg: String) -> candle_core::Error {
    candle_core::Error::Msg(msg)
}

/// True when bf16 tensors are multiplied as bf16 ([`super::gemm_bf16`]).
fn bf16_products(dtype: DType) -> bool {
    dtype == DType::BF16 && super::gemm_bf16::available()
}

/// A convolution's input gradient (when computed) and weight gradient.
type Grads<T> = (Option<Vec<T>>, Vec<T>);

struct Conv2d {
    stride: usize,
    pad: usize,
    /// Bytes of column matrix per chunk of an image ([`plan::CHUNK_BYTES`]; tests make it small).
    chunk: usize,
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
            self.forward(&g, &read::<T>(sx, lx)?, &w)?
        } else {
            self.forward(&g, x, &w)?
        };
        Ok((T::storage(y, sx.dtype())?, Shape::from((g.n, g.c_out, g.oh, g.ow))))
    }

    /// [`Conv2d::fwd`] for bf16 images and weights, multiplied as bf16 (f32 sums).
    fn fwd_bf16(&self, sx: &CpuStorage, lx: &Layout, sw: &CpuStorage, lw: &Layout) -> Result<(CpuStorage, Shape)> {
        let g = Geometry::new(lx.shape(), lw.shape(), self.stride, self.pad, false)?;
        let (x, w) = (elems::<f32, bf16>(sx, lx)?, elems::<f32, bf16>(sw, lw)?);
        let y = if direct::applies::<bf16>(&g) {
            CpuStorage::BF16(direct::forward(&g, x, w)?)
        } else if super::gemm_bf16::rounds_directly(g.rows()) {
            // Each sum rounded as the product stores it: no f32 output, no rounding pass.
            CpuStorage::BF16(self.forward::<f32, bf16, bf16, bf16>(&g, x, w)?)
        } else {
            f32::storage(self.forward::<f32, bf16, bf16, f32>(&g, x, w)?, sx.dtype())?
        };
        Ok((y, Shape::from((g.n, g.c_out, g.oh, g.ow))))
    }

    /// [`Conv2d::fwd`] for f32 images and weights computed directly ([`direct`]); `None` where
    /// [`direct::applies`] does not.
    fn fwd_f32(
        &self,
        sx: &CpuStorage,
        lx: &Layout,
        sw: &CpuStorage,
        lw: &Layout,
    ) -> Result<Option<(CpuStorage, Shape)>> {
        let g = Geometry::new(lx.shape(), lw.shape(), self.stride, self.pad, false)?;
        if !direct::applies::<f32>(&g) {
            return Ok(None);
        }
        let y = direct::forward(&g, &read::<f32>(sx, lx)?, &read::<f32>(sw, lw)?)?;
        Ok(Some((CpuStorage::F32(y), Shape::from((g.n, g.c_out, g.oh, g.ow)))))
    }

    /// The convolution of images `x` with weights `w` (row-major (C_out, C_in·k·k)).
    fn forward<T: Real, E: Gather<P>, P: Operand<T>, O: Out<T, P>>(
        &self,
        g: &Geometry,
        x: &[E],
        w: &[P],
    ) -> Result<Vec<O>> {
        self.forward_by(g, x, Mat::rows(w, g.c_out, g.rows()), &Plain)
    }

    /// [`Conv2d::forward`] with the weights as any (C_out × C_in·k·k) matrix view, and
    /// `epilogue` applied to each run of outputs as it is written (while it is in the cache).
    /// The weights are prepared once for every item's product ([`Operand::lhs`]: bf16 weights
    /// are packed once, not per image or chunk).
    /// A 1×1 stride-1 convolution's images must be operands already ([`Conv2d::widen_first`]).
    fn forward_by<T: Real, E: Gather<P>, P: Operand<T>, O: Out<T, P>, F: Epilogue<O>>(
        &self,
        g: &Geometry,
        x: &[E],
        wm: Mat<'_, P>,
        epilogue: &F,
    ) -> Result<Vec<O>> {
        self.forward_with(g, x, &P::lhs(wm, self.item_columns::<P>(g))?, epilogue)
    }

    /// Columns of the largest item's product (the width the weights are prepared for).
    fn item_columns<P>(&self, g: &Geometry) -> usize {
        Plan::new(g, size_of::<P>(), self.chunk, false).width(g)
    }

    /// [`Conv2d::forward_by`] with the weights prepared ([`Operand::lhs`]).
    fn forward_with<T: Real, E: Gather<P>, P: Operand<T>, O: Out<T, P>, F: Epilogue<O>>(
        &self,
        g: &Geometry,
        x: &[E],
        wp: &P::Lhs<'_>,
        epilogue: &F,
    ) -> Result<Vec<O>> {
        let (rows, cols) = (g.rows(), g.cols());
        let mut y = vec![O::default(); g.n * g.c_out * cols];
        let out = SharedMut::new(&mut y);
        let plan = Plan::new(g, size_of::<P>(), self.chunk, false);
        // A whole image at a time writes straight into the output; a group or a chunk goes
        // through a (C_out × columns) buffer.
        let direct = plan.size == 1 && plan.chunks == 1;
        let width = plan.width(g);
        let itself = direct && g.pointwise();
        let col = Scratch::<P>::new(plan.workers, if itself { 0 } else { rows * width });
        let ybuf = Scratch::<O>::new(plan.workers, if direct { 0 } else { g.c_out * width });
        plan.run(g, |worker, item, parallel| {
            let (range, l, p0, ld) = (item.images.clone(), item.len, item.at, item.width());
            let mut col = col.get(worker)?;
            let cm = columns(g, x, (range.clone(), item.out_rows), itself, &mut col)?;
            if direct {
                // SAFETY: one image's output per group.
                let dst = unsafe { out.range(range.start * g.c_out * cols, g.c_out * cols) };
                O::product_by(dst, wp, Mat::rows(cm, rows, cols), parallel)?;
                if F::ACTIVE && parallel {
                    // The lone worker: the pass over the output is shared as the product was.
                    use rayon::prelude::*;
                    let b = range.start;
                    dst.par_chunks_exact_mut(cols).enumerate().for_each(|(c, run)| epilogue.write(b, c, 0, None, run));
                } else if F::ACTIVE {
                    for (c, run) in dst.chunks_exact_mut(cols).enumerate() {
                        epilogue.write(range.start, c, 0, None, run);
                    }
                }
                return Ok(());
            }
            let mut yb = ybuf.get(worker)?;
            O::product_by(&mut yb[..g.c_out * ld], wp, Mat::rows(cm, rows, ld), parallel)?;
            for (j, b) in range.enumerate() {
                for c in 0..g.c_out {
                    // SAFETY: columns p0..p0 + l of image `b` belong to this item only.
                    let dst = unsafe { out.range((b * g.c_out + c) * cols + p0, l) };
                    epilogue.write(b, c, p0, Some(&yb[c * ld + j * l..][..l]), dst);
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
        &self,
        g: &Geometry,
        w: &[P],
        dy: &[P],
    ) -> Result<Vec<O>> {
        let kk = g.k * g.k;
        let back = g.input_gradient();
        if kk == 1 {
            // Nothing to flip: the transposed weights are a view (the copy was a strided
            // transpose of every 1×1 weight, a visible share of a ResNet-50 step).
            return self.forward_by(&back, dy, Mat::rows(w, g.c_out, g.c_in).t(), &Plain);
        }
        // Row ci of the flipped weights, written in order (each source run of k² taps read
        // whole): the other loop order scattered every write across the output. Handed to the
        // product row by row: bf16 packs them a panel at a time, with no flipped copy.
        let flip = |ci: usize, row: &mut [P]| {
            for (co, taps) in row.chunks_exact_mut(kk).enumerate() {
                let src = &w[(co * g.c_in + ci) * kk..][..kk];
                for (d, s) in taps.iter_mut().zip(src.iter().rev()) {
                    *d = *s;
                }
            }
        };
        let flipped = P::lhs_rows((g.c_in, g.c_out * kk), self.item_columns::<P>(&back), &flip)?;
        self.forward_with(&back, dy, &flipped, &Plain)
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
                        with::<T, _>(x, |x| self.bwd_from::<T, T, T>(g, x, w, dy, want_dx))
                    } else {
                        self.bwd_from::<T, E, T>(g, xe, w, dy, want_dx)
                    }
                })
            })
        })
    }

    /// [`Conv2d::bwd`] for bf16 images, weights and output gradients, multiplied as bf16.
    ///
    /// The input gradient is computed directly on the output gradient where
    /// [`direct::gradients`] says so, else, at stride 1 when its sums fit one slice of the product, written
    /// in bf16 as it is computed (no f32 result, no rounding pass); the weight gradient directly
    /// where [`direct::gradients`] says so.
    fn bwd_bf16(&self, x: &Tensor, w: &Tensor, dy: &Tensor, want_dx: bool) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let g = Geometry::new(x.shape(), w.shape(), self.stride, self.pad, false)?;
        let (by_kernel, direct_dw) = direct::gradients::<bf16>(&g, want_dx);
        let direct_dx = by_kernel
            || want_dx && Self::dx_by_convolution(&g) && super::gemm_bf16::rounds_directly(g.c_out * g.k * g.k);
        // A 1×1 layer's weight gradient along its positions only where its input gradient is
        // computed apart (else the product computes both from one set of operands).
        let pointwise_dw = direct::pointwise(&g) && (!want_dx || direct_dx);
        let (dx, dw) = with_elems::<f32, bf16, _>(w, |w| {
            with_elems::<f32, bf16, _>(dy, |dy| {
                let (dx, dw) = with_elems::<f32, bf16, _>(x, |x| match (direct_dw, pointwise_dw) {
                    (true, _) => Ok((None, direct::weight_gradient(&g, x, dy)?)),
                    (false, true) => Ok((None, direct::pointwise_weight_gradient(&g, x, dy)?)),
                    (false, false) => self.bwd_from::<f32, bf16, bf16>(g, x, w, dy, want_dx && !direct_dx),
                })?;
                let dx = match dx {
                    Some(dx) => Some(tensor(dx, x.shape(), x.dtype())?),
                    None if by_kernel => Some(elem_tensor::<f32, bf16>(direct::input_gradient(&g, w, dy)?, x.shape())?),
                    None if direct_dx => {
                        let dx = self.input_gradient::<f32, bf16, bf16>(&g, w, dy)?;
                        Some(elem_tensor::<f32, bf16>(dx, x.shape())?)
                    }
                    None => None,
                };
                Ok((dx, dw))
            })
        })?;
        Ok((dx, super::weight_grad(w, dw)?))
    }

    /// [`Conv2d::bwd`] for f32 images, weights and output gradients where [`direct`] computes the
    /// input gradient or the weight gradient ([`direct::gradients`]; the other as [`Conv2d::bwd`]
    /// does); `None` where it computes neither.
    fn bwd_f32(&self, x: &Tensor, w: &Tensor, dy: &Tensor, want_dx: bool) -> Result<Option<Grads<f32>>> {
        let g = Geometry::new(x.shape(), w.shape(), self.stride, self.pad, false)?;
        let (by_kernel, direct_dw) = direct::gradients::<f32>(&g, want_dx);
        if !by_kernel && !direct_dw {
            return Ok(None);
        }
        let (dx, dw) = match direct_dw {
            true => (None, with::<f32, _>(x, |x| with::<f32, _>(dy, |dy| direct::weight_gradient(&g, x, dy)))?),
            false => self.bwd::<f32, f32>(x, w, dy, want_dx && !by_kernel)?,
        };
        let dx = match by_kernel {
            true => Some(with::<f32, _>(w, |w| with::<f32, _>(dy, |dy| direct::input_gradient(&g, w, dy)))?),
            false => dx,
        };
        Ok(Some((dx, dw)))
    }

    /// True when the input gradient is a convolution of its own ([`Conv2d::input_gradient`]:
    /// stride 1) rather than columns folded back onto the image.
    fn dx_by_convolution(g: &Geometry) -> bool {
        g.stride == 1 && g.pad < g.k
    }

    /// [`Conv2d::bwd`] from the images as stored (`E`) or widened, with weights and output
    /// gradients as operands `P`.
    fn bwd_from<T: Real, E: Gather<P>, P: Operand<T> + Gather<P>>(
        &self,
        g: Geometry,
        x: &[E],
        w: &[P],
        dy: &[P],
        want_dx: bool,
    ) -> Result<(Option<Vec<T>>, Vec<T>)> {
        let (rows, cols, img) = (g.rows(), g.cols(), g.c_in * g.h * g.w);
        // Stride 1: the input gradient is a convolution of its own (below). Folded back from
        // columns, an image's chunks overlap in the input rows they touch: one worker each.
        let by_columns = want_dx && !Self::dx_by_convolution(&g);
        let plan = Plan::new(&g, size_of::<P>(), self.chunk, by_columns);
        let width = plan.width(&g);
        let direct = plan.size == 1 && g.pointwise();
        let col = Scratch::<P>::new(plan.workers, if direct { 0 } else { rows * width });
        let gbuf = Scratch::<P>::new(plan.workers, if plan.size == 1 { 0 } else { g.c_out * width });
        let dcol = Scratch::<T>::new(plan.workers, if by_columns { rows * width } else { 0 });
        // Wᵀ, prepared once for every item's dcol = Wᵀ·dY.
        let wt = if by_columns { Some(P::lhs(Mat::rows(w, g.c_out, rows).t(), width)?) } else { None };
        // dW: one partial sum per worker, added at the end.
        let dws = Scratch::<T>::new(plan.workers, g.c_out * rows);
        let mut dx = if by_columns { vec![T::zero(); x.len()] } else { Vec::new() };
        let sdx = SharedMut::new(&mut dx);
        plan.run(&g, |worker, item, parallel| {
            let (range, l, p0, ld) = (item.images.clone(), item.len, item.at, item.width());
            let (mut col, mut gb, mut dw) = (col.get(worker)?, gbuf.get(worker)?, dws.get(worker)?);
            let cm = columns(&g, x, (range.clone(), item.out_rows.clone()), direct, &mut col)?;
            // The item's output gradient as (C_out × columns): one image's is a view of its
            // own (its rows `cols` apart), a group's is copied side by side.
            let gm = if range.len() == 1 {
                let at = range.start * g.c_out * cols;
                Mat { data: &dy[at + p0..at + g.c_out * cols], rows: g.c_out, cols: l, row_stride: cols, col_stride: 1 }
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
            if let Some(wt) = &wt {
                let mut dc = dcol.get(worker)?;
                P::product_by(&mut dc[..rows * ld], wt, gm, parallel)?;
                for (j, b) in range.enumerate() {
                    // SAFETY: image `b` belongs to this item's worker only (`whole_images`).
                    let dst = unsafe { sdx.range(b * img, img) };
                    g.col2im(&dc, (ld, j * l), item.out_rows.clone(), dst);
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
            (true, false) => Some(self.input_gradient(&g, w, dy)?),
        };
        Ok((dx, dw))
    }
}

/// An item's column matrix ((C_in·k·k) × (images·rows·OW)): the images of `range` themselves
/// when `itself` (a 1×1 stride-1 convolution, one whole image per item: no copy), else output
/// rows `out_rows` of them unfolded into `col`.
fn columns<'a, P, E: Gather<P>>(
    g: &Geometry,
    x: &'a [E],
    (range, out_rows): (std::ops::Range<usize>, std::ops::Range<usize>),
    itself: bool,
    col: &'a mut [P],
) -> Result<&'a [P]> {
    if itself {
        let img = g.c_in * g.h * g.w;
        return E::as_operands(&x[range.start * img..range.end * img])
            .ok_or_else(|| err("conv2d: a 1×1 convolution's images were not widened".into()));
    }
    let len = g.rows() * range.len() * out_rows.len() * g.ow;
    E::unfold(*g, x, range, out_rows, col);
    Ok(&col[..len])
}

impl CustomOp2 for Conv2d {
    fn name(&self) -> &'static str {
        "conv2d"
    }
    fn cpu_fwd(&self, sx: &CpuStorage, lx: &Layout, sw: &CpuStorage, lw: &Layout) -> Result<(CpuStorage, Shape)> {
        if bf16_products(sx.dtype()) && sw.dtype() == sx.dtype() {
            return self.fwd_bf16(sx, lx, sw, lw);
        }
        if sx.dtype() == DType::F32 && sw.dtype() == DType::F32 {
            if let Some(y) = self.fwd_f32(sx, lx, sw, lw)? {
                return Ok(y);
            }
        }
        by_elem!(sx.dtype(), T, E => self.fwd::<T, E>(sx, lx, sw, lw))
    }
    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        sx: &candle_core::CudaStorage,
        lx: &Layout,
        sw: &candle_core::CudaStorage,
        lw: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        super::cuda::conv::forward((sx, lx), (sw, lw), self.stride, self.pad, false)
    }
    fn bwd(&self, x: &Tensor, w: &Tensor, _res: &Tensor, dy: &Tensor) -> Result<(Option<Tensor>, Option<Tensor>)> {
        // The input image of a network needs no gradient: skip backward-input for it.
        let want_dx = x.track_op();
        #[cfg(feature = "cuda")]
        if x.device().is_cuda() {
            return super::cuda::conv::backward(x, w, dy, (self.stride, self.pad, false), (want_dx, w.track_op()));
        }
        if bf16_products(x.dtype()) && w.dtype() == x.dtype() && dy.dtype() == x.dtype() {
            return self.bwd_bf16(x, w, dy, want_dx);
        }
        if [x.dtype(), w.dtype(), dy.dtype()] == [DType::F32; 3] {
            if let Some(grads) = self.bwd_f32(x, w, dy, want_dx)? {
                return super::input_weight_grads::<f32>(x, w, grads);
            }
        }
        by_elem!(x.dtype(), T, E => super::input_weight_grads::<T>(x, w, self.bwd::<T, E>(x, w, dy, want_dx)?))
    }
}

/// A dense convolution (`weight` (C_out, C_in, k, k), square stride and padding): on the CPU
/// computed in f32 (f64 for f64) and returned in `x`'s dtype; on a CUDA device (feature `cuda`)
/// through cuDNN in `x`'s dtype (`super::cuda::conv`).
pub fn conv2d(x: &Tensor, weight: &Tensor, pad: usize, stride: usize) -> Result<Tensor> {
    conv2d_chunked(x, weight, pad, stride, CHUNK_BYTES)
}

/// [`conv2d`] with an image's columns cut into chunks of about `chunk` bytes (tests: small
/// chunks on small images; `usize::MAX`: never cut, the unchunked kernel kept as an oracle).
pub(crate) fn conv2d_chunked(x: &Tensor, weight: &Tensor, pad: usize, stride: usize, chunk: usize) -> Result<Tensor> {
    super::apply2(&x.contiguous()?, &weight.contiguous()?, Conv2d { stride, pad, chunk })
}
