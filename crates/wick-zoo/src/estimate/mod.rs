//! Memory estimator: what a model needs for inference or one training step at a batch size, in
//! parameters, gradients, optimizer state, activations and workspace.
//!
//! Activations are counted from the model's own graph, not from a rule of thumb: the model runs
//! its forward pass at batches 1, 2, 4, 8 and 16 (after a warm-up pass at batch 1) at the target
//! sequence or image size, and every tensor that the autograd graph keeps alive (each distinct
//! storage, views counted once) is summed by its shape and dtype. Activation memory is affine in
//! the batch for these models, so two counts give the per-sample and fixed parts, and the estimate
//! extrapolates to any batch without running it.
//!
//! The backward pass's workspace (one gradient per graph edge while it is in flight, plus each
//! op's temporaries) depends on edges that candle does not expose, so it is profiled instead: a
//! backward pass at each profiled batch under an exact heap (wick's counting allocator or its caching
//! heap as the global allocator), read between and beyond the profiled batches by [`Piecewise`]. Without one, training estimates use
//! a lower bound (two gradients of the largest activation) and say so.
//!
//! | module | what it owns |
//! |---|---|
//! | `profile` | the profile ([`ActivationProfile`]) and how it is read between and beyond the profiled batches ([`Affine`], [`Piecewise`]) |
//! | `ranks` | one rank's figures in a data-parallel run ([`estimate_per_rank`]) |
//! | `blocks` | what ZeRO stage 3 gathers block by block ([`BlockBytes`]), and the stand-in for its gather and reduce a profile runs through ([`BlockRecorder`]) |
//! | this module | the estimate from parameters and a profile ([`Estimate`], [`estimate_bytes`]), batch fitting and its margins |

mod blocks;
mod profile;
mod ranks;

pub use blocks::{BlockBytes, BlockRecorder};
pub use profile::{
    profile_batches, ActivationProfile, Affine, Piecewise, CHECKPOINTED_PROFILE_BATCHES, EXTRAPOLATION_DIVISOR,
    INFERENCE_PROFILE_BATCHES, PROFILE_BATCHES,
};
pub use ranks::{estimate_per_rank, Overlap, PeakPhase, RankEstimate, Ranks};

use wick_nn::params::Params;

/// What a training step keeps per parameter byte besides the parameter itself.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub enum Mode {
    /// Forward only.
    Inference,
    /// Forward, backward and a plain SGD update.
    TrainSgd,
    /// Forward, backward and an SGD update with momentum (one state tensor per parameter).
    TrainSgdMomentum,
    /// Forward, backward and an AdamW update (two state tensors per parameter).
    TrainAdamW,
}

impl Mode {
    fn optimizer_states(self) -> usize {
        match self {
            Mode::Inference | Mode::TrainSgd => 0,
            Mode::TrainSgdMomentum => 1,
            Mode::TrainAdamW => 2,
        }
    }
}

/// The estimate, in bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct Estimate {
    /// Mode estimated.
    pub mode: Mode,
    /// Batch size estimated.
    pub batch: usize,
    /// Parameters.
    pub parameters: usize,
    /// Parameter gradients (training).
    pub gradients: usize,
    /// Optimizer state.
    pub optimizer_state: usize,
    /// f32 master weights (mixed-precision training with `wick_train::amp::MasterWeights`; 0 otherwise).
    pub master_weights: usize,
    /// Tensors the forward pass keeps for backward (0 for inference profiled under
    /// [`wick_nn::no_grad`]: its whole peak is transient, in `workspace`).
    pub activations: usize,
    /// Transient memory: gradients in flight during backward, or the optimizer's temporaries
    /// beyond the activations (the update runs after the graph is freed), whichever is larger.
    pub workspace: usize,
    /// What the estimate adds for what the profile cannot see (run-to-run and shape-to-shape
    /// variation of the transients): [`NOISE_ALLOWANCE`] of the activations and workspace, at
    /// least [`NOISE_ALLOWANCE_FLOOR`] of the whole; for inference [`NOISE_ALLOWANCE_INFERENCE`]
    /// of the whole.
    pub allowance: usize,
    /// The sum.
    pub total: usize,
}

