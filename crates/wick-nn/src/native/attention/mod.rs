//! Scaled dot-product attention with a closed-form backward pass. With the `cuda` feature the op
//! has a CUDA body (`crate::native::cuda::attention`, the same contract: one log-sum-exp per query row
//! kept, on the device).
//!
//! Attention over (batch, heads, seq, head_dim) keeps q, k, v and one log-sum-exp per query row;
//! backward recomputes the scores from q and k (one gemm per head) instead of keeping any
//! seq × seq tensor, as flash attention does. Everything computes in f32 (f64 for f64), softmax
//! included; bf16 inputs are widened once and the output rounded once.
//!
//! The forward pass takes a head's query rows a block at a time (its scores stay in cache
//! between the two products and the softmax) and, with a bias, weighs a block's keys only up to
//! its rows' last unmasked one (`bias`: the keys after it, a causal mask's future or a padding
//! mask's padding, take no part in the softmax): a causal decoder's attention is about half the
//! work. Backward takes the same rows in blocks against the same keys (dK and dV summed over a
//! head's blocks), so a causal mask halves its products too; without a bias it takes a head's
//! rows at once.
//! A block's softmax leaves its rows undivided (`exp(s − max)` on the vector kernel of
//! `wick_kernels::cpu::softmax`); each row's `head_dim` outputs are divided by its sum instead of
//! its keys' probabilities, and the log-sum-exps are worked out only when a backward pass can
//! follow (in eval, under `no_grad` or on untracked inputs, they are not).
//!
//! Modules: `bias` (the additive bias and where each row's keys end), `layout` (where the heads'
//! rows lie, and the result buffer their threads write); this one holds the op and its passes.

use std::sync::Mutex;

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp1, CustomOp3, Layout, Result, Shape, Tensor};

mod bias;
mod layout;

use bias::{Bias, Rows};
use layout::{Heads, Scale, Target};

use super::{dot, gemm, par_ranges, read, tensor, with, Mat, Real, SharedMut};

fn err(msg: String) -> candle_core::Error {
    candle_core::Error::Msg(msg)
}

struct Attention {
    bias: Option<Bias>,
    /// Whether a backward pass can follow (gradients on, an input tracked): only then does the
    /// forward pass work out the log-sum-exps (a library `ln` a row) and keep them.
    keep: bool,
    /// Log-sum-exp of each query row's scaled, biased scores, from the forward pass.
    lse: Mutex<Vec<f64>>,
    /// The CUDA body's bias and log-sum-exps, on the device.
    #[cfg(feature = "cuda")]
    device: Device,
}

/// What the CUDA body keeps: the bias in the compute type, and forward's log-sum-exps.
#[cfg(feature = "cuda")]
#[derive(Default)]
struct Device {
    bias: Option<cuda::DeviceBias>,
    lse: Mutex<Option<candle_core::cuda_backend::cudarc::driver::CudaSlice<f64>>>,
}

#[cfg(feature = "cuda")]
use crate::native::cuda::attention as cuda;

/// (batch, heads, seq_q, seq_k, head_dim) of q (B, H, Sq, D) and k, v (B, H, Sk, D).
fn dims(q: &Shape, k: &Shape, v: &Shape) -> Result<(usize, usize, usize, usize, usize)> {
    match (q.dims(), k.dims(), v.dims()) {
        (&[_, _, _, _], &[_, _, 0, _], _) => Err(err(format!("attention: k {k:?} has no keys to attend to"))),
        (&[b, h, sq, d], &[b2, h2, sk, d2], &[b3, h3, sk3, d3])
            if (b, h, d) == (b2, h2, d2) && (b, h, sk, d) == (b3, h3, sk3, d3) =>
        {
            Ok((b, h, sq, sk, d))
        }
        _ => Err(err(format!("attention: q {q:?}, k {k:?}, v {v:?} do not fit"))),
    }
}

wide_kernel! {
    /// `s[j] += bias[j·stride]` along one row of scores (a padding mask's row lies along the
    /// keys, stride 1: added a vector at a time).
    fn add_bias<T>(s: &mut [T], bias: &[T], stride: usize) {
        if stride == 1 {
            s.iter_mut().zip(bias).for_each(|(v, b)| *v = *v + *b);
        } else {
            s.iter_mut().enumerate().for_each(|(j, v)| *v = *v + bias[j * stride]);
        }
    }
}

