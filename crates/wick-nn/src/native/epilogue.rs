//! A linear layer's product finished with what follows it in a transformer block, for
//! inference: GELU (BERT's and ViT's feed-forward), a residual (pre-norm blocks), or a residual
//! and then layer norm (post-norm BERT), each row of the product finished once while it is in
//! cache, instead of ops of their own that read and write the whole output again and allocate
//! one each. No gradient: the callers ([`crate::ops::linear_gelu`], [`crate::ops::linear_add`],
//! [`crate::ops::linear_add_layer_norm`]) run the separate ops when one is wanted.
//!
//! Numerics: the separate ops' outputs bit for bit. The product is `linear`'s, and each element
//! takes the same operations in the same order (the bias, then the residual, in the output's
//! type; GELU's per-element function and layer norm's row code are theirs, `act::gelu_at` and
//! `row_norm::norm_row`).

use candle_core::{Result, Tensor};

use super::act::gelu_at;
use super::elem::Elem;
use super::linear::{dims, out_shape};
use super::row_norm::norm_row;
use super::{par_ranges, product, tensor, with, Mat, Real, SharedMut};

fn err(msg: String) -> candle_core::Error {
    candle_core::Error::Msg(msg)
}

/// What finishes the product (after its bias).
pub(crate) enum Then<'a> {
    /// GELU, erf form.
    Gelu,
    /// `+ residual` (the output's shape).
    Add(&'a Tensor),
    /// `layer_norm(· + residual, weight, bias, eps)`.
    AddLayerNorm { residual: &'a Tensor, weight: &'a Tensor, bias: &'a Tensor, eps: f64 },
}

/// `then(x·Wᵀ + b)` for f32 or f64 `x` and every operand of its dtype, no graph recorded.
pub(crate) fn linear_then(x: &Tensor, w: &Tensor, b: Option<&Tensor>, then: Then<'_>) -> Result<Tensor> {
    let name = match then {
        Then::Gelu => "linear_gelu",
        Then::Add(_) => "linear_add",
        Then::AddLayerNorm { .. } => "linear_add_layer_norm",
    };
    let shapes = || format!("{:?} · {:?}", x.dims(), w.dims());
    super::profile::time(name, "forward", shapes, || by_real!(x.dtype(), T => run::<T>(x, w, b, then)))
}

/// The elements of `t` (contiguous) in compute type `T`, owned.
fn values<T: Real>(t: &Tensor) -> Result<Vec<T>> {
    with::<T, _>(t, |v| Ok(v.to_vec()))
}

fn run<T: Real + Elem<T>>(x: &Tensor, w: &Tensor, b: Option<&Tensor>, then: Then<'_>) -> Result<Tensor> {
    let (m, k, n) = dims(x.shape(), w.shape())?;
    let Some(len) = m.checked_mul(n) else {
        return Err(err(format!("linear: {m} rows of {n} outputs overflow")));
    };
    let shape = out_shape(x.shape(), n);
    let fits = |t: &Tensor, what: &str| match t.shape() == &shape {
        true => Ok(()),
        false => Err(err(format!("linear: {what} {:?} for an output of {shape:?}", t.shape()))),
    };
    let vector = |t: &Tensor, what: &str| -> Result<Vec<T>> {
        match t.dims() {
            &[len] if len == n => values::<T>(t),
            d => Err(err(format!("linear: {what} {d:?} for {n} outputs"))),
        }
    };
    let bias = b.map(|b| vector(b, "bias")).transpose()?;
    super::ask_for_output::<T>(len)?;
    let mut y = with::<T, _>(x, |xs| {
        with::<T, _>(w, |ws| product(Mat::rows(xs, m, k), Mat::rows(ws, n, k).t(), T::one(), true))
    })?;
    match then {
        Then::Gelu => finish::<T, T>(&mut y, n, bias.as_deref(), None, true, None),
        Then::Add(r) => {
            fits(r, "residual")?;
            with::<T, _>(r, |r| {
                finish::<T, T>(&mut y, n, bias.as_deref(), Some(r), false, None);
                Ok(())
            })?
        }
        Then::AddLayerNorm { residual, weight, bias: norm_bias, eps } => {
            fits(residual, "residual")?;
            let (nw, nb) = (vector(weight, "norm weight")?, vector(norm_bias, "norm bias")?);
            with::<T, _>(residual, |r| {
                finish::<T, T>(&mut y, n, bias.as_deref(), Some(r), false, Some((&nw, &nb, eps)));
                Ok(())
            })?
        }
    }
    tensor(y, shape, x.dtype())
}

wide_kernel! {
    /// Each `n`-long row of `y`: `+ bias`, `+ residual`'s row, then GELU or layer norm.
    fn finish<T, E>(
        y: &mut [E],
        n: usize,
        bias: Option<&[T]>,
        residual: Option<&[E]>,
        gelu: bool,
        norm: Option<(&[T], &[T], f64)>,
    ) {
        let rows = y.len() / n.max(1);
        let out = SharedMut::new(y);
        par_ranges(rows, 16, |r| {
            let mut row_in = Vec::with_capacity(if norm.is_some() { n } else { 0 });
            for row in r {
                // SAFETY: one row per index.
                let dst = unsafe { out.range(row * n, n) };
                if let Some(b) = bias {
                    dst.iter_mut().zip(b).for_each(|(v, b)| *v = E::store(v.load() + *b));
                }
                if let Some(res) = residual {
                    let res = &res[row * n..(row + 1) * n];
                    dst.iter_mut().zip(res).for_each(|(v, r)| *v = E::store(v.load() + r.load()));
                }
                if gelu {
                    dst.iter_mut().for_each(|v| *v = E::store(gelu_at(v.load())));
                }
                if let Some((w, b, eps)) = norm {
                    row_in.clear();
                    row_in.extend_from_slice(dst);
                    norm_row::<T, E>(&row_in, dst, w, Some(b), false, eps);
                }
            }
        });
    }
}
