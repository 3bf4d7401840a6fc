//! Batch norm over (N, H, W) per channel with a closed-form backward pass: statistics summed in
//! f64, computed once in the forward pass and kept (two numbers per channel) for backward. Layer
//! norm and RMS norm are [`super::row_norm`]'s.

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp3, Layout, Result, Shape, Tensor};

use super::elem::{by_elem, elem_tensor, elems, with_elems, Elem};
use super::{par_ranges, read, sum, sum_sq_dev, tensor, with, Real, SharedMut};
use wick_kernels::cpu::bn_sums::{self, Through};

fn err(msg: String) -> candle_core::Error {
    candle_core::Error::Msg(msg)
}

/// (N, C, H·W) of a 4-D shape.
pub(super) fn nchw(shape: &Shape) -> Result<(usize, usize, usize)> {
    match shape.dims() {
        [n, c, h, w] => Ok((*n, *c, h * w)),
        d => Err(err(format!("batch norm: expected (N, C, H, W), got {d:?}"))),
    }
}

/// Per-channel mean and biased variance of `x` (N, C, H, W) over (N, H, W), summed in f64
/// (two passes: the mean, then the squared deviations).
pub fn batch_stats(x: &Tensor) -> Result<(Vec<f64>, Vec<f64>)> {
    let (n, c, hw) = nchw(x.shape())?;
    wide_kernel! {
        fn stats<T, E>(x: &[E], n: usize, c: usize, hw: usize) -> (Vec<f64>, Vec<f64>) {
            let (mut mean, mut var) = (vec![0.0; c], vec![0.0; c]);
            let (m, v) = (SharedMut::new(&mut mean), SharedMut::new(&mut var));
            let count = (n * hw).max(1) as f64;
            par_ranges(c, 1, |r| {
                // SAFETY: disjoint channel ranges.
                let (m, v) = unsafe { (m.range(r.start, r.len()), v.range(r.start, r.len())) };
                let (mut planes, mut sums) = (Vec::with_capacity(n), vec![0.0; n]);
                for (i, ch) in r.enumerate() {
                    let plane = |b: usize| &x[(b * c + ch) * hw..(b * c + ch + 1) * hw];
                    planes.clear();
                    planes.extend((0..n).map(plane));
                    // The channel's planes at once where the kernel takes them (the same sums).
                    let mut total = |dev: Option<f64>| {
                        if bn_sums::plane_moments::<T, E>(&planes, dev, &mut sums) {
                            return sums.iter().sum::<f64>();
                        }
                        let one = |p: &&[E]| dev.map_or_else(|| sum::<T, E>(p), |m| sum_sq_dev::<T, E>(p, m));
                        planes.iter().map(one).sum::<f64>()
                    };
                    let mean = total(None) / count;
                    (m[i], v[i]) = (mean, total(Some(mean)) / count);
                }
            });
            (mean, var)
        }
    }
    by_elem!(x.dtype(), T, E => with_elems::<T, E, _>(x, |x| Ok(stats::<T, E>(x, n, c, hw))))
}

/// Batch normalisation of (N, C, H, W) with given per-channel statistics: `batch` when they are
/// this batch's own (their dependence on `x` enters the gradient), the running estimates
/// otherwise. One op, two bodies: the statistics are on the host for a CPU tensor, on the device
/// for a CUDA one (`crate::native::cuda::batch_norm`), and are what backward reads.
struct BatchNorm {
    stats: ChannelStats,
    batch: bool,
    act: Activation,
}

/// A batch norm's per-channel (mean, inverse deviation).
enum ChannelStats {
    Host {
        mean: Vec<f64>,
        invstd: Vec<f64>,
    },
    #[cfg(feature = "cuda")]
    Device(crate::native::cuda::batch_norm::Stats),
}

impl ChannelStats {
    /// The host's (mean, inverse deviation), or an error for statistics on a device.
    fn host(&self) -> Result<(&[f64], &[f64])> {
        match self {
            ChannelStats::Host { mean, invstd } => Ok((mean, invstd)),
            #[cfg(feature = "cuda")]
            ChannelStats::Device(_) => Err(err("batch norm: statistics on a device for a CPU tensor".into())),
        }
    }
}

