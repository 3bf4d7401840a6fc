//! The additive bias of attention, broadcast to (batch, heads, seq_q, seq_k), and where each
//! query row's keys end: the keys after a row's last one with a bias above [`MASKED`] take no
//! part in its softmax (a causal mask's future, a padding mask's padding), so the forward pass
//! neither scores nor weighs them.
//!
//! The op keeps the bias tensor itself (it shares the caller's storage): its values are read in
//! place when they are of the compute type ([`Bias::with_rows`]), never copied into a wider
//! buffer per call — a causal mask at 1 024 tokens is 10⁶ values, in every layer. Backward reads
//! it again: a bias changed in place between the two passes (candle allows that) is read as it is
//! then, where PyTorch's autograd would refuse; the row ends stay those of the forward pass,
//! which backward weighs the same keys by.

use std::borrow::Cow;

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, DType, Result, Storage, Tensor};

use super::err;
use crate::native::Real;

/// A bias at or below which a key at the end of a row is left out: exp(score − 9 900 − max) is 0
/// in f32 (and below f64's smallest normal) unless the masked key's score exceeds the row's
/// largest by more than about 9 800, so leaving it out changes no probability. wick's causal mask
/// ([`crate::ops::causal_bias`]) is −10⁴ in f32, f64 and f16, and −9 984 in bf16, whose spacing
/// there is 64 (with −10⁴ itself as the bound, a bf16 model's causal attention weighed every key:
/// its forward and backward passes did the masked half of the work for nothing); PyTorch's mask
/// is the dtype's lowest value.
pub(super) const MASKED: f64 = -9.9e3;

/// Keys scanned at a time from a row's end for its last unmasked one (compared as one vector).
const SCAN: usize = 16;

/// An additive bias broadcast to (batch, heads, seq_q, seq_k): the tensor, the strides it is read
/// with, and each row's end.
pub(super) struct Bias {
    /// The bias broadcast to the op's dimensions (a view of the caller's tensor).
    tensor: Tensor,
    /// The first element the view reads and how many elements from there it spans.
    start: usize,
    extent: usize,
    strides: [usize; 4],
    /// Per (batch, head, query) — over one batch or head where the bias does not vary along it
    /// — the keys a row weighs: 1 + its last key with a bias above [`MASKED`] (all of them for
    /// a row masked throughout, whose softmax weighs every key alike, as without the skip).
    ends: Vec<usize>,
    /// Elements of `ends` from one batch and one head to the next (0 where shared).
    end_strides: [usize; 2],
}

/// The bias's values in the compute type, for [`Bias::with_rows`]'s closure.
pub(super) struct Rows<'a, T> {
    values: &'a [T],
    strides: [usize; 4],
}

impl<T> Rows<'_, T> {
    /// The bias row for (b, h, i) and its stride along keys.
    pub(super) fn row(&self, b: usize, h: usize, i: usize) -> (&[T], usize) {
        let start = b * self.strides[0] + h * self.strides[1] + i * self.strides[2];
        (&self.values[start..], self.strides[3])
    }
}

impl Bias {
    /// The bias broadcast to `dims`, or `None` when every value is zero (the padding mask of a
    /// batch without padding): adding zeros changes no score (a −0 score becomes +0, which the
    /// softmax and its gradient treat alike), and PyTorch's SDPA path drops such a mask too.
    pub(super) fn new(bias: &Tensor, dims: [usize; 4]) -> Result<Option<Self>> {
        let tensor = bias.broadcast_as(dims.to_vec())?;
        let (start, strides, extent) = {
            let (_, layout) = tensor.storage_and_layout();
            let stride = layout.stride();
            let extent = dims.iter().zip(stride).map(|(d, s)| d.saturating_sub(1) * s).sum::<usize>() + 1;
            (layout.start_offset(), [stride[0], stride[1], stride[2], stride[3]], extent)
        };
        let scanned = if tensor.dtype() == DType::F64 {
            read_values::<f64, _>(&tensor, (start, extent), |v| scan(v, strides, dims))?
        } else {
            read_values::<f32, _>(&tensor, (start, extent), |v| scan(v, strides, dims))?
        };
        Ok(scanned.map(|(ends, end_strides)| Bias { tensor, start, extent, strides, ends, end_strides }))
    }

