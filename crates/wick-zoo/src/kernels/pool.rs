//! Pooling with closed-form backward passes: max pooling (the gradient of each window goes to its
//! first maximum in row-major order, as PyTorch's `max_pool2d`; padding never wins) and global
//! average pooling. Max pooling keeps only its input: backward finds each window's maximum again.

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp1, Layout, Result, Shape, Tensor};

use super::{par_ranges, read, sum, tensor, with, Real, SharedMut};

fn dims4(shape: &Shape) -> Result<(usize, usize, usize, usize)> {
    match shape.dims() {
        [n, c, h, w] => Ok((*n, *c, *h, *w)),
        d => Err(candle_core::Error::Msg(format!("pooling: expected (N, C, H, W), got {d:?}"))),
    }
}

/// Output length of a window sweep, or an error when the window does not fit.
pub(crate) fn out_len(len: usize, kernel: usize, stride: usize, pad: usize) -> Result<usize> {
    let padded = len + 2 * pad;
    if kernel == 0 || stride == 0 || padded < kernel {
        return Err(candle_core::Error::Msg(format!(
            "window {kernel} (stride {stride}, padding {pad}) does not fit a length of {len}"
        )));
    }
    Ok((padded - kernel) / stride + 1)
}

struct MaxPool {
    kernel: usize,
    stride: usize,
    pad: usize,
}

impl MaxPool {
    /// For each output position along an axis of `len` inputs, the input range of its window
    /// (padding excluded; never empty, since padding is at most half the kernel).
    fn windows(&self, len: usize, out: usize) -> Vec<(usize, usize)> {
        (0..out)
            .map(|o| {
                let start = o * self.stride;
                (start.saturating_sub(self.pad), (start + self.kernel).saturating_sub(self.pad).min(len))
            })
            .collect()
    }

    /// Index (within the plane) of the first maximum of the window rows `ys` × columns `xs`,
    /// NaN winning as in PyTorch (a later NaN replaces an earlier one).
    #[inline]
    fn argmax<T: Real>(plane: &[T], w: usize, ys: (usize, usize), xs: (usize, usize)) -> usize {
        let mut at = ys.0 * w + xs.0;
        let mut best = plane[at];
        for iy in ys.0..ys.1 {
            let row = &plane[iy * w..(iy + 1) * w];
            for (ix, v) in row.iter().enumerate().take(xs.1).skip(xs.0) {
                if *v > best || v.is_nan() {
                    (best, at) = (*v, iy * w + ix);
                }
            }
        }
        at
    }

    /// Output sizes, checked.
    fn out(&self, h: usize, w: usize) -> Result<(usize, usize)> {
        if 2 * self.pad > self.kernel {
            return Err(candle_core::Error::Msg(format!(
                "max_pool2d: padding {} is more than half the kernel {}",
                self.pad, self.kernel
            )));
        }
        Ok((out_len(h, self.kernel, self.stride, self.pad)?, out_len(w, self.kernel, self.stride, self.pad)?))
    }

    fn fwd<T: Real>(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let (n, c, h, w) = dims4(l.shape())?;
        let (oh, ow) = self.out(h, w)?;
        let (rows, cols) = (self.windows(h, oh), self.windows(w, ow));
        let x = read::<T>(s, l)?;
        let mut y = vec![T::zero(); n * c * oh * ow];
        let out = SharedMut::new(&mut y);
        par_ranges(n * c, 1, |r| {
            for p in r {
                let plane = &x[p * h * w..(p + 1) * h * w];
                // SAFETY: one plane per index.
                let dst = unsafe { out.range(p * oh * ow, oh * ow) };
                for (oy, ys) in rows.iter().enumerate() {
                    for (ox, xs) in cols.iter().enumerate() {
                        dst[oy * ow + ox] = plane[Self::argmax(plane, w, *ys, *xs)];
                    }
                }
            }
        });
        Ok((T::storage(y, s.dtype())?, Shape::from((n, c, oh, ow))))
    }

