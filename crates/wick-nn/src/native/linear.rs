//! `y = x·Wᵀ + b` over every row of `x` (…, in) as one 2-D gemm, with backward `dx = g·W`,
//! `dW = gᵀ·x` and `db = Σ_rows g` (three gemm-class passes, nothing recomputed). Summed in f32
//! (f64 for f64) whatever the dtype and rounded once: bf16 x, W and g are multiplied as bf16 with
//! f32 sums where the CPU has AVX512-BF16 (`gemm_bf16`; the products of two bf16 values
//! are exact in f32), widened to f32 elsewhere; bias gradients are sums in f32.

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp2, CustomOp3, Layout, Result, Shape, Tensor};

use candle_core::DType;
use half::bf16;

use super::elem::{elem_tensor, elems, with_elems};
use super::gemm::gemm_into_rows_apart;
use super::gemm_bf16::{self, gemm_bf16};
use super::{gemm, par_ranges, product, read, tensor, with, Mat, Real, SharedMut};

fn err(msg: String) -> candle_core::Error {
    candle_core::Error::Msg(msg)
}

struct Linear;

/// Input, weight and bias gradients (the first and last when wanted).
type Grads<T> = (Option<Vec<T>>, Vec<T>, Option<Vec<T>>);

/// (rows, in, out) of `x` (…, in) times `w` (out, in).
pub(crate) fn dims(x: &Shape, w: &Shape) -> Result<(usize, usize, usize)> {
    let (Some(&k), &[out, wk]) = (x.dims().last(), w.dims()) else {
        return Err(err(format!("linear: input {x:?}, weight {w:?}")));
    };
    if k != wk || k == 0 {
        return Err(err(format!("linear: input {x:?} does not fit weight {w:?}")));
    }
    Ok((x.elem_count() / k, k, out))
}

impl Linear {
    fn fwd<T: Real>(
        sx: &CpuStorage,
        lx: &Layout,
        sw: &CpuStorage,
        lw: &Layout,
        bias: Option<(&CpuStorage, &Layout)>,
    ) -> Result<(CpuStorage, Shape)> {
        let (m, k, n) = dims(lx.shape(), lw.shape())?;
        let (x, w) = (read::<T>(sx, lx)?, read::<T>(sw, lw)?);
        let y = product(Mat::rows(&x, m, k), Mat::rows(&w, n, k).t(), T::one(), true)?;
        Self::finish(y, lx, sx.dtype(), n, bias)
    }

    /// [`Linear::fwd`] for bf16 x and W with bf16 products (f32 sums, no widened copies).
    fn fwd_bf16(
        (x, w): (&[bf16], &[bf16]),
        lx: &Layout,
        lw: &Layout,
        bias: Option<(&CpuStorage, &Layout)>,
    ) -> Result<(CpuStorage, Shape)> {
        let (m, k, n) = dims(lx.shape(), lw.shape())?;
        let (xm, wm) = (Mat::rows(x, m, k), Mat::rows(w, n, k).t());
        if bias.is_none() {
            return Self::finish_storage(CpuStorage::BF16(rounded_product(xm, wm)?), lx, n);
        }
        let mut y = vec![0f32; m * n];
        gemm_bf16(&mut y, xm, wm, 1.0, false, true)?;
        Self::finish(y, lx, DType::BF16, n, bias)
    }

    /// `y` (rows × n) plus the bias, as storage of `dtype` with x's shape but n columns.
    fn finish<T: Real>(
        mut y: Vec<T>,
        lx: &Layout,
        dtype: DType,
        n: usize,
        bias: Option<(&CpuStorage, &Layout)>,
    ) -> Result<(CpuStorage, Shape)> {
        if let Some((sb, lb)) = bias {
            add_bias(&mut y, &read::<T>(sb, lb)?)?;
        }
        Self::finish_storage(T::storage(y, dtype)?, lx, n)
    }

    /// `y` with x's shape but n columns.
    fn finish_storage(y: CpuStorage, lx: &Layout, n: usize) -> Result<(CpuStorage, Shape)> {
        Ok((y, out_shape(lx.shape(), n)))
    }