    /// `f` of the bias's rows in the compute type `T`: read in place when the tensor holds `T`,
    /// converted once otherwise (a bf16 mask under autocast).
    pub(super) fn with_rows<T: Real, R>(&self, f: impl FnOnce(&Rows<'_, T>) -> Result<R>) -> Result<R> {
        read_values::<T, _>(&self.tensor, (self.start, self.extent), |values| {
            f(&Rows { values, strides: self.strides })
        })?
    }

    /// The keys query row `i` of (b, h) weighs: those before this end.
    pub(super) fn end(&self, b: usize, h: usize, i: usize) -> usize {
        self.ends[b * self.end_strides[0] + h * self.end_strides[1] + i]
    }
}

/// `f` of the `extent` elements of `tensor`'s storage from `start`, as `T` (borrowed when the
/// storage holds `T`).
fn read_values<T: Real, R>(tensor: &Tensor, (start, extent): (usize, usize), f: impl FnOnce(&[T]) -> R) -> Result<R> {
    let (storage, _) = tensor.storage_and_layout();
    let values: Cow<'_, [T]> = match &*storage {
        Storage::Cpu(s @ (CpuStorage::F64(_) | CpuStorage::F32(_) | CpuStorage::BF16(_) | CpuStorage::F16(_))) => {
            match T::slice(s, start, extent) {
                Ok(v) => v,
                // f64 compute over a bf16 / f16 bias: through f32, exactly.
                Err(_) => f32::slice(s, start, extent)?.iter().map(|v| T::of(f64::from(*v))).collect(),
            }
        }
        Storage::Cpu(other) => {
            return Err(err(format!("attention: a bias of {:?} (a float type wanted)", other.dtype())));
        }
        _ => return Err(err("attention: the bias is not on the CPU".into())),
    };
    Ok(f(&values))
}

/// Each distinct row's end and the ends' strides, or `None` when every value is zero.
fn scan<T: Real>(values: &[T], strides: [usize; 4], dims: [usize; 4]) -> Option<(Vec<usize>, [usize; 2])> {
    if values.iter().all(|v| *v == T::zero()) {
        return None;
    }
    let [batches, heads, sq, sk] = dims;
    // Rows that differ: one batch (head) where the bias does not vary along batches (heads).
    let (nb, nh) = (if strides[0] == 0 { 1 } else { batches }, if strides[1] == 0 { 1 } else { heads });
    let masked = T::of(MASKED);
    let mut ends = Vec::with_capacity(nb * nh * sq);
    for b in 0..nb {
        for h in 0..nh {
            for i in 0..sq {
                let row = b * strides[0] + h * strides[1] + i * strides[2];
                ends.push(row_end(&values[row..], strides[3], sk, masked).unwrap_or(sk));
            }
        }
    }
    let end_strides = [if nb == 1 { 0 } else { nh * sq }, if nh == 1 { 0 } else { sq }];
    Some((ends, end_strides))
}

/// 1 + the last of a row's `sk` keys (`stride` apart in `row`) with a bias above `masked`; `None`
/// when there is none. Along contiguous keys [`SCAN`] at a time from the end.
fn row_end<T: Real>(row: &[T], stride: usize, sk: usize, masked: T) -> Option<usize> {
    if stride != 1 {
        return (0..sk).rev().find(|&j| row[j * stride] > masked).map(|j| j + 1);
    }
    let row = &row[..sk];
    let mut end = sk;
    for chunk in row.rchunks(SCAN) {
        if chunk.iter().fold(false, |any, v| any | (*v > masked)) {
            return chunk.iter().rposition(|v| *v > masked).map(|j| end - chunk.len() + j + 1);
        }
        end -= chunk.len();
    }
    None
}

#[cfg(test)]
mod tests {
    use candle_core::{DType, Device};

    use super::Bias;

    /// wick's causal mask in every float dtype ends row `i` after key `i` (bf16 rounds −10⁴ to
    /// −9 984: the bound must take it, or a bf16 model's attention weighs every key).
    #[test]
    fn a_causal_mask_ends_each_row_at_its_diagonal_in_every_dtype() {
        for dtype in [DType::F64, DType::F32, DType::BF16, DType::F16] {
            let mask = crate::ops::causal_bias(6, dtype, &Device::Cpu).unwrap();
            let bias = Bias::new(&mask, [2, 3, 6, 6]).unwrap().expect("a causal mask is not all zeros");
            for (b, h, i) in (0..2).flat_map(|b| (0..3).flat_map(move |h| (0..6).map(move |i| (b, h, i)))) {
                assert_eq!(bias.end(b, h, i), i + 1, "{dtype:?}: row {i} of ({b}, {h})");
            }
        }
    }
}
