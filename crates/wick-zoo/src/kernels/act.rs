//! Element-wise activations as single ops with closed-form gradients: ReLU and ReLU6 with
//! PyTorch's gradient at the kinks (`[x > 0]`, `[0 < x < 6]`; NaN propagates), GELU (erf form)
//! and SwiGLU's `silu(a)·b`. Each keeps its inputs only.

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp1, CustomOp2, Layout, Result, Shape, Tensor};

use super::{is_f64, par_ranges, read, tensor, with, Real, SharedMut};

/// Elements per parallel chunk: below this a thread's start-up costs more than the work.
const CHUNK: usize = 1 << 15;

/// `out[i] = f(i)` for every element, in parallel chunks.
fn fill<T: Real>(n: usize, f: impl Fn(usize) -> T + Send + Sync) -> Vec<T> {
    let mut out = vec![T::zero(); n];
    let shared = SharedMut::new(&mut out);
    par_ranges(n, CHUNK, |r| {
        // SAFETY: the ranges of `par_ranges` are disjoint.
        let dst = unsafe { shared.range(r.start, r.len()) };
        for (d, i) in dst.iter_mut().zip(r) {
            *d = f(i);
        }
    });
    out
}

/// `x` clamped below at 0 and, with `max`, above at `max`, by comparisons (NaN fails both and
/// passes through; +0 for negative inputs).
struct Clamp {
    max: Option<f64>,
}

fn clamp_value<T: Real>(v: T, max: Option<T>) -> T {
    let v = if v <= T::zero() { T::zero() } else { v };
    match max {
        Some(m) if v >= m => m,
        _ => v,
    }
}

impl Clamp {
    fn fwd<T: Real>(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let x = read::<T>(s, l)?;
        let max = self.max.map(T::of);
        let y = fill(x.len(), |i| clamp_value(x[i], max));
        Ok((T::storage(y, s.dtype())?, l.shape().clone()))
    }

    fn bwd<T: Real>(&self, x: &Tensor, g: &Tensor) -> Result<Tensor> {
        let max = self.max.map(T::of);
        let dx = with::<T, _>(x, |x| {
            with::<T, _>(g, |g| {
                Ok(fill(x.len(), |i| {
                    let inside = x[i] > T::zero() && max.is_none_or(|m| x[i] < m);
                    if inside {
                        g[i]
                    } else {
                        T::zero()
                    }
                }))
            })
        })?;
        tensor(dx, x.shape(), x.dtype())
    }
}

impl CustomOp1 for Clamp {
    fn name(&self) -> &'static str {
        if self.max.is_some() {
            "relu6"
        } else {
            "relu"
        }
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

/// ReLU on the CPU (see [`crate::ops::relu`]).
pub fn relu(x: &Tensor) -> Result<Tensor> {
    super::apply1(&x.contiguous()?, Clamp { max: None })
}

/// ReLU6 on the CPU (see [`crate::ops::relu6`]).
pub fn relu6(x: &Tensor) -> Result<Tensor> {
    super::apply1(&x.contiguous()?, Clamp { max: Some(6.0) })
}

fn erf<T: Real>(v: T) -> T {
    if std::any::TypeId::of::<T>() == std::any::TypeId::of::<f64>() {
        T::of(candle_core::cpu::erf::erf_f64(T::wide(v)))
    } else {
        T::of(candle_core::cpu::erf::erf_f32(T::wide(v) as f32) as f64)
    }
}

/// GELU, erf form: `x·Φ(x)`.
struct Gelu;

impl Gelu {
    fn fwd<T: Real>(s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let x = read::<T>(s, l)?;
        let (half, r2) = (T::of(0.5), T::of(std::f64::consts::FRAC_1_SQRT_2));
        let y = fill(x.len(), |i| (erf(x[i] * r2) + T::one()) * half * x[i]);
        Ok((T::storage(y, s.dtype())?, l.shape().clone()))
    }