/// An activation applied to a normalisation's output inside the same op (its input, the
/// normalised value, is then neither stored nor kept for backward: backward recomputes it).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Activation {
    /// None.
    Identity,
    /// ReLU, PyTorch's gradient (`[y > 0]`).
    Relu,
    /// ReLU6, PyTorch's gradient (`[0 < y < 6]`).
    Relu6,
}

impl Activation {
    /// The activation's code in the CUDA kernels (0 none, 1 ReLU, 2 ReLU6).
    #[cfg(feature = "cuda")]
    fn code(self) -> i32 {
        match self {
            Activation::Identity => 0,
            Activation::Relu => 1,
            Activation::Relu6 => 2,
        }
    }

    /// The activation of `y` (selections: NaN passes through). Selects, not branches: the
    /// signs of normalised values are random.
    #[inline(always)]
    pub(crate) fn apply<T: Real>(self, y: T) -> T {
        use std::hint::select_unpredictable as select;
        match self {
            Activation::Identity => y,
            Activation::Relu => select(y <= T::zero(), T::zero(), y),
            Activation::Relu6 => {
                let six = T::of(6.0);
                select(y <= T::zero(), T::zero(), select(y >= six, six, y))
            }
        }
    }
}

/// `1 / √(var + ε)` per channel.
pub(crate) fn inverse_deviations(var: &[f64], eps: f64) -> Vec<f64> {
    var.iter().map(|v| 1.0 / (v + eps).sqrt()).collect()
}

/// Batch norm's per-channel `(scale, shift)` with `y = x·scale + shift`, from the weight `w`
/// and bias `b` (each element in f64), the mean and the inverse deviation.
pub(crate) fn affine<T: Real>(
    w: impl Fn(usize) -> f64,
    b: impl Fn(usize) -> f64,
    mean: &[f64],
    invstd: &[f64],
) -> (Vec<T>, Vec<T>) {
    (0..mean.len())
        .map(|c| {
            let scale = w(c) * invstd[c];
            (T::of(scale), T::of(b(c) - mean[c] * scale))
        })
        .unzip()
}

impl BatchNorm {
    /// Per-channel `(scale, shift)` with `y = x·scale + shift`.
    fn affine<T: Real>(&self, w: &[T], b: &[T]) -> Result<(Vec<T>, Vec<T>)> {
        let (mean, invstd) = self.stats.host()?;
        Ok(affine(|c| T::wide(w[c]), |c| T::wide(b[c]), mean, invstd))
    }

    fn fwd<T: Real, E: Elem<T>>(
        &self,
        sx: &CpuStorage,
        lx: &Layout,
        sw: &CpuStorage,
        lw: &Layout,
        sb: &CpuStorage,
        lb: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (n, c, hw) = nchw(lx.shape())?;
        let (x, w, b) = (elems::<T, E>(sx, lx)?, read::<T>(sw, lw)?, read::<T>(sb, lb)?);
        if w.len() != c || b.len() != c || self.stats.host()?.0.len() != c {
            return Err(err(format!("batch norm: {c} channels, {} weights, {} biases", w.len(), b.len())));
        }
        let (scale, shift) = self.affine(&w, &b)?;
        let y = bn_forward::<T, E>(x, (n, c, hw), &scale, &shift, self.act);
        Ok((E::into_storage(y), lx.shape().clone()))
    }

    /// (dx, dweight, dbias).
    fn bwd<T: Real, E: Elem<T>>(
        &self,
        x: &Tensor,
        w: &Tensor,
        b: &Tensor,
        g: &Tensor,
    ) -> Result<(Vec<E>, Vec<T>, Vec<T>)> {
        let (n, c, hw) = nchw(x.shape())?;
        with_elems::<T, E, _>(x, |x| {
            with::<T, _>(w, |w| {
                with::<T, _>(b, |b| {
                    with_elems::<T, E, _>(g, |g| {
                        let (scale, shift) = self.affine(w, b)?;
                        let (mean, invstd) = self.stats.host()?;
                        let stats = Stats { mean, invstd, scale: &scale, shift: &shift };
                        Ok(bn_backward::<T, E>(x, w, g, (n, c, hw), stats, self.batch, self.act))
                    })
                })
            })
        })
    }
}

