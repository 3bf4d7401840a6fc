//! Element-wise activations as single ops with closed-form gradients: ReLU and ReLU6 with
//! PyTorch's gradient at the kinks (`[x > 0]`, `[0 < x < 6]`; NaN propagates), GELU (erf form)
//! and SwiGLU's `silu(a)·b`. Each keeps its inputs only. They read and write their tensors' own
//! element types (the crate's `kernels::elem`): a bf16 op computes in f32 inside the loop and
//! moves half the bytes of an f32 one. With the `cuda` feature each op but `add` (a host fix for
//! candle's slow bf16 addition; candle's CUDA addition is one kernel already) has a CUDA body too
//! (`crate::native::cuda::act`): the same node, keeping the same tensors, one launch per pass.

use std::f64::consts::{FRAC_1_SQRT_2, FRAC_2_SQRT_PI};
use std::mem::MaybeUninit;

use candle_core::backend::BackendStorage;
#[cfg(feature = "cuda")]
use candle_core::CudaStorage;
use candle_core::{CpuStorage, CustomOp1, CustomOp2, Layout, Result, Shape, Tensor};

use super::elem::{by_elem, elem_tensor, elems, with_elems, Elem};
use super::Real;
#[cfg(feature = "cuda")]
use crate::native::cuda::act as cuda;

/// Elements per parallel chunk: below this a thread's start-up costs more than the work.
const CHUNK: usize = 1 << 15;

/// `len` outputs, each parallel chunk written by `f(chunk index, chunk)`.
fn par_out<E: Send>(len: usize, f: impl Fn(usize, &mut [MaybeUninit<E>]) + Send + Sync) -> Vec<E> {
    use rayon::prelude::*;
    let mut out = Vec::with_capacity(len);
    let spare = &mut out.spare_capacity_mut()[..len];
    if len <= CHUNK {
        // One chunk: no hand-over to the thread pool (waking a worker and waiting for it cost
        // more than a small op).
        f(0, spare);
    } else {
        spare.par_chunks_mut(CHUNK).enumerate().for_each(|(i, o)| f(i, o));
    }
    out
}

/// An element-wise function of `N` inputs. The maps' loops, compiled for the CPU's widest
/// vectors, call it through this trait's `#[inline(always)]` method: a closure's body is a
/// function of its own, which the compiler did not inline into such a loop (GELU's backward
/// then ran one out-of-line scalar call per element, several times slower: BENCHMARKS.md,
/// "Kernel design measurements").
trait Pointwise<T, const N: usize>: Send + Sync {
    fn at(&self, v: [T; N]) -> T;
}

