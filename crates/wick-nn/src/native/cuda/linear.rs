//! The CUDA body of the linear layer: `y = x·Wᵀ + b` as one cuBLAS product over every row, the
//! output's rows filled with the bias first and the product added onto them (beta = 1: the bias
//! enters the product's f32 sums and the output is rounded once, as the host body rounds it);
//! backward `dx = g·W` and `dW = gᵀ·x` as two more products and `db` as column sums of `g` in f64
//! per chunk of rows, added in chunk order (`kernels/src/cuda/nn_linear.cu`). Three products a
//! step and nothing recomputed, where the composed node recomputed the forward product in backward
//! and copied its output once more. The products are cuBLAS's `gemm` on candle's handle and
//! stream (f32 and f16/bf16 with f32 sums, f64; candle's switches for reduced precision honoured),
//! in the column-major shapes of `super::super::colmajor`.

use candle_core::backend::BackendStorage;
use std::ffi::c_void;

use candle_core::cuda_backend::cudarc::cublas::result;
use candle_core::cuda_backend::cudarc::cublas::sys::{cublasGemmAlgo_t, cublasOperation_t};
use candle_core::cuda_backend::cudarc::driver::{
    CudaSlice, CudaView, DevicePtr, DevicePtrMut, DeviceRepr, LaunchConfig, PushKernelArg,
};
use candle_core::cuda_backend::{CudaDevice, CudaStorage};
use candle_core::{DType, Layout, Result, Shape, Tensor, WithDType};

use super::super::colmajor;
use super::super::linear::{dims, out_shape};
use super::{
    by_cuda_elem, compute, elementwise, err, function, in_dtype, output, row_chunks, suffix, tensor, view, with_cuda,
    THREADS,
};

const MODULE: &str = "nn_linear";

fn int(v: usize) -> Result<i32> {
    i32::try_from(v).map_err(|_| err(format!("linear: size {v} exceeds cuBLAS's 32-bit sizes")))
}

/// `c = op(a)·op(b) (+ c when accumulate)` as cuBLAS's `gemm` in the shape `g` (`a` and `b` the
/// buffers `g.operands` names, in that order), summed in f32 for f32, f16 and bf16 (f64 for f64).
/// It follows candle's switches for its own products: TF32 for f32 only with
/// `candle_core::cuda::set_gemm_reduced_precision_f32(true)` (off by default, as PyTorch's
/// matmul), bf16's reduced-precision sums only with `set_gemm_reduced_precision_bf16(true)`.
fn gemm<E: WithDType + DeviceRepr>(
    dev: &CudaDevice,
    g: colmajor::Gemm,
    (a, b): (&CudaView<'_, E>, &CudaView<'_, E>),
    c: &mut CudaSlice<E>,
    accumulate: bool,
) -> Result<()> {
    use candle_core::cuda_backend::cudarc::cublas::sys::{cublasComputeType_t as Compute, cudaDataType_t as Data};
    let (data, compute) = match E::DTYPE {
        DType::F32 if candle_core::cuda::gemm_reduced_precision_f32() => {
            (Data::CUDA_R_32F, Compute::CUBLAS_COMPUTE_32F_FAST_TF32)
        }
        DType::F32 => (Data::CUDA_R_32F, Compute::CUBLAS_COMPUTE_32F),
        DType::F16 => (Data::CUDA_R_16F, Compute::CUBLAS_COMPUTE_32F),
        DType::BF16 if candle_core::cuda::gemm_reduced_precision_bf16() => {
            (Data::CUDA_R_16BF, Compute::CUBLAS_COMPUTE_32F_FAST_16BF)
        }
        DType::BF16 => (Data::CUDA_R_16BF, Compute::CUBLAS_COMPUTE_32F),
        DType::F64 => (Data::CUDA_R_64F, Compute::CUBLAS_COMPUTE_64F),
        other => return Err(err(format!("linear: no cuBLAS product of {other:?}"))),
    };
    // The elements a column-major (rows × cols) matrix with leading dimension `ld` spans.
    let span = |ld: usize, rows: usize, cols: usize| if rows == 0 || cols == 0 { 0 } else { ld * (cols - 1) + rows };
    let a_need = if g.transa { span(g.lda, g.k, g.m) } else { span(g.lda, g.m, g.k) };
    let b_need = if g.transb { span(g.ldb, g.n, g.k) } else { span(g.ldb, g.k, g.n) };
    if a.len() < a_need || b.len() < b_need || c.len() < span(g.ldc, g.m, g.n) {
        return Err(err(format!("linear: buffers of {}, {} and {} elements for {g:?}", a.len(), b.len(), c.len())));
    }
    let op = |t: bool| if t { cublasOperation_t::CUBLAS_OP_T } else { cublasOperation_t::CUBLAS_OP_N };
    // alpha and beta in the compute type's scalar: double for f64, float otherwise.
    let beta = if accumulate { 1.0 } else { 0.0 };
    let (one64, beta64, one32, beta32) = (1.0f64, beta, 1.0f32, beta as f32);
    let (alpha_ptr, beta_ptr): (*const c_void, *const c_void) = if E::DTYPE == DType::F64 {
        (&one64 as *const f64 as *const c_void, &beta64 as *const f64 as *const c_void)
    } else {
        (&one32 as *const f32 as *const c_void, &beta32 as *const f32 as *const c_void)
    };
    let blas = dev.cublas_handle();
    let stream = dev.cuda_stream();
    let ((ap, _ga), (bp, _gb)) = (a.device_ptr(&stream), b.device_ptr(&stream));
    let (cp, _gc) = c.device_ptr_mut(&stream);
    // SAFETY: A, B and C are device buffers of E on the handle's stream (candle's), each at least
    // the elements the call reads or writes (checked above); alpha and beta point to host scalars
    // of the compute type's kind that outlive the call.
    unsafe {
        result::gemm_ex(
            *blas.handle(),
            op(g.transa),
            op(g.transb),
            int(g.m)?,
            int(g.n)?,
            int(g.k)?,
            alpha_ptr,
            ap as *const c_void,
            data,
            int(g.lda)?,
            bp as *const c_void,
            data,
            int(g.ldb)?,
            beta_ptr,
            cp as *mut c_void,
            data,
            int(g.ldc)?,
            compute,
            cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
        )
    }
    .map_err(|e| err(format!("linear: cuBLAS: {e:?}")))
}