wide_kernel! {
    /// `act(x·scale + shift)` per channel of (N, C, HW) `x`.
    fn bn_forward<T, E>(x: &[E], dims: (usize, usize, usize), scale: &[T], shift: &[T], act: Activation) -> Vec<E> {
        let (n, c, hw) = dims;
        let mut y = vec![E::store(T::zero()); x.len()];
        let out = SharedMut::new(&mut y);
        par_ranges(n * c, 1, |r| {
            for plane in r {
                let (a, t) = (scale[plane % c], shift[plane % c]);
                // SAFETY: one plane per index.
                let dst = unsafe { out.range(plane * hw, hw) };
                let src = &x[plane * hw..(plane + 1) * hw];
                // One loop per activation, so the loop body has no branch.
                match act {
                    Activation::Identity => dst.iter_mut().zip(src).for_each(|(d, v)| *d = E::store(v.load() * a + t)),
                    Activation::Relu => {
                        dst.iter_mut().zip(src).for_each(|(d, v)| *d = E::store(Activation::Relu.apply(v.load() * a + t)))
                    }
                    Activation::Relu6 => {
                        dst.iter_mut().zip(src).for_each(|(d, v)| *d = E::store(Activation::Relu6.apply(v.load() * a + t)))
                    }
                }
            }
        });
        y
    }
}

/// Batch norm's per-channel figures for backward (the affine `y = x·scale + shift`).
#[derive(Clone, Copy)]
struct Stats<'a, T> {
    mean: &'a [f64],
    invstd: &'a [f64],
    scale: &'a [T],
    shift: &'a [T],
}

wide_kernel! {
    /// Batch norm's (dx, dweight, dbias) over (N, C, HW) `x` and output gradient `g`.
    fn bn_backward<T, E>(
        x: &[E],
        w: &[T],
        g: &[E],
        dims: (usize, usize, usize),
        stats: Stats<'_, T>,
        batch: bool,
        act: Activation,
    ) -> (Vec<E>, Vec<T>, Vec<T>) {
        let (n, c, hw) = dims;
        let count = (n * hw).max(1) as f64;
        let (mut dw, mut db) = (vec![T::zero(); c], vec![T::zero(); c]);
        let mut dx = vec![E::store(T::zero()); x.len()];
        let (sdw, sdb, sdx) =
            (SharedMut::new(&mut dw), SharedMut::new(&mut db), SharedMut::new(&mut dx));
        let bounds = match act {
            Activation::Identity => None,
            Activation::Relu => Some(mask_bounds::<T, E>(T::infinity())),
            Activation::Relu6 => Some(mask_bounds::<T, E>(T::of(6.0))),
        };
        // Two passes per channel, each reading g and x once: the sums, then dx.
        // The activation's gradient mask is recomputed in each (the normalised
        // value is never stored): it passes g where that value lies strictly
        // between the bounds (the kinks as the stored value reaches them).
        par_ranges(c, 1, |r| {
            let (mut pairs, mut per_plane) = (Vec::with_capacity(n), vec![(0.0, 0.0); n]);
            for ch in r {
                let (mean, invstd) = (stats.mean[ch], stats.invstd[ch]);
                let (a, t) = (stats.scale[ch], stats.shift[ch]);
                let planes = || (0..n).map(|b| (b * c + ch) * hw);
                // Σg and Σg·x̂ in f64, per plane in lanes (as `sum` adds), the channel's planes
                // at once where the kernel takes them, added in order.
                pairs.clear();
                pairs.extend(planes().map(|s| (&g[s..s + hw], &x[s..s + hw])));
                match bounds {
                    Some((lo, hi)) => {
                        let f = |v: T| T::wide(v) as f32;
                        let fast = Through::Masked { a: f(a), t: f(t), lower: f(lo), upper: f(hi) };
                        plane_sums(&pairs, mean, |gv, xv| masked(gv, xv * a + t, (lo, hi)), fast, &mut per_plane)
                    }
                    None => plane_sums(&pairs, mean, |gv, _| gv, Through::Identity, &mut per_plane),
                };
                let (mut sum_g, mut sum_gx) = (0.0f64, 0.0f64);
                for &(sg, sgx) in &per_plane {
                    sum_g += sg;
                    sum_gx += sgx * invstd;
                }
                // SAFETY: one channel per index, and channel `ch`'s planes.
                unsafe {
                    sdw.range(ch, 1)[0] = T::of(sum_gx);
                    sdb.range(ch, 1)[0] = T::of(sum_g);
                }
                let k = T::wide(w[ch]) * invstd;
                // dx = k·(g − Σg/M − x̂·Σg·x̂/M) = k·g + e·(x − mean) + c.
                let (mg, mgx) = if batch { (sum_g / count, sum_gx / count) } else { (0.0, 0.0) };
                let (ka, e, c0, m) = (T::of(k), T::of(-k * mgx * invstd), T::of(-k * mg), T::of(mean));
                for start in planes() {
                    // SAFETY: as above.
                    let dst = unsafe { sdx.range(start, hw) };
                    let (gp, xp) = (&g[start..start + hw], &x[start..start + hw]);
                    match bounds {
                        Some(b) => plane_dx(dst, gp, xp, (ka, e, c0, m), |gv, xv| masked(gv, xv * a + t, b)),
                        None => plane_dx(dst, gp, xp, (ka, e, c0, m), |gv, _| gv),
                    }
                }
            }
        });
        (dx, dw, db)
    }
}