/// Defines a unit struct that is a [`Pointwise`] function of `N` inputs.
macro_rules! pointwise {
    ($(#[$m:meta])* $name:ident, $n:literal, |$v:pat_param| $body:expr) => {
        $(#[$m])*
        struct $name;
        impl<T: Real> Pointwise<T, $n> for $name {
            #[inline(always)]
            fn at(&self, $v: [T; $n]) -> T {
                $body
            }
        }
    };
}

pointwise!(
    /// ReLU by comparison (NaN fails it and passes through; +0 for negative inputs).
    Relu, 1, |[v]| if v <= T::zero() { T::zero() } else { v }
);
pointwise!(
    /// GELU, erf form: `x·Φ(x)`.
    GeluF, 1, |[v]| (T::erf_(v * T::of(FRAC_1_SQRT_2)) + T::one()) * T::of(0.5) * v
);
/// GELU (erf form) of one value, as [`gelu`] computes each (the fused inference epilogues').
#[inline(always)]
pub(super) fn gelu_at<T: Real>(v: T) -> T {
    GeluF.at([v])
}

pointwise!(
    /// GELU's gradient at `v` times `g`.
    GeluGrad, 2, |[v, g]| {
        let (half, r2) = (T::of(0.5), T::of(FRAC_1_SQRT_2));
        let pdf = T::of(0.5 * FRAC_2_SQRT_PI * FRAC_1_SQRT_2);
        let cdf = (T::erf_(v * r2) + T::one()) * half;
        g * (cdf + v * pdf * T::exp_(-(v * v) * half))
    }
);
pointwise!(
    /// `silu(a)·b`.
    SiluMulF, 2, |[a, b]| a * sigmoid(a) * b
);
pointwise!(
    /// `silu(a)·b`'s gradient with respect to `a`, times `g`.
    SiluMulGradA, 3, |[a, b, g]| {
        let s = sigmoid(a);
        g * b * s * (T::one() + a * (T::one() - s))
    }
);
pointwise!(
    /// `silu(a)·b`'s gradient with respect to `b`, times `g`.
    SiluMulGradB, 2, |[a, g]| g * a * sigmoid(a)
);
pointwise!(
    /// `a + b`.
    AddF, 2, |[a, b]| a + b
);
pointwise!(
    /// `relu(a + b)`.
    AddReluF, 2, |[a, b]| Relu.at([a + b])
);
pointwise!(
    /// `relu(a + b)`'s gradient (PyTorch's, `[a + b > 0]`) times `g`.
    AddReluGrad, 3, |[a, b, g]| if a + b > T::zero() { g } else { T::zero() }
);

/// ReLU6-style clamp to `[0, max]` by comparisons (NaN passes through).
struct ClampMax<T>(T);

impl<T: Real> Pointwise<T, 1> for ClampMax<T> {
    #[inline(always)]
    fn at(&self, [v]: [T; 1]) -> T {
        if v <= T::zero() {
            T::zero()
        } else if v >= self.0 {
            self.0
        } else {
            v
        }
    }
}

/// The clamp's gradient: `g` where `0 < v < max` (PyTorch's rule at the kinks).
struct ClampGrad<T>(T);

impl<T: Real> Pointwise<T, 2> for ClampGrad<T> {
    #[inline(always)]
    fn at(&self, [v, g]: [T; 2]) -> T {
        if v > T::zero() && v < self.0 {
            g
        } else {
            T::zero()
        }
    }
}

wide_kernel! {
    /// `f` of every element of `x`, in parallel chunks, compiled for the CPU's widest vectors
    /// (the loop itself: a loop in a closure handed to such a function stayed baseline code
    /// when the closure was not inlined, as with a bf16 SiLU's conversions and exponential).
    fn map1<T, E>(x: &[E], f: impl Pointwise<T, 1>) -> Vec<E> {
        let mut out = par_out(x.len(), |i, o| {
            let x = &x[i * CHUNK..][..o.len()];
            o.iter_mut().zip(x).for_each(|(d, v)| _ = d.write(E::store(f.at([v.load()]))))
        });
        // SAFETY: `par_out` split the first `x.len()` elements into chunks, and each chunk's
        // loop above wrote every element of it (it zips the chunk with an equally long part of
        // `x`).
        unsafe { out.set_len(x.len()) };
        out
    }
}

wide_kernel! {
    /// `f` of every pair of elements of `a` and `b` (same length, checked), in parallel chunks.
    fn map2<T, E>(what: &str, a: &[E], b: &[E], f: impl Pointwise<T, 2>) -> Result<Vec<E>> {
        same_len(what, a.len(), b.len())?;
        let mut out = par_out(a.len(), |i, o| {
            let (a, b) = (&a[i * CHUNK..][..o.len()], &b[i * CHUNK..][..o.len()]);
            o.iter_mut().zip(a).zip(b).for_each(|((d, x), y)| _ = d.write(E::store(f.at([x.load(), y.load()]))))
        });
        // SAFETY: as in `map1`: every element of every chunk was written (`a` and `b` are as
        // long as the output).
        unsafe { out.set_len(a.len()) };
        Ok(out)
    }
}

wide_kernel! {
    /// `f` of every triple of elements of `a`, `b` and `c` (same length, checked), in parallel
    /// chunks.
    fn map3<T, E>(what: &str, a: &[E], b: &[E], c: &[E], f: impl Pointwise<T, 3>) -> Result<Vec<E>> {
        same_len(what, a.len(), b.len())?;
        same_len(what, a.len(), c.len())?;
        let mut out = par_out(a.len(), |i, o| {
            let (a, b, c) = (&a[i * CHUNK..][..o.len()], &b[i * CHUNK..][..o.len()], &c[i * CHUNK..][..o.len()]);
            for (((d, x), y), z) in o.iter_mut().zip(a).zip(b).zip(c) {
                d.write(E::store(f.at([x.load(), y.load(), z.load()])));
            }
        });
        // SAFETY: as in `map1`: every element of every chunk was written (`a`, `b` and `c` are
        // as long as the output).
        unsafe { out.set_len(a.len()) };
        Ok(out)
    }
}

/// A two-input element-wise op's forward: `f` of the two storages' elements, as stored.
fn binary<T: Real, E: Elem<T>>(
    what: &str,
    (sa, la): (&CpuStorage, &Layout),
    (sb, lb): (&CpuStorage, &Layout),
    f: impl Pointwise<T, 2>,
) -> Result<(CpuStorage, Shape)> {
    let y = map2(what, elems::<T, E>(sa, la)?, elems::<T, E>(sb, lb)?, f)?;
    Ok((E::into_storage(y), la.shape().clone()))
}

/// Applies a two-input element-wise `op` to same-shaped, same-dtype `a` and `b` (anything else
/// is an error naming `what`).
fn apply_same<C: CustomOp2 + Send + Sync + 'static>(what: &str, a: &Tensor, b: &Tensor, op: C) -> Result<Tensor> {
    if a.shape() != b.shape() || a.dtype() != b.dtype() {
        return Err(candle_core::Error::Msg(format!(
            "{what}: {:?} {:?} vs {:?} {:?}",
            a.shape(),
            a.dtype(),
            b.shape(),
            b.dtype()
        )));
    }
    super::apply2(&a.contiguous()?, &b.contiguous()?, op)
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
    fn fwd<T: Real, E: Elem<T>>(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let x = elems::<T, E>(s, l)?;
        let y = match self.max.map(T::of) {
            // Selections, so NaN (which fails every comparison) passes through.
            Some(m) => map1(x, ClampMax(m)),
            None => map1(x, Relu),
        };
        Ok((E::into_storage(y), l.shape().clone()))
    }

    fn bwd<T: Real, E: Elem<T>>(&self, x: &Tensor, g: &Tensor) -> Result<Tensor> {
        let max = self.max.map(T::of).unwrap_or(T::infinity());
        let dx =
            with_elems::<T, E, _>(x, |x| with_elems::<T, E, _>(g, |g| map2("relu backward", x, g, ClampGrad(max))))?;
        elem_tensor::<T, E>(dx, x.shape())
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
        by_elem!(s.dtype(), T, E => self.fwd::<T, E>(s, l))
    }
    #[cfg(feature = "cuda")]
    fn cuda_fwd(&self, s: &CudaStorage, l: &Layout) -> Result<(CudaStorage, Shape)> {
        cuda::forward("clamp", &[(s, l)], self.max.unwrap_or(f64::INFINITY))
    }
    fn bwd(&self, x: &Tensor, _res: &Tensor, g: &Tensor) -> Result<Option<Tensor>> {
        #[cfg(feature = "cuda")]
        if x.device().is_cuda() {
            return cuda::grad("clamp_grad", &[x, g], self.max.unwrap_or(f64::INFINITY)).map(Some);
        }
        by_elem!(x.dtype(), T, E => self.bwd::<T, E>(x, g).map(Some))
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
    fn fwd<T: Real, E: Elem<T>>(s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let y = map1(elems::<T, E>(s, l)?, GeluF);
        Ok((E::into_storage(y), l.shape().clone()))
    }

    fn bwd<T: Real, E: Elem<T>>(x: &Tensor, g: &Tensor) -> Result<Tensor> {
        let dx = with_elems::<T, E, _>(x, |x| with_elems::<T, E, _>(g, |g| map2("gelu backward", x, g, GeluGrad)))?;
        elem_tensor::<T, E>(dx, x.shape())
    }
}

impl CustomOp1 for Gelu {
    fn name(&self) -> &'static str {
        "gelu"
    }
    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        by_elem!(s.dtype(), T, E => Gelu::fwd::<T, E>(s, l))
    }
    #[cfg(feature = "cuda")]
    fn cuda_fwd(&self, s: &CudaStorage, l: &Layout) -> Result<(CudaStorage, Shape)> {
        cuda::forward("gelu", &[(s, l)], 0.0)
    }
    fn bwd(&self, x: &Tensor, _res: &Tensor, g: &Tensor) -> Result<Option<Tensor>> {
        #[cfg(feature = "cuda")]
        if x.device().is_cuda() {
            return cuda::grad("gelu_grad", &[x, g], 0.0).map(Some);
        }
        by_elem!(x.dtype(), T, E => Gelu::bwd::<T, E>(x, g).map(Some))
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
    fn bwd<T: Real, E: Elem<T>>(a: &Tensor, b: &Tensor, g: &Tensor) -> Result<(Tensor, Tensor)> {
        let (da, db) = with_elems::<T, E, _>(a, |a| {
            with_elems::<T, E, _>(b, |b| {
                with_elems::<T, E, _>(g, |g| {
                    let da = map3("silu_mul backward", a, b, g, SiluMulGradA)?;
                    let db = map2("silu_mul backward", a, g, SiluMulGradB)?;
                    Ok((da, db))
                })
            })
        })?;
        Ok((elem_tensor::<T, E>(da, a.shape())?, elem_tensor::<T, E>(db, b.shape())?))
    }
}

impl CustomOp2 for SiluMul {
    fn name(&self) -> &'static str {
        "silu_mul"
    }
    fn cpu_fwd(&self, sa: &CpuStorage, la: &Layout, sb: &CpuStorage, lb: &Layout) -> Result<(CpuStorage, Shape)> {
        by_elem!(sa.dtype(), T, E => binary::<T, E>("silu_mul", (sa, la), (sb, lb), SiluMulF))
    }
    #[cfg(feature = "cuda")]
    fn cuda_fwd(&self, sa: &CudaStorage, la: &Layout, sb: &CudaStorage, lb: &Layout) -> Result<(CudaStorage, Shape)> {
        cuda::forward("silu_mul", &[(sa, la), (sb, lb)], 0.0)
    }
    fn bwd(&self, a: &Tensor, b: &Tensor, _res: &Tensor, g: &Tensor) -> Result<(Option<Tensor>, Option<Tensor>)> {
        #[cfg(feature = "cuda")]
        if a.device().is_cuda() {
            let (da, db) = cuda::silu_mul_grads(a, b, g)?;
            return Ok((Some(da), Some(db)));
        }
        let (da, db) = by_elem!(a.dtype(), T, E => SiluMul::bwd::<T, E>(a, b, g))?;
        Ok((Some(da), Some(db)))
    }
}

