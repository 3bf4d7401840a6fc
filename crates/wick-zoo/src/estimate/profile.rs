//! The activation profile: what a model's forward keeps for backward and what backward and
//! inference need beyond it, measured at a few batches ([`ActivationProfile`]) and read between
//! and beyond them ([`Affine`], [`Piecewise`]); decoders profiled through one and two layers and
//! extended to their depth.

use candle_core::{Result, Tensor};

use wick_nn::checkpoint::Checkpointing;
use wick_nn::graph::graph_bytes;
use wick_nn::params::Params;

/// Bytes that are affine in the batch: `fixed + batch * per_sample`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct Affine {
    /// Independent of the batch.
    pub fixed: usize,
    /// Added by each sample.
    pub per_sample: usize,
}

impl Affine {
    /// Through the values at batch `b` and `2b`.
    fn from_doubling(b: usize, at_b: usize, at_2b: usize) -> Self {
        let per_sample = at_2b.saturating_sub(at_b) / b.max(1);
        Affine { fixed: at_b.saturating_sub(b.saturating_mul(per_sample)), per_sample }
    }

    /// The value at `batch` (`usize::MAX` when it is not representable: it never fits).
    pub fn at(&self, batch: usize) -> usize {
        self.fixed.saturating_add(batch.saturating_mul(self.per_sample))
    }
}

/// Bytes profiled at increasing batches, read by linear interpolation between them and, beyond
/// the largest, along the last segment's line (never below the larger of its two points).
///
/// Rationale: a backward pass's transient memory is a maximum over its ops, each affine in the
/// batch, so it is convex and its slope can grow with the batch (ResNet-18 at 224² needs more
/// per sample from batch 4 on than between 2 and 4, so a line through 2 and 4 put its training
/// step low at batch 32: BENCHMARKS.md, "Zoo (issue 5)"). For convex values the last segment is the steepest
/// and the best line beyond the profile. The profiled values also carry scheduling noise: the
/// CPU kernels' parallel chunks overlap differently from run to run (a 16-wide ResNet-18 at 64²
/// moves by one 384 KiB buffer at batch 2, 4 or 8), and the noise makes the values locally
/// non-convex. The upper envelope of every segment's line, used before, then extrapolated an
/// early, steep segment from batch 2 or 4 to batch 24, multiplying the noise (same section);
/// interpolating keeps each value's noise to its own segments.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Piecewise {
    /// `(batch, bytes)`, batches increasing.
    pub points: Vec<(usize, usize)>,
}

impl Piecewise {
    /// The value at `batch`: at or below the first profiled batch, the first value (the values
    /// grow with the batch); between two, on their segment; beyond the last, along the last
    /// segment (a falling last segment, which is noise, counts as flat at its larger value).
    /// `usize::MAX` when not representable: it never fits.
    pub fn at(&self, batch: usize) -> usize {
        self.read(batch, None)
    }

    /// [`Piecewise::at`], with the line beyond the last profiled batch made steeper by
    /// 1/[`EXTRAPOLATION_DIVISOR`] (the backward workspace's reading).
    pub fn at_steeper(&self, batch: usize) -> usize {
        self.read(batch, Some(EXTRAPOLATION_DIVISOR))
    }

    fn read(&self, batch: usize, steeper: Option<i128>) -> usize {
        let p = &self.points;
        match p.len() {
            0 => 0,
            1 => p[0].1,
            _ if batch <= p[0].0 => p[0].1,
            n => {
                let i = (1..n).find(|&i| p[i].0 >= batch).unwrap_or(n - 1);
                let ((b0, v0), (b1, v1)) = (p[i - 1], p[i]);
                let (b0, v0, b1, v1, x) = (b0 as i128, v0 as i128, b1 as i128, v1 as i128, batch as i128);
                // Saturating: the products can pass i128 for batches near usize::MAX.
                let value = if x <= b1 {
                    v0 + (v1 - v0) * (x - b0) / (b1 - b0).max(1)
                } else {
                    let rise = (v1 - v0).max(0).saturating_mul(x - b1) / (b1 - b0).max(1);
                    v0.max(v1).saturating_add(rise.saturating_add(steeper.map_or(0, |d| rise / d)))
                };
                usize::try_from(value.max(0)).unwrap_or(usize::MAX)
            }
        }
    }
}