/// `g` where the normalised value `y` lies strictly inside (`lower`, `upper`), else 0: the
/// gradient through a ReLU or ReLU6 at `y`, its kinks as [`mask_bounds`] gives them.
#[inline(always)]
fn masked<T: Real>(g: T, y: T, (lower, upper): (T, T)) -> T {
    // A select, not a branch: half of a ReLU's inputs are negative, at random.
    std::hint::select_unpredictable((y > lower) & (y < upper), g, T::zero())
}

/// [`mask_bounds`] of `act` for an output of `dtype`, in f64 (exact in the compute type); `None`
/// for no activation.
#[cfg(feature = "cuda")]
fn mask_bounds_of(dtype: candle_core::DType, act: Activation) -> Result<Option<(f64, f64)>> {
    let upper = match act {
        Activation::Identity => return Ok(None),
        Activation::Relu => f64::INFINITY,
        Activation::Relu6 => 6.0,
    };
    by_elem!(dtype, T, E => {
        let (lo, hi) = mask_bounds::<T, E>(T::of(upper));
        Ok(Some((T::wide(lo), T::wide(hi))))
    })
}

/// The bounds on a normalised value `y` (computed in `T`) strictly between which the gradient of
/// a ReLU (`upper` = ∞) or ReLU6 (`upper` = 6) passes, when the op's output is stored as `E`: the
/// largest value that rounds to 0 in `E`, and the least that rounds to `upper`. The activation's
/// gradient then reads the value as stored, as PyTorch's separate activation reads the rounded
/// output of the norm before it (a bf16 value within 1/64 below 6 is stored as 6.0, and passes
/// nothing there); for f32 and f64 outputs they are 0 and `upper` themselves.
pub(crate) fn mask_bounds<T: Real, E: Elem<T>>(upper: T) -> (T, T) {
    let round = |v: f64| T::wide(E::store(T::of(v)).load());
    let probe = 1.0 + 2f64.powi(-20);
    if round(probe) == probe {
        return (T::zero(), upper);
    }
    // `E` rounds: `T` is f32 (every low-precision element widens to f32), so bisect over the bit
    // patterns of positive f32 values, on which rounding is monotonic.
    let at = |bits: u32| f64::from(f32::from_bits(bits));
    let bisect = |mut below: u32, mut above: u32, is_above: &dyn Fn(f64) -> bool| {
        while above - below > 1 {
            let mid = below + (above - below) / 2;
            if is_above(at(mid)) {
                above = mid;
            } else {
                below = mid;
            }
        }
        (below, above)
    };
    let (zero, _) = bisect(0, 1.0f32.to_bits(), &|v| round(v) != 0.0);
    let lower = T::of(at(zero));
    let k = T::wide(upper);
    if !k.is_finite() || k <= 0.0 {
        return (lower, upper);
    }
    let kf = k as f32;
    let (_, reaches) = bisect((kf * 0.5).to_bits(), kf.to_bits(), &|v| round(v) >= k);
    (lower, T::of(at(reaches)))
}