/// `silu(a)·b` for same-shaped `a` and `b` on the CPU, computed in f32 (f64 for f64).
pub fn silu_mul(a: &Tensor, b: &Tensor) -> Result<Tensor> {
    apply_same("silu_mul", a, b, SiluMul)
}

wide_kernel! {
    /// `silu(a)·b` of every row of `u`, rows of `2·width` elements holding `a` then `b`, in
    /// parallel over rows.
    fn silu_mul_rows<T, E>(u: &[E], width: usize) -> Vec<E> {
        let rows = u.len() / (2 * width).max(1);
        let mut out = vec![E::store(T::zero()); rows * width];
        let shared = super::SharedMut::new(&mut out);
        super::par_ranges(rows, 8, |r| {
            // SAFETY: disjoint row ranges.
            let dst = unsafe { shared.range(r.start * width, r.len() * width) };
            for (row, o) in r.zip(dst.chunks_exact_mut(width)) {
                let (a, b) = u[row * 2 * width..(row + 1) * 2 * width].split_at(width);
                for ((d, a), b) in o.iter_mut().zip(a).zip(b) {
                    *d = E::store(SiluMulF.at([a.load(), b.load()]));
                }
            }
        });
        out
    }
}

wide_kernel! {
    /// The gradient of [`silu_mul_rows`] for the output gradient `g` (rows of `width`): each
    /// row's `a` part, then its `b` part.
    fn silu_mul_rows_grad<T, E>(u: &[E], g: &[E], width: usize) -> Vec<E> {
        let rows = u.len() / (2 * width).max(1);
        let mut du = vec![E::store(T::zero()); u.len()];
        let shared = super::SharedMut::new(&mut du);
        super::par_ranges(rows, 8, |r| {
            // SAFETY: disjoint row ranges.
            let dst = unsafe { shared.range(r.start * 2 * width, r.len() * 2 * width) };
            for (row, d) in r.zip(dst.chunks_exact_mut(2 * width)) {
                let (a, b) = u[row * 2 * width..(row + 1) * 2 * width].split_at(width);
                let gr = &g[row * width..(row + 1) * width];
                let (da, db) = d.split_at_mut(width);
                // Stored as computed (f32): written straight to `da` and `db` in one loop, the
                // body stayed scalar (the compiler could not tell the stores from the loads), 8×
                // the bf16 one's time; both outputs go through local blocks instead. Stored
                // narrower (bf16): the one loop over the whole row (the blocks measured slower
                // there: 39–41 ms against 33–34 for the decoder's three steps).
                const BLOCK: usize = 16;
                let whole = if E::compute_slice(a).is_some() { width / BLOCK * BLOCK } else { 0 };
                let (mut oa, mut ob) = ([T::zero(); BLOCK], [T::zero(); BLOCK]);
                for at in (0..whole).step_by(BLOCK) {
                    let (a, b, g) = (&a[at..at + BLOCK], &b[at..at + BLOCK], &gr[at..at + BLOCK]);
                    for i in 0..BLOCK {
                        let (a, b, g) = (a[i].load(), b[i].load(), g[i].load());
                        oa[i] = SiluMulGradA.at([a, b, g]);
                        ob[i] = SiluMulGradB.at([a, g]);
                    }
                    da[at..at + BLOCK].iter_mut().zip(&oa).for_each(|(d, v)| *d = E::store(*v));
                    db[at..at + BLOCK].iter_mut().zip(&ob).for_each(|(d, v)| *d = E::store(*v));
                }
                let rest = da[whole..].iter_mut().zip(db[whole..].iter_mut()).zip(&a[whole..]).zip(&b[whole..]);
                for ((((da, db), a), b), g) in rest.zip(&gr[whole..]) {
                    let (a, b, g) = (a.load(), b.load(), g.load());
                    *da = E::store(SiluMulGradA.at([a, b, g]));
                    *db = E::store(SiluMulGradB.at([a, g]));
                }
            }
        });
        du
    }
}