/// The share of the batch-dependent memory (activations and workspace) a training estimate adds
/// so that it is never under a measured peak: the kernels' scratch buffers do not follow the
/// batch in a straight line between the profiled batches, and small tensors (a mask's sum, a
/// readout's gradient) are not in the sum's parts, and a profile taken while other work shares
/// the cores sees its parallel chunks overlap differently (a 6-layer decoder's AMP estimate
/// moved by 2 MiB). Without it the sweep's training steps came out up to 0.5 % under
/// (BENCHMARKS.md, "Estimator sweep (issue 28)").
pub const NOISE_ALLOWANCE: f64 = 0.015;

/// The least a training estimate's allowance is, as a share of the whole: with activation
/// checkpointing the activations and workspace are a small part of a step, while what varies
/// (a scratch buffer, a small gradient) does not shrink with them — ResNet-50 checkpointed at
/// 64² came within 0.1 % of its measured peak without it.
pub const NOISE_ALLOWANCE_FLOOR: f64 = 0.005;

/// The share of the whole estimate that an inference estimate adds. A forward peak is all
/// transient, and the kernels' scratch buffers (the matrix products' packing, sized by the
/// product's shape) do not follow the batch in a straight line: MiniLM's forward peak at
/// sequence 200 grows by 7.0 MiB per two samples from batch 8 to 16 except from 10 to 12, by
/// 10.0, which puts batch 12 3 MiB (1.1 % of the whole step) above the line between the
/// profiled batches 8 and 16 — the same on every run.
pub const NOISE_ALLOWANCE_INFERENCE: f64 = 0.02;

/// Estimates `mode` at `batch` for a model with `params`, whose activations were profiled; the
/// optimizer (if any) keeps its state in the parameters' dtype.
pub fn estimate(params: &Params, profile: &ActivationProfile, batch: usize, mode: Mode) -> Estimate {
    estimate_with(params, profile, batch, mode, false)
}

/// As [`estimate`], for mixed-precision training with `wick_train::amp::MasterWeights`: every
/// parameter also has an f32 master, the optimizer state is f32, and the update's temporaries are
/// f32 (for a model built in bf16/f16 by [`wick_nn::Autocast`]; its activations and gradients
/// are counted in the model's dtypes as profiled).
pub fn estimate_amp(params: &Params, profile: &ActivationProfile, batch: usize, mode: Mode) -> Estimate {
    estimate_with(params, profile, batch, mode, true)
}

/// A model's parameter bytes, for an estimate without the model itself (a model too large to
/// build here, profiled through fewer layers: [`ActivationProfile::with_layers`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct ParamBytes {
    /// All parameters, in their dtypes.
    pub total: usize,
    /// The largest parameter.
    pub largest: usize,
    /// All parameters at 4 bytes each (f32 masters and state).
    pub f32_total: usize,
    /// The largest parameter at 4 bytes an element.
    pub largest_f32: usize,
}

impl ParamBytes {
    /// The bytes of `params`.
    pub fn of(params: &Params) -> Self {
        let bytes = |v: &candle_core::Var| v.elem_count() * v.dtype().size_in_bytes();
        ParamBytes {
            total: params.iter().map(|(_, v)| bytes(v)).sum(),
            largest: params.iter().map(|(_, v)| bytes(v)).max().unwrap_or(0),
            f32_total: params.iter().map(|(_, v)| v.elem_count() * 4).sum(),
            largest_f32: params.iter().map(|(_, v)| v.elem_count() * 4).max().unwrap_or(0),
        }
    }
}

fn estimate_with(params: &Params, profile: &ActivationProfile, batch: usize, mode: Mode, masters: bool) -> Estimate {
    estimate_bytes(ParamBytes::of(params), profile, batch, mode, masters, Update::InPlace)
}

