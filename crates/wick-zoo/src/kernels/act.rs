//! Element-wise activations as single ops with closed-form gradients: ReLU and ReLU6 with
//! PyTorch's gradient at the kinks (`[x > 0]`, `[0 < x < 6]`; NaN propagates), GELU (erf form)
//! and SwiGLU's `silu(a)·b`. Each keeps its inputs only.

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp1, CustomOp2, Layout, Result, Shape, Tensor};

use super::math::vectorized;
use super::{read, tensor, with, Real};

/// Elements per parallel chunk: below this a thread's start-up costs more than the work.
const CHUNK: usize = 1 << 15;

/// `f` of every element of `x`, in parallel chunks (slices, so the loops vectorise).
pub(crate) fn map1<T: Real>(x: &[T], f: impl Fn(T) -> T + Send + Sync) -> Vec<T> {
    use rayon::prelude::*;
    let mut out = vec![T::zero(); x.len()];
    out.par_chunks_mut(CHUNK).zip(x.par_chunks(CHUNK)).for_each(|(o, i)| {
        vectorized(|| {
            for (d, v) in o.iter_mut().zip(i) {
                *d = f(*v);
            }
        })
    });
    out
}

/// `f` of every pair of elements of `a` and `b` (same length), in parallel chunks.
pub(crate) fn map2<T: Real>(a: &[T], b: &[T], f: impl Fn(T, T) -> T + Send + Sync) -> Vec<T> {
    use rayon::prelude::*;
    let mut out = vec![T::zero(); a.len()];
    out.par_chunks_mut(CHUNK).zip(a.par_chunks(CHUNK)).zip(b.par_chunks(CHUNK)).for_each(|((o, a), b)| {
        vectorized(|| {
            for ((d, x), y) in o.iter_mut().zip(a).zip(b) {
                *d = f(*x, *y);
            }
        })
    });
    out
}

/// `f` of every triple of elements of `a`, `b` and `c` (same length), in parallel chunks.
pub(crate) fn map3<T: Real>(a: &[T], b: &[T], c: &[T], f: impl Fn(T, T, T) -> T + Send + Sync) -> Vec<T> {
    use rayon::prelude::*;
    let mut out = vec![T::zero(); a.len()];
    out.par_chunks_mut(CHUNK).zip(a.par_chunks(CHUNK)).zip(b.par_chunks(CHUNK)).zip(c.par_chunks(CHUNK)).for_each(
        |(((o, a), b), c)| {
            vectorized(|| {
                for (((d, x), y), z) in o.iter_mut().zip(a).zip(b).zip(c) {
                    *d = f(*x, *y, *z);
                }
            })
        },
    );
    out
}

fn same_len(what: &str, a: usize, b: usize) -> Result<()> {
    if a == b {
        Ok(())
    } else {
        Err(candle_core::Error::Msg(format!("{what}: {a} vs {b} elements")))
    }
}

/// `x` clamped below at 0 and, with `max`, above at `max`, by comparisons (NaN fails both and
/// passes through; +0 for negative inputs).
struct Clamp {
    max: Option<f64>,
}

impl Clamp {
    fn fwd<T: Real>(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let x = read::<T>(s, l)?;
        let y = match self.max.map(T::of) {
            // Selections, so NaN (which fails every comparison) passes through.
            Some(m) => map1(&x, move |v| {
                if v <= T::zero() {
                    T::zero()
                } else if v >= m {
                    m
                } else {
                    v
                }
            }),
            None => map1(&x, move |v| if v <= T::zero() { T::zero() } else { v }),
        };
        Ok((T::storage(y, s.dtype())?, l.shape().clone()))
    }