/// `(Σ g', Σ g'·(x − mean))` over each plane `(g, x)` in f64 into `out`, `g' = through(g, x)`, in the
/// lanes and order of `sum` ([`super::lane_sums`]; the per-index form ran scalar:
/// BENCHMARKS.md, "Kernel design measurements").
/// `fast` is `through` for [`bn_sums`], which takes f32 compute over f32 or bf16 with
/// AVX-512, several planes at once (the same sums to the bit).
#[inline(always)]
fn plane_sums<T: Real, E: Elem<T>>(
    planes: &[(&[E], &[E])],
    mean: f64,
    through: impl Fn(T, T) -> T,
    fast: Through,
    out: &mut [(f64, f64)],
) {
    if bn_sums::plane_sums::<T, E>(planes, mean, fast, out) {
        return;
    }
    for ((g, x), out) in planes.iter().zip(out) {
        let [sum_g, sum_gx] = super::lane_sums(g, x, |gv, xv| {
            let (gv, xv) = (gv.load(), xv.load());
            let gv = T::wide(through(gv, xv));
            [gv, gv * (T::wide(xv) - mean)]
        });
        *out = (sum_g, sum_gx);
    }
}

/// `dx = k·g' + e·(x − m) + c` over one plane, `g' = through(g, x)`.
#[inline(always)]
fn plane_dx<T: Real, E: Elem<T>>(
    dx: &mut [E],
    g: &[E],
    x: &[E],
    (k, e, c, m): (T, T, T, T),
    through: impl Fn(T, T) -> T,
) {
    for ((d, gv), xv) in dx.iter_mut().zip(g).zip(x) {
        let (gv, xv) = (gv.load(), xv.load());
        *d = E::store(k * through(gv, xv) + e * (xv - m) + c);
    }
}

impl CustomOp3 for BatchNorm {
    fn name(&self) -> &'static str {
        "batch_norm"
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
        by_elem!(sx.dtype(), T, E => self.fwd::<T, E>(sx, lx, sw, lw, sb, lb))
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
        let ChannelStats::Device(stats) = &self.stats else {
            return Err(err("batch norm: statistics on the host for a CUDA tensor".into()));
        };
        crate::native::cuda::batch_norm::forward((sx, lx), (sw, lw), (sb, lb), stats, self.act.code())
    }
    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        b: &Tensor,
        _res: &Tensor,
        g: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let (dx, dw, db) = self.grads(x, w, b, g)?;
        Ok((x.track_op().then_some(dx), w.track_op().then_some(dw), b.track_op().then_some(db)))
    }
}

impl BatchNorm {
    /// (dx, dweight, dbias) as tensors: dx like `x`, the others like `w` and `b`.
    fn grads(&self, x: &Tensor, w: &Tensor, b: &Tensor, g: &Tensor) -> Result<(Tensor, Tensor, Tensor)> {
        #[cfg(feature = "cuda")]
        if let ChannelStats::Device(stats) = &self.stats {
            let bounds = mask_bounds_of(x.dtype(), self.act)?.unwrap_or((0.0, f64::INFINITY));
            let (dx, dw, db) =
                crate::native::cuda::batch_norm::backward(x, (w, b), g, stats, (self.batch, self.act.code(), bounds))?;
            return Ok((dx, dw.to_dtype(w.dtype())?, db.to_dtype(b.dtype())?));
        }
        let c = w.elem_count();
        by_elem!(x.dtype(), T, E => {
            let (dx, dw, db) = self.bwd::<T, E>(x, w, b, g)?;
            Ok((elem_tensor::<T, E>(dx, x.shape())?, tensor(dw, c, w.dtype())?, tensor(db, c, b.dtype())?))
        })
    }
}

/// Batch normalisation of `x` (N, C, H, W) with per-channel `mean` and biased `var` (this
/// batch's own when `batch`, whose dependence on `x` then enters the gradient; the running
/// estimates otherwise), `weight` and `bias` (C), followed by `act` in the same op.
#[allow(clippy::too_many_arguments)]
pub fn batch_norm(
    x: &Tensor,
    mean: &[f64],
    var: &[f64],
    weight: &Tensor,
    bias: &Tensor,
    eps: f64,
    batch: bool,
    act: Activation,
) -> Result<Tensor> {
    let invstd = inverse_deviations(var, eps);
    let op = BatchNorm { stats: ChannelStats::Host { mean: mean.to_vec(), invstd }, batch, act };
    super::apply3(&x.contiguous()?, &weight.contiguous()?, &bias.contiguous()?, op)
}

