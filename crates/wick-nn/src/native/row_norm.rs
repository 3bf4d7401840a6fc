//! Layer norm and RMS norm over the last dimension with closed-form backward passes: each row's
//! mean and variance summed in f64 in the forward pass and kept (two numbers per row) for
//! backward. With the `cuda` feature, the same op has a CUDA body (`crate::native::cuda::norm`) that keeps
//! those numbers on the device.

use std::sync::Mutex;

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp2, CustomOp3, DType, Layout, Result, Shape, Tensor};

use super::elem::{by_elem, elem_tensor, elems, with_elems, Elem};
use super::{par_ranges, read, sum, sum_sq_dev, tensor, with, Real, SharedMut};

fn err(msg: String) -> candle_core::Error {
    candle_core::Error::Msg(msg)
}

/// Layer norm (`affine`: with weight and bias) or RMS norm over the last dimension, with the
/// per-row mean (0 for RMS norm) and inverse deviation kept for backward: on the host for a CPU
/// tensor, on the device for a CUDA one (the op's CUDA body, `crate::native::cuda::norm`).
struct RowNorm {
    eps: f64,
    rms: bool,
    stats: Mutex<Kept>,
}

/// What a row norm's forward pass kept for its backward pass.
enum Kept {
    Nothing,
    Host(Vec<(f64, f64)>),
    #[cfg(feature = "cuda")]
    Device(crate::native::cuda::norm::Stats),
}

impl RowNorm {
    fn new(eps: f64, rms: bool) -> Self {
        RowNorm { eps, rms, stats: Mutex::new(Kept::Nothing) }
    }

    fn keep(&self, kept: Kept) {
        *self.stats.lock().unwrap_or_else(|p| p.into_inner()) = kept;
    }

    /// The CUDA body's forward pass (the weights converted to the compute type on the device).
    #[cfg(feature = "cuda")]
    fn cuda(
        &self,
        x: (&candle_core::CudaStorage, &Layout),
        w: (&candle_core::CudaStorage, &Layout),
        b: Option<(&candle_core::CudaStorage, &Layout)>,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let (y, shape, stats) = crate::native::cuda::norm::forward(x, w, b, self.rms, self.eps)?;
        self.keep(Kept::Device(stats));
        Ok((y, shape))
    }

    /// (dx, dweight, dbias) as tensors: dx like `x`, the others of length d in `w`'s dtype and
    /// `bias_dtype`.
    fn grads(&self, x: &Tensor, w: &Tensor, g: &Tensor, bias_dtype: DType) -> Result<(Tensor, Tensor, Tensor)> {
        #[cfg(feature = "cuda")]
        if x.device().is_cuda() {
            let guard = self.stats.lock().unwrap_or_else(|p| p.into_inner());
            let Kept::Device(stats) = &*guard else {
                return Err(err("norm backward: no statistics kept on the device".into()));
            };
            let (dx, dw, db) = crate::native::cuda::norm::backward(x, w, g, stats, self.rms)?;
            return Ok((dx, dw.to_dtype(w.dtype())?, db.to_dtype(bias_dtype)?));
        }
        let d = w.elem_count();
        by_elem!(x.dtype(), T, E => {
            let (dx, dw, db) = self.bwd::<T, E>(x, w, g)?;
            Ok((elem_tensor::<T, E>(dx, x.shape())?, tensor(dw, d, w.dtype())?, tensor(db, d, bias_dtype)?))
        })
    }
}

impl RowNorm {
    fn fwd<T: Real, E: Elem<T>>(
        &self,
        sx: &CpuStorage,
        lx: &Layout,
        w: &[T],
        b: Option<&[T]>,
    ) -> Result<(CpuStorage, Shape)> {
        let x = elems::<T, E>(sx, lx)?;
        let d = lx.shape().dims().last().copied().unwrap_or(1).max(1);
        if w.len() != d || b.is_some_and(|b| b.len() != d) {
            return Err(err(format!("norm: rows of {d}, {} weights", w.len())));
        }
        let (y, stats) = row_norm_forward::<T, E>(x, w, b, d, self.rms, self.eps);
        self.keep(Kept::Host(stats));
        Ok((E::into_storage(y), lx.shape().clone()))
    }

