//! The estimate of one rank of a data-parallel run (wick-train's `dist`): the model replicated,
//! the batch split, the optimizer's state and f32 masters sharded under ZeRO, and the
//! communication buffers on top.
//!
//! What one rank holds at its peak, as wick-train runs it:
//! - parameters and their gradients whole on every rank at every stage (a stage-2 bucket
//!   reduced during backward leaves only its block, which is not counted: how many are depends
//!   on timing);
//! - with the reduction overlapping backward ([`Overlap`]): one bucket in flight beside
//!   backward's activations, which candle holds until backward returns;
//! - optimizer state and f32 masters: whole (stage 0) or one rank's share (stages 1 and 2: the
//!   buckets' elements dealt in equal blocks, so a share is the whole over the ranks, rounded up);
//! - activations and backward's workspace at the per-rank batch;
//! - after backward (activations freed), the reduction and the sharded update, whichever needs
//!   more: replicated, the largest reduction buffer being filled (its gradients are freed as
//!   they are copied in) and, for a bf16 model, its bf16 copy; sharded, what the stage keeps
//!   reduced — stage 1 every gradient in f32 (twice a bf16 model's), stage 2 this rank's f32
//!   blocks — plus the update's bucket-sized gather and, beside it, this rank's block of it or
//!   the largest parameter's copy out of it.
//!
//! Stage 3 (parameters sharded, see [`BlockBytes`]) is estimated from a profile taken through a
//! [`super::BlockRecorder`] ([`super::ActivationProfile::measure_sharded`]), whose backward
//! workspace is already the stage-3 step's: a block's gathered parameters, its recomputation, its
//! gradients and the reduce-scatter's buffers, with the blocks' reduced pieces where they
//! coincide (blocks kept instead of recomputed: every block's activations in the profile's
//! graph, and a block's parameters gathered again for its backward). On top, what a rank keeps all along: the parameters read outside the blocks whole
//! (their gradients whole until reduced one by one after backward, then pieces), its piece of
//! every parameter as an f32 master (an f32 block parameter's piece is the parameter), the
//! pieces' optimizer state — and, after backward and the update, the outside parameters'
//! reduction and the gather that brings them back whole. Measured against two ranks' peaks in
//! wick-train's `tests/multi_rank.rs` and at 58 M and 168 M parameters (BENCHMARKS.md).

use super::{estimate_bytes, Estimate, Mode, ParamBytes, Update};
use super::{ActivationProfile, BlockBytes};

/// How a data-parallel run is laid out.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct Ranks {
    /// Processes.
    pub ranks: usize,
    /// ZeRO stage: 0 (replicated), 1 (optimizer state and masters sharded), 2 (gradients too),
    /// 3 (parameters too, gathered a block at a time).
    pub zero_stage: u8,
    /// Bytes of the largest buffer the reduction fills: a bucket, or a large gradient reduced
    /// on its own (wick-train's `dist::buckets::GradBuckets::largest_buffer` for a model's parameters).
    pub largest_bucket: usize,
    /// Stage 3: where the parameters are (`None`: no block, every parameter read whole, as a
    /// stage-3 rank holds a model without checkpoint segments).
    pub blocks: Option<BlockBytes>,
    /// Stages 0–2: the reduction started from inside backward (wick-train's default), or
    /// `None` when every bucket is reduced after it.
    pub overlap: Option<Overlap>,
    /// Stage 3: the next block's gather started while a block runs (wick-train's
    /// `DataParallelOptions::prefetch`): one more block whole beside it.
    pub prefetch: bool,
    /// Stage 3: the blocks recomputed in backward (wick-train's default), or kept with their
    /// activations (`DataParallelOptions::recompute` off); the profile the estimate reads must
    /// have been made the same way ([`crate::registry::ModelSpec::profile_sharded`]).
    pub recompute: bool,
}

/// The buckets a reduction may start from inside backward (wick-train's
/// `dist::buckets::GradBuckets::in_backward_bytes`): f32 bytes of the largest and of all of them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct Overlap {
    /// The largest such bucket (padded to the world size when sharded).
    pub largest: usize,
    /// All of them.
    pub total: usize,
}

