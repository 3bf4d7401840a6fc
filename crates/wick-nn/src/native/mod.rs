//! wick's own ops ("native", as PyTorch's ATen calls its own): candle custom ops with closed-form
//! backward passes, each one graph node with a CPU body and — with the `cuda` feature — a CUDA
//! body (`cuda`), keeping the same tensors on both devices.
//!
//! wick-nn's differentiable building blocks ([`crate::ops`], [`crate::cnn`]) were first composed
//! from candle's primitive ops under candle's autograd, and then wrapped as single graph nodes
//! that recompute their forward pass during backward ([`crate::fused`]). That is correct and
//! lean in memory, but slow on the CPU: every op allocates, strided reductions run on one core,
//! every broadcast is differentiated, and backward recomputes each node with autograd on
//! (profiled on ResNet-18, batch norm and the convolutions were each tens of times PyTorch's:
//! BENCHMARKS.md, "Kernel design measurements"). Each op here is one candle custom op whose forward and backward are written out;
//! its CPU body runs over plain slices, parallel over independent rows, channels or images with rayon, with the
//! matrix products, the vectorised math and batch norm's sums from `wick_kernels::cpu` (the
//! products through the `gemm` crate, candle's own CPU matmul, with its AVX-512 kernels):
//!
//! - `conv`: dense convolution (direct kernels on the images in place for bf16 and f32 where
//!   they apply, else im2col + gemm, a large image's columns in cache-sized chunks of output
//!   rows, small images' in groups; backward-input only when the input needs a gradient; 1×1
//!   stride-1 convolutions without im2col; for inference, convolution + batch norm + residual +
//!   activation in one pass over the output); `depthwise` convolution;
//! - `norm`: batch norm (statistics once, mean and inverse deviation kept per channel; fused
//!   with a following ReLU/ReLU6, whose input is then neither stored nor kept); `row_norm`:
//!   layer norm and RMS norm (per-row statistics kept);
//! - `pool`: max pooling (the first maximum of a window, as PyTorch) and global average pooling;
//! - `act`: ReLU/ReLU6 with PyTorch's gradient at the kinks, a residual `relu(a + b)`, GELU,
//!   SiLU·mul;
//! - `linear`: `x·Wᵀ + b` as one 2-D gemm over all rows (and, for inference, the products of
//!   separate weights into their columns of one output); `epilogue`: for inference, the
//!   product finished with GELU, a residual, or a residual and layer norm in one pass;
//! - `attention`: scaled dot-product attention that keeps q, k, v and one log-sum-exp per row
//!   (backward recomputes the scores; never an s×s tensor kept); `rope`: rotary embeddings;
//! - `loss`: cross-entropy and embedding lookups with f32 gradient sums;
//! - [`profile`]: per-op times (`WICK_PROFILE_OPS=1`).
//!
//! What each op keeps for backward is what the composed node kept (its inputs), plus per-row or
//! per-channel statistics where stated; the gradients are the composed versions' (each op's
//! tests check them against the composed form, kept as the oracle, and finite differences).
//!
//! Precision: f64 inputs compute in f64; f32, bf16 and f16 in f32 (low-precision inputs are
//! widened inside the op and its result rounded once, autocast's f32-class behaviour, and every
//! gradient sum is accumulated in f32). Linear layers and dense convolutions whose operands are
//! all bf16 multiply them as bf16 with f32 sums on CPUs with AVX512-BF16 (`gemm_bf16`, as
//! oneDNN's bf16 kernels do under PyTorch's CPU autocast). With the `cuda` feature every op above
//! has a CUDA body as well (`cuda`'s, used where [`serves_either`] says so): wick's CUDA C for the
//! element-wise, normalisation, attention, row and pooling ops; cuDNN for the convolutions
//! (opened at run time, [`serves_conv_on_device`]); cuBLAS for the linear layer's products, the
//! bias added inside the forward product's sums (`colmajor`: the row-major products as cuBLAS's
//! column-major calls).