/// Each `sk`-long row of `s` replaced by `exp(s − its max)`, the softmax before its division by
/// the row's sum; each row's max and sum into `max` and `sum`. f32 on the vector kernel
/// ([`wick_kernels::cpu::softmax`]: the exponentials are most of attention's forward outside its
/// products — as much as the products at a head width of 32).
fn exp_rows<T: Real>(s: &mut [T], sk: usize, max: &mut [T], sum: &mut [T]) {
    if let (Some(s), Some(max), Some(sum)) = (T::as_f32_mut(s), T::as_f32_mut(max), T::as_f32_mut(sum)) {
        return wick_kernels::cpu::softmax::exp_rows_f32(s, sk, max, sum);
    }
    for ((row, m), sm) in s.chunks_mut(sk).zip(max.iter_mut()).zip(sum.iter_mut()) {
        *m = row.iter().fold(T::neg_infinity(), |m, v| if *v > m { *v } else { m });
        *sm = T::zero();
        for v in row.iter_mut() {
            *v = T::exp_nonpositive(*v - *m);
            *sm = *sm + *v;
        }
    }
}

/// Each `sk`-long row of scores `p` replaced by `exp(p − lse)`, its probabilities again (the
/// arguments are at most 0: a log-sum-exp is at least its row's largest score). f32 on the vector
/// kernel ([`wick_kernels::cpu::softmax::exp_shifted_rows_f32`], as the forward pass's
/// exponentials).
fn probabilities<T: Real>(p: &mut [T], sk: usize, lse: &[f64]) {
    if let Some(p) = T::as_f32_mut(p) {
        let shift: Vec<f32> = lse.iter().map(|l| *l as f32).collect();
        return wick_kernels::cpu::softmax::exp_shifted_rows_f32(p, sk, &shift);
    }
    probabilities_wide(p, sk, lse);
}

wide_kernel! {
    /// [`probabilities`] for any dtype.
    fn probabilities_wide<T>(p: &mut [T], sk: usize, lse: &[f64]) {
        for (row, l) in p.chunks_mut(sk).zip(lse) {
            let l = T::of(*l);
            row.iter_mut().for_each(|v| *v = T::exp_nonpositive(*v - l));
        }
    }
}

wide_kernel! {
    /// The softmax's backward on rows of `sk`: `dS = P ∘ (dP − Σ_j P∘dP)` into `dp`, each row's
    /// sum in f64.
    fn softmax_grad_rows<T>(p: &[T], dp: &mut [T], sk: usize) {
        for (prow, drow) in p.chunks(sk).zip(dp.chunks_mut(sk)) {
            let dot = T::of(dot(prow, drow));
            drow.iter_mut().zip(prow).for_each(|(g, pv)| *g = *pv * (*g - dot));
        }
    }
}

/// The layouts of q, k, v and the output.
type Layouts = [Heads; 4];

/// Query rows of one block of the forward pass with a bias: fine enough that a causal mask's
/// blocks weigh little more than half the keys, coarse enough for the products. The decoder's
/// attention at 1 024 tokens (one sequence, Xeon, AVX-512): 72–74 ms a pass in blocks of 128, 83–85
/// in blocks of 64, 100–102 in blocks of 32, 74–81 in blocks of 192 or 256, 121 over all rows at
/// once; at 256 tokens 6.0 in blocks of 64 or 128, 6.9 over all rows.
const QUERY_BLOCK: usize = 128;

/// Query rows of one block of the backward pass with a bias (see [`Attention::bwd`]). The
/// decoder-512's attention backward, 8 layers over two steps (Zen 5, AVX-512): at 2 × 1 024 tokens
/// 291–312 ms in blocks of 128, 360–373 in blocks of 64, 311–313 in blocks of 256, 507 over all
/// rows at once; at 8 × 256 tokens 112–124, 116–123, 139–140 and 144.
const QUERY_BLOCK_BACKWARD: usize = 128;