    /// [`Linear::bwd`] for bf16 x, W and g with bf16 products (f32 sums, rounded once): dx and
    /// dW in bf16, db in f32.
    fn bwd_bf16(x: &Tensor, w: &Tensor, g: &Tensor, want_dx: bool, want_db: bool) -> Result<Bf16Grads> {
        let (m, k, n) = dims(x.shape(), w.shape())?;
        with_elems::<f32, bf16, _>(x, |x| {
            with_elems::<f32, bf16, _>(w, |w| {
                with_elems::<f32, bf16, _>(g, |g| {
                    let gm = Mat::rows(g, m, n);
                    let dx = want_dx.then(|| rounded_product(gm, Mat::rows(w, n, k))).transpose()?;
                    let dw = rounded_product(gm.t(), Mat::rows(x, m, k))?;
                    let db = want_db.then(|| {
                        let mut db = vec![0f32; n];
                        for row in g.chunks(n) {
                            db.iter_mut().zip(row).for_each(|(d, v)| *d += v.to_f32());
                        }
                        db
                    });
                    Ok((dx, dw, db))
                })
            })
        })
    }

    /// (dx when wanted, dw, db when wanted).
    fn bwd<T: Real>(x: &Tensor, w: &Tensor, g: &Tensor, want_dx: bool, want_db: bool) -> Result<Grads<T>> {
        let (m, k, n) = dims(x.shape(), w.shape())?;
        with::<T, _>(x, |x| {
            with::<T, _>(w, |w| {
                with::<T, _>(g, |g| {
                    let gm = Mat::rows(g, m, n);
                    let dx = if want_dx {
                        let mut dx = vec![T::zero(); m * k];
                        gemm(&mut dx, gm, Mat::rows(w, n, k), T::one(), false, true)?;
                        Some(dx)
                    } else {
                        None
                    };
                    let mut dw = vec![T::zero(); n * k];
                    gemm(&mut dw, gm.t(), Mat::rows(x, m, k), T::one(), false, true)?;
                    let db = want_db.then(|| {
                        let mut db = vec![T::zero(); n];
                        for row in g.chunks(n) {
                            db.iter_mut().zip(row).for_each(|(d, v)| *d = *d + *v);
                        }
                        db
                    });
                    Ok((dx, dw, db))
                })
            })
        })
    }

    fn grads(
        x: &Tensor,
        w: &Tensor,
        b: Option<&Tensor>,
        g: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let (want_dx, want_db) = (x.track_op(), b.is_some_and(|b| b.track_op()));
        #[cfg(feature = "cuda")]
        if x.device().is_cuda() {
            return super::cuda::linear::backward(x, w, b, g, (want_dx, w.track_op(), want_db));
        }
        if [x, w, g].iter().all(|t| t.dtype() == DType::BF16) && gemm_bf16::available() {
            let (dx, dw, db) = Linear::bwd_bf16(x, w, g, want_dx, want_db)?;
            let dx = dx.map(|v| elem_tensor::<f32, bf16>(v, x.shape())).transpose()?;
            let dw = w.track_op().then(|| elem_tensor::<f32, bf16>(dw, w.shape())).transpose()?;
            let db = match (db, b) {
                (Some(v), Some(b)) => Some(tensor(v, b.shape(), b.dtype())?),
                _ => None,
            };
            return Ok((dx, dw, db));
        }
        by_real!(x.dtype(), T => Self::tensors(Linear::bwd::<T>(x, w, g, want_dx, want_db)?, x, w, b))
    }

    /// The gradients as tensors of their inputs' shapes and dtypes (rounded once).
    fn tensors<T: Real>(
        (dx, dw, db): Grads<T>,
        x: &Tensor,
        w: &Tensor,
        b: Option<&Tensor>,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let dx = dx.map(|v| tensor(v, x.shape(), x.dtype())).transpose()?;
        let db = match (db, b) {
            (Some(v), Some(b)) => Some(tensor(v, b.shape(), b.dtype())?),
            _ => None,
        };
        Ok((dx, super::weight_grad(w, dw)?, db))
    }
}

