//! The CUDA body of batch norm (`kernels/src/cuda/nn_batch_norm.cu`), with its fused ReLU or
//! ReLU6: each channel's statistics summed in f64 on the device (partial sums per segment of a
//! channel, added in segment order: the same bits on every run), the running estimates moved on
//! the device (no host synchronisation anywhere in a step), (mean, inverse deviation) kept per
//! channel for backward as the host op keeps them on the host.
//!
//! Launches: this batch's statistics and running estimates 3, given estimates 1; forward 2 (the
//! per-channel affine, then one element-wise pass); backward 3 (per-segment sums, the per-channel
//! gradients and input-gradient coefficients, one element-wise pass).

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{CudaSlice, CudaView, LaunchConfig, PushKernelArg};
use candle_core::cuda_backend::{CudaDevice, CudaStorage};
use candle_core::{DType, Layout, Result, Shape, Tensor, WithDType};

use super::super::norm::nchw;
use super::{
    by_cuda_elem, compute, elementwise, err, function, in_dtype, output, suffix, tensor, view, with_cuda, THREADS,
};

const MODULE: &str = "nn_batch_norm";

/// What forward keeps on the device: [mean C | inverse deviation C], f64.
pub(crate) type Stats = CudaSlice<f64>;

/// (elements a segment, segments a channel) for a channel of `count` elements: at least 8 192
/// elements a segment (32 a thread of a block), at most 256 segments.
fn segments(count: usize) -> (usize, usize) {
    let seg = count.div_ceil(256).max(8192);
    (seg, count.div_ceil(seg).max(1))
}