/// The linear layer's forward pass: x (…, in) times W (out, in) plus the bias (out), in x's dtype
/// (W and b converted to it when they differ).
pub(crate) fn forward(
    (sx, lx): (&CudaStorage, &Layout),
    (sw, lw): (&CudaStorage, &Layout),
    bias: Option<(&CudaStorage, &Layout)>,
) -> Result<(CudaStorage, Shape)> {
    let (m, k, n) = dims(lx.shape(), lw.shape())?;
    let dev = sx.device();
    let (w_conv, lw) = in_dtype(sw, lw, sx.dtype())?;
    let sw = w_conv.as_ref().unwrap_or(sw);
    let b_conv = bias.map(|(sb, lb)| in_dtype(sb, lb, sx.dtype())).transpose()?;
    let len = m.checked_mul(n).ok_or_else(|| err("linear: output size overflows"))?;
    by_cuda_elem!(sx.dtype(), E => {
        let (x, w) = (view::<E>(sx, lx)?, view::<E>(sw, &lw)?);
        let mut y = output::<E>(dev, len)?;
        let accumulate = match (bias, &b_conv) {
            (Some((sb, _)), Some((conv, lb))) => {
                let b = view::<E>(conv.as_ref().unwrap_or(sb), lb)?;
                if b.len() != n {
                    return Err(err(format!("linear: {} biases for {n} outputs", b.len())));
                }
                let f = function(dev, MODULE, &format!("wick_bias_rows_{}", suffix(E::DTYPE)?))?;
                let (rows, cols) = (m as i64, n as i64);
                let stream = dev.cuda_stream();
                let mut launch = stream.launch_builder(&f);
                launch.arg(&b).arg(&mut y).arg(&rows).arg(&cols);
                // SAFETY: (b: n of E; y: rows × n of E; rows, n), the kernel's parameters in order.
                unsafe { launch.launch(elementwise(len)) }.map_err(|e| err(format!("linear: {e}")))?;
                true
            }
            _ => false,
        };
        gemm(dev, colmajor::forward(m, k, n), (&w, &x), &mut y, accumulate)?;
        Ok((CudaStorage::wrap_cuda_slice(y, dev.clone()), out_shape(lx.shape(), n)))
    })
}