    /// (dx, dweight, dbias).
    fn bwd<T: Real, E: Elem<T>>(&self, x: &Tensor, w: &Tensor, g: &Tensor) -> Result<(Vec<E>, Vec<T>, Vec<T>)> {
        let stats = match &*self.stats.lock().unwrap_or_else(|p| p.into_inner()) {
            Kept::Host(stats) => stats.clone(),
            _ => return Err(err("norm backward: no statistics kept on the host".into())),
        };
        let d = x.dims().last().copied().unwrap_or(1).max(1);
        with_elems::<T, E, _>(x, |x| {
            with::<T, _>(w, |w| with_elems::<T, E, _>(g, |g| row_norm_backward::<T, E>(x, w, g, d, self.rms, &stats)))
        })
    }

    fn cpu<T: Real, E: Elem<T>>(
        &self,
        sx: &CpuStorage,
        lx: &Layout,
        sw: &CpuStorage,
        lw: &Layout,
        b: Option<(&CpuStorage, &Layout)>,
    ) -> Result<(CpuStorage, Shape)> {
        let w = read::<T>(sw, lw)?;
        match b {
            Some((sb, lb)) => self.fwd::<T, E>(sx, lx, &w, Some(&read::<T>(sb, lb)?)),
            None => self.fwd::<T, E>(sx, lx, &w, None),
        }
    }
}

wide_kernel! {
    /// Layer norm (with `b`; RMS norm with `rms`) of each `d`-long row of `x` with weights `w`:
    /// the output and each row's (mean, inverse deviation).
    fn row_norm_forward<T, E>(
        x: &[E],
        w: &[T],
        b: Option<&[T]>,
        d: usize,
        rms: bool,
        eps: f64,
    ) -> (Vec<E>, Vec<(f64, f64)>) {
        let rows = x.len() / d;
        let mut y = vec![E::store(T::zero()); x.len()];
        let mut stats = vec![(0.0, 0.0); rows];
        let (out, st) = (SharedMut::new(&mut y), SharedMut::new(&mut stats));
        par_ranges(rows, 16, |r| {
            for row in r {
                // SAFETY: one row per index.
                let (dst, stat) = unsafe { (out.range(row * d, d), st.range(row, 1)) };
                stat[0] = norm_row::<T, E>(&x[row * d..(row + 1) * d], dst, w, b, rms, eps);
            }
        });
        (y, stats)
    }
}

/// Layer norm (with `b`; RMS norm with `rms`) of the row `xr` into `dst`: its (mean, inverse
/// deviation). One row of [`row_norm_forward`], and of the fused inference epilogues after a
/// linear layer (`super::epilogue`), which so give the separate ops' outputs bit for bit.
#[inline(always)]
pub(super) fn norm_row<T: Real, E: Elem<T>>(
    xr: &[E],
    dst: &mut [E],
    w: &[T],
    b: Option<&[T]>,
    rms: bool,
    eps: f64,
) -> (f64, f64) {
    let d = xr.len();
    let mean = if rms { 0.0 } else { sum::<T, E>(xr) / d as f64 };
    let var = sum_sq_dev::<T, E>(xr, mean) / d as f64;
    let inv = 1.0 / (var + eps).sqrt();
    let (m, i) = (T::of(mean), T::of(inv));
    match b {
        Some(b) => dst.iter_mut().enumerate().for_each(|(j, o)| *o = E::store((xr[j].load() - m) * i * w[j] + b[j])),
        None => dst.iter_mut().enumerate().for_each(|(j, o)| *o = E::store(xr[j].load() * i * w[j])),
    }
    (mean, inv)
}

