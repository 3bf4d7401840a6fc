//! Convolutions with closed-form backward passes.
//!
//! Dense (groups = 1): each image's windows are unfolded into a (C_in·k·k) × (OH·OW) column
//! matrix (im2col; a 1×1 stride-1 convolution uses the image itself), and the output is one gemm,
//! `W · col`. Backward: `dW = Σ_images dY · colᵀ` (the columns are unfolded again, not kept) and,
//! only when the input needs a gradient, `dcol = Wᵀ · dY` folded back onto the image (col2im).
//! Images run in parallel, one gemm per thread, when there are at least as many as threads.
//!
//! Depthwise (one k×k filter per channel, MobileNetV2): direct loops over rows, parallel over
//! (image, channel) planes.

use std::sync::Mutex;

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp2, Layout, Result, Shape, Tensor};

use super::pool::out_len;
use super::{gemm, is_f64, par_ranges, read, tensor, with, Mat, Real, SharedMut};

fn err(msg: String) -> candle_core::Error {
    candle_core::Error::Msg(msg)
}

/// The geometry of a convolution: square kernel, same stride and padding on both axes.
#[derive(Clone, Copy, Debug)]
struct Geometry {
    n: usize,
    c_in: usize,
    h: usize,
    w: usize,
    c_out: usize,
    k: usize,
    stride: usize,
    pad: usize,
    oh: usize,
    ow: usize,
}

impl Geometry {
    fn new(x: &Shape, weight: &Shape, stride: usize, pad: usize, depthwise: bool) -> Result<Self> {
        let (&[n, c_in, h, w], &[c_out, wc, kh, kw]) = (x.dims(), weight.dims()) else {
            return Err(err(format!("conv2d: input {x:?} and weight {weight:?} must be 4-D")));
        };
        let expected_wc = if depthwise { 1 } else { c_in };
        if wc != expected_wc || kh != kw || (depthwise && c_out != c_in) {
            return Err(err(format!("conv2d: weight {weight:?} does not fit input {x:?}")));
        }
        let (oh, ow) = (out_len(h, kh, stride, pad)?, out_len(w, kw, stride, pad)?);
        Ok(Geometry { n, c_in, h, w, c_out, k: kh, stride, pad, oh, ow })
    }

    /// Rows of the column matrix (C_in·k·k).
    fn rows(&self) -> usize {
        self.c_in * self.k * self.k
    }

    /// Columns of the column matrix (OH·OW).
    fn cols(&self) -> usize {
        self.oh * self.ow
    }

    /// True when the image itself is the column matrix.
    fn pointwise(&self) -> bool {
        self.k == 1 && self.stride == 1 && self.pad == 0
    }

    /// The input row feeding output row `o` at kernel offset `d`, if inside the image.
    #[inline]
    fn source(&self, o: usize, d: usize, len: usize) -> Option<usize> {
        (o * self.stride + d).checked_sub(self.pad).filter(|i| *i < len)
    }

    /// The outputs `o` (of `out` along an axis of `len` inputs) whose input `o·stride + d − pad`
    /// lies inside the image.
    #[inline]
    fn valid(&self, d: usize, len: usize, out: usize) -> std::ops::Range<usize> {
        let (s, p) = (self.stride, self.pad);
        let lo = if p > d { (p - d).div_ceil(s) } else { 0 };
        let hi = if len + p > d { ((len + p - d - 1) / s + 1).min(out) } else { 0 };
        lo.min(hi)..hi
    }