/// How the optimizer's update runs, which decides its temporaries (in copies of the largest
/// parameter, at the update's precision: f32 under mixed precision).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub enum Update {
    /// wick-train's update on the CPU: one pass in place per parameter, whose only extra memory
    /// is the new optimizer state of that parameter (a momentum buffer; AdamW's two moments).
    /// Plain SGD (`Params::sgd_step`) makes `g·lr` and `p − g·lr`: two copies.
    InPlace,
    /// An update from tensor ops, each result a new tensor (wick-train's masters update on a
    /// device without wick's kernels): the old and new value and state, the gradient and AdamW's
    /// bias-corrected moments — up to eight copies for AdamW, five for momentum, two for plain SGD.
    OutOfPlace,
    /// wick-train's update on a CUDA device with wick's kernels: every parameter of a dtype in one
    /// multi-tensor launch, the value and the state updated in place, nothing made beside them
    /// (plain SGD, `Params::sgd_step`, still makes its two copies).
    Fused,
}

/// Copies of the largest parameter the update of `mode` holds at once, run as `update` says.
fn update_copies(mode: Mode, update: Update) -> usize {
    let states = mode.optimizer_states();
    match (mode, update) {
        (Mode::Inference, _) => 0,
        (Mode::TrainSgd, _) => 2,
        (_, Update::InPlace) => states,
        (_, Update::OutOfPlace) => 2 + 3 * states,
        (_, Update::Fused) => 0,
    }
}

/// Backward's gradients in flight at `batch`: profiled, or at least an incoming and an outgoing
/// gradient of the largest activation.
fn backward_workspace(profile: &ActivationProfile, batch: usize) -> usize {
    let largest = profile.largest.at(batch);
    profile.backward_workspace.as_ref().map_or(largest.saturating_mul(2), |w| w.at_steeper(batch))
}

/// [`estimate`] (`masters` false) or [`estimate_amp`] (true) from parameter bytes, with the
/// update run as `update` says ([`estimate`] and [`estimate_amp`] take [`Update::InPlace`], the
/// CPU's).
pub fn estimate_bytes(
    p: ParamBytes,
    profile: &ActivationProfile,
    batch: usize,
    mode: Mode,
    masters: bool,
    update: Update,
) -> Estimate {
    let (parameters, largest_param, f32_params, largest_f32) = (p.total, p.largest, p.f32_total, p.largest_f32);
    let no_grad_inference = mode == Mode::Inference && profile.inference_peak.is_some();
    let activations = if no_grad_inference { 0 } else { profile.activations.at(batch) };
    let largest = profile.largest.at(batch);
    let (gradients, optimizer_state, master_weights, workspace) = match mode {
        // Profiled under no_grad: the forward pass's peak, all transient. Without a profile,
        // the graph (the output holds it) and the largest op's result on top.
        Mode::Inference => (0, 0, 0, profile.inference_peak.as_ref().map_or(largest, |p| p.at(batch))),
        // Backward's gradients in flight (profiled, or at least an incoming and an outgoing
        // gradient of the largest activation), or the update's temporaries, whichever needs
        // more: they do not overlap, and the update runs once the graph is dropped (the
        // trainer's loss goes out of scope before it), so its temporaries count only beyond the
        // activations they replace.
        _ => {
            let backward = backward_workspace(profile, batch);
            let states = mode.optimizer_states();
            let transient = |update: usize| backward.max(update.saturating_sub(activations));
            let largest_update = if masters { largest_f32 } else { largest_param };
            // The store's other gradients live through the update too.
            let update = largest_update
                .saturating_mul(update_copies(mode, update))
                .saturating_add(profile.kept_gradients.at(batch));
            if masters {
                (parameters, f32_params.saturating_mul(states), f32_params, transient(update))
            } else {
                (parameters, parameters.saturating_mul(states), 0, transient(update))
            }
        }
    };
    let mut e = Estimate {
        mode,
        batch,
        parameters,
        gradients,
        optimizer_state,
        master_weights,
        activations,
        workspace,
        allowance: 0,
        total: 0,
    };
    e.add_up();
    e
}

