//! Scaled dot-product attention and rotary position embeddings with closed-form backward passes.
//!
//! Attention over (batch, heads, seq, head_dim) keeps q, k, v and one log-sum-exp per query row;
//! backward recomputes the scores from q and k (one gemm per head) instead of keeping any
//! seq × seq tensor, as flash attention does. Everything computes in f32 (f64 for f64), softmax
//! included; bf16 inputs are widened once and the output rounded once.

use std::sync::Mutex;

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp1, CustomOp3, Layout, Result, Shape, Storage, Tensor};

use super::{dot, gemm, par_ranges, read, sum, tensor, with, Mat, Real, SharedMut};

fn err(msg: String) -> candle_core::Error {
    candle_core::Error::Msg(msg)
}

/// An additive bias broadcast to (batch, heads, seq_q, seq_k): its values and strides.
struct Bias {
    values: Vec<f64>,
    strides: [usize; 4],
}

impl Bias {
    fn new(bias: &Tensor, dims: [usize; 4]) -> Result<Self> {
        let b = bias.to_dtype(candle_core::DType::F64)?.broadcast_as(dims.to_vec())?;
        let (storage, layout) = b.storage_and_layout();
        let Storage::Cpu(CpuStorage::F64(all)) = &*storage else {
            return Err(err("attention: the bias is not on the CPU".into()));
        };
        let (start, stride) = (layout.start_offset(), layout.stride());
        let extent: usize = dims.iter().zip(stride).map(|(d, s)| d.saturating_sub(1) * s).sum::<usize>() + 1;
        let values = all.get(start..start + extent).ok_or_else(|| err("attention: bias out of range".into()))?.to_vec();
        Ok(Bias { values, strides: [stride[0], stride[1], stride[2], stride[3]] })
    }

    /// The bias row for (b, h, i) and its stride along keys.
    fn row(&self, b: usize, h: usize, i: usize) -> (&[f64], usize) {
        let start = b * self.strides[0] + h * self.strides[1] + i * self.strides[2];
        (&self.values[start..], self.strides[3])
    }
}

struct Attention {
    bias: Option<Bias>,
    /// Log-sum-exp of each query row's scaled, biased scores, from the forward pass.
    lse: Mutex<Vec<f64>>,
}

/// (batch, heads, seq_q, seq_k, head_dim) of q (B, H, Sq, D) and k, v (B, H, Sk, D).
fn dims(q: &Shape, k: &Shape, v: &Shape) -> Result<(usize, usize, usize, usize, usize)> {
    match (q.dims(), k.dims(), v.dims()) {
        (&[b, h, sq, d], &[b2, h2, sk, d2], &[b3, h3, sk3, d3])
            if (b, h, d) == (b2, h2, d2) && (b, h, sk, d) == (b3, h3, sk3, d3) =>
        {
            Ok((b, h, sq, sk, d))
        }
        _ => Err(err(format!("attention: q {q:?}, k {k:?}, v {v:?} do not fit"))),
    }
}

impl Attention {
    /// Scaled, biased scores of head `bh` into `s` (Sq × Sk).
    fn scores<T: Real>(
        &self,
        q: &[T],
        k: &[T],
        bh: usize,
        heads: usize,
        (sq, sk, d): (usize, usize, usize),
        s: &mut [T],
    ) -> Result<()> {
        let scale = T::of(1.0 / (d as f64).sqrt());
        gemm(s, Mat::rows(&q[bh * sq * d..], sq, d), Mat::rows(&k[bh * sk * d..], sk, d).t(), scale, false, false)?;
        if let Some(bias) = &self.bias {
            for i in 0..sq {
                let (row, stride) = bias.row(bh / heads, bh % heads, i);
                for (j, v) in s[i * sk..(i + 1) * sk].iter_mut().enumerate() {
                    *v = *v + T::of(row[j * stride]);
                }
            }
        }
        Ok(())
    }

