//! The CUDA bodies of layer norm and RMS norm (`kernels/src/cuda/nn_norm.cu`): forward in one
//! launch, keeping each row's (mean, inverse deviation) in f64 on the device as the host op keeps
//! them on the host; backward in three (the input gradient, per-chunk partial sums of the weight
//! and bias gradients, their sum in chunk order: the same bits on every run).

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{CudaSlice, LaunchConfig, PushKernelArg};
use candle_core::cuda_backend::CudaStorage;
use candle_core::{DType, Layout, Result, Shape, Tensor, WithDType};

use super::{
    by_cuda_elem, compute, elementwise, err, function, in_dtype, output, per_row, row_chunks, suffix, tensor, view,
    with_cuda, THREADS,
};

const MODULE: &str = "nn_norm";

/// Layer norm (with `b`; RMS norm with `rms`) over the last dimension: the output and the
/// per-row statistics (mean, inverse deviation), 2 × rows f64 on the device.
pub(crate) fn forward(
    (sx, lx): (&CudaStorage, &Layout),
    (sw, lw): (&CudaStorage, &Layout),
    b: Option<(&CudaStorage, &Layout)>,
    rms: bool,
    eps: f64,
) -> Result<(CudaStorage, Shape, CudaSlice<f64>)> {
    let dev = sx.device();
    let d = lx.shape().dims().last().copied().unwrap_or(1).max(1);
    let c = compute(sx.dtype());
    let (w_conv, lw) = in_dtype(sw, lw, c)?;
    let sw = w_conv.as_ref().unwrap_or(sw);
    let b_conv = b.map(|(sb, lb)| in_dtype(sb, lb, c)).transpose()?;
    if lw.shape().elem_count() != d || b_conv.as_ref().is_some_and(|(_, lb)| lb.shape().elem_count() != d) {
        return Err(err(format!("norm: rows of {d}, {} weights", lw.shape().elem_count())));
    }
    let rms_flag = i32::from(rms);
    let (y, stats) = by_cuda_elem!(sx.dtype(), E => {
        let x = view::<E>(sx, lx)?;
        let rows = x.len() / d;
        let f = function(dev, MODULE, &format!("wick_row_norm_{}", suffix(E::DTYPE)?))?;
        let mut y = output::<E>(dev, x.len())?;
        let mut stats = output::<f64>(dev, 2 * rows)?;
        let (r, dd) = (rows as i64, d as i64);
        let stream = dev.cuda_stream();
        // The weights (and bias) in the compute type, f32 or f64; a null bias for RMS norm.
        macro_rules! launch_with {
            ($t:ty) => {{
                let w = view::<$t>(sw, &lw)?;
                let bias = match &b_conv {
                    Some((conv, lb)) => {
                        let sb = conv.as_ref().or(b.map(|(s, _)| s)).ok_or_else(|| err("norm: no bias"))?;
                        Some(view::<$t>(sb, lb)?)
                    }
                    None => None,
                };
                let null = 0u64;
                let mut launch = stream.launch_builder(&f);
                launch.arg(&x).arg(&w);
                match &bias {
                    Some(bv) => launch.arg(bv),
                    None => launch.arg(&null),
                };
                launch.arg(&mut y).arg(&mut stats).arg(&r).arg(&dd).arg(&rms_flag).arg(&eps);
                // SAFETY: (x: rows × d of E; w, b: d of the compute type, or a null bias; y: rows × d
                // of E; stats: 2 × rows f64; rows, d as 64-bit; rms as int; eps as double), the
                // kernel's parameters in order.
                unsafe { launch.launch(per_row(rows)) }.map_err(|e| err(format!("norm: {e}")))?;
            }};
        }
        if c == DType::F64 {
            launch_with!(f64)
        } else {
            launch_with!(f32)
        }
        Ok((CudaStorage::wrap_cuda_slice(y, dev.clone()), stats))
    })?;
    Ok((y, lx.shape().clone(), stats))
}