    /// Unfolds one image (C_in × H × W) into `col` (rows × cols).
    fn im2col<T: Real>(&self, img: &[T], col: &mut [T]) {
        let (k, l) = (self.k, self.cols());
        for ci in 0..self.c_in {
            let plane = &img[ci * self.h * self.w..(ci + 1) * self.h * self.w];
            for dy in 0..k {
                for dx in 0..k {
                    let row = &mut col[((ci * k + dy) * k + dx) * l..][..l];
                    for oy in 0..self.oh {
                        let dst = &mut row[oy * self.ow..(oy + 1) * self.ow];
                        let Some(iy) = self.source(oy, dy, self.h) else {
                            dst.iter_mut().for_each(|v| *v = T::zero());
                            continue;
                        };
                        let src = &plane[iy * self.w..(iy + 1) * self.w];
                        let r = self.valid(dx, self.w, self.ow);
                        dst[..r.start].iter_mut().for_each(|v| *v = T::zero());
                        dst[r.end..].iter_mut().for_each(|v| *v = T::zero());
                        let first = r.start * self.stride + dx - self.pad;
                        if self.stride == 1 {
                            // One shifted copy.
                            dst[r.clone()].copy_from_slice(&src[first..first + r.len()]);
                        } else {
                            for (v, ix) in dst[r.clone()].iter_mut().zip((first..).step_by(self.stride)) {
                                *v = src[ix];
                            }
                        }
                    }
                }
            }
        }
    }

    /// Adds the column matrix `col` back onto one image's gradient (C_in × H × W).
    fn col2im<T: Real>(&self, col: &[T], img: &mut [T]) {
        let (k, l) = (self.k, self.cols());
        for ci in 0..self.c_in {
            let plane = &mut img[ci * self.h * self.w..(ci + 1) * self.h * self.w];
            for dy in 0..k {
                for dx in 0..k {
                    let row = &col[((ci * k + dy) * k + dx) * l..][..l];
                    for oy in 0..self.oh {
                        let Some(iy) = self.source(oy, dy, self.h) else { continue };
                        let dst = &mut plane[iy * self.w..(iy + 1) * self.w];
                        let r = self.valid(dx, self.w, self.ow);
                        let first = r.start * self.stride + dx - self.pad;
                        let src = &row[oy * self.ow + r.start..oy * self.ow + r.end];
                        for (v, ix) in src.iter().zip((first..).step_by(self.stride)) {
                            dst[ix] = dst[ix] + *v;
                        }
                    }
                }
            }
        }
    }
}

/// Runs `f(image, scratch)` for every image, in parallel over images (each thread with its own
/// scratch of `scratch` elements) when there are at least as many images as threads; `f` is told
/// whether its gemms should be parallel themselves.
fn per_image<T: Real>(
    n: usize,
    scratch: usize,
    f: impl Fn(usize, &mut [T], bool) -> Result<()> + Send + Sync,
) -> Result<()> {
    let threads = rayon::current_num_threads();
    if n >= threads && threads > 1 {
        let failure = Mutex::new(None);
        par_ranges(n, 1, |r| {
            let mut buf = vec![T::zero(); scratch];
            for b in r {
                if let Err(e) = f(b, &mut buf, false) {
                    *failure.lock().unwrap_or_else(|p| p.into_inner()) = Some(e);
                    return;
                }
            }
        });
        match failure.into_inner().unwrap_or_else(|p| p.into_inner()) {
            Some(e) => Err(e),
            None => Ok(()),
        }
    } else {
        let mut buf = vec![T::zero(); scratch];
        (0..n).try_for_each(|b| f(b, &mut buf, true))
    }
}

struct Conv2d {
    stride: usize,
    pad: usize,
}

impl Conv2d {
    fn fwd<T: Real>(&self, sx: &CpuStorage, lx: &Layout, sw: &CpuStorage, lw: &Layout) -> Result<(CpuStorage, Shape)> {
        let g = Geometry::new(lx.shape(), lw.shape(), self.stride, self.pad, false)?;
        let (x, w) = (read::<T>(sx, lx)?, read::<T>(sw, lw)?);
        let (rows, cols, img) = (g.rows(), g.cols(), g.c_in * g.h * g.w);
        let mut y = vec![T::zero(); g.n * g.c_out * cols];
        let out = SharedMut::new(&mut y);
        let scratch = if g.pointwise() { 0 } else { rows * cols };
        per_image::<T>(g.n, scratch, |b, col, parallel| {
            let image = &x[b * img..(b + 1) * img];
            let col: &[T] = if g.pointwise() {
                image
            } else {
                g.im2col(image, col);
                col
            };
            // SAFETY: one image's output per index.
            let dst = unsafe { out.range(b * g.c_out * cols, g.c_out * cols) };
            gemm(dst, Mat::rows(&w, g.c_out, rows), Mat::rows(col, rows, cols), T::one(), false, parallel)
        })?;
        Ok((T::storage(y, sx.dtype())?, Shape::from((g.n, g.c_out, g.oh, g.ow))))
    }