    fn fwd<T: Real>(
        &self,
        q: &[T],
        k: &[T],
        v: &[T],
        (b, h, sq, sk, d): (usize, usize, usize, usize, usize),
    ) -> Result<(Vec<T>, Vec<f64>)> {
        let mut out = vec![T::zero(); b * h * sq * d];
        let mut lse = vec![0.0; b * h * sq];
        let (so, sl) = (SharedMut::new(&mut out), SharedMut::new(&mut lse));
        let failure = Mutex::new(None);
        par_ranges(b * h, 1, |r| {
            let mut s = vec![T::zero(); sq * sk];
            for bh in r {
                let mut run = || -> Result<()> {
                    self.scores(q, k, bh, h, (sq, sk, d), &mut s)?;
                    // SAFETY: one head's rows per index.
                    let l = unsafe { sl.range(bh * sq, sq) };
                    for (i, row) in s.chunks_mut(sk).enumerate() {
                        let max = row.iter().fold(T::neg_infinity(), |m, v| m.max(*v));
                        row.iter_mut().for_each(|v| *v = T::exp_(*v - max));
                        let sum = sum(row);
                        let inv = T::of(1.0 / sum);
                        row.iter_mut().for_each(|v| *v = *v * inv);
                        l[i] = T::wide(max) + sum.ln();
                    }
                    // SAFETY: as above.
                    let o = unsafe { so.range(bh * sq * d, sq * d) };
                    gemm(o, Mat::rows(&s, sq, sk), Mat::rows(&v[bh * sk * d..], sk, d), T::one(), false, false)
                };
                if let Err(e) = run() {
                    *failure.lock().unwrap_or_else(|p| p.into_inner()) = Some(e);
                }
            }
        });
        match failure.into_inner().unwrap_or_else(|p| p.into_inner()) {
            Some(e) => Err(e),
            None => Ok((out, lse)),
        }
    }

    /// (dq, dk, dv).
    fn bwd<T: Real>(
        &self,
        q: &[T],
        k: &[T],
        v: &[T],
        go: &[T],
        (b, h, sq, sk, d): (usize, usize, usize, usize, usize),
    ) -> Result<[Vec<T>; 3]> {
        let lse = self.lse.lock().unwrap_or_else(|p| p.into_inner()).clone();
        if lse.len() != b * h * sq {
            return Err(err("attention backward: no forward statistics".into()));
        }
        let scale = T::of(1.0 / (d as f64).sqrt());
        let (mut dq, mut dk, mut dv) = (vec![T::zero(); q.len()], vec![T::zero(); k.len()], vec![T::zero(); v.len()]);
        let (sdq, sdk, sdv) = (SharedMut::new(&mut dq), SharedMut::new(&mut dk), SharedMut::new(&mut dv));
        let failure = Mutex::new(None);
        par_ranges(b * h, 1, |r| {
            let (mut p, mut dp) = (vec![T::zero(); sq * sk], vec![T::zero(); sq * sk]);
            for bh in r {
                let mut run = || -> Result<()> {
                    // P = exp(S − lse), recomputed.
                    self.scores(q, k, bh, h, (sq, sk, d), &mut p)?;
                    for (i, row) in p.chunks_mut(sk).enumerate() {
                        let l = T::of(lse[bh * sq + i]);
                        row.iter_mut().for_each(|v| *v = T::exp_(*v - l));
                    }
                    let gm = Mat::rows(&go[bh * sq * d..], sq, d);
                    // SAFETY: one head's slices per index.
                    let (dqh, dkh, dvh) = unsafe {
                        (sdq.range(bh * sq * d, sq * d), sdk.range(bh * sk * d, sk * d), sdv.range(bh * sk * d, sk * d))
                    };
                    gemm(dvh, Mat::rows(&p, sq, sk).t(), gm, T::one(), false, false)?;
                    gemm(&mut dp, gm, Mat::rows(&v[bh * sk * d..], sk, d).t(), T::one(), false, false)?;
                    // dS = P ∘ (dP − Σ_j P∘dP), into `dp`.
                    for (prow, drow) in p.chunks(sk).zip(dp.chunks_mut(sk)) {
                        let dot = T::of(dot(prow, drow));
                        drow.iter_mut().zip(prow).for_each(|(g, pv)| *g = *pv * (*g - dot));
                    }
                    gemm(dqh, Mat::rows(&dp, sq, sk), Mat::rows(&k[bh * sk * d..], sk, d), scale, false, false)?;
                    gemm(dkh, Mat::rows(&dp, sq, sk).t(), Mat::rows(&q[bh * sq * d..], sq, d), scale, false, false)
                };
                if let Err(e) = run() {
                    *failure.lock().unwrap_or_else(|p| p.into_inner()) = Some(e);
                }
            }
        });
        match failure.into_inner().unwrap_or_else(|p| p.into_inner()) {
            Some(e) => Err(e),
            None => Ok([dq, dk, dv]),
        }
    }

    fn cpu<T: Real>(
        &self,
        sq: &CpuStorage,
        lq: &Layout,
        sk: &CpuStorage,
        lk: &Layout,
        sv: &CpuStorage,
        lv: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let dims = dims(lq.shape(), lk.shape(), lv.shape())?;
        let (q, k, v) = (read::<T>(sq, lq)?, read::<T>(sk, lk)?, read::<T>(sv, lv)?);
        let (out, lse) = self.fwd(&q, &k, &v, dims)?;
        *self.lse.lock().unwrap_or_else(|p| p.into_inner()) = lse;
        Ok((T::storage(out, sq.dtype())?, lq.shape().clone()))
    }