/// Beyond the last profiled batch the backward workspace is read along its last segment made a
/// twentieth steeper (the rise over the last value grows by 1/`EXTRAPOLATION_DIVISOR`). Which
/// op's transients dominate can change above the profile and no profile below can show it: a
/// 32 000-token decoder's training peak grows 27.1 MiB per sample from batch 8 to 16 and 28.5
/// from 16 to 24, with a workspace whose profiled slope is flat. Training estimates beyond the
/// profile therefore err high, by a twentieth of the extrapolated rise at most. (Inference is
/// profiled to batch 32 and read straight: its allowance covers what lies beyond.)
pub const EXTRAPOLATION_DIVISOR: i128 = 20;

/// The batches a training profile runs, after a warm-up at batch 1. Batch 1 is profiled too:
/// below the first profiled batch a value is read flat, which put a batch-1 estimate one
/// sample's transients high.
pub const PROFILE_BATCHES: &[usize] = &[1, 2, 4, 8, 16];

/// The batches an inference profile runs: a forward pass is cheap, and the CNNs' forward peak
/// grows faster per sample beyond batch 16 than below it (ResNet-18 at 224²: 5.9 MiB per sample
/// up to 16, 6.6 beyond), which a profile that stopped at 16 extrapolated 4 % low at batch 32.
pub const INFERENCE_PROFILE_BATCHES: &[usize] = &[1, 2, 4, 8, 16, 32];

/// The batches a checkpointed training profile runs: one doubling further. With checkpointing
/// the batch-independent transients (a large embedding's gradient, added to in place of
/// nothing) stay the largest up to larger batches, and the recomputed block's transients, which
/// grow with the batch, overtake them later: all-MiniLM-L6-v2 at sequence 128 crosses over at
/// batch 16, which a profile ending at 16 cannot see (BENCHMARKS.md, "Zoo (issue 5)").
pub const CHECKPOINTED_PROFILE_BATCHES: &[usize] = &[1, 2, 4, 8, 16, 32];

/// The batches a training profile runs, with or without checkpointing.
pub fn profile_batches(checkpointing: bool) -> &'static [usize] {
    if checkpointing {
        CHECKPOINTED_PROFILE_BATCHES
    } else {
        PROFILE_BATCHES
    }
}

/// A model's memory profile at one input size, from forward (and backward) passes at
/// [`PROFILE_BATCHES`].
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct ActivationProfile {
    /// Bytes the graph keeps alive, counted from its tensors' shapes.
    pub activations: Affine,
    /// The largest single activation.
    pub largest: Affine,
    /// Transient bytes of the backward pass, profiled when an exact heap (counting allocator or
    /// caching heap) is installed (`None` otherwise), at the profiled batches. Beyond the largest
    /// it follows the last segment, the steepest for convex values; an op that dominates only at
    /// larger batches is not seen.
    pub backward_workspace: Option<Piecewise>,
    /// Peak bytes of a forward pass under [`wick_nn::no_grad`] (inference as it is run: nothing
    /// kept for backward), profiled like the workspace when an exact heap is installed.
    pub inference_peak: Option<Piecewise>,
    /// Bytes of the gradients the backward pass returns besides the parameters': candle's
    /// backward also differentiates the plain tensors an op reads (an attention mask broadcast
    /// to the hidden states, a fixed readout) and keeps those gradients in the store, which
    /// lives through the optimizer's update.
    pub kept_gradients: Affine,
}

impl ActivationProfile {
    /// Profiles `forward(batch)`, which must build the model's loss (a scalar; for inference,
    /// any output) for that batch; `params` are the model's parameters.
    pub fn measure(params: &Params, forward: impl Fn(usize) -> Result<Tensor>) -> Result<Self> {
        Self::measure_with(params, |batch, _| forward(batch), false)
    }