/// Runs `$body` with `$t` the compute type of `$dtype`: f64 for f64 tensors, f32 for the others
/// (every op dispatches its generic forward and backward this way).
macro_rules! by_real {
    ($dtype:expr, $t:ident => $body:expr) => {
        if $crate::native::is_f64($dtype) {
            type $t = f64;
            $body
        } else {
            type $t = f32;
            $body
        }
    };
}

/// Defines a kernel function generic over `T: Real` (and optionally a storage type
/// `E: Elem<T>`) whose body — with every closure written in
/// it, `par_ranges` bodies included — is compiled three times: for AVX-512, for AVX2 + FMA, and
/// for the baseline, the widest the CPU has chosen at run time. Closures inherit the target
/// features of the function they are written in, not of the function they are inlined into:
/// a large `par_ranges` body handed to `math::vectorized` stays baseline SSE2 code, 4 lanes at
/// a time with scalar conversions (batch norm's backward ran far below its AVX-512 speed).
/// Parameters are `name: Type` (no patterns). Check what it makes of a loop: a loop the
/// compiler cannot vectorise may come out slower (batch norm's forward did, until its
/// per-element activation branch became a select). Figures: BENCHMARKS.md, "Kernel design
/// measurements".
macro_rules! wide_kernel {
    ($(#[$m:meta])* $vis:vis fn $name:ident<$t:ident $(, $e:ident)?>($($a:ident: $ty:ty),* $(,)?) $(-> $r:ty)? $body:block) => {
        $(#[$m])*
        #[allow(clippy::too_many_arguments)]
        $vis fn $name<$t: $crate::native::Real $(, $e: $crate::native::elem::Elem<$t>)?>($($a: $ty),*) $(-> $r)? {
            #[cfg(target_arch = "x86_64")]
            {
                #[target_feature(enable = "avx512f,avx2,fma")]
                #[allow(clippy::too_many_arguments)]
                fn v4<$t: $crate::native::Real $(, $e: $crate::native::elem::Elem<$t>)?>($($a: $ty),*) $(-> $r)? $body
                #[target_feature(enable = "avx2,fma")]
                #[allow(clippy::too_many_arguments)]
                fn v3<$t: $crate::native::Real $(, $e: $crate::native::elem::Elem<$t>)?>($($a: $ty),*) $(-> $r)? $body
                if wick_kernels::cpu::avx512() {
                    // SAFETY: the CPU has AVX-512F (and with it AVX2 and FMA).
                    return unsafe { v4::<$t $(, $e)?>($($a),*) };
                }
                if std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma") {
                    // SAFETY: the CPU has AVX2 and FMA.
                    return unsafe { v3::<$t $(, $e)?>($($a),*) };
                }
            }
            $body
        }
    };
}

pub(crate) mod act;
pub(crate) mod attention;
pub(crate) mod colmajor;
pub(crate) mod conv;
#[cfg(feature = "cuda")]
pub mod cuda;
pub(crate) mod depthwise;
pub mod elem;
pub(crate) mod epilogue;
mod gemm;
pub(crate) mod linear;
pub(crate) mod loss;
pub(crate) mod norm;
pub(crate) mod pool;
pub mod profile;
pub(crate) mod rope;
pub(crate) mod row_norm;

/// Allocates the matrix products' per-thread scratch before a memory measurement (the kernels'
/// [`wick_kernels::cpu::gemm::allocate_thread_scratch`]).
pub use wick_kernels::cpu::gemm::allocate_thread_scratch;

use std::borrow::Cow;

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, DType, Device, Layout, Result, Shape, Storage, Tensor};

use elem::Elem;

use crate::grad::grad_enabled;
pub(crate) use gemm::{gemm, gemm_bf16, product, Mat};
pub(crate) use wick_kernels::cpu::{lane_sums, math, par_ranges, round_bf16, SharedMut};