/// `silu(a)·b` of a packed (…, 2·I) tensor holding `a` and `b` side by side, as one fused gate
/// and up projection writes them; the output is (…, I).
struct SiluMulPacked;

/// Half the last dimension of a packed `shape`, and the output shape.
fn packed_half(shape: &Shape) -> Result<(usize, Shape)> {
    let mut dims = shape.dims().to_vec();
    match dims.last_mut() {
        Some(last) if *last > 0 && *last % 2 == 0 => {
            *last /= 2;
            Ok((*last, Shape::from(dims)))
        }
        _ => Err(candle_core::Error::Msg(format!("silu_mul: packed input {shape:?} has no even last dimension"))),
    }
}

impl CustomOp1 for SiluMulPacked {
    fn name(&self) -> &'static str {
        "silu_mul"
    }
    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let (width, shape) = packed_half(l.shape())?;
        let y =
            by_elem!(s.dtype(), T, E => elems::<T, E>(s, l).map(|u| E::into_storage(silu_mul_rows::<T, E>(u, width))))?;
        Ok((y, shape))
    }
    #[cfg(feature = "cuda")]
    fn cuda_fwd(&self, s: &CudaStorage, l: &Layout) -> Result<(CudaStorage, Shape)> {
        let (width, shape) = packed_half(l.shape())?;
        cuda::silu_mul_packed(s, l, width, shape)
    }
    fn bwd(&self, u: &Tensor, _res: &Tensor, g: &Tensor) -> Result<Option<Tensor>> {
        let (width, out) = packed_half(u.shape())?;
        if g.shape() != &out || g.dtype() != u.dtype() {
            return Err(candle_core::Error::Msg(format!("silu_mul: gradient {:?} for output {out:?}", g.shape())));
        }
        #[cfg(feature = "cuda")]
        if u.device().is_cuda() {
            return cuda::silu_mul_packed_grad(u, g, width).map(Some);
        }
        let du = by_elem!(u.dtype(), T, E => with_elems::<T, E, _>(u, |uv| {
            with_elems::<T, E, _>(g, |gv| Ok(silu_mul_rows_grad::<T, E>(uv, gv, width)))
        })
        .and_then(|d| elem_tensor::<T, E>(d, u.shape())))?;
        Ok(Some(du))
    }
}

