//! Pooling with closed-form backward passes: max pooling (the gradient of each window goes to its
//! first maximum in row-major order, as PyTorch's `max_pool2d`; padding never wins) and global
//! average pooling. Max pooling keeps only its input: backward finds each window's maximum again.

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp1, Layout, Result, Shape, Tensor};

use super::{is_f64, par_ranges, read, tensor, with, Real, SharedMut};

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
    /// Index (within the plane) of the first maximum of output (oy, ox)'s window, NaN winning
    /// as in PyTorch.
    #[inline]
    fn argmax<T: Real>(&self, plane: &[T], h: usize, w: usize, oy: usize, ox: usize) -> usize {
        let (mut best, mut at) = (T::neg_infinity(), usize::MAX);
        for dy in 0..self.kernel {
            let Some(iy) = (oy * self.stride + dy).checked_sub(self.pad).filter(|iy| *iy < h) else { continue };
            for dx in 0..self.kernel {
                let Some(ix) = (ox * self.stride + dx).checked_sub(self.pad).filter(|ix| *ix < w) else { continue };
                let v = plane[iy * w + ix];
                if at == usize::MAX || v > best || v.is_nan() {
                    (best, at) = (v, iy * w + ix);
                }
            }
        }
        at
    }

    fn fwd<T: Real>(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let (n, c, h, w) = dims4(l.shape())?;
        let (oh, ow) =
            (out_len(h, self.kernel, self.stride, self.pad)?, out_len(w, self.kernel, self.stride, self.pad)?);
        let x = read::<T>(s, l)?;
        let mut y = vec![T::zero(); n * c * oh * ow];
        let out = SharedMut::new(&mut y);
        par_ranges(n * c, 1, |r| {
            for p in r {
                let plane = &x[p * h * w..(p + 1) * h * w];
                // SAFETY: one plane per index.
                let dst = unsafe { out.range(p * oh * ow, oh * ow) };
                for oy in 0..oh {
                    for ox in 0..ow {
                        let at = self.argmax(plane, h, w, oy, ox);
                        dst[oy * ow + ox] = plane.get(at).copied().unwrap_or(T::neg_infinity());
                    }
                }
            }
        });
        Ok((T::storage(y, s.dtype())?, Shape::from((n, c, oh, ow))))
    }

    fn bwd<T: Real>(&self, x: &Tensor, g: &Tensor) -> Result<Tensor> {
        let (n, c, h, w) = dims4(x.shape())?;
        let (_, _, oh, ow) = dims4(g.shape())?;
        let dx = with::<T, _>(x, |x| {
            with::<T, _>(g, |g| {
                let mut dx = vec![T::zero(); x.len()];
                let out = SharedMut::new(&mut dx);
                par_ranges(n * c, 1, |r| {
                    for p in r {
                        let plane = &x[p * h * w..(p + 1) * h * w];
                        // SAFETY: one plane per index.
                        let dst = unsafe { out.range(p * h * w, h * w) };
                        for oy in 0..oh {
                            for ox in 0..ow {
                                if let Some(d) = dst.get_mut(self.argmax(plane, h, w, oy, ox)) {
                                    *d = *d + g[(p * oh + oy) * ow + ox];
                                }
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
        if is_f64(s.dtype()) {
            self.fwd::<f64>(s, l)
        } else {
            self.fwd::<f32>(s, l)
        }
    }
    fn bwd(&self, x: &Tensor, _res: &Tensor, g: &Tensor) -> Result<Option<Tensor>> {
        Ok(Some(if is_f64(x.dtype()) { self.bwd::<f64>(x, g)? } else { self.bwd::<f32>(x, g)? }))
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
        let y: Vec<T> = (0..n * c)
            .map(|p| T::of(x[p * hw..(p + 1) * hw].iter().map(|v| T::wide(*v)).sum::<f64>() / hw as f64))
            .collect();
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
        if is_f64(s.dtype()) {
            GlobalAvg::fwd::<f64>(s, l)
        } else {
            GlobalAvg::fwd::<f32>(s, l)
        }
    }
    fn bwd(&self, x: &Tensor, _res: &Tensor, g: &Tensor) -> Result<Option<Tensor>> {
        Ok(Some(if is_f64(x.dtype()) { GlobalAvg::bwd::<f64>(x, g)? } else { GlobalAvg::bwd::<f32>(x, g)? }))
    }
}

/// Global average pooling on the CPU (see [`crate::cnn::global_avg_pool`]).
pub fn global_avg_pool(x: &Tensor) -> Result<Tensor> {
    super::apply1(&x.contiguous()?, GlobalAvg)
}