    fn bwd<T: Real>(x: &Tensor, g: &Tensor) -> Result<Tensor> {
        let (half, r2) = (T::of(0.5), T::of(std::f64::consts::FRAC_1_SQRT_2));
        let pdf = T::of(0.5 * std::f64::consts::FRAC_2_SQRT_PI * std::f64::consts::FRAC_1_SQRT_2);
        let dx = with::<T, _>(x, |x| {
            with::<T, _>(g, |g| {
                Ok(fill(x.len(), |i| {
                    let v = x[i];
                    let cdf = (erf(v * r2) + T::one()) * half;
                    g[i] * (cdf + v * pdf * (-(v * v) * half).exp())
                }))
            })
        })?;
        tensor(dx, x.shape(), x.dtype())
    }
}

impl CustomOp1 for Gelu {
    fn name(&self) -> &'static str {
        "gelu"
    }
    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        if is_f64(s.dtype()) {
            Gelu::fwd::<f64>(s, l)
        } else {
            Gelu::fwd::<f32>(s, l)
        }
    }
    fn bwd(&self, x: &Tensor, _res: &Tensor, g: &Tensor) -> Result<Option<Tensor>> {
        Ok(Some(if is_f64(x.dtype()) { Gelu::bwd::<f64>(x, g)? } else { Gelu::bwd::<f32>(x, g)? }))
    }
}

/// GELU (erf form) on the CPU, computed in f32 (f64 for f64) and rounded once.
pub fn gelu(x: &Tensor) -> Result<Tensor> {
    super::apply1(&x.contiguous()?, Gelu)
}

/// `silu(a)·b` (SwiGLU's gate).
struct SiluMul;

fn sigmoid<T: Real>(v: T) -> T {
    T::one() / (T::one() + (-v).exp())
}

impl SiluMul {
    fn fwd<T: Real>(sa: &CpuStorage, la: &Layout, sb: &CpuStorage, lb: &Layout) -> Result<(CpuStorage, Shape)> {
        let (a, b) = (read::<T>(sa, la)?, read::<T>(sb, lb)?);
        if a.len() != b.len() {
            return Err(candle_core::Error::Msg(format!("silu_mul: {} vs {} elements", a.len(), b.len())));
        }
        let y = fill(a.len(), |i| a[i] * sigmoid(a[i]) * b[i]);
        Ok((T::storage(y, sa.dtype())?, la.shape().clone()))
    }

    fn bwd<T: Real>(a: &Tensor, b: &Tensor, g: &Tensor) -> Result<(Tensor, Tensor)> {
        let (da, db) = with::<T, _>(a, |a| {
            with::<T, _>(b, |b| {
                with::<T, _>(g, |g| {
                    let da = fill(a.len(), |i| {
                        let s = sigmoid(a[i]);
                        g[i] * b[i] * s * (T::one() + a[i] * (T::one() - s))
                    });
                    let db = fill(a.len(), |i| g[i] * a[i] * sigmoid(a[i]));
                    Ok((da, db))
                })
            })
        })?;
        Ok((tensor(da, a.shape(), a.dtype())?, tensor(db, b.shape(), b.dtype())?))
    }
}

impl CustomOp2 for SiluMul {
    fn name(&self) -> &'static str {
        "silu_mul"
    }
    fn cpu_fwd(&self, sa: &CpuStorage, la: &Layout, sb: &CpuStorage, lb: &Layout) -> Result<(CpuStorage, Shape)> {
        if is_f64(sa.dtype()) {
            SiluMul::fwd::<f64>(sa, la, sb, lb)
        } else {
            SiluMul::fwd::<f32>(sa, la, sb, lb)
        }
    }
    fn bwd(&self, a: &Tensor, b: &Tensor, _res: &Tensor, g: &Tensor) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let (da, db) = if is_f64(a.dtype()) { SiluMul::bwd::<f64>(a, b, g)? } else { SiluMul::bwd::<f32>(a, b, g)? };
        Ok((Some(da), Some(db)))
    }
}

/// `silu(a)·b` for same-shaped `a` and `b` on the CPU, computed in f32 (f64 for f64).
pub fn silu_mul(a: &Tensor, b: &Tensor) -> Result<Tensor> {
    if a.shape() != b.shape() || a.dtype() != b.dtype() {
        return Err(candle_core::Error::Msg(format!(
            "silu_mul: {:?} {:?} vs {:?} {:?}",
            a.shape(),
            a.dtype(),
            b.shape(),
            b.dtype()
        )));
    }
    super::apply2(&a.contiguous()?, &b.contiguous()?, SiluMul)
}