impl Ranks {
    /// `ranks` processes at ZeRO stage `zero_stage`, the largest reduction buffer bounded from
    /// the parameter bytes alone: a full bucket of `bucket_bytes` (or all the gradients when
    /// fewer), or the largest parameter when it is larger — for models too large to build.
    pub fn bounded(ranks: usize, zero_stage: u8, bucket_bytes: usize, p: ParamBytes) -> Self {
        let largest_bucket = bucket_bytes.min(p.f32_total).max(p.largest_f32);
        let overlap = Some(Overlap { largest: largest_bucket, total: p.f32_total });
        Ranks { ranks, zero_stage, largest_bucket, blocks: None, overlap, prefetch: false, recompute: true }
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
    /// Stage 3: the phase of the step that sets the peak.
    pub peak_phase: Option<PeakPhase>,
}

/// Where a ZeRO stage-3 step reaches its peak.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub enum PeakPhase {
    /// Backward: the blocks gathered again one at a time (recomputed, or their kept
    /// activations back-propagated), the loss's gradients.
    Backward,
    /// After backward: the parameters read outside the blocks reduced one at a time.
    OutsideReduction,
    /// The update of this rank's pieces.
    Update,
    /// After the update: the parameters read outside the blocks gathered back whole.
    OutsideGather,
}

impl std::fmt::Display for PeakPhase {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            PeakPhase::Backward => "backward (the blocks gathered again one at a time, the loss's gradients)",
            PeakPhase::OutsideReduction => "the reduction of the parameters read outside the blocks, after backward",
            PeakPhase::Update => "the update of this rank's pieces",
            PeakPhase::OutsideGather => "gathering the parameters read outside the blocks back, after the update",
        })
    }
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
        return RankEstimate { ranks, estimate: e, reduction: 0, peak_phase: None };
    }
    if ranks.zero_stage >= 3 {
        let backward = super::backward_workspace(profile, per_rank_batch);
        let update = Update3 {
            backward,
            copies: super::update_copies(mode, update),
            kept: profile.kept_gradients.at(per_rank_batch),
        };
        return sharded_parameters(p, e, update, masters, ranks);
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
    // Overlap: one bucket in flight beside backward's activations — while it is packed its
    // gradients and the packed copy (`u`), then the copy and the receive buffer, a low-precision
    // model's f32 copy beside its gradients (1.5 `u`); stage 1 of a low-precision model also
    // keeps every reduced bucket in f32 from then on (half of `total` more than its gradients).
    // A stage-2 bucket reduced during backward leaves only this rank's block of it, which is
    // not counted: how many are reduced before backward's end depends on timing.
    let during = ranks.overlap.map_or(0, |o| {
        let u = o.largest;
        match (ranks.zero_stage, masters) {
            (0, true) => u.saturating_add(u / 2),
            (1, true) => u.saturating_add(u / 2).saturating_add(o.total / 2),
            _ => u,
        }
    });
    e.workspace = e.workspace.saturating_add(during).max(reduction.saturating_sub(e.activations));
    e.add_up();
    RankEstimate { ranks, estimate: e, reduction, peak_phase: None }
}

/// Heap bytes a stage-3 rank keeps per parameter besides the numbers: the handles of its piece's
/// master, optimizer state and view tensors (shape, strides, storage), which the whole-heap
/// measurement sees and the parameter bytes do not — 1.2–1.3 KiB per parameter measured on the
/// two-rank test models (62 parameters of a 16-wide ResNet-18: 76–80 KiB).
const PIECE_HANDLES: usize = 1536;

/// What stage 3 reads of the replicated estimate's transients, apart.
struct Update3 {
    /// Backward's workspace (the profile's, taken through the recorder: already stage 3's).
    backward: usize,
    /// Copies of a parameter the update makes beside it.
    copies: usize,
    /// The store's other gradients, live through the update.
    kept: usize,
}