/// The gradients (dx, dweight, dbias) of a row norm from its input `x`, weights `w`, output
/// gradient `g` and forward's statistics; dweight and dbias in the compute type (f32 or f64),
/// one-dimensional of length d.
pub(crate) fn backward(
    x: &Tensor,
    w: &Tensor,
    g: &Tensor,
    stats: &CudaSlice<f64>,
    rms: bool,
) -> Result<(Tensor, Tensor, Tensor)> {
    let d = x.dims().last().copied().unwrap_or(1).max(1);
    let c = compute(x.dtype());
    let w = w.to_dtype(c)?;
    if g.shape() != x.shape() || g.dtype() != x.dtype() {
        return Err(err(format!("norm backward: gradient {:?} for input {:?}", g.shape(), x.shape())));
    }
    let rows = x.elem_count() / d;
    if stats.len() != 2 * rows {
        return Err(err(format!("norm backward: {} rows kept, {rows} now", stats.len() / 2)));
    }
    with_cuda("norm backward", &[x, g, &w], |p| {
        let [(sx, lx), (sg, lg), (sw, lw)] = [p[0], p[1], p[2]];
        let dev = sx.device();
        let stream = dev.cuda_stream();
        let (chunk, chunks) = row_chunks(rows);
        let (r, dd, ch, nch, rms_flag) = (rows as i64, d as i64, chunk as i64, chunks as i64, i32::from(rms));
        let dx = by_cuda_elem!(x.dtype(), E => {
            let (xv, gv) = (view::<E>(sx, lx)?, view::<E>(sg, lg)?);
            let sfx = suffix(E::DTYPE)?;
            let mut dx = output::<E>(dev, xv.len())?;
            let mut partial = output::<f64>(dev, chunks * 2 * d)?;
            let f = function(dev, MODULE, &format!("wick_row_norm_input_grad_{sfx}"))?;
            macro_rules! input_grad {
                ($t:ty) => {{
                    let wv = view::<$t>(sw, lw)?;
                    let mut launch = stream.launch_builder(&f);
                    launch.arg(&xv).arg(&wv).arg(&gv).arg(stats).arg(&mut dx).arg(&r).arg(&dd).arg(&rms_flag);
                    // SAFETY: (x: rows × d of E; w: d of the compute type; g: rows × d of E; stats:
                    // 2 × rows f64; dx: rows × d of E; rows, d; rms), the kernel's parameters in order.
                    unsafe { launch.launch(per_row(rows)) }.map_err(|e| err(format!("norm backward: {e}")))?;
                }};
            }
            if c == DType::F64 {
                input_grad!(f64)
            } else {
                input_grad!(f32)
            }
            let f = function(dev, MODULE, &format!("wick_row_norm_weight_partials_{sfx}"))?;
            let mut launch = stream.launch_builder(&f);
            launch.arg(&xv).arg(&gv).arg(stats).arg(&mut partial).arg(&r).arg(&dd).arg(&ch);
            let grid = LaunchConfig {
                grid_dim: (d.div_ceil(THREADS as usize) as u32, chunks as u32, 1),
                block_dim: (THREADS, 1, 1),
                shared_mem_bytes: 0,
            };
            // SAFETY: (x, g: rows × d of E; stats: 2 × rows f64; partial: chunks × 2d f64; rows, d,
            // chunk), the kernel's parameters in order; the grid covers d columns and `chunks` chunks.
            unsafe { launch.launch(grid) }.map_err(|e| err(format!("norm backward: {e}")))?;
            Ok((tensor(dx, dev, x.shape()), partial))
        })?;
        let (dx, partial) = dx;
        let sums = |suffix: &str| function(dev, MODULE, &format!("wick_row_norm_weight_sums_{suffix}"));
        macro_rules! weight_sums {
            ($t:ty, $sfx:literal) => {{
                let (mut dw, mut db) = (output::<$t>(dev, d)?, output::<$t>(dev, d)?);
                let f = sums($sfx)?;
                let mut launch = stream.launch_builder(&f);
                launch.arg(&partial).arg(&mut dw).arg(&mut db).arg(&nch).arg(&dd);
                // SAFETY: (partial: chunks × 2d f64; dw, db: d of the compute type; chunks, d).
                unsafe { launch.launch(elementwise(2 * d)) }.map_err(|e| err(format!("norm backward: {e}")))?;
                (tensor(dw, dev, d), tensor(db, dev, d))
            }};
        }
        let (dw, db) = if c == DType::F64 { weight_sums!(f64, "f64") } else { weight_sums!(f32, "f32") };
        Ok((dx, dw, db))
    })
}

/// What forward keeps on the device: (mean, inverse deviation) per row, f64.
pub(crate) type Stats = CudaSlice<f64>;
