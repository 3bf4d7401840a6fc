//! Storage element types that element-wise kernels read and write in place of converted copies.
//!
//! A kernel computes in its [`Real`](super::Real) type (f32 for f32, bf16 and f16 tensors; f64 for f64). The
//! general path ([`super::read`], [`super::with`]) widens a low-precision input into a fresh f32
//! buffer and rounds the f32 result into another: for a memory-bound op (an activation, a
//! residual add) those two passes cost more than the op, and made AMP's element-wise ops
//! slower than the same ops in f32 (ResNet-50's `add_relu`; BENCHMARKS.md, "Kernel design
//! measurements"). An [`Elem`] is read and
//! written where the kernel's loop uses it — a bf16 element is widened by a shift and rounded by
//! `round_bf16` inside the vectorised loop — so a bf16 op moves half the bytes of an f32 one.
//! The results are the same values the widen-compute-round path gives: the widening is exact and
//! the rounding is the same single rounding.

use candle_core::backend::BackendStorage;
use candle_core::op::BackpropOp;
use candle_core::{CpuStorage, Layout, Result, Shape, Storage, Tensor};
use half::{bf16, f16};

use super::round_bf16;

/// A tensor element type stored as `Self` and computed on as `T` (sealed: its module is
/// private, so only the impls below exist).
pub trait Elem<T>: Copy + Send + Sync + 'static {
    /// The element in the compute type (exact).
    fn load(self) -> T;
    /// `v` rounded to the storage type (once, to nearest even).
    fn store(v: T) -> Self;
    /// The storage's elements when it holds this type.
    fn of_storage(s: &CpuStorage) -> Option<&[Self]>;
    /// `v` as storage.
    fn into_storage(v: Vec<Self>) -> CpuStorage;
    /// `v` itself when this is the compute type (no conversion needed).
    fn compute_slice(v: &[Self]) -> Option<&[T]>;
    /// `v` itself, writable, when this is the compute type.
    fn compute_slice_mut(v: &mut [Self]) -> Option<&mut [T]>;
    /// `src` widened into `dst` (the same length).
    #[inline(always)]
    fn widen_into(src: &[Self], dst: &mut [T]) {
        dst.iter_mut().zip(src).for_each(|(d, s)| *d = s.load());
    }
}

impl Elem<f32> for f32 {
    #[inline(always)]
    fn load(self) -> f32 {
        self
    }
    #[inline(always)]
    fn store(v: f32) -> f32 {
        v
    }
    fn of_storage(s: &CpuStorage) -> Option<&[f32]> {
        if let CpuStorage::F32(v) = s {
            Some(v)
        } else {
            None
        }
    }
    fn into_storage(v: Vec<f32>) -> CpuStorage {
        CpuStorage::F32(v)
    }
    fn compute_slice(v: &[f32]) -> Option<&[f32]> {
        Some(v)
    }
    fn compute_slice_mut(v: &mut [f32]) -> Option<&mut [f32]> {
        Some(v)
    }
    #[inline(always)]
    fn widen_into(src: &[f32], dst: &mut [f32]) {
        dst.copy_from_slice(src)
    }
}

impl Elem<f64> for f64 {
    #[inline(always)]
    fn load(self) -> f64 {
        self
    }
    #[inline(always)]
    fn store(v: f64) -> f64 {
        v
    }
    fn of_storage(s: &CpuStorage) -> Option<&[f64]> {
        if let CpuStorage::F64(v) = s {
            Some(v)
        } else {
            None
        }
    }
    fn into_storage(v: Vec<f64>) -> CpuStorage {
        CpuStorage::F64(v)
    }
    fn compute_slice(v: &[f64]) -> Option<&[f64]> {
        Some(v)
    }
    fn compute_slice_mut(v: &mut [f64]) -> Option<&mut [f64]> {
        Some(v)
    }
    #[inline(always)]
    fn widen_into(src: &[f64], dst: &mut [f64]) {
        dst.copy_from_slice(src)
    }
}

impl Elem<f32> for bf16 {
    #[inline(always)]
    fn load(self) -> f32 {
        f32::from_bits((self.to_bits() as u32) << 16)
    }
    #[inline(always)]
    fn store(v: f32) -> bf16 {
        round_bf16(v)
    }
    fn of_storage(s: &CpuStorage) -> Option<&[bf16]> {
        if let CpuStorage::BF16(v) = s {
            Some(v)
        } else {
            None
        }
    }
    fn into_storage(v: Vec<bf16>) -> CpuStorage {
        CpuStorage::BF16(v)
    }
    fn compute_slice(_: &[bf16]) -> Option<&[f32]> {
        None
    }
    fn compute_slice_mut(_: &mut [bf16]) -> Option<&mut [f32]> {
        None
    }
}

