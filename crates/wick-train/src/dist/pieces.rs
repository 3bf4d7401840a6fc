//! A parameter's pieces as ZeRO stage 3 moves them: this rank's piece packed as bytes in the
//! parameter's dtype, where each parameter lies in a gather's bytes ([`GatherLayout`]), every
//! rank's pieces made back into a whole parameter (a fresh variable, or written into the model's
//! own tensor), values read as f32 where they lie, and a tensor's pages handed back to the
//! operating system.

use candle_core::{CpuStorage, DType, Device, InplaceOp1, Layout, Tensor, Var};

use super::error::DistError;
use super::flight::append_f32;

/// `values` rounded to `dtype` (kept in f32).
pub(in crate::dist) fn rounded(values: &mut [f32], dtype: DType) {
    match dtype {
        DType::BF16 => values.iter_mut().for_each(|v| *v = half::bf16::from_f32(*v).to_f32()),
        DType::F16 => values.iter_mut().for_each(|v| *v = half::f16::from_f32(*v).to_f32()),
        _ => {}
    }
}

/// Appends `values` in `dtype`, little-endian, then zeros up to `chunk` elements (one pass over
/// a buffer sized once: element-by-element appends ran at about 1 GB/s).
pub(super) fn push_bytes(values: &[f32], chunk: usize, dtype: DType, out: &mut Vec<u8>) -> Result<(), DistError> {
    let size = match dtype {
        DType::F32 => 4,
        DType::BF16 | DType::F16 => 2,
        d => return Err(DistError::unsupported("ZeRO-3", format!("a {d:?} parameter"))),
    };
    let at = out.len();
    out.resize(at + chunk.max(values.len()) * size, 0);
    let dst = &mut out[at..at + values.len() * size];
    match dtype {
        DType::F32 => dst.chunks_exact_mut(4).zip(values).for_each(|(d, v)| d.copy_from_slice(&v.to_le_bytes())),
        DType::BF16 => dst
            .chunks_exact_mut(2)
            .zip(values)
            .for_each(|(d, v)| d.copy_from_slice(&half::bf16::from_f32(*v).to_le_bytes())),
        _ => dst
            .chunks_exact_mut(2)
            .zip(values)
            .for_each(|(d, v)| d.copy_from_slice(&half::f16::from_f32(*v).to_le_bytes())),
    }
    Ok(())
}

/// A fresh variable of `dims`/`dtype` from the little-endian `pieces` laid end to end (every
/// rank's piece of a gather; no copy made to track it, none made to join the pieces).
pub(super) fn var_from_pieces<'a>(
    pieces: impl Iterator<Item = &'a [u8]> + Clone,
    dtype: DType,
    dims: &[usize],
) -> Result<Tensor, DistError> {
    let elems: usize = dims.iter().product();
    fn join<'a, T>(pieces: impl Iterator<Item = &'a [u8]>, n: usize, elems: usize, f: impl Fn(&[u8]) -> T) -> Vec<T> {
        let mut out = Vec::with_capacity(elems);
        for p in pieces {
            let room = elems - out.len();
            out.extend(p.chunks_exact(n).take(room).map(&f));
        }
        out
    }
    let var = match dtype {
        DType::F32 => {
            Var::from_vec(join(pieces, 4, elems, |b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])), dims, &Device::Cpu)?
        }
        DType::BF16 => {
            Var::from_vec(join(pieces, 2, elems, |b| half::bf16::from_le_bytes([b[0], b[1]])), dims, &Device::Cpu)?
        }
        DType::F16 => {
            Var::from_vec(join(pieces, 2, elems, |b| half::f16::from_le_bytes([b[0], b[1]])), dims, &Device::Cpu)?
        }
        d => return Err(DistError::unsupported("ZeRO-3", format!("a {d:?} parameter"))),
    };
    Ok(var.as_tensor().clone())
}

pub(super) fn vec_f32(t: &Tensor) -> Result<Vec<f32>, DistError> {
    let mut out = Vec::with_capacity(t.elem_count());
    append_f32(t, &mut out)?;
    Ok(out)
}