    /// [`ActivationProfile::measure`] for a `forward(batch, checkpoint)` that takes a
    /// checkpointing context: with `checkpointing`, each training pass runs its blocks
    /// checkpointed and back-propagates through [`Checkpointing::backward`], so the profile's
    /// activations are what the checkpointed graph keeps (the blocks' inputs) and its workspace
    /// includes the recomputation of one block during backward; the training passes then run
    /// at [`CHECKPOINTED_PROFILE_BATCHES`]. Inference is profiled without, at
    /// [`INFERENCE_PROFILE_BATCHES`].
    pub fn measure_with(
        params: &Params,
        forward: impl Fn(usize, Option<&Checkpointing>) -> Result<Tensor>,
        checkpointing: bool,
    ) -> Result<Self> {
        Self::measure_at(params, forward, checkpointing, &[])
    }

    /// [`ActivationProfile::measure_with`], also profiling the batches of `extra` that lie
    /// between the first and the last profiled batch. Read at a profiled batch, the estimate is
    /// the profile's own value; between two it is a line, and the kernels' scratch buffers do not
    /// always follow one (a 32 000-token decoder's training peak sat 5.7 MiB above the line
    /// between batches 4 and 8 at batch 5, and 5.6 below it at batch 6): profiling the batch a
    /// decision is about removes that error. Batches outside the range are left to the
    /// extrapolation (a batch beyond the profile is the one that may not fit).
    pub fn measure_at(
        params: &Params,
        forward: impl Fn(usize, Option<&Checkpointing>) -> Result<Tensor>,
        checkpointing: bool,
        extra: &[usize],
    ) -> Result<Self> {
        Self::measure_in(params, forward, checkpointing.then_some(&Checkpointing::new), None, extra)
    }

    /// [`ActivationProfile::measure_at`] with every block run as a ZeRO stage-3 rank runs it:
    /// checkpointed, its parameters and gradients through `blocks` (a
    /// [`super::BlockRecorder`]: the gather's and the reduce-scatter's buffers allocated where a
    /// rank's are). The backward workspace is then the stage-3 step's: the block's gathered
    /// parameters, its recomputation and its gradients on their way out — the blocks' gradients
    /// are not in the store the profile subtracts, since a rank never holds them whole.
    pub fn measure_sharded(
        params: &Params,
        forward: impl Fn(usize, Option<&Checkpointing>) -> Result<Tensor>,
        blocks: std::sync::Arc<super::BlockRecorder>,
        extra: &[usize],
    ) -> Result<Self> {
        let context = || Checkpointing::sharded(blocks.clone());
        Self::measure_in(params, forward, Some(&context), Some(&|| blocks.take_pieces()), extra)
    }