impl Elem<f32> for f16 {
    #[inline(always)]
    fn load(self) -> f32 {
        self.to_f32()
    }
    #[inline(always)]
    fn store(v: f32) -> f16 {
        f16::from_f32(v)
    }
    fn of_storage(s: &CpuStorage) -> Option<&[f16]> {
        if let CpuStorage::F16(v) = s {
            Some(v)
        } else {
            None
        }
    }
    fn into_storage(v: Vec<f16>) -> CpuStorage {
        CpuStorage::F16(v)
    }
    fn compute_slice(_: &[f16]) -> Option<&[f32]> {
        None
    }
    fn compute_slice_mut(_: &mut [f16]) -> Option<&mut [f32]> {
        None
    }
}

/// The first `n` elements of `scratch`, grown with zeros when shorter.
#[inline(always)]
fn scratch_prefix<T: super::Real>(scratch: &mut Vec<T>, n: usize) -> &mut [T] {
    if scratch.len() < n {
        scratch.resize(n, T::zero());
    }
    &mut scratch[..n]
}

/// `src` in the compute type: itself when stored as `T`, else widened into `scratch` (grown as
/// needed) in one pass. Kernels that lay a plane out row by row (padded, split) copy its rows
/// from here: widening rows of 7–56 elements one at a time leaves most of them to scalar tails.
#[inline(always)]
pub(crate) fn widened<'a, T: super::Real, E: Elem<T>>(src: &'a [E], scratch: &'a mut Vec<T>) -> &'a [T] {
    if let Some(same) = E::compute_slice(src) {
        return same;
    }
    let dst = scratch_prefix(scratch, src.len());
    E::widen_into(src, dst);
    dst
}

/// Runs `f` on a plane of `T` that becomes `dst`: `dst` itself when stored as `T`, else
/// `scratch`, rounded into `dst` afterwards in one pass (for the reason [`widened`] gives).
#[inline(always)]
pub(crate) fn into_plane<T: super::Real, E: Elem<T>>(dst: &mut [E], scratch: &mut Vec<T>, f: impl FnOnce(&mut [T])) {
    if let Some(same) = E::compute_slice_mut(dst) {
        return f(same);
    }
    let plane = scratch_prefix(scratch, dst.len());
    f(plane);
    dst.iter_mut().zip(plane.iter()).for_each(|(d, v)| *d = E::store(*v));
}

/// Stores `dst.len() / width` rows of `width` values, row `r` read from `src[r * stride..]`,
/// into `dst` (contiguous rows), each rounded once ([`into_plane`]).
#[inline(always)]
pub(crate) fn store_rows<T: super::Real, E: Elem<T>>(
    dst: &mut [E],
    src: &[T],
    width: usize,
    stride: usize,
    scratch: &mut Vec<T>,
) {
    if width == 0 {
        return;
    }
    into_plane(dst, scratch, |rows| {
        for (r, row) in rows.chunks_mut(width).enumerate() {
            row.copy_from_slice(&src[r * stride..][..width]);
        }
    });
}

/// Runs `$body` with `$t` the compute type and `$e` the storage element type of `$dtype` (a
/// float dtype; any other is an error).
macro_rules! by_elem {
    ($dtype:expr, $t:ident, $e:ident => $body:expr) => {
        match $dtype {
            candle_core::DType::F64 => {
                type $t = f64;
                type $e = f64;
                $body
            }
            candle_core::DType::F32 => {
                type $t = f32;
                type $e = f32;
                $body
            }
            candle_core::DType::BF16 => {
                type $t = f32;
                type $e = half::bf16;
                $body
            }
            candle_core::DType::F16 => {
                type $t = f32;
                type $e = half::f16;
                $body
            }
            other => Err($crate::native::unsupported(other)),
        }
    };
}
pub(crate) use by_elem;

/// The elements of `s` under `layout` (contiguous), as stored.
pub fn elems<'a, T, E: Elem<T>>(s: &'a CpuStorage, layout: &Layout) -> Result<&'a [E]> {
    let (start, end) = layout
        .contiguous_offsets()
        .ok_or_else(|| candle_core::Error::Msg("wick kernels: input is not contiguous".into()))?;
    E::of_storage(s).and_then(|v| v.get(start..end)).ok_or_else(|| {
        candle_core::Error::Msg(format!("wick kernels: a {:?} input where its op's dtype was expected", s.dtype()))
    })
}

/// Runs `f` on the elements of a CPU tensor `t`, as stored.
pub(crate) fn with_elems<T, E: Elem<T>, R>(t: &Tensor, f: impl FnOnce(&[E]) -> Result<R>) -> Result<R> {
    let t = t.contiguous()?;
    let (storage, layout) = t.storage_and_layout();
    match &*storage {
        Storage::Cpu(s) => f(elems::<T, E>(s, layout)?),
        _ => Err(candle_core::Error::Msg("wick kernels: tensor is not on the CPU".into())),
    }
}

/// A CPU tensor holding `values` (shape `shape`), with no graph.
pub(crate) fn elem_tensor<T, E: Elem<T>>(values: Vec<E>, shape: &Shape) -> Result<Tensor> {
    if values.len() != shape.elem_count() {
        return Err(candle_core::Error::Msg(format!("wick kernels: {} values for shape {shape:?}", values.len())));
    }
    Ok(Tensor::from_storage(Storage::Cpu(E::into_storage(values)), shape.clone(), BackpropOp::none(), false))
}