/// Query rows of one block without a bias (every block weighs every key): the scores of one
/// block (256 × 1 024 f32 at 1 024 tokens: 1 MiB) stay in L2.
const QUERY_BLOCK_UNMASKED: usize = 256;

impl Attention {
    /// Attention of `dims` (B, H, Sq, Sk) with an optional additive bias, kept on the host for a
    /// CPU input and on the device for a CUDA one.
    /// `inputs` are q, k and v (or the packed qkv): whether any of them is tracked decides
    /// whether the log-sum-exps are kept for backward.
    fn new(bias: Option<&Tensor>, dims: [usize; 4], inputs: &[&Tensor]) -> Result<Self> {
        let keep = super::grad_enabled() && inputs.iter().any(|t| t.track_op());
        #[cfg(feature = "cuda")]
        if let Some(input) = inputs.first().filter(|t| t.device().is_cuda()) {
            let bias = bias.map(|t| cuda::DeviceBias::new(t, dims, input)).transpose()?;
            let device = Device { bias, lse: Mutex::new(None) };
            return Ok(Attention { bias: None, keep, lse: Mutex::new(Vec::new()), device });
        }
        let bias = bias.map(|t| Bias::new(t, dims)).transpose()?.flatten();
        Ok(Attention {
            bias,
            keep,
            lse: Mutex::new(Vec::new()),
            #[cfg(feature = "cuda")]
            device: Device::default(),
        })
    }

    /// The CUDA body's forward pass: the output and, kept, each query row's log-sum-exp.
    #[cfg(feature = "cuda")]
    fn cuda_forward(
        &self,
        inputs: [(&candle_core::CudaStorage, &Layout); 3],
        geometry: &cuda::Geometry,
        out_len: usize,
    ) -> Result<candle_core::CudaStorage> {
        let (out, lse) = cuda::forward(inputs, geometry, out_len, self.device.bias.as_ref())?;
        *self.device.lse.lock().unwrap_or_else(|p| p.into_inner()) = Some(lse);
        Ok(out)
    }

    /// The CUDA body's backward pass (see [`cuda::backward`]).
    #[cfg(feature = "cuda")]
    fn cuda_backward(
        &self,
        inputs: [&Tensor; 3],
        (out, g): (&Tensor, &Tensor),
        geometry: &cuda::Geometry,
        packed: bool,
    ) -> Result<Vec<Tensor>> {
        let guard = self.device.lse.lock().unwrap_or_else(|p| p.into_inner());
        let lse = guard.as_ref().ok_or_else(|| err("attention backward: no forward statistics".into()))?;
        cuda::backward(inputs, out, g, lse, geometry, self.device.bias.as_ref(), packed)
    }

    /// Scaled, biased scores of query rows `first..first + rows` of head `bh` against its first
    /// `keys` keys into `s` (rows × keys).
    fn scores_of_rows<T: Real>(
        bias: Option<&Rows<'_, T>>,
        q: &[T],
        k: &[T],
        lay: &Layouts,
        (bh, heads): (usize, usize),
        (first, rows, keys, d): (usize, usize, usize, usize),
        s: &mut [T],
    ) -> Result<()> {
        let scale = T::of(1.0 / (d as f64).sqrt());
        let (qm, km) = (lay[0].rows_from(q, bh, heads, (first, rows), d)?, lay[1].mat(k, bh, heads, keys, d)?);
        gemm(&mut s[..rows * keys], qm, km.t(), scale, false, false)?;
        if let Some(bias) = bias {
            for (i, row) in s[..rows * keys].chunks_exact_mut(keys).enumerate() {
                let (b_row, stride) = bias.row(bh / heads, bh % heads, first + i);
                add_bias::<T>(row, b_row, stride);
            }
        }
        Ok(())
    }

    /// Keys that query rows `first..first + rows` of head `bh` weigh: all `sk` without a bias,
    /// else up to the last row's end ([`Bias::end`]).
    fn keys_of_rows(&self, (bh, heads): (usize, usize), (first, rows): (usize, usize), sk: usize) -> usize {
        match &self.bias {
            Some(bias) => (first..first + rows).map(|i| bias.end(bh / heads, bh % heads, i)).max().unwrap_or(sk),
            None => sk,
        }
    }