    fn bwd<T: Real>(&self, x: &Tensor, g: &Tensor) -> Result<Tensor> {
        let (n, c, h, w) = dims4(x.shape())?;
        let (oh, ow) = self.out(h, w)?;
        let (rows, cols) = (self.windows(h, oh), self.windows(w, ow));
        let dx = with::<T, _>(x, |x| {
            with::<T, _>(g, |g| {
                if g.len() != n * c * oh * ow {
                    return Err(candle_core::Error::Msg("max_pool2d backward: gradient shape".into()));
                }
                let mut dx = vec![T::zero(); x.len()];
                let out = SharedMut::new(&mut dx);
                par_ranges(n * c, 1, |r| {
                    for p in r {
                        let plane = &x[p * h * w..(p + 1) * h * w];
                        // SAFETY: one plane per index.
                        let dst = unsafe { out.range(p * h * w, h * w) };
                        for (oy, ys) in rows.iter().enumerate() {
                            for (ox, xs) in cols.iter().enumerate() {
                                let at = Self::argmax(plane, w, *ys, *xs);
                                dst[at] = dst[at] + g[(p * oh + oy) * ow + ox];
                            }
                        }
                    }
                });
                Ok(dx)
            })
        })?;
        tensor(dx, x.shape(), x.dtype())
    }
}

impl CustomOp1 for MaxPool {
    fn name(&self) -> &'static str {
        "max_pool2d"
    }
    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        by_real!(s.dtype(), T => self.fwd::<T>(s, l))
    }
    fn bwd(&self, x: &Tensor, _res: &Tensor, g: &Tensor) -> Result<Option<Tensor>> {
        Ok(Some(by_real!(x.dtype(), T => self.bwd::<T>(x, g)?)))
    }
}

/// Max pooling on the CPU (see [`crate::cnn::max_pool2d`]).
pub fn max_pool2d(x: &Tensor, kernel: usize, stride: usize, pad: usize) -> Result<Tensor> {
    super::apply1(&x.contiguous()?, MaxPool { kernel, stride, pad })
}

/// Mean over the two spatial dimensions: (N, C, H, W) → (N, C), summed in f64.
struct GlobalAvg;

impl GlobalAvg {
    fn fwd<T: Real>(s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let (n, c, h, w) = dims4(l.shape())?;
        let x = read::<T>(s, l)?;
        let hw = (h * w).max(1);
        let y: Vec<T> = (0..n * c).map(|p| T::of(sum(&x[p * hw..(p + 1) * hw]) / hw as f64)).collect();
        Ok((T::storage(y, s.dtype())?, Shape::from((n, c))))
    }

    fn bwd<T: Real>(x: &Tensor, g: &Tensor) -> Result<Tensor> {
        let (_, _, h, w) = dims4(x.shape())?;
        let hw = (h * w).max(1);
        let scale = T::of(1.0 / hw as f64);
        let dx = with::<T, _>(g, |g| Ok(g.iter().flat_map(|v| std::iter::repeat_n(*v * scale, hw)).collect()))?;
        tensor(dx, x.shape(), x.dtype())
    }
}

impl CustomOp1 for GlobalAvg {
    fn name(&self) -> &'static str {
        "global_avg_pool"
    }
    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        by_real!(s.dtype(), T => GlobalAvg::fwd::<T>(s, l))
    }
    fn bwd(&self, x: &Tensor, _res: &Tensor, g: &Tensor) -> Result<Option<Tensor>> {
        Ok(Some(by_real!(x.dtype(), T => GlobalAvg::bwd::<T>(x, g)?)))
    }
}

/// Global average pooling on the CPU (see [`crate::cnn::global_avg_pool`]).
pub fn global_avg_pool(x: &Tensor) -> Result<Tensor> {
    super::apply1(&x.contiguous()?, GlobalAvg)
}