impl Estimate {
    /// What the step takes from the driver's graph pool when it runs captured as a CUDA graph
    /// (`wick train --cuda-graph`, `wick::cuda_graph`): every tensor the step makes and frees —
    /// the gradients, the activations, the transients — with the allowance; the parameters,
    /// masters and optimizer state stay in wick's pool, as the step's inputs do. The graph's
    /// allocations are the eager step's, in its order, and the driver reuses the memory of one
    /// freed earlier in the graph, so the pool follows the step's own transient peak; how the
    /// driver rounds its reservation is not modelled (scripts/gpu-check.sh compares the two).
    pub fn graph_pool(&self) -> usize {
        [self.gradients, self.activations, self.workspace, self.allowance].into_iter().fold(0, usize::saturating_add)
    }

    /// Sets the allowance (see [`Estimate::allowance`]) and the total from the parts.
    pub(crate) fn add_up(&mut self) {
        let parts = [
            self.parameters,
            self.gradients,
            self.optimizer_state,
            self.master_weights,
            self.activations,
            self.workspace,
        ];
        let sum = parts.into_iter().fold(0usize, usize::saturating_add) as f64;
        let allowance = if self.mode == Mode::Inference {
            sum * NOISE_ALLOWANCE_INFERENCE
        } else {
            (self.activations.saturating_add(self.workspace) as f64 * NOISE_ALLOWANCE).max(sum * NOISE_ALLOWANCE_FLOOR)
        };
        self.allowance = allowance.ceil() as usize;
        // Saturating: an estimate past the address space is "does not fit", never a wrap.
        self.total = parts.into_iter().fold(self.allowance, usize::saturating_add);
    }
}

/// The largest batch in `1..=max_batch` whose estimate fits in `budget` bytes (0 if none).
pub fn largest_batch(
    params: &Params,
    profile: &ActivationProfile,
    mode: Mode,
    budget: usize,
    max_batch: usize,
) -> usize {
    largest_fitting(max_batch, |b| estimate(params, profile, b, mode).total <= budget)
}

/// The largest batch in `1..=max_batch` for which `fits` holds (0 if none), by bisection: `fits`
/// must hold for every batch below one it holds for (memory grows with the batch).
pub fn largest_fitting(max_batch: usize, fits: impl Fn(usize) -> bool) -> usize {
    let (mut lo, mut hi) = (0, max_batch);
    while lo < hi {
        let mid = lo + (hi - lo).div_ceil(2);
        if fits(mid) {
            lo = mid;
        } else {
            hi = mid - 1;
        }
    }
    lo
}

/// The margin `wick fit-batch` adds to an estimate for a CPU budget: none. The estimate carries
/// its own noise allowance ([`NOISE_ALLOWANCE`], [`NOISE_ALLOWANCE_INFERENCE`]), and across the
/// validation sweep — every zoo model family, every mode, f32 and AMP, with and without
/// checkpointing, at batches and lengths no profile ran — it was never below the measured peak
/// and at most 1.5 % above it (BENCHMARKS.md, "Estimator sweep (issue 28)"). The 3 % and 7 %
/// margins before it covered shortfalls the estimate no longer has.
pub const FIT_MARGIN: f64 = 0.0;

/// The margin for a GPU's budget (`--gpu`, `--device`): the CUDA caching allocator rounds every
/// block up (to 512 bytes, large ones into 2 MiB pages of a segment) and the estimate has not yet
/// been checked against a GPU's measured peak, so a GPU plan keeps 3 %.
pub const FIT_MARGIN_GPU: f64 = 0.03;

/// The margin for a budget on the GPU (`gpu`) or the CPU.
pub fn fit_margin(gpu: bool) -> f64 {
    if gpu {
        FIT_MARGIN_GPU
    } else {
        FIT_MARGIN
    }
}