/// The reductions' grid: a block per (segment, channel), channels looped beyond 65 535.
fn reduction(segs: usize, c: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (segs as u32, c.clamp(1, 65_535) as u32, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// This batch's per-channel statistics of `x` (N, C, H, W) with `eps`; with `running` = (mean,
/// variance, momentum), the running estimates moved (the variance unbiased) as new tensors of
/// their dtype.
pub(crate) fn batch_stats(
    x: &Tensor,
    eps: f64,
    running: Option<(&Tensor, &Tensor, f64)>,
) -> Result<(Stats, Option<(Tensor, Tensor)>)> {
    let (n, c, hw) = nchw(x.shape())?;
    let count = n * hw;
    let (seg, segs) = segments(count);
    let (dev, sums, squares) = with_cuda("batch norm", &[x], |p| {
        let (sx, lx) = p[0];
        let dev = sx.device();
        let stream = dev.cuda_stream();
        let a = [n, c, hw, seg, segs].map(|v| v as i64);
        by_cuda_elem!(sx.dtype(), E => {
            let xv = view::<E>(sx, lx)?;
            let sfx = suffix(E::DTYPE)?;
            let mut s = output::<f64>(dev, c * segs)?;
            let mut q = output::<f64>(dev, c * segs)?;
            let f = function(dev, MODULE, &format!("wick_bn_sums_{sfx}"))?;
            let mut launch = stream.launch_builder(&f);
            launch.arg(&xv).arg(&mut s);
            a.iter().for_each(|v| {
                launch.arg(v);
            });
            // SAFETY: (x: n·c·hw of E; sums: c × segs f64; n, c, hw, seg, segs as 64-bit), the
            // kernel's parameters in order; segs·seg covers each channel's n·hw elements.
            unsafe { launch.launch(reduction(segs, c)) }.map_err(|e| err(format!("batch norm: {e}")))?;
            let f = function(dev, MODULE, &format!("wick_bn_squares_{sfx}"))?;
            let mut launch = stream.launch_builder(&f);
            launch.arg(&xv).arg(&s).arg(&mut q);
            a.iter().for_each(|v| {
                launch.arg(v);
            });
            // SAFETY: as above, with squares (c × segs f64) after the sums.
            unsafe { launch.launch(reduction(segs, c)) }.map_err(|e| err(format!("batch norm: {e}")))?;
            Ok((dev.clone(), s, q))
        })
    })?;
    finish(&dev, (&sums, &squares), (c, segs, count), eps, running)
}

/// The per-channel kernel that turns partial sums into statistics (and moves the running
/// estimates).
fn finish(
    dev: &CudaDevice,
    (sums, squares): (&CudaSlice<f64>, &CudaSlice<f64>),
    (c, segs, count): (usize, usize, usize),
    eps: f64,
    running: Option<(&Tensor, &Tensor, f64)>,
) -> Result<(Stats, Option<(Tensor, Tensor)>)> {
    let mut stats = output::<f64>(dev, 2 * c)?;
    let stream = dev.cuda_stream();
    let (cc, ss, cnt) = (c as i64, segs as i64, count as i64);
    let Some((old_mean, old_var, momentum)) = running else {
        let f = function(dev, MODULE, "wick_bn_finish_f32")?;
        let (null, update) = (0u64, 0i32);
        let mut launch = stream.launch_builder(&f);
        launch.arg(sums).arg(squares).arg(&cc).arg(&ss).arg(&cnt).arg(&eps).arg(&mut stats);
        launch.arg(&null).arg(&null).arg(&null).arg(&null).arg(&0.0f64).arg(&update);
        // SAFETY: (sums, squares: c × segs f64; c, segs, count; eps; stats: 2c f64; four null
        // estimate pointers, never read with update 0; momentum; update), in order.
        unsafe { launch.launch(elementwise(c)) }.map_err(|e| err(format!("batch norm: {e}")))?;
        return Ok((stats, None));
    };
    if old_mean.elem_count() != c || old_var.elem_count() != c {
        return Err(err(format!(
            "batch norm: {c} channels, running estimates of {} and {}",
            old_mean.elem_count(),
            old_var.elem_count()
        )));
    }
    let kept = old_mean.dtype();
    // The per-channel kernels take the estimates in the compute type (f64 stays, others f32).
    let r = compute(kept);
    let (m, v) = (old_mean.to_dtype(r)?, old_var.to_dtype(r)?);
    let moved = with_cuda("batch norm", &[&m, &v], |p| {
        let [(sm, lm), (sv, lv)] = [p[0], p[1]];
        macro_rules! launch_with {
            ($t:ty, $sfx:literal) => {{
                let (om, ov) = (view::<$t>(sm, lm)?, view::<$t>(sv, lv)?);
                let (mut nm, mut nv) = (output::<$t>(dev, c)?, output::<$t>(dev, c)?);
                let f = function(dev, MODULE, concat!("wick_bn_finish_", $sfx))?;
                let update = 1i32;
                let mut launch = stream.launch_builder(&f);
                launch.arg(sums).arg(squares).arg(&cc).arg(&ss).arg(&cnt).arg(&eps).arg(&mut stats);
                launch.arg(&om).arg(&ov).arg(&mut nm).arg(&mut nv).arg(&momentum).arg(&update);
                // SAFETY: (sums, squares: c × segs f64; c, segs, count; eps; stats: 2c f64; the old
                // and new estimates: c each of the estimates' type; momentum; update), in order.
                unsafe { launch.launch(elementwise(c)) }.map_err(|e| err(format!("batch norm: {e}")))?;
                (tensor(nm, dev, c), tensor(nv, dev, c))
            }};
        }
        Ok(if r == DType::F64 { launch_with!(f64, "f64") } else { launch_with!(f32, "f32") })
    })?;
    let (m, v) = moved;
    Ok((stats, Some((m.to_dtype(kept)?, v.to_dtype(kept)?))))
}

/// Per-channel statistics from given estimates (`mean`, `var`: C each), with `eps`.
pub(crate) fn given_stats(mean: &Tensor, var: &Tensor, eps: f64) -> Result<Stats> {
    let c = mean.elem_count();
    if var.elem_count() != c {
        return Err(err(format!("batch norm: {c} means, {} variances", var.elem_count())));
    }
    let r = compute(mean.dtype());
    let (m, v) = (mean.to_dtype(r)?, var.to_dtype(r)?);
    with_cuda("batch norm", &[&m, &v], |p| {
        let [(sm, lm), (sv, lv)] = [p[0], p[1]];
        let dev = sm.device();
        let mut stats = output::<f64>(dev, 2 * c)?;
        let cc = c as i64;
        macro_rules! launch_with {
            ($t:ty, $sfx:literal) => {{
                let (mv, vv) = (view::<$t>(sm, lm)?, view::<$t>(sv, lv)?);
                let f = function(dev, MODULE, concat!("wick_bn_given_", $sfx))?;
                let stream = dev.cuda_stream();
                let mut launch = stream.launch_builder(&f);
                launch.arg(&mv).arg(&vv).arg(&cc).arg(&eps).arg(&mut stats);
                // SAFETY: (mean, var: c of the estimates' type; c; eps; stats: 2c f64), in order.
                unsafe { launch.launch(elementwise(c)) }.map_err(|e| err(format!("batch norm: {e}")))?;
            }};
        }
        if r == DType::F64 {
            launch_with!(f64, "f64")
        } else {
            launch_with!(f32, "f32")
        }
        Ok(stats)
    })
}

/// The per-channel (scale, shift) in the compute type `$t` from weights and biases of that type.
macro_rules! affine {
    ($dev:expr, $w:expr, $b:expr, $stats:expr, $c:expr, $t:ty, $sfx:literal) => {{
        let (w, b): (CudaView<'_, $t>, CudaView<'_, $t>) = ($w, $b);
        let mut affine = output::<$t>($dev, 2 * $c)?;
        let f = function($dev, MODULE, concat!("wick_bn_affine_", $sfx))?;
        let cc = $c as i64;
        let stream = $dev.cuda_stream();
        let mut launch = stream.launch_builder(&f);
        launch.arg(&w).arg(&b).arg($stats).arg(&mut affine).arg(&cc);
        // SAFETY: (w, b: c of the compute type; stats: 2c f64; affine: 2c of the compute type; c).
        unsafe { launch.launch(elementwise($c)) }.map_err(|e| err(format!("batch norm: {e}")))?;
        affine
    }};
}

/// Batch norm's forward pass over `x` (N, C, H, W) with weights `w` and biases `b` (C each, any
/// float dtype: converted to the compute type), the statistics `stats` and activation `act`
/// (0 none, 1 ReLU, 2 ReLU6).
pub(crate) fn forward(
    (sx, lx): (&CudaStorage, &Layout),
    (sw, lw): (&CudaStorage, &Layout),
    (sb, lb): (&CudaStorage, &Layout),
    stats: &Stats,
    act: i32,
) -> Result<(CudaStorage, Shape)> {
    let (n, c, hw) = nchw(lx.shape())?;
    if lw.shape().elem_count() != c || lb.shape().elem_count() != c || stats.len() != 2 * c {
        return Err(err(format!(
            "batch norm: {c} channels, {} weights, {} biases, {} statistics",
            lw.shape().elem_count(),
            lb.shape().elem_count(),
            stats.len() / 2
        )));
    }
    let dev = sx.device();
    let t = compute(sx.dtype());
    let (w_conv, lw) = in_dtype(sw, lw, t)?;
    let (b_conv, lb) = in_dtype(sb, lb, t)?;
    let (sw, sb) = (w_conv.as_ref().unwrap_or(sw), b_conv.as_ref().unwrap_or(sb));
    let a = [n, c, hw].map(|v| v as i64);
    by_cuda_elem!(sx.dtype(), E => {
        let xv = view::<E>(sx, lx)?;
        let mut y = output::<E>(dev, xv.len())?;
        let f = function(dev, MODULE, &format!("wick_bn_forward_{}", suffix(E::DTYPE)?))?;
        let stream = dev.cuda_stream();
        macro_rules! launch_with {
            ($t:ty, $sfx:literal) => {{
                let affine = affine!(dev, view::<$t>(sw, &lw)?, view::<$t>(sb, &lb)?, stats, c, $t, $sfx);
                let mut launch = stream.launch_builder(&f);
                launch.arg(&xv).arg(&affine).arg(&mut y).arg(&a[0]).arg(&a[1]).arg(&a[2]).arg(&act);
                // SAFETY: (x: n·c·hw of E; affine: 2c of the compute type; y: n·c·hw of E; n, c,
                // hw; act), the kernel's parameters in order.
                unsafe { launch.launch(elementwise(xv.len())) }.map_err(|e| err(format!("batch norm: {e}")))?;
            }};
        }
        if t == DType::F64 {
            launch_with!(f64, "f64")
        } else {
            launch_with!(f32, "f32")
        }
        Ok((CudaStorage::wrap_cuda_slice(y, dev.clone()), lx.shape().clone()))
    })
}

/// Batch norm's gradients (dx, dweight, dbias) from its input `x`, weights `w`, biases `b`, output
/// gradient `g` and forward's statistics; `batch` when they were this batch's own (their
/// dependence on `x` enters dx); `act` the activation's code and `(lower, upper)` the bounds its
/// gradient passes between (`native::norm::mask_bounds`). dweight and dbias in the compute type
/// (f32 or f64).
pub(crate) fn backward(
    x: &Tensor,
    (w, b): (&Tensor, &Tensor),
    g: &Tensor,
    stats: &Stats,
    (batch, act, (lower, upper)): (bool, i32, (f64, f64)),
) -> Result<(Tensor, Tensor, Tensor)> {
    let (n, c, hw) = nchw(x.shape())?;
    if g.shape() != x.shape() || g.dtype() != x.dtype() {
        return Err(err(format!("batch norm backward: gradient {:?} for input {:?}", g.shape(), x.shape())));
    }
    if w.elem_count() != c || b.elem_count() != c || stats.len() != 2 * c {
        return Err(err(format!("batch norm backward: {c} channels, {} statistics kept", stats.len() / 2)));
    }
    let t = compute(x.dtype());
    let (w, b) = (w.to_dtype(t)?, b.to_dtype(t)?);
    let count = n * hw;
    let (seg, segs) = segments(count);
    let (cc, ss, cnt, batch) = (c as i64, segs as i64, count as i64, i32::from(batch));
    let a = [n, c, hw, seg, segs].map(|v| v as i64);
    with_cuda("batch norm backward", &[x, g, &w, &b], |p| {
        let [(sx, lx), (sg, lg), (sw, lw), (sb, lb)] = [p[0], p[1], p[2], p[3]];
        let dev = sx.device();
        let stream = dev.cuda_stream();
        by_cuda_elem!(x.dtype(), E => {
            let (xv, gv) = (view::<E>(sx, lx)?, view::<E>(sg, lg)?);
            let sfx = suffix(E::DTYPE)?;
            let mut dx = output::<E>(dev, xv.len())?;
            let mut partial = output::<f64>(dev, 2 * c * segs)?;
            let sums = function(dev, MODULE, &format!("wick_bn_grad_sums_{sfx}"))?;
            let input = function(dev, MODULE, &format!("wick_bn_input_grad_{sfx}"))?;
            macro_rules! launch_with {
                ($t:ty, $tsfx:literal) => {{
                    let wv = view::<$t>(sw, lw)?;
                    let affine = affine!(dev, view::<$t>(sw, lw)?, view::<$t>(sb, lb)?, stats, c, $t, $tsfx);
                    let mut launch = stream.launch_builder(&sums);
                    launch.arg(&xv).arg(&gv).arg(&affine).arg(stats).arg(&mut partial);
                    a.iter().for_each(|v| {
                        launch.arg(v);
                    });
                    let (lo, hi) = (lower as $t, upper as $t);
                    launch.arg(&act).arg(&lo).arg(&hi);
                    // SAFETY: (x, g: n·c·hw of E; affine: 2c of the compute type; stats: 2c f64;
                    // partial: 2c × segs f64; n, c, hw, seg, segs; act; the bounds in the compute
                    // type), in order.
                    unsafe { launch.launch(reduction(segs, c)) }.map_err(|e| err(format!("batch norm backward: {e}")))?;
                    let (mut dw, mut db, mut coef) = (output::<$t>(dev, c)?, output::<$t>(dev, c)?, output::<$t>(dev, 4 * c)?);
                    let f = function(dev, MODULE, concat!("wick_bn_grad_finish_", $tsfx))?;
                    let mut launch = stream.launch_builder(&f);
                    launch.arg(&partial).arg(stats).arg(&wv).arg(&cc).arg(&ss).arg(&cnt).arg(&batch);
                    launch.arg(&mut dw).arg(&mut db).arg(&mut coef);
                    // SAFETY: (partial: 2c × segs f64; stats: 2c f64; w: c; c, segs, count; batch;
                    // dw, db: c; coef: 4c, all of the compute type), in order.
                    unsafe { launch.launch(elementwise(c)) }.map_err(|e| err(format!("batch norm backward: {e}")))?;
                    let mut launch = stream.launch_builder(&input);
                    launch.arg(&xv).arg(&gv).arg(&affine).arg(&coef).arg(&mut dx);
                    launch.arg(&a[0]).arg(&a[1]).arg(&a[2]).arg(&act).arg(&lo).arg(&hi);
                    // SAFETY: (x, g: n·c·hw of E; affine: 2c, coef: 4c of the compute type; dx:
                    // n·c·hw of E; n, c, hw; act; the bounds in the compute type), in order.
                    unsafe { launch.launch(elementwise(xv.len())) }
                        .map_err(|e| err(format!("batch norm backward: {e}")))?;
                    (tensor(dw, dev, c), tensor(db, dev, c))
                }};
            }
            let (dw, db) = if t == DType::F64 { launch_with!(f64, "f64") } else { launch_with!(f32, "f32") };
            Ok((tensor(dx, dev, x.shape()), dw, db))
        })
    })
}