/// Stage 3 from `e`, the estimate of a profile taken through a [`super::BlockRecorder`] (see the
/// module documentation).
fn sharded_parameters(p: ParamBytes, mut e: Estimate, u: Update3, masters: bool, ranks: Ranks) -> RankEstimate {
    let mode = e.mode;
    let n = ranks.ranks.max(1);
    // Without blocks every parameter is read outside them.
    let b = ranks.blocks.unwrap_or(BlockBytes {
        outside: p.total,
        outside_f32: p.f32_total,
        outside_largest: p.largest,
        outside_largest_f32: p.largest_f32,
        outside_largest_sent: p.largest_f32,
        ..BlockBytes::default()
    });
    // A rank's piece of each parameter is its elements over the ranks rounded up: at most one
    // element per parameter over the even share (a 64th of the share where the count is not
    // known).
    let share = |bytes: usize| {
        let even = bytes.div_ceil(n);
        even.saturating_add(if ranks.blocks.is_some() { b.tensors.saturating_mul(4) } else { even / 64 })
    };
    let pieces = share(p.f32_total);
    // The outside parameters whole, what the model's copies of block parameters keep (see
    // `BlockBytes::kept`) and the buffers (batch-norm statistics), whole on every rank. An f32
    // block parameter's piece is the parameter; a low-precision one's is its master, as is a
    // low-precision outside parameter's (an f32 outside parameter is its own master).
    let own = b.outside.saturating_add(b.kept).saturating_add(b.buffers).saturating_add(b.tensors * PIECE_HANDLES);
    e.parameters = own.saturating_add(if masters { 0 } else { share(b.inside_f32) });
    e.master_weights = if masters { pieces } else { 0 };
    e.optimizer_state = pieces.saturating_mul(mode.optimizer_states());
    // Every block's reduced piece, and each outside parameter's gradient whole until it is
    // reduced, its piece after (one or the other: the larger counted).
    let outside = b.outside.max(share(b.outside_f32));
    e.gradients = share(b.inside_f32).saturating_add(outside);
    let held = e.activations.saturating_add(e.gradients);
    // The update (activations gone, every gradient reduced to this rank's piece): the largest
    // piece's gradient as a tensor and the new state made beside the old.
    let piece = p.largest_f32.div_ceil(n).saturating_add(4);
    let update =
        share(p.f32_total).saturating_add(piece.saturating_mul(u.copies.saturating_add(1))).saturating_add(u.kept);
    // After the update (gradients gone): the outside parameters gathered back one at a time,
    // this rank's piece packed in the parameter's dtype and every rank's received, then
    // written into the model's own tensor.
    let gather_back = b.outside_largest.saturating_add(b.outside_largest.div_ceil(n));
    // After backward (activations gone), the outside parameters' gradients reduced one at a
    // time: the largest's send buffer (none for an f32 gradient that splits evenly: sent where
    // it lies) and this rank's piece of it received, beside a low-precision gradient's f32
    // copy.
    let low = if b.outside_largest < b.outside_largest_f32 { b.outside_largest_f32 } else { 0 };
    let reduce_rest = low.saturating_add(b.outside_largest_sent).saturating_add(b.outside_largest_f32.div_ceil(n));
    // Prefetching, the next block's gather in flight beside the block that runs: its received
    // bytes and this rank's piece packed for it.
    let next = if ranks.prefetch { b.largest.saturating_add(b.largest.div_ceil(n)) } else { 0 };
    let phases = [
        (PeakPhase::Backward, u.backward.saturating_add(next)),
        (PeakPhase::Update, update.saturating_sub(held)),
        (PeakPhase::OutsideReduction, reduce_rest.saturating_sub(e.activations)),
        (PeakPhase::OutsideGather, gather_back.saturating_sub(held)),
    ];
    let (phase, workspace) = phases.into_iter().fold(phases[0], |a, b| if b.1 > a.1 { b } else { a });
    e.workspace = workspace;
    e.add_up();
    let reduction = b.largest_f32.saturating_add(b.largest_f32.div_ceil(n));
    RankEstimate { ranks, estimate: e, reduction, peak_phase: Some(phase) }
}