    /// (dx when wanted, dw).
    fn bwd<T: Real>(&self, x: &Tensor, w: &Tensor, dy: &Tensor, want_dx: bool) -> Result<(Option<Vec<T>>, Vec<T>)> {
        let g = Geometry::new(x.shape(), w.shape(), self.stride, self.pad, false)?;
        let (rows, cols, img) = (g.rows(), g.cols(), g.c_in * g.h * g.w);
        with::<T, _>(x, |x| {
            with::<T, _>(w, |w| {
                with::<T, _>(dy, |dy| {
                    // dW: one partial sum per thread, added at the end.
                    let partials: Mutex<Vec<Vec<T>>> = Mutex::new(Vec::new());
                    let mut dx = if want_dx { vec![T::zero(); x.len()] } else { Vec::new() };
                    let sdx = SharedMut::new(&mut dx);
                    let threads = rayon::current_num_threads();
                    let chunks = if g.n >= threads && threads > 1 { threads } else { 1 };
                    let per = g.n.div_ceil(chunks);
                    let failure = Mutex::new(None);
                    let work = |chunk: usize| -> Result<()> {
                        let parallel = chunks == 1;
                        let mut dw = vec![T::zero(); g.c_out * rows];
                        let mut col = vec![T::zero(); if g.pointwise() { 0 } else { rows * cols }];
                        let mut dcol = vec![T::zero(); if want_dx && !g.pointwise() { rows * cols } else { 0 }];
                        for b in chunk * per..((chunk + 1) * per).min(g.n) {
                            let image = &x[b * img..(b + 1) * img];
                            let cm: &[T] = if g.pointwise() {
                                image
                            } else {
                                g.im2col(image, &mut col);
                                &col
                            };
                            let gy = Mat::rows(&dy[b * g.c_out * cols..(b + 1) * g.c_out * cols], g.c_out, cols);
                            gemm(&mut dw, gy, Mat::rows(cm, rows, cols).t(), T::one(), true, parallel)?;
                            if want_dx {
                                // SAFETY: one image's gradient per index.
                                let dst = unsafe { sdx.range(b * img, img) };
                                let wt = Mat::rows(w, g.c_out, rows).t();
                                if g.pointwise() {
                                    gemm(dst, wt, gy, T::one(), false, parallel)?;
                                } else {
                                    gemm(&mut dcol, wt, gy, T::one(), false, parallel)?;
                                    g.col2im(&dcol, dst);
                                }
                            }
                        }
                        partials.lock().unwrap_or_else(|p| p.into_inner()).push(dw);
                        Ok(())
                    };
                    use rayon::prelude::*;
                    (0..chunks).into_par_iter().for_each(|c| {
                        if let Err(e) = work(c) {
                            *failure.lock().unwrap_or_else(|p| p.into_inner()) = Some(e);
                        }
                    });
                    if let Some(e) = failure.into_inner().unwrap_or_else(|p| p.into_inner()) {
                        return Err(e);
                    }
                    let mut parts = partials.into_inner().unwrap_or_else(|p| p.into_inner()).into_iter();
                    let mut dw = parts.next().unwrap_or_else(|| vec![T::zero(); g.c_out * rows]);
                    for p in parts {
                        dw.iter_mut().zip(&p).for_each(|(a, b)| *a = *a + *b);
                    }
                    Ok((want_dx.then_some(dx), dw))
                })
            })
        })
    }
}