/// A compute type of the kernels: f32 (for f32, bf16 and f16 tensors) or f64.
pub trait Real:
    wick_kernels::cpu::gemm::Scalar
    + num_traits::Float
    + num_traits::FromPrimitive
    + std::iter::Sum
    + Send
    + Sync
    + Copy
    + Default
    + elem::Elem<Self>
    + 'static
{
    /// This type's elements of `s` (of any float dtype) between `start` and `start + len`,
    /// borrowed when `s` holds this type, converted otherwise.
    fn slice(s: &CpuStorage, start: usize, len: usize) -> Result<Cow<'_, [Self]>>;
    /// `values` as storage of `dtype` (rounded once when narrower).
    fn storage(values: Vec<Self>, dtype: DType) -> Result<CpuStorage>;
    /// `v` as f64 (for error messages and tests).
    fn wide(v: Self) -> f64;
    /// `v` as this type.
    fn of(v: f64) -> Self;
    /// `e^v` (vectorisable in f32: [`math::exp_f32`]).
    fn exp_(v: Self) -> Self;
    /// `e^v` for `v ≤ 0`, a softmax's arguments (in f32 [`math::exp_nonpositive_f32`], cheaper than
    /// [`Real::exp_`]; a positive `v` counts as 0 there).
    fn exp_nonpositive(v: Self) -> Self;
    /// The error function (vectorisable in f32: [`math::erf_f32`]).
    fn erf_(v: Self) -> Self;
    /// `v` itself when this is f32 (the kernels that take f32 slices only).
    fn as_f32(v: &[Self]) -> Option<&[f32]>;
    /// [`Real::as_f32`], writable.
    fn as_f32_mut(v: &mut [Self]) -> Option<&mut [f32]>;
}

fn range<T>(v: &[T], start: usize, len: usize) -> Result<&[T]> {
    v.get(start..start + len)
        .ok_or_else(|| candle_core::Error::Msg(format!("kernel input: {len} elements at {start} exceed the storage")))
}

/// Elements per parallel chunk of the dtype conversions.
const CONVERT_CHUNK: usize = 1 << 16;

/// `f` over `dst` and `src` (the same length) in chunks of [`CONVERT_CHUNK`], in parallel when
/// there is more than one (a single chunk runs here: waking a pool thread and waiting for it
/// cost more than converting a small tensor), each compiled for the CPU's widest vectors.
fn convert<S: Sync, D: Send>(dst: &mut [D], src: &[S], f: impl Fn(&mut [D], &[S]) + Send + Sync) {
    use rayon::prelude::*;
    if dst.len() <= CONVERT_CHUNK {
        math::vectorized(|| f(dst, src));
    } else {
        dst.par_chunks_mut(CONVERT_CHUNK)
            .zip(src.par_chunks(CONVERT_CHUNK))
            .for_each(|(o, i)| math::vectorized(|| f(o, i)));
    }
}

/// A low-precision storage's elements `start..start + len` widened to f32 ([`Elem::load`]:
/// exact), parallel and vectorised.
fn widen_elems<E: Elem<f32>>(v: &[E], start: usize, len: usize) -> Result<Vec<f32>> {
    let src = range(v, start, len)?;
    // Written, not zero-filled first: a reused heap block asked for zeroed is cleared by a pass
    // of its own.
    let mut out = Vec::<f32>::with_capacity(len);
    convert(&mut out.spare_capacity_mut()[..len], src, |o, i| {
        o.iter_mut().zip(i).for_each(|(d, e)| _ = d.write(e.load()))
    });
    // SAFETY: `convert` split the first `len` elements of the capacity into the same chunks as
    // `src` (also `len` long), and every element of every chunk was written above.
    unsafe { out.set_len(len) };
    Ok(out)
}

/// `src` rounded into `dst` (the same length; [`Elem::store`]), parallel and vectorised.
pub fn narrow_into<E: Elem<f32>>(src: &[f32], dst: &mut [E]) {
    convert(dst, src, |o, i| o.iter_mut().zip(i).for_each(|(d, x)| *d = E::store(*x)));
}