/// The gradients (dx when `want.0`, dW when `want.1`, db when `want.2` and there is a bias) from
/// x, W, the bias and the output gradient g, each in its input's dtype.
pub(crate) fn backward(
    x: &Tensor,
    w: &Tensor,
    b: Option<&Tensor>,
    g: &Tensor,
    want: (bool, bool, bool),
) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
    let (m, k, n) = dims(x.shape(), w.shape())?;
    if g.elem_count() != m * n {
        return Err(err(format!("linear backward: gradient {:?} for {m} rows of {n}", g.dims())));
    }
    let (wc, gc) = (w.to_dtype(x.dtype())?, g.to_dtype(x.dtype())?);
    let t = compute(x.dtype());
    let (dx, dw, db) = with_cuda("linear backward", &[x, &wc, &gc], |p| {
        let [(sx, lx), (sw, lw), (sg, lg)] = [p[0], p[1], p[2]];
        let dev = sx.device();
        by_cuda_elem!(x.dtype(), E => {
            let (xv, wv, gv) = (view::<E>(sx, lx)?, view::<E>(sw, lw)?, view::<E>(sg, lg)?);
            let dx = if want.0 {
                let mut dx = output::<E>(dev, m * k)?;
                gemm(dev, colmajor::input_grad(m, k, n), (&wv, &gv), &mut dx, false)?;
                Some(tensor(dx, dev, x.shape()))
            } else {
                None
            };
            let dw = if want.1 {
                let mut dw = output::<E>(dev, n * k)?;
                gemm(dev, colmajor::weight_grad(m, k, n), (&xv, &gv), &mut dw, false)?;
                Some(tensor(dw, dev, w.shape()))
            } else {
                None
            };
            let db = match (want.2, b) {
                (true, Some(_)) => Some(column_sums(dev, &gv, m, n, t)?),
                _ => None,
            };
            Ok((dx, dw, db))
        })
    })?;
    let dw = dw.map(|d| d.to_dtype(w.dtype())).transpose()?;
    let db = match (db, b) {
        (Some(d), Some(b)) => Some(d.to_dtype(b.dtype())?),
        _ => None,
    };
    Ok((dx, dw, db))
}

/// Σ over the rows of g (rows × n), in the compute type `t` (f32, or f64 for f64): f64 sums per
/// chunk of rows, the chunks added in order (the same bits on every run). The bias gradient here
/// and the broadcast embeddings' gradients (`super::loss::add_broadcast_grads`).
pub(crate) fn column_sums<E: WithDType + DeviceRepr>(
    dev: &CudaDevice,
    g: &CudaView<'_, E>,
    rows: usize,
    n: usize,
    t: DType,
) -> Result<Tensor> {
    let (chunk, chunks) = row_chunks(rows);
    let mut partial = output::<f64>(dev, chunks * n)?;
    let stream = dev.cuda_stream();
    let f = function(dev, MODULE, &format!("wick_column_partials_{}", suffix(E::DTYPE)?))?;
    let (r, nn, ch, nch) = (rows as i64, n as i64, chunk as i64, chunks as i64);
    let mut launch = stream.launch_builder(&f);
    launch.arg(g).arg(&mut partial).arg(&r).arg(&nn).arg(&ch);
    let grid = LaunchConfig {
        grid_dim: (n.div_ceil(THREADS as usize).max(1) as u32, chunks as u32, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    };
    // SAFETY: (g: rows × n of E; partial: chunks × n f64; rows, n, chunk), in order; the grid
    // covers n columns and `chunks` chunks.
    unsafe { launch.launch(grid) }.map_err(|e| err(format!("column sums: {e}")))?;
    macro_rules! finish {
        ($t:ty, $sfx:literal) => {{
            let mut db = output::<$t>(dev, n)?;
            let f = function(dev, MODULE, concat!("wick_column_finish_", $sfx))?;
            let mut launch = stream.launch_builder(&f);
            launch.arg(&partial).arg(&mut db).arg(&nch).arg(&nn);
            // SAFETY: (partial: chunks × n f64; db: n of the compute type; chunks, n), in order.
            unsafe { launch.launch(elementwise(n)) }.map_err(|e| err(format!("column sums: {e}")))?;
            tensor(db, dev, n)
        }};
    }
    Ok(if t == DType::F64 { finish!(f64, "f64") } else { finish!(f32, "f32") })
}