    fn bwd<T: Real>(&self, x: &Tensor, g: &Tensor) -> Result<Tensor> {
        let max = self.max.map(T::of).unwrap_or(T::infinity());
        let dx = with::<T, _>(x, |x| {
            with::<T, _>(g, |g| {
                same_len("relu backward", x.len(), g.len())?;
                Ok(map2(x, g, move |v, g| if v > T::zero() && v < max { g } else { T::zero() }))
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
        by_real!(s.dtype(), T => self.fwd::<T>(s, l))
    }
    fn bwd(&self, x: &Tensor, _res: &Tensor, g: &Tensor) -> Result<Option<Tensor>> {
        Ok(Some(by_real!(x.dtype(), T => self.bwd::<T>(x, g)?)))
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

/// GELU, erf form: `x·Φ(x)`.
struct Gelu;

impl Gelu {
    fn fwd<T: Real>(s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let x = read::<T>(s, l)?;
        let (half, r2) = (T::of(0.5), T::of(std::f64::consts::FRAC_1_SQRT_2));
        let y = map1(&x, move |v| (T::erf_(v * r2) + T::one()) * half * v);
        Ok((T::storage(y, s.dtype())?, l.shape().clone()))
    }

    fn bwd<T: Real>(x: &Tensor, g: &Tensor) -> Result<Tensor> {
        let (half, r2) = (T::of(0.5), T::of(std::f64::consts::FRAC_1_SQRT_2));
        let pdf = T::of(0.5 * std::f64::consts::FRAC_2_SQRT_PI * std::f64::consts::FRAC_1_SQRT_2);
        let dx = with::<T, _>(x, |x| {
            with::<T, _>(g, |g| {
                same_len("gelu backward", x.len(), g.len())?;
                Ok(map2(x, g, move |v, g| {
                    let cdf = (T::erf_(v * r2) + T::one()) * half;
                    g * (cdf + v * pdf * T::exp_(-(v * v) * half))
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
        by_real!(s.dtype(), T => Gelu::fwd::<T>(s, l))
    }
    fn bwd(&self, x: &Tensor, _res: &Tensor, g: &Tensor) -> Result<Option<Tensor>> {
        Ok(Some(by_real!(x.dtype(), T => Gelu::bwd::<T>(x, g)?)))
    }
}

/// GELU (erf form) on the CPU, computed in f32 (f64 for f64) and rounded once.
pub fn gelu(x: &Tensor) -> Result<Tensor> {
    super::apply1(&x.contiguous()?, Gelu)
}

/// `silu(a)·b` (SwiGLU's gate).
struct SiluMul;

#[inline(always)]
fn sigmoid<T: Real>(v: T) -> T {
    T::one() / (T::one() + T::exp_(-v))
}

impl SiluMul {
    fn fwd<T: Real>(sa: &CpuStorage, la: &Layout, sb: &CpuStorage, lb: &Layout) -> Result<(CpuStorage, Shape)> {
        let (a, b) = (read::<T>(sa, la)?, read::<T>(sb, lb)?);
        same_len("silu_mul", a.len(), b.len())?;
        let y = map2(&a, &b, move |a, b| a * sigmoid(a) * b);
        Ok((T::storage(y, sa.dtype())?, la.shape().clone()))
    }

    fn bwd<T: Real>(a: &Tensor, b: &Tensor, g: &Tensor) -> Result<(Tensor, Tensor)> {
        let (da, db) = with::<T, _>(a, |a| {
            with::<T, _>(b, |b| {
                with::<T, _>(g, |g| {
                    same_len("silu_mul backward", a.len(), g.len())?;
                    let da = map3(a, b, g, move |a, b, g| {
                        let s = sigmoid(a);
                        g * b * s * (T::one() + a * (T::one() - s))
                    });
                    let db = map2(a, g, move |a, g| g * a * sigmoid(a));
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
        by_real!(sa.dtype(), T => SiluMul::fwd::<T>(sa, la, sb, lb))
    }
    fn bwd(&self, a: &Tensor, b: &Tensor, _res: &Tensor, g: &Tensor) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let (da, db) = by_real!(a.dtype(), T => SiluMul::bwd::<T>(a, b, g)?);
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

/// `relu(a + b)` (a residual connection's end), the sum neither stored nor kept: backward
/// recomputes it for the mask (PyTorch's gradient, `[a + b > 0]`).
struct AddRelu;

impl AddRelu {
    fn fwd<T: Real>(sa: &CpuStorage, la: &Layout, sb: &CpuStorage, lb: &Layout) -> Result<(CpuStorage, Shape)> {
        let (a, b) = (read::<T>(sa, la)?, read::<T>(sb, lb)?);
        same_len("add_relu", a.len(), b.len())?;
        let y = map2(&a, &b, move |a, b| {
            let v = a + b;
            if v <= T::zero() {
                T::zero()
            } else {
                v
            }
        });
        Ok((T::storage(y, sa.dtype())?, la.shape().clone()))
    }

    fn bwd<T: Real>(a: &Tensor, b: &Tensor, g: &Tensor) -> Result<(Tensor, Tensor)> {
        let d = with::<T, _>(a, |a| {
            with::<T, _>(b, |b| {
                with::<T, _>(g, |g| {
                    same_len("add_relu backward", a.len(), g.len())?;
                    Ok(map3(a, b, g, move |a, b, g| if a + b > T::zero() { g } else { T::zero() }))
                })
            })
        })?;
        let da = tensor(d.clone(), a.shape(), a.dtype())?;
        Ok((da, tensor(d, b.shape(), b.dtype())?))
    }
}

impl CustomOp2 for AddRelu {
    fn name(&self) -> &'static str {
        "add_relu"
    }
    fn cpu_fwd(&self, sa: &CpuStorage, la: &Layout, sb: &CpuStorage, lb: &Layout) -> Result<(CpuStorage, Shape)> {
        by_real!(sa.dtype(), T => AddRelu::fwd::<T>(sa, la, sb, lb))
    }
    fn bwd(&self, a: &Tensor, b: &Tensor, _res: &Tensor, g: &Tensor) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let (da, db) = by_real!(a.dtype(), T => AddRelu::bwd::<T>(a, b, g)?);
        Ok((a.track_op().then_some(da), b.track_op().then_some(db)))
    }
}

/// `relu(a + b)` for same-shaped `a` and `b` on the CPU (see [`crate::ops::add_relu`]).
pub fn add_relu(a: &Tensor, b: &Tensor) -> Result<Tensor> {
    if a.shape() != b.shape() || a.dtype() != b.dtype() {
        return Err(candle_core::Error::Msg(format!(
            "add_relu: {:?} {:?} vs {:?} {:?}",
            a.shape(),
            a.dtype(),
            b.shape(),
            b.dtype()
        )));
    }
    super::apply2(&a.contiguous()?, &b.contiguous()?, AddRelu)
}
