//! Rotary position embeddings with a closed-form backward pass (the rotation by the inverse
//! angles), each element computed in f32 (f64 for f64) and rounded once.

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp1, Layout, Result, Shape, Tensor};

use super::elem::{by_elem, elem_tensor, elems, with_elems, Elem};
use super::{par_ranges, Real, SharedMut};

fn err(msg: String) -> candle_core::Error {
    candle_core::Error::Msg(msg)
}

/// Rotary embedding of (…, seq, head_dim) with tables (seq, head_dim/2), rotating pairs
/// (i, i + head_dim/2); or, `packed` with H heads, of the q and k of a (B, S, 3·H·D) fused
/// projection (q, k and v side by side, heads side by side in each), v passed through.
struct Rope {
    cos: Vec<f64>,
    sin: Vec<f64>,
    /// Values in each table.
    table_len: usize,
    packed: Option<usize>,
    /// The CUDA body's tables, on the device (the host's are then empty).
    #[cfg(feature = "cuda")]
    device: Option<crate::native::cuda::rope::Tables>,
}

impl Rope {
    /// (head_dim, positions, row width, rotated heads per row) of an input of `shape`.
    fn geometry(&self, shape: &Shape) -> Result<(usize, usize, usize, usize)> {
        let dims = shape.dims();
        let (d, seq, width, rotated) = match (self.packed, dims) {
            (Some(h), &[_, s, e]) if h > 0 && e % (3 * h) == 0 => (e / (3 * h), s, e, 2 * h),
            (None, [.., s, d]) => (*d, *s, *d, 1),
            _ => return Err(err(format!("rope: input {shape:?}"))),
        };
        if d % 2 != 0 || self.table_len != seq * (d / 2) {
            return Err(err(format!("rope: input {shape:?} does not fit tables of {} values", self.table_len)));
        }
        Ok((d, seq, width, rotated))
    }

    /// Rotates `x` (stored as `E`) by the tables (`sign` −1: by their inverse, the backward
    /// pass), each element rounded once.
    fn rotate<T: Real, E: Elem<T>>(&self, x: &[E], shape: &Shape, sign: f64) -> Result<Vec<E>> {
        let (d, seq, width, rotated) = self.geometry(shape)?;
        let half = d / 2;
        let mut y = x.to_vec();
        let out = SharedMut::new(&mut y);
        let (cos, sin): (Vec<T>, Vec<T>) =
            self.cos.iter().zip(&self.sin).map(|(c, s)| (T::of(*c), T::of(sign * s))).unzip();
        par_ranges(x.len() / width.max(1), 64, |r| {
            // SAFETY: disjoint row ranges.
            let dst = unsafe { out.range(r.start * width, r.len() * width) };
            for (row, yr) in r.zip(dst.chunks_mut(width)) {
                let pos = row % seq;
                let (c, s) = (&cos[pos * half..][..half], &sin[pos * half..][..half]);
                // The first `rotated` heads of the row (v, if packed, stays as copied).
                for head in yr[..rotated * d].chunks_exact_mut(d) {
                    let (lo, hi) = head.split_at_mut(half);
                    for (((a, b), c), s) in lo.iter_mut().zip(hi.iter_mut()).zip(c).zip(s) {
                        let (x1, x2) = (a.load(), b.load());
                        *a = E::store(x1 * *c - x2 * *s);
                        *b = E::store(x1 * *s + x2 * *c);
                    }
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
    #[cfg(feature = "cuda")]
    fn cuda_fwd(&self, s: &candle_core::CudaStorage, l: &Layout) -> Result<(candle_core::CudaStorage, Shape)> {
        let tables = self.device.as_ref().ok_or_else(|| err("rope: no tables on the device".into()))?;
        Ok((crate::native::cuda::rope::rotate((s, l), tables, self.geometry(l.shape())?, 1.0)?, l.shape().clone()))
    }
    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let y = by_elem!(s.dtype(), T, E => self.rotate::<T, E>(elems::<T, E>(s, l)?, l.shape(), 1.0).map(E::into_storage))?;
        Ok((y, l.shape().clone()))
    }
    fn bwd(&self, x: &Tensor, _res: &Tensor, g: &Tensor) -> Result<Option<Tensor>> {
        #[cfg(feature = "cuda")]
        if let (Some(tables), true) = (&self.device, x.device().is_cuda()) {
            return crate::native::cuda::rope::rotate_tensor(g, tables, self.geometry(x.shape())?, -1.0).map(Some);
        }
        let dx = by_elem!(x.dtype(), T, E => with_elems::<T, E, _>(g, |g| self.rotate::<T, E>(g, x.shape(), -1.0))
            .and_then(|d| elem_tensor::<T, E>(d, x.shape())))?;
        Ok(Some(dx))
    }
}

impl Rope {
    /// The op for `input` with tables `cos` and `sin`: kept on the host in f64 for a CPU input, on
    /// the device in the compute type for a CUDA one.
    fn new(cos: &Tensor, sin: &Tensor, packed: Option<usize>, input: &Tensor) -> Result<Self> {
        if cos.elem_count() != sin.elem_count() {
            return Err(err(format!("rope: tables of {} and {} values", cos.elem_count(), sin.elem_count())));
        }
        let table_len = cos.elem_count();
        #[cfg(feature = "cuda")]
        if input.device().is_cuda() {
            let device = Some(crate::native::cuda::rope::Tables::new(cos, sin, input)?);
            return Ok(Rope { cos: Vec::new(), sin: Vec::new(), table_len, packed, device });
        }
        let _ = input;
        let table = |t: &Tensor| -> Result<Vec<f64>> { t.to_dtype(candle_core::DType::F64)?.flatten_all()?.to_vec1() };
        Ok(Rope {
            cos: table(cos)?,
            sin: table(sin)?,
            table_len,
            packed,
            #[cfg(feature = "cuda")]
            device: None,
        })
    }
}

/// Rotary position embedding on the CPU or (feature `cuda`) a CUDA device (see
/// [`crate::ops::rope`]).
pub fn rope(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    super::apply1(&x.contiguous()?, Rope::new(cos, sin, None, x)?)
}

/// Rotary position embedding of the q and k in a packed (B, S, 3·H·D) projection on the CPU or
/// (feature `cuda`) a CUDA device (see [`crate::ops::rope_packed`]).
pub fn rope_packed(qkv: &Tensor, heads: usize, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    super::apply1(&qkv.contiguous()?, Rope::new(cos, sin, Some(heads), qkv)?)
}