wide_kernel! {
    /// The row norm's (dx, dweight, dbias) from its input `x`, weights `w`, output gradient `g`
    /// and the forward pass's per-row statistics.
    fn row_norm_backward<T, E>(
        x: &[E],
        w: &[T],
        g: &[E],
        d: usize,
        rms: bool,
        stats: &[(f64, f64)],
    ) -> Result<(Vec<E>, Vec<T>, Vec<T>)> {
        let rows = x.len() / d;
        if stats.len() != rows {
            return Err(err(format!("norm backward: {} rows kept, {rows} now", stats.len())));
        }
        let mut dx = vec![E::store(T::zero()); x.len()];
        let sdx = SharedMut::new(&mut dx);
        // Per-chunk partial sums of dweight and dbias (f64), added at the end in
        // the chunks' order, so the result does not depend on which thread ends
        // first (the same inputs give the same bits on every run).
        let partial = Mutex::new(Vec::new());
        par_ranges(rows, 16, |r| {
            let first = r.start;
            let mut acc = vec![0.0f64; 2 * d];
            for row in r {
                let (mean, inv) = stats[row];
                let (xr, gr) = (&x[row * d..(row + 1) * d], &g[row * d..(row + 1) * d]);
                let (mut s1, mut s2) = (0.0f64, 0.0f64);
                for j in 0..d {
                    let (xv, gv) = (T::wide(xr[j].load()), T::wide(gr[j].load()));
                    let xhat = (xv - mean) * inv;
                    let gw = gv * T::wide(w[j]);
                    s1 += gw;
                    s2 += gw * xhat;
                    acc[j] += gv * xhat;
                    acc[d + j] += gv;
                }
                let (m1, m2) = (if rms { 0.0 } else { s1 / d as f64 }, s2 / d as f64);
                // SAFETY: one row per index.
                let dst = unsafe { sdx.range(row * d, d) };
                for j in 0..d {
                    let xhat = (T::wide(xr[j].load()) - mean) * inv;
                    let gw = T::wide(gr[j].load()) * T::wide(w[j]);
                    dst[j] = E::store(T::of(inv * (gw - m1 - xhat * m2)));
                }
            }
            partial.lock().unwrap_or_else(|p| p.into_inner()).push((first, acc));
        });
        let mut parts = partial.into_inner().unwrap_or_else(|p| p.into_inner());
        parts.sort_by_key(|(first, _)| *first);
        let mut sums = vec![0.0f64; 2 * d];
        for (_, acc) in &parts {
            sums.iter_mut().zip(acc).for_each(|(t, a)| *t += a);
        }
        let dw = sums[..d].iter().map(|v| T::of(*v)).collect();
        let db = sums[d..].iter().map(|v| T::of(*v)).collect();
        Ok((dx, dw, db))
    }
}

impl CustomOp3 for RowNorm {
    fn name(&self) -> &'static str {
        "layer_norm"
    }
    fn cpu_fwd(
        &self,
        sx: &CpuStorage,
        lx: &Layout,
        sw: &CpuStorage,
        lw: &Layout,
        sb: &CpuStorage,
        lb: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        by_elem!(sx.dtype(), T, E => self.cpu::<T, E>(sx, lx, sw, lw, Some((sb, lb))))
    }
    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        sx: &candle_core::CudaStorage,
        lx: &Layout,
        sw: &candle_core::CudaStorage,
        lw: &Layout,
        sb: &candle_core::CudaStorage,
        lb: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        self.cuda((sx, lx), (sw, lw), Some((sb, lb)))
    }
    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        b: &Tensor,
        _res: &Tensor,
        g: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let (dx, dw, db) = self.grads(x, w, g, b.dtype())?;
        Ok((x.track_op().then_some(dx), w.track_op().then_some(dw), b.track_op().then_some(db)))
    }
}

impl CustomOp2 for RowNorm {
    fn name(&self) -> &'static str {
        "rms_norm"
    }
    fn cpu_fwd(&self, sx: &CpuStorage, lx: &Layout, sw: &CpuStorage, lw: &Layout) -> Result<(CpuStorage, Shape)> {
        by_elem!(sx.dtype(), T, E => self.cpu::<T, E>(sx, lx, sw, lw, None))
    }
    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        sx: &candle_core::CudaStorage,
        lx: &Layout,
        sw: &candle_core::CudaStorage,
        lw: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        self.cuda((sx, lx), (sw, lw), None)
    }
    fn bwd(&self, x: &Tensor, w: &Tensor, _res: &Tensor, g: &Tensor) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let (dx, dw, _) = self.grads(x, w, g, w.dtype())?;
        Ok((x.track_op().then_some(dx), w.track_op().then_some(dw)))
    }
}

/// Layer normalisation over the last dimension, on the CPU or (feature `cuda`) a CUDA device
/// (see [`crate::ops::layer_norm`]).
pub fn layer_norm(x: &Tensor, weight: &Tensor, bias: &Tensor, eps: f64) -> Result<Tensor> {
    let op = RowNorm::new(eps, false);
    super::apply3(&x.contiguous()?, &weight.contiguous()?, &bias.contiguous()?, op)
}

/// RMS normalisation over the last dimension, on the CPU or (feature `cuda`) a CUDA device (see
/// [`crate::ops::rms_norm`]).
pub fn rms_norm(x: &Tensor, weight: &Tensor, eps: f64) -> Result<Tensor> {
    let op = RowNorm::new(eps, true);
    super::apply2(&x.contiguous()?, &weight.contiguous()?, op)
}