impl CustomOp2 for Linear {
    fn name(&self) -> &'static str {
        "linear"
    }
    fn cpu_fwd(&self, sx: &CpuStorage, lx: &Layout, sw: &CpuStorage, lw: &Layout) -> Result<(CpuStorage, Shape)> {
        if let Some(xw) = bf16_operands(sx, lx, sw, lw)? {
            return Linear::fwd_bf16(xw, lx, lw, None);
        }
        by_real!(sx.dtype(), T => Linear::fwd::<T>(sx, lx, sw, lw, None))
    }
    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        sx: &candle_core::CudaStorage,
        lx: &Layout,
        sw: &candle_core::CudaStorage,
        lw: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        super::cuda::linear::forward((sx, lx), (sw, lw), None)
    }
    fn bwd(&self, x: &Tensor, w: &Tensor, _res: &Tensor, g: &Tensor) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let (dx, dw, _) = Linear::grads(x, w, None, g)?;
        Ok((dx, dw))
    }
}

impl CustomOp3 for Linear {
    fn name(&self) -> &'static str {
        "linear"
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
        if let Some(xw) = bf16_operands(sx, lx, sw, lw)? {
            return Linear::fwd_bf16(xw, lx, lw, Some((sb, lb)));
        }
        by_real!(sx.dtype(), T => Linear::fwd::<T>(sx, lx, sw, lw, Some((sb, lb))))
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
        super::cuda::linear::forward((sx, lx), (sw, lw), Some((sb, lb)))
    }
    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        b: &Tensor,
        _res: &Tensor,
        g: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        Linear::grads(x, w, Some(b), g)
    }
}

/// The output's shape: `x`'s with `n` in its last dimension.
pub(crate) fn out_shape(x: &Shape, n: usize) -> Shape {
    let mut shape = x.dims().to_vec();
    if let Some(last) = shape.last_mut() {
        *last = n;
    }
    Shape::from(shape)
}

/// `b` added to every row of `y` (rows of `b.len()` elements).
fn add_bias<T: Real>(y: &mut [T], b: &[T]) -> Result<()> {
    let n = b.len();
    if n == 0 || !y.len().is_multiple_of(n) {
        return Err(err(format!("linear: {n} biases for an output of {} elements", y.len())));
    }
    let m = y.len() / n;
    let out = SharedMut::new(y);
    par_ranges(m, 64, |r| {
        // SAFETY: disjoint row ranges.
        let rows = unsafe { out.range(r.start * n, r.len() * n) };
        for row in rows.chunks_mut(n) {
            row.iter_mut().zip(b.iter()).for_each(|(v, b)| *v = *v + *b);
        }
    });
    Ok(())
}

/// bf16 input and weight gradients, f32 bias gradient.
type Bf16Grads = (Option<Vec<bf16>>, Vec<bf16>, Option<Vec<f32>>);

/// `a·b` rounded to bf16: each sum as the product stores it when the depth allows
/// ([`gemm_bf16::rounds_directly`]: no f32 result, no rounding pass), else summed in f32 and
/// rounded once afterwards.
fn rounded_product(a: Mat<'_, bf16>, b: Mat<'_, bf16>) -> Result<Vec<bf16>> {
    let len = a.rows * b.cols;
    if gemm_bf16::rounds_directly(a.cols) {
        let mut y = vec![bf16::ZERO; len];
        gemm_bf16::gemm_bf16_rounded(&mut y, a, b, true)?;
        return Ok(y);
    }
    let mut y = vec![0f32; len];
    gemm_bf16(&mut y, a, b, 1.0, false, true)?;
    match f32::storage(y, DType::BF16)? {
        CpuStorage::BF16(v) => Ok(v),
        other => Err(err(format!("linear: rounding gave {:?}", other.dtype()))),
    }
}

