//! The additive bias of attention, broadcast to (batch, heads, seq_q, seq_k), and where each
//! query row's keys end: the keys after a row's last one with a bias above [`MASKED`] take no
//! part in its softmax (a causal mask's future, a padding mask's padding), so the forward pass
//! neither scores nor weighs them.

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, Result, Storage, Tensor};

use super::err;

/// A bias at or below which a key at the end of a row is left out: exp(score − 10⁴ − max) is 0 in
/// f32 (and below f64's smallest normal) unless the masked key's score exceeds the row's largest
/// by more than about 9 900, so leaving it out changes no probability. wick's causal mask
/// ([`crate::ops::causal_bias`]) is −10⁴; PyTorch's is the dtype's lowest value.
pub(super) const MASKED: f64 = -1e4;

/// An additive bias broadcast to (batch, heads, seq_q, seq_k): its values and strides, and each
/// row's end.
pub(super) struct Bias {
    values: Vec<f64>,
    strides: [usize; 4],
    /// Per (batch, head, query) — over one batch or head where the bias does not vary along it
    /// — the keys a row weighs: 1 + its last key with a bias above [`MASKED`] (all of them for
    /// a row masked throughout, whose softmax weighs every key alike, as without the skip).
    ends: Vec<usize>,
    /// Elements of `ends` from one batch and one head to the next (0 where shared).
    end_strides: [usize; 2],
}

impl Bias {
    /// The bias broadcast to `dims`, or `None` when every value is zero (the padding mask of a
    /// batch without padding): adding zeros changes no score (a −0 score becomes +0, which the
    /// softmax and its gradient treat alike), and PyTorch's SDPA path drops such a mask too.
    pub(super) fn new(bias: &Tensor, dims: [usize; 4]) -> Result<Option<Self>> {
        let b = bias.broadcast_as(dims.to_vec())?;
        let (storage, layout) = b.storage_and_layout();
        let (start, stride) = (layout.start_offset(), layout.stride());
        let extent: usize = dims.iter().zip(stride).map(|(d, s)| d.saturating_sub(1) * s).sum::<usize>() + 1;
        // The elements the broadcast reads, widened to f64 in one pass (no widened copy of the
        // whole tensor first: a causal mask at 1 024 tokens is 10⁶ of them, in every layer).
        fn wide<T: Copy>(all: &[T], range: std::ops::Range<usize>, f: impl Fn(T) -> f64) -> Result<Vec<f64>> {
            Ok(all
                .get(range)
                .ok_or_else(|| err("attention: bias out of range".into()))?
                .iter()
                .map(|v| f(*v))
                .collect())
        }
        let range = start..start + extent;
        let values = match &*storage {
            Storage::Cpu(CpuStorage::F64(all)) => wide(all, range, |v| v)?,
            Storage::Cpu(CpuStorage::F32(all)) => wide(all, range, f64::from)?,
            Storage::Cpu(CpuStorage::BF16(all)) => wide(all, range, |v| v.to_f64())?,
            Storage::Cpu(CpuStorage::F16(all)) => wide(all, range, |v| v.to_f64())?,
            Storage::Cpu(other) => {
                return Err(err(format!("attention: a bias of {:?} (a float type wanted)", other.dtype())));
            }
            _ => return Err(err("attention: the bias is not on the CPU".into())),
        };
        if values.iter().all(|v| *v == 0.0) {
            return Ok(None);
        }
        let strides = [stride[0], stride[1], stride[2], stride[3]];
        let [batches, heads, sq, sk] = dims;
        // Rows that differ: one batch (head) where the bias does not vary along batches (heads).
        let (nb, nh) = (if strides[0] == 0 { 1 } else { batches }, if strides[1] == 0 { 1 } else { heads });
        let mut ends = Vec::with_capacity(nb * nh * sq);
        for b in 0..nb {
            for h in 0..nh {
                for i in 0..sq {
                    let row = b * strides[0] + h * strides[1] + i * strides[2];
                    let weighed = (0..sk).rev().find(|&j| values[row + j * strides[3]] > MASKED);
                    ends.push(weighed.map_or(sk, |j| j + 1));
                }
            }
        }
        let end_strides = [if nb == 1 { 0 } else { nh * sq }, if nh == 1 { 0 } else { sq }];
        Ok(Some(Bias { values, strides, ends, end_strides }))
    }

    /// The bias row for (b, h, i) and its stride along keys.
    pub(super) fn row(&self, b: usize, h: usize, i: usize) -> (&[f64], usize) {
        let start = b * self.strides[0] + h * self.strides[1] + i * self.strides[2];
        (&self.values[start..], self.strides[3])
    }

    /// The keys query row `i` of (b, h) weighs: those before this end.
    pub(super) fn end(&self, b: usize, h: usize, i: usize) -> usize {
        self.ends[b * self.end_strides[0] + h * self.end_strides[1] + i]
    }
}