impl CustomOp2 for Conv2d {
    fn name(&self) -> &'static str {
        "conv2d"
    }
    fn cpu_fwd(&self, sx: &CpuStorage, lx: &Layout, sw: &CpuStorage, lw: &Layout) -> Result<(CpuStorage, Shape)> {
        if is_f64(sx.dtype()) {
            self.fwd::<f64>(sx, lx, sw, lw)
        } else {
            self.fwd::<f32>(sx, lx, sw, lw)
        }
    }
    fn bwd(&self, x: &Tensor, w: &Tensor, _res: &Tensor, dy: &Tensor) -> Result<(Option<Tensor>, Option<Tensor>)> {
        // The input image of a network needs no gradient: skip backward-input for it.
        let want_dx = x.track_op();
        macro_rules! run {
            ($t:ty) => {{
                let (dx, dw) = self.bwd::<$t>(x, w, dy, want_dx)?;
                let dx = dx.map(|dx| tensor(dx, x.shape(), x.dtype())).transpose()?;
                (dx, tensor(dw, w.shape(), w.dtype())?)
            }};
        }
        let (dx, dw) = if is_f64(x.dtype()) { run!(f64) } else { run!(f32) };
        Ok((dx, w.track_op().then_some(dw)))
    }
}

/// A dense convolution on the CPU (`weight` (C_out, C_in, k, k), square stride and padding),
/// computed in f32 (f64 for f64) and returned in `x`'s dtype.
pub fn conv2d(x: &Tensor, weight: &Tensor, pad: usize, stride: usize) -> Result<Tensor> {
    super::apply2(&x.contiguous()?, &weight.contiguous()?, Conv2d { stride, pad })
}

struct Depthwise {
    stride: usize,
    pad: usize,
}

impl Depthwise {
    fn fwd<T: Real>(&self, sx: &CpuStorage, lx: &Layout, sw: &CpuStorage, lw: &Layout) -> Result<(CpuStorage, Shape)> {
        let g = Geometry::new(lx.shape(), lw.shape(), self.stride, self.pad, true)?;
        let (x, w) = (read::<T>(sx, lx)?, read::<T>(sw, lw)?);
        let (hw, ohw, kk) = (g.h * g.w, g.cols(), g.k * g.k);
        let mut y = vec![T::zero(); g.n * g.c_in * ohw];
        let out = SharedMut::new(&mut y);
        par_ranges(g.n * g.c_in, 1, |r| {
            for p in r {
                let (plane, filter) = (&x[p * hw..(p + 1) * hw], &w[(p % g.c_in) * kk..][..kk]);
                // SAFETY: one plane per index.
                let dst = unsafe { out.range(p * ohw, ohw) };
                for oy in 0..g.oh {
                    let row = &mut dst[oy * g.ow..(oy + 1) * g.ow];
                    for dy in 0..g.k {
                        let Some(iy) = g.source(oy, dy, g.h) else { continue };
                        let src = &plane[iy * g.w..(iy + 1) * g.w];
                        for dx in 0..g.k {
                            let f = filter[dy * g.k + dx];
                            let r = g.valid(dx, g.w, g.ow);
                            let first = r.start * g.stride + dx - g.pad;
                            for (v, ix) in row[r].iter_mut().zip((first..).step_by(g.stride)) {
                                *v = *v + f * src[ix];
                            }
                        }
                    }
                }
            }
        });
        Ok((T::storage(y, sx.dtype())?, Shape::from((g.n, g.c_in, g.oh, g.ow))))
    }