/// x and W as stored when both are bf16 and the CPU multiplies bf16 ([`gemm_bf16`]).
fn bf16_operands<'a>(
    sx: &'a CpuStorage,
    lx: &Layout,
    sw: &'a CpuStorage,
    lw: &Layout,
) -> Result<Option<(&'a [bf16], &'a [bf16])>> {
    if sx.dtype() != DType::BF16 || sw.dtype() != DType::BF16 || !gemm_bf16::available() {
        return Ok(None);
    }
    Ok(Some((elems::<f32, bf16>(sx, lx)?, elems::<f32, bf16>(sw, lw)?)))
}

/// `x·weightᵀ (+ bias)` on the CPU or (feature `cuda`) a CUDA device (see [`crate::ops::linear`]).
pub fn linear(x: &Tensor, weight: &Tensor, bias: Option<&Tensor>) -> Result<Tensor> {
    let (x, w) = (x.contiguous()?, weight.contiguous()?);
    match bias {
        Some(b) => super::apply3(&x, &w, &b.contiguous()?, Linear),
        None => super::apply2(&x, &w, Linear),
    }
}

/// `x·[W₀; W₁; …]ᵀ + [b₀; b₁; …]` for f32 or f64 `x`, weights and biases of one dtype, with no
/// gradient (see [`crate::ops::linear_stacked`]): each weight's product written into its columns
/// of the output in place, so that the weights are never copied into one stacked matrix.
pub fn linear_stacked(x: &Tensor, weights: &[&Tensor], biases: Option<&[&Tensor]>) -> Result<Tensor> {
    let shapes = || format!("{:?} · {:?}", x.dims(), weights.iter().map(|w| w.dims()).collect::<Vec<_>>());
    super::profile::time(
        "linear_stacked",
        "forward",
        shapes,
        || by_real!(x.dtype(), T => stacked::<T>(x, weights, biases)),
    )
}

fn stacked<T: Real>(x: &Tensor, weights: &[&Tensor], biases: Option<&[&Tensor]>) -> Result<Tensor> {
    // (rows, in, out) against each weight: the same rows and depth for all.
    let each = weights.iter().map(|w| dims(x.shape(), w.shape())).collect::<Result<Vec<_>>>()?;
    let (m, k) = each.first().map_or((0, 0), |&(m, k, _)| (m, k));
    let outs: Vec<usize> = each.iter().map(|&(_, _, out)| out).collect();
    let n = outs.iter().try_fold(0usize, |n, o| n.checked_add(*o));
    let (Some(n), Some(len)) = (n, n.and_then(|n| n.checked_mul(m))) else {
        return Err(err(format!("linear: {outs:?} outputs of {m} rows overflow")));
    };
    super::ask_for_output::<T>(len)?;
    // Each weight writes its columns of every row into memory not zero-filled first; the
    // output is whole once the last has (the outputs sum to n).
    let mut y: Vec<T> = Vec::with_capacity(len);
    with::<T, _>(x, |xs| {
        let fresh = &mut y.spare_capacity_mut()[..len];
        let mut j0 = 0;
        for (w, &out) in weights.iter().zip(&outs) {
            let dst = fresh.get_mut(j0..).unwrap_or_default();
            with::<T, _>(w, |wv| gemm_into_rows_apart(dst, n, Mat::rows(xs, m, k), Mat::rows(wv, out, k).t(), true))?;
            j0 += out;
        }
        Ok(())
    })?;
    // SAFETY: the products above wrote columns j0..j0 + out of all m rows for every weight, and
    // those ranges tile 0..n: every one of the m·n = len elements (the capacity holds them).
    unsafe { y.set_len(len) };
    if let Some(biases) = biases {
        if biases.len() != weights.len() {
            return Err(err(format!("linear: {} biases for {} weights", biases.len(), weights.len())));
        }
        let mut b = Vec::with_capacity(n);
        for bias in biases {
            with::<T, _>(bias, |v| {
                b.extend_from_slice(v);
                Ok(())
            })?;
        }
        if b.len() != n {
            return Err(err(format!("linear: {} biases for {n} outputs", b.len())));
        }
        add_bias(&mut y, &b)?;
    }
    tensor(y, out_shape(x.shape(), n), x.dtype())
}