    /// `f` of the bias's rows in the compute type (`None` without a bias).
    fn biased<T: Real, R>(&self, f: impl FnOnce(Option<&Rows<'_, T>>) -> Result<R>) -> Result<R> {
        match &self.bias {
            Some(bias) => bias.with_rows(|rows| f(Some(rows))),
            None => f(None),
        }
    }

    /// The output (laid out as `lay[3]`) and each query row's log-sum-exp.
    fn fwd<T: Real>(
        &self,
        inputs: (&[T], &[T], &[T]),
        lay: &Layouts,
        dims: (usize, usize, usize, usize, usize),
    ) -> Result<(Vec<T>, Vec<f64>)> {
        self.biased(|bias| self.fwd_biased(bias, inputs, lay, dims))
    }

    /// [`Attention::fwd`] with the bias's rows.
    fn fwd_biased<T: Real>(
        &self,
        bias: Option<&Rows<'_, T>>,
        (q, k, v): (&[T], &[T], &[T]),
        lay: &Layouts,
        (b, h, sq, sk, d): (usize, usize, usize, usize, usize),
    ) -> Result<(Vec<T>, Vec<f64>)> {
        let mut out = vec![T::zero(); b * h * sq * d];
        let mut lse = vec![0.0; if self.keep { b * h * sq } else { 0 }];
        let (so, sl) = (SharedMut::new(&mut out), SharedMut::new(&mut lse));
        let target = Target { data: &so, layout: lay[3] };
        let failure = Mutex::new(None);
        // Query rows a block at a time: each block's scores stay in cache between the product, the
        // softmax and the product with V, and a block weighs only the keys up to its rows' ends
        // (a causal mask's: about half of them).
        let block = if self.bias.is_some() { QUERY_BLOCK } else { QUERY_BLOCK_UNMASKED }.min(sq);
        par_ranges(b * h, 1, |r| {
            let (mut s, mut scratch) = (vec![T::zero(); block * sk], vec![T::zero(); block * d]);
            let (mut max, mut sum) = (vec![T::zero(); block], vec![T::zero(); block]);
            for bh in r {
                let mut run = || -> Result<()> {
                    for first in (0..sq).step_by(block.max(1)) {
                        let rows = block.min(sq - first);
                        let keys = self.keys_of_rows((bh, h), (first, rows), sk);
                        Self::scores_of_rows(bias, q, k, lay, (bh, h), (first, rows, keys, d), &mut s)?;
                        let scores = &mut s[..rows * keys];
                        exp_rows::<T>(scores, keys, &mut max, &mut sum);
                        if self.keep {
                            // SAFETY: rows of one head per index.
                            let lse = unsafe { sl.range(bh * sq + first, rows) };
                            for (l, (m, s)) in lse.iter_mut().zip(max.iter().zip(&sum)) {
                                *l = T::wide(*m) + T::wide(*s).ln();
                            }
                        }
                        // The sums become their inverses, each row's factor after the product.
                        sum[..rows].iter_mut().for_each(|s| *s = T::one() / *s);
                        let (pm, vm) = (Mat::rows(scores, rows, keys), lay[2].mat(v, bh, h, keys, d)?);
                        // SAFETY: one head per index.
                        unsafe { target.put_rows(bh, h, (first, rows, d), &mut scratch, (pm, vm), Scale::Rows(&sum))? };
                    }
                    Ok(())
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

    /// dq, dk and dv into `grads` (each buffer `b·h·s·d` long where its layout puts it).
    fn bwd<T: Real>(
        &self,
        inputs: (&[T], &[T], &[T], &[T]),
        lay: &Layouts,
        dims: (usize, usize, usize, usize, usize),
        targets: [Target<'_, T>; 3],
    ) -> Result<()> {
        self.biased(|bias| self.bwd_biased(bias, inputs, lay, dims, targets))
    }

    /// [`Attention::bwd`] with the bias's rows.
    fn bwd_biased<T: Real>(
        &self,
        bias: Option<&Rows<'_, T>>,
        (q, k, v, go): (&[T], &[T], &[T], &[T]),
        lay: &Layouts,
        (b, h, sq, sk, d): (usize, usize, usize, usize, usize),
        [dq, dk, dv]: [Target<'_, T>; 3],
    ) -> Result<()> {
        let lse = self.lse.lock().unwrap_or_else(|p| p.into_inner()).clone();
        if lse.len() != b * h * sq {
            return Err(err("attention backward: no forward statistics".into()));
        }
        let scale = T::of(1.0 / (d as f64).sqrt());
        let failure = Mutex::new(None);
        // With a bias, query rows a block at a time, each against the keys up to its rows' last
        // unmasked one, as the forward pass weighs them (a causal mask's blocks: about half the
        // products); without one, all rows at once (one product each, as before blocks).
        let block = if self.bias.is_some() { QUERY_BLOCK_BACKWARD } else { sq }.clamp(1, sq.max(1));
        par_ranges(b * h, 1, |r| {
            let (mut p, mut dp) = (vec![T::zero(); block * sk], vec![T::zero(); block * sk]);
            let mut scratch = vec![T::zero(); block.max(sk) * d];
            // dK and dV of a head, summed over its blocks of query rows.
            let (mut dk_sum, mut dv_sum) = (vec![T::zero(); sk * d], vec![T::zero(); sk * d]);
            for bh in r {
                let mut run = || -> Result<()> {
                    dk_sum.fill(T::zero());
                    dv_sum.fill(T::zero());
                    for first in (0..sq).step_by(block) {
                        let rows = block.min(sq - first);
                        let keys = self.keys_of_rows((bh, h), (first, rows), sk);
                        let (p, dp) = (&mut p[..rows * keys], &mut dp[..rows * keys]);
                        // P = exp(S − lse), recomputed.
                        Self::scores_of_rows(bias, q, k, lay, (bh, h), (first, rows, keys, d), p)?;
                        probabilities::<T>(p, keys, &lse[bh * sq + first..bh * sq + first + rows]);
                        let gm = lay[3].rows_from(go, bh, h, (first, rows), d)?;
                        // dV += Pᵀ·dO.
                        gemm(&mut dv_sum[..keys * d], Mat::rows(p, rows, keys).t(), gm, T::one(), true, false)?;
                        gemm(dp, gm, lay[2].mat(v, bh, h, keys, d)?.t(), T::one(), false, false)?;
                        // dS = P ∘ (dP − Σ_j P∘dP), into `dp`.
                        softmax_grad_rows::<T>(p, dp, keys);
                        let (km, qm) = (lay[1].mat(k, bh, h, keys, d)?, lay[0].rows_from(q, bh, h, (first, rows), d)?);
                        // SAFETY: one head per index (each thread its own heads), these rows once.
                        unsafe {
                            dq.put_rows(
                                bh,
                                h,
                                (first, rows, d),
                                &mut scratch,
                                (Mat::rows(dp, rows, keys), km),
                                Scale::All(scale),
                            )?
                        };
                        // dK += scale·dSᵀ·Q.
                        gemm(&mut dk_sum[..keys * d], Mat::rows(dp, rows, keys).t(), qm, scale, true, false)?;
                    }
                    // SAFETY: as for dq (keys no row weighs keep their zeros).
                    unsafe {
                        dk.write_rows(bh, h, (0, sk, d), &dk_sum)?;
                        dv.write_rows(bh, h, (0, sk, d), &dv_sum)
                    }
                };
                if let Err(e) = run() {
                    *failure.lock().unwrap_or_else(|p| p.into_inner()) = Some(e);
                }
            }
        });
        match failure.into_inner().unwrap_or_else(|p| p.into_inner()) {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    fn apart(h: usize, sq: usize, sk: usize, d: usize) -> Layouts {
        [Heads::apart(h, sq, d), Heads::apart(h, sk, d), Heads::apart(h, sk, d), Heads::apart(h, sq, d)]
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
        let dims @ (_, h, s_q, s_k, d) = dims(lq.shape(), lk.shape(), lv.shape())?;
        let (q, k, v) = (read::<T>(sq, lq)?, read::<T>(sk, lk)?, read::<T>(sv, lv)?);
        let (out, lse) = self.fwd((&q, &k, &v), &Attention::apart(h, s_q, s_k, d), dims)?;
        *self.lse.lock().unwrap_or_else(|p| p.into_inner()) = lse;
        Ok((T::storage(out, sq.dtype())?, lq.shape().clone()))
    }

    fn grads<T: Real>(&self, q: &Tensor, k: &Tensor, v: &Tensor, g: &Tensor) -> Result<[Tensor; 3]> {
        let dims @ (_, h, s_q, s_k, d) = dims(q.shape(), k.shape(), v.shape())?;
        let lay = Attention::apart(h, s_q, s_k, d);
        let [dq, dk, dv] = with::<T, _>(q, |qs| {
            with::<T, _>(k, |ks| {
                with::<T, _>(v, |vs| {
                    with::<T, _>(g, |gs| {
                        let (mut dq, mut dk, mut dv) =
                            (vec![T::zero(); qs.len()], vec![T::zero(); ks.len()], vec![T::zero(); vs.len()]);
                        let (sdq, sdk, sdv) =
                            (SharedMut::new(&mut dq), SharedMut::new(&mut dk), SharedMut::new(&mut dv));
                        let targets = [
                            Target { data: &sdq, layout: lay[0] },
                            Target { data: &sdk, layout: lay[1] },
                            Target { data: &sdv, layout: lay[2] },
                        ];
                        self.bwd((qs, ks, vs, gs), &lay, dims, targets)?;
                        Ok([dq, dk, dv])
                    })
                })
            })
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
    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        sq: &candle_core::CudaStorage,
        lq: &Layout,
        sk: &candle_core::CudaStorage,
        lk: &Layout,
        sv: &candle_core::CudaStorage,
        lv: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let dims @ (_, h, s_q, s_k, d) = dims(lq.shape(), lk.shape(), lv.shape())?;
        let geometry = cuda::Geometry { dims, lays: Attention::apart(h, s_q, s_k, d).map(Heads::lay) };
        let out = self.cuda_forward([(sq, lq), (sk, lk), (sv, lv)], &geometry, lq.shape().elem_count())?;
        Ok((out, lq.shape().clone()))
    }
    fn bwd(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        res: &Tensor,
        g: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        #[cfg(feature = "cuda")]
        if q.device().is_cuda() {
            let dims @ (_, h, s_q, s_k, d) = dims(q.shape(), k.shape(), v.shape())?;
            let geometry = cuda::Geometry { dims, lays: Attention::apart(h, s_q, s_k, d).map(Heads::lay) };
            let mut grads = self.cuda_backward([q, k, v], (res, g), &geometry, false)?.into_iter();
            let (dq, dk, dv) = (grads.next(), grads.next(), grads.next());
            return Ok((dq.filter(|_| q.track_op()), dk.filter(|_| k.track_op()), dv.filter(|_| v.track_op())));
        }
        let _ = res;
        let [dq, dk, dv] = by_real!(q.dtype(), T => self.grads::<T>(q, k, v, g)?);
        Ok((q.track_op().then_some(dq), k.track_op().then_some(dk), v.track_op().then_some(dv)))
    }
}

/// Scaled dot-product attention on the CPU (see [`crate::ops::attention`]).
pub fn attention(q: &Tensor, k: &Tensor, v: &Tensor, bias: Option<&Tensor>) -> Result<Tensor> {
    let (b, h, sq, sk, _) = dims(q.shape(), k.shape(), v.shape())?;
    let op = Attention::new(bias, [b, h, sq, sk], &[q, k, v])?;
    super::apply3(&q.contiguous()?, &k.contiguous()?, &v.contiguous()?, op)
}

/// Self-attention over q, k and v packed in one (B, S, 3·H·D) tensor, as a fused projection
/// writes them; the output is (B, S, H·D) with the heads side by side, ready for the output
/// projection.
struct Packed {
    attention: Attention,
    heads: usize,
}

/// (batch, seq, head_dim) of a packed (B, S, 3·heads·D) input.
fn packed_dims(shape: &Shape, heads: usize) -> Result<(usize, usize, usize)> {
    match shape.dims() {
        &[b, s, e] if heads > 0 && s > 0 && e > 0 && e % (3 * heads) == 0 => Ok((b, s, e / (3 * heads))),
        d => Err(err(format!("attention: packed q, k, v {d:?} are not (batch, seq > 0, 3·{heads}·head_dim)"))),
    }
}

impl Packed {
    fn layouts(&self, seq: usize, d: usize) -> Layouts {
        let h = self.heads;
        [
            Heads::packed(0, 3, h, seq, d),
            Heads::packed(1, 3, h, seq, d),
            Heads::packed(2, 3, h, seq, d),
            Heads::packed(0, 1, h, seq, d),
        ]
    }

    #[cfg(feature = "cuda")]
    fn geometry(&self, b: usize, seq: usize, d: usize) -> cuda::Geometry {
        cuda::Geometry { dims: (b, self.heads, seq, seq, d), lays: self.layouts(seq, d).map(Heads::lay) }
    }

    fn cpu<T: Real>(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let (b, seq, d) = packed_dims(l.shape(), self.heads)?;
        let qkv = read::<T>(s, l)?;
        let dims = (b, self.heads, seq, seq, d);
        let (out, lse) = self.attention.fwd((&qkv, &qkv, &qkv), &self.layouts(seq, d), dims)?;
        *self.attention.lse.lock().unwrap_or_else(|p| p.into_inner()) = lse;
        Ok((T::storage(out, s.dtype())?, Shape::from((b, seq, self.heads * d))))
    }

    fn grad<T: Real>(&self, x: &Tensor, g: &Tensor) -> Result<Tensor> {
        let (b, seq, d) = packed_dims(x.shape(), self.heads)?;
        let lay = self.layouts(seq, d);
        let dqkv = with::<T, _>(x, |qkv| {
            with::<T, _>(g, |go| {
                let mut dqkv = vec![T::zero(); qkv.len()];
                let sd = SharedMut::new(&mut dqkv);
                let targets = [0, 1, 2].map(|i| Target { data: &sd, layout: lay[i] });
                self.attention.bwd((qkv, qkv, qkv, go), &lay, (b, self.heads, seq, seq, d), targets)?;
                Ok(dqkv)
            })
        })?;
        tensor(dqkv, x.shape(), x.dtype())
    }
}

impl CustomOp1 for Packed {
    fn name(&self) -> &'static str {
        "attention"
    }
    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        by_real!(s.dtype(), T => self.cpu::<T>(s, l))
    }
    #[cfg(feature = "cuda")]
    fn cuda_fwd(&self, s: &candle_core::CudaStorage, l: &Layout) -> Result<(candle_core::CudaStorage, Shape)> {
        let (b, seq, d) = packed_dims(l.shape(), self.heads)?;
        let geometry = self.geometry(b, seq, d);
        let out = self.attention.cuda_forward([(s, l), (s, l), (s, l)], &geometry, b * seq * self.heads * d)?;
        Ok((out, Shape::from((b, seq, self.heads * d))))
    }
    fn bwd(&self, x: &Tensor, res: &Tensor, g: &Tensor) -> Result<Option<Tensor>> {
        #[cfg(feature = "cuda")]
        if x.device().is_cuda() {
            let (b, seq, d) = packed_dims(x.shape(), self.heads)?;
            let geometry = self.geometry(b, seq, d);
            return Ok(self.attention.cuda_backward([x, x, x], (res, g), &geometry, true)?.into_iter().next());
        }
        let _ = res;
        by_real!(x.dtype(), T => self.grad::<T>(x, g).map(Some))
    }
}

/// Self-attention of `qkv` (B, S, 3·H·D: q, k and v side by side, each with its heads side by
/// side) into (B, S, H·D) on the CPU (see [`crate::ops::attention_packed`]).
pub fn attention_packed(qkv: &Tensor, heads: usize, bias: Option<&Tensor>) -> Result<Tensor> {
    let (b, s, _) = packed_dims(qkv.shape(), heads)?;
    let attention = Attention::new(bias, [b, heads, s, s], &[qkv])?;
    super::apply1(&qkv.contiguous()?, Packed { attention, heads })
}