/// `v` rounded to a low-precision type ([`Elem::store`]), parallel and vectorised.
fn narrow_elems<E: Elem<f32>>(v: &[f32]) -> Vec<E> {
    let mut out = Vec::<E>::with_capacity(v.len());
    convert(&mut out.spare_capacity_mut()[..v.len()], v, |o, i| {
        o.iter_mut().zip(i).for_each(|(d, x)| _ = d.write(E::store(*x)))
    });
    // SAFETY: `convert` split the first `v.len()` elements of the capacity into the same chunks
    // as `v`, and every element of every chunk was written above.
    unsafe { out.set_len(v.len()) };
    out
}

impl Real for f32 {
    fn slice(s: &CpuStorage, start: usize, len: usize) -> Result<Cow<'_, [f32]>> {
        Ok(match s {
            CpuStorage::F32(v) => Cow::Borrowed(range(v, start, len)?),
            CpuStorage::BF16(v) => Cow::Owned(widen_elems(v, start, len)?),
            CpuStorage::F16(v) => Cow::Owned(widen_elems(v, start, len)?),
            CpuStorage::F64(v) => Cow::Owned(range(v, start, len)?.iter().map(|x| *x as f32).collect()),
            other => return Err(unsupported(other.dtype())),
        })
    }
    fn storage(values: Vec<f32>, dtype: DType) -> Result<CpuStorage> {
        Ok(match dtype {
            DType::F32 => CpuStorage::F32(values),
            DType::BF16 => CpuStorage::BF16(narrow_elems(&values)),
            DType::F16 => CpuStorage::F16(narrow_elems(&values)),
            DType::F64 => CpuStorage::F64(values.iter().map(|v| *v as f64).collect()),
            other => return Err(unsupported(other)),
        })
    }
    fn wide(v: f32) -> f64 {
        v as f64
    }
    fn of(v: f64) -> f32 {
        v as f32
    }
    #[inline(always)]
    fn exp_(v: f32) -> f32 {
        math::exp_f32(v)
    }
    #[inline(always)]
    fn exp_nonpositive(v: f32) -> f32 {
        math::exp_nonpositive_f32(v)
    }
    #[inline(always)]
    fn erf_(v: f32) -> f32 {
        math::erf_f32(v)
    }
    fn as_f32(v: &[f32]) -> Option<&[f32]> {
        Some(v)
    }
    fn as_f32_mut(v: &mut [f32]) -> Option<&mut [f32]> {
        Some(v)
    }
}

impl Real for f64 {
    fn slice(s: &CpuStorage, start: usize, len: usize) -> Result<Cow<'_, [f64]>> {
        Ok(match s {
            CpuStorage::F64(v) => Cow::Borrowed(range(v, start, len)?),
            CpuStorage::F32(v) => Cow::Owned(range(v, start, len)?.iter().map(|x| *x as f64).collect()),
            other => return Err(unsupported(other.dtype())),
        })
    }
    fn storage(values: Vec<f64>, dtype: DType) -> Result<CpuStorage> {
        match dtype {
            DType::F64 => Ok(CpuStorage::F64(values)),
            DType::F32 => Ok(CpuStorage::F32(values.iter().map(|v| *v as f32).collect())),
            other => Err(unsupported(other)),
        }
    }
    fn wide(v: f64) -> f64 {
        v
    }
    fn of(v: f64) -> f64 {
        v
    }
    fn exp_(v: f64) -> f64 {
        v.exp()
    }
    fn exp_nonpositive(v: f64) -> f64 {
        v.exp()
    }
    fn erf_(v: f64) -> f64 {
        candle_core::cpu::erf::erf_f64(v)
    }
    fn as_f32(_: &[f64]) -> Option<&[f32]> {
        None
    }
    fn as_f32_mut(_: &mut [f64]) -> Option<&mut [f32]> {
        None
    }
}

pub(crate) fn unsupported(dtype: DType) -> candle_core::Error {
    candle_core::Error::Msg(format!("wick kernels: dtype {dtype:?} is not a floating-point type they compute in"))
}

/// The compute type of a dtype: f64 for f64, f32 for the others.
pub fn is_f64(dtype: DType) -> bool {
    dtype == DType::F64
}