    /// The profile, each training pass in the checkpointing context `context` makes (none:
    /// not checkpointed); `pieces` drops the reduced gradients a sharded pass kept outside the
    /// store, and says their bytes (they are gradients, as the store's are).
    fn measure_in(
        params: &Params,
        forward: impl Fn(usize, Option<&Checkpointing>) -> Result<Tensor>,
        context: Option<&dyn Fn() -> Checkpointing>,
        pieces: Option<&dyn Fn() -> usize>,
        extra: &[usize],
    ) -> Result<Self> {
        let checkpointing = context.is_some();
        let with_extra = |base: &[usize]| {
            let (first, last) = (base[0], base[base.len() - 1]);
            let mut all: Vec<usize> =
                base.iter().copied().chain(extra.iter().copied().filter(|b| (first..last).contains(b))).collect();
            all.sort_unstable();
            all.dedup();
            all
        };
        let mut counts = Vec::new();
        let mut workspace = Vec::new();
        let mut kept = Vec::new();
        let training = &with_extra(profile_batches(checkpointing))[..];
        let inference_batches = &with_extra(INFERENCE_PROFILE_BATCHES)[..];
        // A first pass warms up what the process creates once (thread pools, kernel caches), so
        // it is not mistaken for the model's memory; the matrix products' per-thread scratch is
        // allocated on every thread first (a batch-1 pass may not multiply on every thread).
        wick_nn::cpu::allocate_thread_scratch();
        for (index, batch) in std::iter::once(1).chain(training.iter().copied()).enumerate() {
            let before = wick::host_memory::exact_heap().map(|(b, _)| b);
            wick::host_memory::reset_exact_peak();
            let checkpoint = context.map(|make| make());
            let out = forward(batch, checkpoint.as_ref())?;
            let graph = graph_bytes(&out);
            if out.elem_count() == 1 && out.track_op() {
                let grads = match &checkpoint {
                    Some(c) => c.backward(&out, params)?,
                    None => out.backward()?,
                };
                let bytes = |g: &Tensor| g.elem_count() * g.dtype().size_in_bytes();
                let param_grads: usize = params.iter().filter_map(|(_, v)| grads.get(v)).map(bytes).sum();
                let all_grads: usize = grads.get_ids().filter_map(|id| grads.get_id(*id)).map(bytes).sum();
                drop(grads);
                let param_grads = param_grads + pieces.map_or(0, |take| take());
                if let (Some(before), Some((peak, _)), true) = (before, wick::host_memory::exact_peak(), index > 0) {
                    workspace.push(peak.saturating_sub(before + graph.total + param_grads));
                }
                if index > 0 {
                    kept.push(all_grads.saturating_sub(param_grads));
                }
            }
            if index > 0 {
                counts.push(graph);
            }
        }
        // Inference as it is run: the forward pass under no_grad, its peak above the start.
        let mut inference = Vec::new();
        for (index, batch) in std::iter::once(1).chain(inference_batches.iter().copied()).enumerate() {
            let before = wick::host_memory::exact_heap().map(|(b, _)| b);
            wick::host_memory::reset_exact_peak();
            drop(wick_nn::no_grad(|| forward(batch, None))?);
            if let (Some(before), Some((peak, _)), true) = (before, wick::host_memory::exact_peak(), index > 0) {
                inference.push(peak.saturating_sub(before));
            }
        }
        let points = |batches: &[usize], v: Vec<usize>| Piecewise { points: batches.iter().copied().zip(v).collect() };
        // The graph's bytes are affine in the batch: the last secant (the largest batches).
        let n = training.len();
        let (b, last) = (training[n - 2], n - 1);
        Ok(ActivationProfile {
            activations: Affine::from_doubling(b, counts[last - 1].total, counts[last].total),
            largest: Affine::from_doubling(b, counts[last - 1].largest, counts[last].largest),
            kept_gradients: match kept.len() {
                k if k == n => Affine::from_doubling(b, kept[last - 1], kept[last]),
                _ => Affine::default(),
            },
            backward_workspace: (workspace.len() == n).then(|| points(training, workspace)),
            inference_peak: (inference.len() == inference_batches.len()).then(|| points(inference_batches, inference)),
        })
    }
}

