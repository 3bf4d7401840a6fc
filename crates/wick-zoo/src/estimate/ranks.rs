//! The estimate of one rank of a data-parallel run (wick-train's `dist`): the model replicated,
//! the batch split, the optimizer's state and f32 masters sharded under ZeRO, and the
//! communication buffers on top.
//!
//! What one rank holds at its peak, as wick-train runs it:
//! - parameters and their gradients whole on every rank at every stage — candle's backward
//!   hands over all gradients at once, so ZeRO-2's gradient shards exist only after it;
//! - optimizer state and f32 masters: whole (stage 0) or one rank's share (stages 1 and 2: the
//!   buckets' elements dealt in equal blocks, so a share is the whole over the ranks, rounded up);
//! - activations and backward's workspace at the per-rank batch;
//! - after backward (activations freed), the reduction and the sharded update, whichever needs
//!   more: replicated, the largest reduction buffer being filled (its gradients are freed as
//!   they are copied in) and, for a bf16 model, its bf16 copy; sharded, what the stage keeps
//!   reduced — stage 1 every gradient in f32 (twice a bf16 model's), stage 2 this rank's f32
//!   blocks — plus the update's bucket-sized gather and, beside it, this rank's block of it or
//!   the largest parameter's copy out of it.

use super::ActivationProfile;
use super::{estimate_bytes, Estimate, Mode, ParamBytes, Update};

/// How a data-parallel run is laid out.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct Ranks {
    /// Processes.
    pub ranks: usize,
    /// ZeRO stage: 0 (replicated), 1 (optimizer state and masters sharded), 2 (gradients too).
    pub zero_stage: u8,
    /// Bytes of the largest buffer the reduction fills: a bucket, or a large gradient reduced
    /// on its own (wick-train's `dist::buckets::largest_buffer` for a model's parameters).
    pub largest_bucket: usize,
}

impl Ranks {
    /// `ranks` processes at ZeRO stage `zero_stage`, the largest reduction buffer bounded from
    /// the parameter bytes alone: a full bucket of `bucket_bytes` (or all the gradients when
    /// fewer), or the largest parameter when it is larger — for models too large to build.
    pub fn bounded(ranks: usize, zero_stage: u8, bucket_bytes: usize, p: ParamBytes) -> Self {
        Ranks { ranks, zero_stage, largest_bucket: bucket_bytes.min(p.f32_total).max(p.largest_f32) }
    }
}

/// One rank's estimate.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct RankEstimate {
    /// The layout.
    pub ranks: Ranks,
    /// The rank's figures (its batch, its share of the optimizer's state and masters; the
    /// reduction's buffers in `workspace` when they outgrow backward's and the update's).
    pub estimate: Estimate,
    /// The reduction's transient: the buckets in flight and what the stage keeps reduced.
    pub reduction: usize,
}

/// The estimate of each rank of `ranks` training `mode` at `per_rank_batch` examples per rank
/// (see [`estimate_bytes`] for the rest of the arguments).
pub fn estimate_per_rank(
    p: ParamBytes,
    profile: &ActivationProfile,
    per_rank_batch: usize,
    mode: Mode,
    masters: bool,
    update: Update,
    ranks: Ranks,
) -> RankEstimate {
    let mut e = estimate_bytes(p, profile, per_rank_batch, mode, masters, update);
    let n = ranks.ranks.max(1);
    if mode == Mode::Inference || n == 1 && ranks.zero_stage == 0 {
        return RankEstimate { ranks, estimate: e, reduction: 0 };
    }
    if ranks.zero_stage >= 1 {
        e.optimizer_state = e.optimizer_state.div_ceil(n);
        e.master_weights = e.master_weights.div_ceil(n);
    }
    let (b, block, largest) = (ranks.largest_bucket, ranks.largest_bucket.div_ceil(n), p.largest_f32);
    let reduction = match ranks.zero_stage {
        0 if masters => b.saturating_add(b / 2),
        0 => b,
        // Every gradient reduced in f32 and kept until the update (a bf16 model's local ones took
        // half as much), then the update's gather, block and parameter copy.
        1 => p.f32_total.saturating_sub(e.gradients).saturating_add(b).saturating_add(block.max(largest)),
        // The first bucket and its block beside every local gradient; or, in the update, this
        // rank's blocks instead of the gradients, and the gather, block and parameter copy.
        _ => (b + block).max(
            p.f32_total.div_ceil(n).saturating_add(b).saturating_add(block.max(largest)).saturating_sub(e.gradients),
        ),
    };
    e.workspace = e.workspace.max(reduction.saturating_sub(e.activations));
    e.add_up();
    RankEstimate { ranks, estimate: e, reduction }
}