/// The contiguous elements of a storage under `layout` in compute type `T`.
pub fn read<'a, T: Real>(s: &'a CpuStorage, layout: &Layout) -> Result<Cow<'a, [T]>> {
    match layout.contiguous_offsets() {
        Some((start, end)) => T::slice(s, start, end - start),
        None => Err(candle_core::Error::Msg("wick kernels: input is not contiguous".into())),
    }
}

/// Runs `f` on the contiguous elements of a CPU tensor `t` in compute type `T`.
pub fn with<T: Real, R>(t: &Tensor, f: impl FnOnce(&[T]) -> Result<R>) -> Result<R> {
    let t = t.contiguous()?;
    let (storage, layout) = t.storage_and_layout();
    match &*storage {
        Storage::Cpu(s) => f(&read::<T>(s, layout)?),
        _ => Err(candle_core::Error::Msg("wick kernels: tensor is not on the CPU".into())),
    }
}

/// The input and weight gradients of a convolution-like op as tensors shaped like `x` and `w`:
/// the input's only when computed (`dx`), the weight's only when `w` needs one.
pub(crate) fn input_weight_grads<T: Real>(
    x: &Tensor,
    w: &Tensor,
    (dx, dw): (Option<Vec<T>>, Vec<T>),
) -> Result<(Option<Tensor>, Option<Tensor>)> {
    let dx = dx.map(|dx| tensor(dx, x.shape(), x.dtype())).transpose()?;
    Ok((dx, weight_grad(w, dw)?))
}

/// A weight gradient as a tensor shaped like `w` (rounded once to its dtype), only when `w`
/// needs one.
pub(crate) fn weight_grad<T: Real>(w: &Tensor, dw: Vec<T>) -> Result<Option<Tensor>> {
    w.track_op().then(|| tensor(dw, w.shape(), w.dtype())).transpose()
}

/// A CPU tensor of `dtype` holding `values` (shape `shape`), with no graph.
pub fn tensor<T: Real>(values: Vec<T>, shape: impl Into<Shape>, dtype: DType) -> Result<Tensor> {
    let shape = shape.into();
    if values.len() != shape.elem_count() {
        return Err(candle_core::Error::Msg(format!("wick kernels: {} values for shape {shape:?}", values.len())));
    }
    let storage = Storage::Cpu(T::storage(values, dtype)?);
    Ok(Tensor::from_storage(storage, shape, candle_core::op::BackpropOp::none(), false))
}

/// Asks the CPU allocation check (`wick_alloc_check`, as candle's own CPU buffers do) for an
/// output of `len` elements of `T` that an op allocates outside candle: a refusal is an error
/// instead of an abort when the host cannot give it.
pub(crate) fn ask_for_output<T>(len: usize) -> Result<()> {
    wick_alloc_check::check(len.checked_mul(std::mem::size_of::<T>())).map_err(candle_core::Error::Msg)
}

/// Applies a one-input op, recording it for backward unless inside [`no_grad`].
pub(crate) fn apply1<C: candle_core::CustomOp1 + Send + Sync + 'static>(x: &Tensor, op: C) -> Result<Tensor> {
    let op = profile::Profiled(op);
    if grad_enabled() {
        x.apply_op1(op)
    } else {
        x.apply_op1_no_bwd(&op)
    }
}

/// Applies a two-input op, recording it for backward unless inside [`no_grad`].
pub(crate) fn apply2<C: candle_core::CustomOp2 + Send + Sync + 'static>(
    a: &Tensor,
    b: &Tensor,
    op: C,
) -> Result<Tensor> {
    let op = profile::Profiled(op);
    if grad_enabled() {
        a.apply_op2(b, op)
    } else {
        a.apply_op2_no_bwd(b, &op)
    }
}

/// Applies a three-input op, recording it for backward unless inside [`no_grad`].
pub(crate) fn apply3<C: candle_core::CustomOp3 + Send + Sync + 'static>(
    a: &Tensor,
    b: &Tensor,
    c: &Tensor,
    op: C,
) -> Result<Tensor> {
    let op = profile::Profiled(op);
    if grad_enabled() {
        a.apply_op3(b, c, op)
    } else {
        a.apply_op3_no_bwd(b, c, &op)
    }
}