/// Runs `f` on `t`'s values as f32: read where they lie for a contiguous f32 host tensor (a
/// master, a gradient), widened into a copy otherwise.
pub(in crate::dist) fn with_f32<R>(t: &Tensor, f: impl FnOnce(&[f32]) -> R) -> Result<R, DistError> {
    if t.dtype() == DType::F32 {
        return super::group::with_slice::<f32, R>(t, f);
    }
    Ok(f(&vec_f32(t)?))
}

/// Writes every rank's piece of a parameter (little-endian, in the tensor's dtype, laid end
/// to end) into the tensor's storage.
pub(super) struct WritePieces<'a> {
    /// Every rank's piece, in rank order.
    pub(super) pieces: Vec<&'a [u8]>,
}

impl InplaceOp1 for WritePieces<'_> {
    fn name(&self) -> &'static str {
        "write-pieces"
    }

    fn cpu_fwd(&self, storage: &mut CpuStorage, layout: &Layout) -> candle_core::Result<()> {
        fn fill<T>(pieces: &[&[u8]], n: usize, dst: &mut [T], f: impl Fn(&[u8]) -> T) {
            let mut at = 0;
            for p in pieces {
                for (d, b) in dst[at..].iter_mut().zip(p.chunks_exact(n)) {
                    *d = f(b);
                }
                at = (at + p.len() / n).min(dst.len());
            }
        }
        let Some((a, b)) = layout.contiguous_offsets() else {
            return Err(candle_core::Error::Msg("ZeRO-3: a parameter that is not contiguous".into()));
        };
        // A kept block's gathered tensor, released after its forward pass, counts as live again
        // before it is written (for other tensors this changes nothing).
        wick_nn::pages::reclaim_storage(storage);
        let p = &self.pieces;
        match storage {
            CpuStorage::F32(v) => fill(p, 4, &mut v[a..b], |b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])),
            CpuStorage::BF16(v) => fill(p, 2, &mut v[a..b], |b| half::bf16::from_le_bytes([b[0], b[1]])),
            CpuStorage::F16(v) => fill(p, 2, &mut v[a..b], |b| half::f16::from_le_bytes([b[0], b[1]])),
            _ => return Err(candle_core::Error::Msg("ZeRO-3: a parameter that is not f32, bf16 or f16".into())),
        }
        Ok(())
    }
}

/// Where a gather's parameters lie in each rank's bytes.
pub(super) struct GatherLayout {
    /// The parameters.
    pub(super) which: Vec<usize>,
    /// Bytes each rank sends.
    pub(super) per_rank: usize,
    /// Each parameter's offset and length in a rank's bytes, its dtype and shape.
    pub(super) placed: Vec<(usize, usize, DType, Vec<usize>)>,
}

impl GatherLayout {
    /// Every rank's piece of parameter `k` in `recv` (the gather's bytes, `world` ranks laid end
    /// to end), in rank order.
    pub(super) fn pieces<'a>(
        &self,
        recv: &'a [u8],
        world: usize,
        k: usize,
    ) -> impl Iterator<Item = &'a [u8]> + Clone + use<'a> {
        let (per_rank, (at, bytes, ..)) = (self.per_rank, self.placed[k].clone());
        (0..world).map(move |r| &recv[r * per_rank + at..r * per_rank + at + bytes])
    }
}

/// Gradient clipping's coefficient and the norm for a sharded step (1 and none without
/// `max_norm`, which the trainer checked before the step): `squares` (this rank's share of the
/// gradients' squares) summed over the ranks, so that every rank takes the same coefficient
/// ([`crate::clip`]).
pub(in crate::dist) fn clip_over_ranks(
    group: &super::ProcessGroup,
    max_norm: Option<f64>,
    squares: impl FnOnce() -> Result<f64, DistError>,
) -> Result<(f32, Option<f64>), crate::TrainError> {
    let Some(max_norm) = max_norm else { return Ok((1.0, None)) };
    let norm = group.sum_f64(&[squares()?])?[0].sqrt();
    Ok((crate::clip::checked_coefficient(norm, max_norm)?, Some(norm)))
}