/// `silu(a)·b` of the halves of a packed (…, 2·I) tensor on the CPU (see
/// [`crate::ops::silu_mul_packed`]).
pub fn silu_mul_packed(u: &Tensor) -> Result<Tensor> {
    super::apply1(&u.contiguous()?, SiluMulPacked)
}

/// `a + b` (a residual connection): candle's own bf16 addition converts eight elements per
/// out-of-line call, several times slower than an f32 one; this one widens and rounds inside
/// its vectorised loop. Backward hands the output gradient to both inputs (one tensor, shared).
struct Add;

impl CustomOp2 for Add {
    fn name(&self) -> &'static str {
        "add"
    }
    fn cpu_fwd(&self, sa: &CpuStorage, la: &Layout, sb: &CpuStorage, lb: &Layout) -> Result<(CpuStorage, Shape)> {
        by_elem!(sa.dtype(), T, E => binary::<T, E>("add", (sa, la), (sb, lb), AddF))
    }
    fn bwd(&self, a: &Tensor, b: &Tensor, _res: &Tensor, g: &Tensor) -> Result<(Option<Tensor>, Option<Tensor>)> {
        Ok((a.track_op().then(|| g.clone()), b.track_op().then(|| g.clone())))
    }
}

/// `a + b` for same-shaped, same-dtype `a` and `b` on the CPU (see [`crate::ops::add`]).
pub fn add(a: &Tensor, b: &Tensor) -> Result<Tensor> {
    apply_same("add", a, b, Add)
}