    /// (dx when wanted, dw).
    fn bwd<T: Real>(&self, x: &Tensor, w: &Tensor, dy: &Tensor, want_dx: bool) -> Result<(Option<Vec<T>>, Vec<T>)> {
        let g = Geometry::new(x.shape(), w.shape(), self.stride, self.pad, true)?;
        let (hw, ohw, kk) = (g.h * g.w, g.cols(), g.k * g.k);
        with::<T, _>(x, |x| {
            with::<T, _>(w, |w| {
                with::<T, _>(dy, |dy| {
                    let mut dx = if want_dx { vec![T::zero(); x.len()] } else { Vec::new() };
                    let mut dw = vec![T::zero(); g.c_in * kk];
                    let (sdx, sdw) = (SharedMut::new(&mut dx), SharedMut::new(&mut dw));
                    // Parallel over channels: each channel's filter gradient sums over images.
                    par_ranges(g.c_in, 1, |r| {
                        for c in r {
                            let filter = &w[c * kk..][..kk];
                            // SAFETY: one channel per index.
                            let dwc = unsafe { sdw.range(c * kk, kk) };
                            for b in 0..g.n {
                                let p = b * g.c_in + c;
                                let (plane, gp) = (&x[p * hw..(p + 1) * hw], &dy[p * ohw..(p + 1) * ohw]);
                                // SAFETY: plane `p` belongs to channel `c` only.
                                let mut dplane = want_dx.then(|| unsafe { sdx.range(p * hw, hw) });
                                for oy in 0..g.oh {
                                    let grow = &gp[oy * g.ow..(oy + 1) * g.ow];
                                    for dy_ in 0..g.k {
                                        let Some(iy) = g.source(oy, dy_, g.h) else { continue };
                                        let src = &plane[iy * g.w..(iy + 1) * g.w];
                                        for dx_ in 0..g.k {
                                            let f = filter[dy_ * g.k + dx_];
                                            let r = g.valid(dx_, g.w, g.ow);
                                            let first = r.start * g.stride + dx_ - g.pad;
                                            let mut acc = T::zero();
                                            for (gv, ix) in grow[r.clone()].iter().zip((first..).step_by(g.stride)) {
                                                acc = acc + *gv * src[ix];
                                            }
                                            dwc[dy_ * g.k + dx_] = dwc[dy_ * g.k + dx_] + acc;
                                            if let Some(d) = dplane.as_deref_mut() {
                                                let drow = &mut d[iy * g.w..(iy + 1) * g.w];
                                                for (gv, ix) in grow[r].iter().zip((first..).step_by(g.stride)) {
                                                    drow[ix] = drow[ix] + f * *gv;
                                                }
                                            }
                                        }
                                    }
                                }
                            }
                        }
                    });
                    Ok((want_dx.then_some(dx), dw))
                })
            })
        })
    }
}

impl CustomOp2 for Depthwise {
    fn name(&self) -> &'static str {
        "depthwise_conv2d"
    }
    fn cpu_fwd(&self, sx: &CpuStorage, lx: &Layout, sw: &CpuStorage, lw: &Layout) -> Result<(CpuStorage, Shape)> {
        if is_f64(sx.dtype()) {
            self.fwd::<f64>(sx, lx, sw, lw)
        } else {
            self.fwd::<f32>(sx, lx, sw, lw)
        }
    }
    fn bwd(&self, x: &Tensor, w: &Tensor, _res: &Tensor, dy: &Tensor) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let want_dx = x.track_op();
        macro_rules! run {
            ($t:ty) => {{
                let (dx, dw) = self.bwd::<$t>(x, w, dy, want_dx)?;
                let dx = dx.map(|dx| tensor(dx, x.shape(), x.dtype())).transpose()?;
                (dx, tensor(dw, w.shape(), w.dtype())?)
            }};
        }
        let (dx, dw) = if is_f64(x.dtype()) { run!(f64) } else { run!(f32) };
        Ok((dx, w.track_op().then_some(dw)))
    }
}

/// A depthwise convolution on the CPU (`weight` (C, 1, k, k)), computed in f32 (f64 for f64).
pub fn depthwise_conv2d(x: &Tensor, weight: &Tensor, stride: usize, pad: usize) -> Result<Tensor> {
    super::apply2(&x.contiguous()?, &weight.contiguous()?, Depthwise { stride, pad })
}