    fn grads<T: Real>(&self, q: &Tensor, k: &Tensor, v: &Tensor, g: &Tensor) -> Result<[Tensor; 3]> {
        let dims = dims(q.shape(), k.shape(), v.shape())?;
        let [dq, dk, dv] = with::<T, _>(q, |qs| {
            with::<T, _>(k, |ks| with::<T, _>(v, |vs| with::<T, _>(g, |gs| self.bwd(qs, ks, vs, gs, dims))))
        })?;
        Ok([tensor(dq, q.shape(), q.dtype())?, tensor(dk, k.shape(), k.dtype())?, tensor(dv, v.shape(), v.dtype())?])
    }
}

impl CustomOp3 for Attention {
    fn name(&self) -> &'static str {
        "attention"
    }
    fn cpu_fwd(
        &self,
        sq: &CpuStorage,
        lq: &Layout,
        sk: &CpuStorage,
        lk: &Layout,
        sv: &CpuStorage,
        lv: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        by_real!(sq.dtype(), T => self.cpu::<T>(sq, lq, sk, lk, sv, lv))
    }
    fn bwd(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        _res: &Tensor,
        g: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let [dq, dk, dv] = by_real!(q.dtype(), T => self.grads::<T>(q, k, v, g)?);
        Ok((q.track_op().then_some(dq), k.track_op().then_some(dk), v.track_op().then_some(dv)))
    }
}

/// Scaled dot-product attention on the CPU (see [`crate::ops::attention`]).
pub fn attention(q: &Tensor, k: &Tensor, v: &Tensor, bias: Option<&Tensor>) -> Result<Tensor> {
    let (b, h, sq, sk, _) = dims(q.shape(), k.shape(), v.shape())?;
    let bias = bias.map(|t| Bias::new(t, [b, h, sq, sk])).transpose()?;
    let op = Attention { bias, lse: Mutex::new(Vec::new()) };
    super::apply3(&q.contiguous()?, &k.contiguous()?, &v.contiguous()?, op)
}

/// Rotary embedding of (…, seq, head_dim) with tables (seq, head_dim/2), rotating pairs
/// (i, i + head_dim/2).
struct Rope {
    cos: Vec<f64>,
    sin: Vec<f64>,
}

impl Rope {
    /// Rotates `x` by the tables (`sign` −1: by their inverse, the backward pass).
    fn rotate<T: Real>(&self, x: &[T], shape: &Shape, sign: f64) -> Result<Vec<T>> {
        let dims = shape.dims();
        let (Some(&d), Some(&seq)) = (dims.last(), dims.len().checked_sub(2).and_then(|i| dims.get(i))) else {
            return Err(err(format!("rope: input {shape:?}")));
        };
        let half = d / 2;
        if d % 2 != 0 || self.cos.len() != seq * half {
            return Err(err(format!("rope: input {shape:?} does not fit tables of {} values", self.cos.len())));
        }
        let mut y = vec![T::zero(); x.len()];
        let out = SharedMut::new(&mut y);
        let rows = x.len() / d;
        par_ranges(rows, 64, |r| {
            // SAFETY: disjoint row ranges.
            let dst = unsafe { out.range(r.start * d, r.len() * d) };
            for (row, yr) in r.zip(dst.chunks_mut(d)) {
                let (xr, pos) = (&x[row * d..(row + 1) * d], row % seq);
                for i in 0..half {
                    let (c, s) = (T::of(self.cos[pos * half + i]), T::of(sign * self.sin[pos * half + i]));
                    let (a, b) = (xr[i], xr[i + half]);
                    yr[i] = a * c - b * s;
                    yr[i + half] = a * s + b * c;
                }
            }
        });
        Ok(y)
    }
}

impl CustomOp1 for Rope {
    fn name(&self) -> &'static str {
        "rope"
    }
    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let y = by_real!(s.dtype(), T => T::storage(self.rotate(&read::<T>(s, l)?, l.shape(), 1.0)?, s.dtype())?);
        Ok((y, l.shape().clone()))
    }
    fn bwd(&self, x: &Tensor, _res: &Tensor, g: &Tensor) -> Result<Option<Tensor>> {
        let dx = by_real!(x.dtype(), T => tensor(with::<T, _>(g, |g| self.rotate(g, x.shape(), -1.0))?, x.shape(), x.dtype())?);
        Ok(Some(dx))
    }
}

/// Rotary position embedding on the CPU (see [`crate::ops::rope`]).
pub fn rope(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    let table = |t: &Tensor| -> Result<Vec<f64>> { t.to_dtype(candle_core::DType::F64)?.flatten_all()?.to_vec1() };
    super::apply1(&x.contiguous()?, Rope { cos: table(cos)?, sin: table(sin)? })
}