/// `relu(a + b)` (a residual connection's end), the sum neither stored nor kept: backward
/// recomputes it for the mask (PyTorch's gradient, `[a + b > 0]`).
struct AddRelu;

impl AddRelu {
    /// The gradient both inputs receive (the same values: one tensor, handed to both), on the CPU
    /// or (feature `cuda`) a CUDA device.
    fn grad(a: &Tensor, b: &Tensor, g: &Tensor) -> Result<Tensor> {
        #[cfg(feature = "cuda")]
        if a.device().is_cuda() {
            return cuda::grad("add_relu_grad", &[a, b, g], 0.0);
        }
        by_elem!(a.dtype(), T, E => AddRelu::bwd::<T, E>(a, b, g))
    }

    /// [`AddRelu::grad`]'s host body.
    fn bwd<T: Real, E: Elem<T>>(a: &Tensor, b: &Tensor, g: &Tensor) -> Result<Tensor> {
        let d = with_elems::<T, E, _>(a, |a| {
            with_elems::<T, E, _>(b, |b| with_elems::<T, E, _>(g, |g| map3("add_relu backward", a, b, g, AddReluGrad)))
        })?;
        elem_tensor::<T, E>(d, a.shape())
    }
}

impl CustomOp2 for AddRelu {
    fn name(&self) -> &'static str {
        "add_relu"
    }
    fn cpu_fwd(&self, sa: &CpuStorage, la: &Layout, sb: &CpuStorage, lb: &Layout) -> Result<(CpuStorage, Shape)> {
        by_elem!(sa.dtype(), T, E => binary::<T, E>("add_relu", (sa, la), (sb, lb), AddReluF))
    }
    #[cfg(feature = "cuda")]
    fn cuda_fwd(&self, sa: &CudaStorage, la: &Layout, sb: &CudaStorage, lb: &Layout) -> Result<(CudaStorage, Shape)> {
        cuda::forward("add_relu", &[(sa, la), (sb, lb)], 0.0)
    }
    fn bwd(&self, a: &Tensor, b: &Tensor, _res: &Tensor, g: &Tensor) -> Result<(Option<Tensor>, Option<Tensor>)> {
        // Tensors are immutable: both gradient entries may share the one result.
        let d = AddRelu::grad(a, b, g)?;
        Ok((a.track_op().then(|| d.clone()), b.track_op().then_some(d)))
    }
}

/// `relu(a + b)` for same-shaped `a` and `b` on the CPU (see [`crate::ops::add_relu`]).
pub fn add_relu(a: &Tensor, b: &Tensor) -> Result<Tensor> {
    apply_same("add_relu", a, b, AddRelu)
}