/// Running estimates a training-mode batch norm moves: `mean`, `var` (C each, any float dtype)
/// and PyTorch's `momentum` (0.1 by default).
#[derive(Clone, Copy)]
pub struct Running<'a> {
    /// The running mean.
    pub mean: &'a Tensor,
    /// The running (unbiased) variance.
    pub var: &'a Tensor,
    /// The weight of this batch's statistics in the moved estimates.
    pub momentum: f64,
}

/// Training-mode batch normalisation of `x` (N, C, H, W) with this batch's statistics (their
/// dependence on `x` enters the gradient), `weight` and `bias` (C), followed by `act` in the same
/// op, on the CPU or (feature `cuda`) a CUDA device. With `running`, also the moved running
/// estimates (`old·(1 − momentum) + new·momentum`, the variance unbiased), in their dtype, for the
/// caller to store: on the device they are computed there (no host synchronisation).
pub fn batch_norm_train(
    x: &Tensor,
    (weight, bias): (&Tensor, &Tensor),
    eps: f64,
    act: Activation,
    running: Option<Running<'_>>,
) -> Result<(Tensor, Option<(Tensor, Tensor)>)> {
    #[cfg(feature = "cuda")]
    if x.device().is_cuda() {
        let x = x.contiguous()?;
        let old = running.map(|r| (r.mean, r.var, r.momentum));
        let (stats, moved) = crate::native::cuda::batch_norm::batch_stats(&x, eps, old)?;
        let op = BatchNorm { stats: ChannelStats::Device(stats), batch: true, act };
        let y = super::apply3(&x, &weight.contiguous()?, &bias.contiguous()?, op)?;
        return Ok((y, moved));
    }
    let (mean, var) = batch_stats(x)?;
    let moved = match running {
        None => None,
        Some(r) => {
            let (n, _, h, w) = x.dims4()?;
            let count = (n * h * w) as f64;
            let unbiased = count / (count - 1.0).max(1.0);
            let blend = |old: &Tensor, new: &[f64], factor: f64| -> Result<Tensor> {
                let old: Vec<f64> = old.to_dtype(candle_core::DType::F64)?.flatten_all()?.to_vec1()?;
                if old.len() != new.len() {
                    return Err(err(format!("batch norm: {} channels, running estimates of {}", new.len(), old.len())));
                }
                let moved: Vec<f64> =
                    old.iter().zip(new).map(|(o, v)| o * (1.0 - r.momentum) + v * factor * r.momentum).collect();
                Tensor::from_vec(moved, new.len(), r.mean.device())?.to_dtype(r.mean.dtype())
            };
            Some((blend(r.mean, &mean, 1.0)?, blend(r.var, &var, unbiased)?))
        }
    };
    Ok((batch_norm(x, &mean, &var, weight, bias, eps, true, act)?, moved))
}

/// Batch normalisation of `x` (N, C, H, W) with given estimates `mean` and `var` (C each: the
/// running estimates in eval mode), `weight` and `bias`, followed by `act` in the same op, on the
/// CPU or (feature `cuda`) a CUDA device.
pub fn batch_norm_given(
    x: &Tensor,
    (mean, var): (&Tensor, &Tensor),
    (weight, bias): (&Tensor, &Tensor),
    eps: f64,
    act: Activation,
) -> Result<Tensor> {
    #[cfg(feature = "cuda")]
    if x.device().is_cuda() {
        let stats = crate::native::cuda::batch_norm::given_stats(mean, var, eps)?;
        let op = BatchNorm { stats: ChannelStats::Device(stats), batch: false, act };
        return super::apply3(&x.contiguous()?, &weight.contiguous()?, &bias.contiguous()?, op);
    }
    let vec = |t: &Tensor| -> Result<Vec<f64>> { t.to_dtype(candle_core::DType::F64)?.flatten_all()?.to_vec1() };
    batch_norm(x, &vec(mean)?, &vec(var)?, weight, bias, eps, false, act)
}