impl ActivationProfile {
    /// The profile of the same model with `layers` identical layers, from profiles with one
    /// (`one`) and two (`two`): activations and the inference peak grow by the second layer's
    /// share per layer; the largest activation is the larger of the two. The backward workspace
    /// follows its two values in either direction, down to zero: it is the backward pass's peak
    /// less the graph and *every* parameter's gradient, and where that peak comes early in the
    /// backward pass (a large vocabulary's logits), the layers' gradients do not exist yet, so
    /// each layer lowers the workspace by its gradients (`layer_gradients`: one layer's parameter
    /// gradient bytes, the most it falls per layer). Read as "never falls", a 6-layer decoder's
    /// estimate came out 6.6 % high; at zero, the estimate is the graph with every gradient,
    /// which the end of the backward pass holds.
    pub fn with_layers(one: &Self, two: &Self, layers: usize, layer_gradients: usize) -> Self {
        let extra = layers.saturating_sub(1);
        let grow = |a: Affine, b: Affine| Affine {
            fixed: a.fixed.saturating_add(extra.saturating_mul(b.fixed.saturating_sub(a.fixed))),
            per_sample: a.per_sample.saturating_add(extra.saturating_mul(b.per_sample.saturating_sub(a.per_sample))),
        };
        let larger =
            |a: Affine, b: Affine| Affine { fixed: a.fixed.max(b.fixed), per_sample: a.per_sample.max(b.per_sample) };
        // `shrinks`: the values may fall with depth (see below), down to zero.
        let piecewise = |a: &Option<Piecewise>, b: &Option<Piecewise>, shrinks: bool| match (a, b) {
            (Some(a), Some(b)) => {
                let deeper = |(batch, a): (usize, usize), b: usize| {
                    let value = if shrinks && b < a {
                        // By at most one layer's gradients per layer: a larger fall is the two
                        // profiles' noise, which depth would multiply.
                        a.saturating_sub(extra.saturating_mul((a - b).min(layer_gradients)))
                    } else {
                        a.saturating_add(extra.saturating_mul(b.saturating_sub(a)))
                    };
                    (batch, value)
                };
                let values: Vec<(usize, usize)> =
                    a.points.iter().zip(&b.points).map(|(&a, &(_, b))| deeper(a, b)).collect();
                if layers <= 2 {
                    return Some(Piecewise { points: values });
                }
                // Deeper than profiled: a batch profiled besides the powers of two (see
                // `measure_at`) carries its kernels' bump in each small model, and the depth
                // would multiply the difference of two bumps (a 6-layer decoder came out under
                // its measured peak at batch 6 that way). Those batches are read on the line
                // between the powers of two instead.
                let line = Piecewise { points: values.iter().copied().filter(|(x, _)| x.is_power_of_two()).collect() };
                Some(Piecewise {
                    points: values
                        .iter()
                        .map(|&(x, v)| if x.is_power_of_two() { (x, v) } else { (x, line.at(x)) })
                        .collect(),
                })
            }
            (a, b) => a.clone().or_else(|| b.clone()),
        };
        ActivationProfile {
            activations: grow(one.activations, two.activations),
            largest: larger(one.largest, two.largest),
            kept_gradients: grow(one.kept_gradients, two.kept_gradients),
            backward_workspace: piecewise(&one.backward_workspace, &two.backward_workspace, true),
            inference_peak: piecewise(&one.inference_peak, &two.inference_peak, false),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::Piecewise;

    fn profile(values: [usize; 4]) -> Piecewise {
        Piecewise { points: [2, 4, 8, 16].into_iter().zip(values).collect() }
    }

    #[test]
    fn convex_values_are_interpolated_and_extended_along_the_steepest_segment() {
        // 100 + 10·b up to batch 4, then 20 per sample: a maximum of two lines.
        let p = profile([120, 140, 220, 380]);
        assert_eq!([p.at(1), p.at(2), p.at(3), p.at(6), p.at(12), p.at(16)], [120, 120, 130, 180, 300, 380]);
        assert_eq!(p.at(24), 540);
        // An envelope of the segments' lines gives the same values for convex points.
        let lines = |b: i64| [100 + 10 * b, 60 + 20 * b].into_iter().max().unwrap() as usize;
        for b in 2..=64 {
            assert_eq!(p.at(b), lines(b as i64), "batch {b}");
        }
    }

    #[test]
    fn noise_at_a_small_batch_stays_in_its_segments() {
        // Batch 2 measured one 384 KiB buffer low, batch 4 high (the ResNet-18 bf16 case): a
        // line through them would reach 9.5 MB at batch 24; the last segment gives 5.6 MB.
        let noisy = profile([1_971_891, 2_660_054, 3_249_942, 4_429_718]);
        let clean = profile([2_365_110, 2_266_835, 3_249_942, 4_429_718]);
        assert_eq!(noisy.at(24), clean.at(24));
        assert_eq!(noisy.at(24), 4_429_718 + 8 * (4_429_718 - 3_249_942) / 8);
    }

    #[test]
    fn a_falling_last_segment_extends_flat_and_huge_batches_saturate() {
        let p = profile([10, 20, 40, 30]);
        assert_eq!([p.at(12), p.at(16), p.at(1000)], [35, 30, 40]);
        let steep = profile([0, 0, usize::MAX / 2, usize::MAX]);
        assert_eq!(steep.at(usize::MAX), usize::MAX);
        assert_eq!(Piecewise { points: vec![] }.at(5), 0);
        assert_eq!(Piecewise { points: vec![(2, 7)] }.at(50), 7);
    }
}