/// While set, every op takes its composed form ([`with_composed`]).
static COMPOSED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Runs `f` with wick's own ops switched off, process-wide: every building block takes its
/// composed form over candle's ops — what a device without wick's kernels runs — forward and
/// backward (a node's backward inside `f` recomputes through the composed forms too). For
/// comparisons and benchmarks (nn-gpu-check times each op beside its real fallback, and checks the
/// fallbacks against the ops on the CPU); the switch is restored when `f` returns or unwinds.
pub fn with_composed<R>(f: impl FnOnce() -> R) -> R {
    struct Restore(bool);
    impl Drop for Restore {
        fn drop(&mut self) {
            COMPOSED.store(self.0, std::sync::atomic::Ordering::Relaxed);
        }
    }
    let _restore = Restore(COMPOSED.swap(true, std::sync::atomic::Ordering::Relaxed));
    f()
}

/// True inside [`with_composed`].
pub(crate) fn composed_only() -> bool {
    COMPOSED.load(std::sync::atomic::Ordering::Relaxed)
}

/// True when the fast CPU kernels serve tensors like `t`: on the CPU, in a float dtype (and not
/// inside [`with_composed`]).
pub fn serves(t: &Tensor) -> bool {
    !composed_only()
        && matches!(t.device(), Device::Cpu)
        && matches!(t.dtype(), DType::F32 | DType::F64 | DType::BF16 | DType::F16)
}

/// True when an op with both bodies (the host's and, with the `cuda` feature, a CUDA one) serves
/// `t`: [`serves`], or on a CUDA device whose kernels this build compiled in.
pub fn serves_either(t: &Tensor) -> bool {
    #[cfg(feature = "cuda")]
    if crate::native::cuda::serves(t) {
        return true;
    }
    serves(t)
}

/// True when a convolution of `x` on a CUDA device runs as wick's op through cuDNN (feature
/// `cuda`, the kernels compiled in, and not `WICK_CUDNN=off`). A missing cuDNN is then the
/// convolution's `Err`, which says how to install it.
pub fn serves_conv_on_device(x: &Tensor) -> bool {
    #[cfg(feature = "cuda")]
    if crate::native::cuda::serves(x) {
        return crate::native::cuda::conv::uses_cudnn();
    }
    let _ = x;
    false
}

/// [`serves_either`] for attention of head dimension `head_dim`: the CUDA body takes head
/// dimensions up to 128 (`crate::native::cuda::attention::MAX_HEAD_DIM`).
pub fn serves_attention(t: &Tensor, head_dim: usize) -> bool {
    #[cfg(feature = "cuda")]
    if crate::native::cuda::serves(t) {
        return head_dim > 0 && head_dim <= crate::native::cuda::attention::MAX_HEAD_DIM;
    }
    let _ = head_dim;
    serves(t)
}

/// `Σ f(a[i], b[i])` in f64: [`lane_sums`] of one sum.
#[inline(always)]
fn lane_sum<T: Copy>(a: &[T], b: &[T], f: impl Fn(T, T) -> f64) -> f64 {
    let [sum] = lane_sums(a, b, |x, y| [f(x, y)]);
    sum
}

/// `Σ x` in f64.
#[inline(always)]
pub(crate) fn sum<T: Real, E: elem::Elem<T>>(x: &[E]) -> f64 {
    lane_sum(x, x, |v, _| T::wide(v.load()))
}

/// `Σ (x − m)²` in f64.
#[inline(always)]
pub(crate) fn sum_sq_dev<T: Real, E: elem::Elem<T>>(x: &[E], m: f64) -> f64 {
    lane_sum(x, x, |v, _| {
        let d = T::wide(v.load()) - m;
        d * d
    })
}

/// `Σ a·b` in f64 (over the common length of `a` and `b`).
#[inline(always)]
pub(crate) fn dot<T: Real>(a: &[T], b: &[T]) -> f64 {
    lane_sum(a, b, |x, y| T::wide(x) * T::wide(y))
}

#[cfg(test)]
mod tests;
