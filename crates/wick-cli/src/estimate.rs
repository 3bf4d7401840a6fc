//! `wick estimate MODEL`: the memory a zoo model needs at a batch size, per mode, from the
//! estimator (`wick_zoo::estimate`): the model is built on the CPU and profiled at batches 2, 4,
//! 8 and 16 (its graph's tensors counted; the backward pass's transients measured by the caching
//! heap this binary installs), then extrapolated to the batch asked for.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use candle_core::DType;
use clap::{Args, ValueEnum};
use wick_memory::format_bytes;
use wick_zoo::estimate::{
    estimate_per_rank, ActivationProfile, Estimate, Mode, ParamBytes, PeakPhase, RankEstimate, Ranks, Update,
};
use wick_zoo::registry::{Input, ModelSpec, NAMED};

use crate::measure;

/// The zoo's published models as `clap` values, each with its help line.
fn model_names() -> clap::builder::PossibleValuesParser {
    clap::builder::PossibleValuesParser::new(
        NAMED.iter().map(|n| clap::builder::PossibleValue::new(n.name).help(n.about)),
    )
}

/// The precision of the run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Precision {
    /// Everything in f32.
    F32,
    /// bf16 autocast: a bf16 model with f32 masters and f32 optimizer state.
    AmpBf16,
}

/// The device the step will run on, which decides how the optimizer's update runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Target {
    /// The CPU: wick-train updates each parameter in one pass, in place.
    Cpu,
    /// A CUDA GPU: the masters' update runs in wick's multi-tensor kernels, in place.
    Cuda,
}

/// What a GPU's figures are worth today, printed (on stderr) with every `--on cuda` estimate and
/// every `fit-batch` against a GPU's budget. On the last device run (BENCHMARKS.md, CUDA: "Every
/// CUDA path on a device") wick's layers ran on a GPU as candle's composed ops and kept 1.15–5.6×
/// these estimates; since then every layer has a CUDA body that keeps what the CPU graph keeps
/// and the update runs in place, which is what the estimate models — not yet checked against a
/// device's measured peak, and without cuDNN's per-convolution workspaces.
pub const GPU_CAVEAT: &str = "warning: not checked against a GPU's measured peak yet. The estimate models wick's GPU step as it now runs (every layer's CUDA body keeps what the CPU graph keeps; the update in place), but the last device run measured the older GPU path, whose composed ops kept 1.15-5.6x these estimates (BENCHMARKS.md, \"Every CUDA path on a device\"), and cuDNN's per-convolution workspaces are not counted. Leave headroom, or let `Engine::find_executable_batch_size` search on the GPU itself.";

/// Which estimates to print.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum ModeArg {
    /// Forward only.
    Inference,
    /// A training step with plain SGD.
    Sgd,
    /// With SGD and momentum.
    SgdMomentum,
    /// With AdamW.
    Adamw,
    /// All four.
    All,
}

/// Which model, at which input size and precision (shared by `estimate` and `fit-batch`).
#[derive(Debug, Args)]
pub struct ModelArgs {
    /// A zoo model by name.
    #[arg(value_parser = model_names(), required_unless_present = "config")]
    pub model: Option<String>,
    /// A Hugging Face `config.json` (BERT, or LLaMA with `model_type: llama`) instead of a name.
    #[arg(long, conflicts_with = "model")]
    pub config: Option<PathBuf>,
    /// Image side for the vision models (ViT: its configured size).
    #[arg(long, default_value_t = 224)]
    pub image: usize,
    /// Sequence length for the text models.
    #[arg(long, default_value_t = 128)]
    pub seq: usize,
    /// Precision.
    #[arg(long, value_enum, default_value = "f32")]
    pub precision: Precision,
    /// Training with activation checkpointing (each block's activations recomputed in backward
    /// instead of kept), as `TrainOptions::activation_checkpointing` and `wick train
    /// --checkpointing` run it.
    #[arg(long)]
    pub checkpointing: bool,
    /// Data-parallel ranks (`wick train --ranks N`, or `mpirun -n N`): the figures are one
    /// rank's, at `--batch` examples per rank.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u64).range(1..=65536))]
    pub ranks: u64,
    /// ZeRO stage of a data-parallel run: 0 replicates everything, 1 shards the optimizer's
    /// state and the f32 masters over the ranks, 2 also reduce-scatters the gradients, 3 also
    /// shards the parameters (gathered a block at a time; the blocks recomputed in backward,
    /// so it implies --checkpointing, unless --no-recompute).
    #[arg(long, default_value_t = 0, value_parser = clap::value_parser!(u8).range(0..=3))]
    pub zero: u8,
    /// A data-parallel run that reduces its gradients after backward (`wick train
    /// --no-overlap`): no bucket in flight beside backward's activations.
    #[arg(long)]
    pub no_overlap: bool,
    /// A ZeRO stage-3 run that prefetches the next block's gather (`wick train --prefetch`):
    /// one more block whole beside the one that runs.
    #[arg(long)]
    pub prefetch: bool,
    /// A ZeRO stage-3 run whose blocks keep their activations (`wick train --no-recompute`).
    #[arg(long)]
    pub no_recompute: bool,
}

/// `wick estimate` arguments.
#[derive(Debug, Args)]
pub struct EstimateArgs {
    /// The model.
    #[command(flatten)]
    pub model: ModelArgs,
    /// Batch size.
    #[arg(long, default_value_t = 32)]
    pub batch: usize,
    /// Mode(s).
    #[arg(long, value_enum, default_value = "all")]
    pub mode: ModeArg,
    /// The device the step will run on (the optimizer's update differs).
    #[arg(long, value_enum, default_value = "cpu")]
    pub on: Target,
    /// Also run each mode's step once at `--batch` on the CPU as wick runs it and print its
    /// measured peak beside the estimate (inference under no_grad; plain SGD; momentum and AdamW
    /// as one trainer step with their state and, under AMP, the f32 masters; the model's memory:
    /// parameters, batch, graph, gradients, optimizer, transients).
    #[arg(long)]
    pub measure: bool,
    /// Print JSON instead of a table.
    #[arg(long)]
    pub json: bool,
}

/// The model the arguments name, and what it is in words.
fn spec_of(args: &ModelArgs) -> Result<(ModelSpec, String)> {
    let input = Input { image: args.image, seq: args.seq };
    let (spec, what) = match (&args.model, &args.config) {
        (_, Some(path)) => {
            let spec = ModelSpec::from_hf_config(path, args.seq)?;
            let kind = if spec.profiled_by_layers() { "LLaMA" } else { "BERT" };
            (spec, format!("{kind} from {}", path.display()))
        }
        (Some(name), None) => {
            let spec = ModelSpec::named(name, input)?;
            let title = NAMED.iter().find(|n| n.name == name).map_or(name.as_str(), |n| n.title);
            (spec, title.to_string())
        }
        (None, None) => bail!("name a model or give --config"),
    };
    let what = match &spec {
        ModelSpec::Llama { config, .. } => format!("{what}, {} layers × {}", config.num_layers, config.hidden_size),
        _ => what,
    };
    let what = format!("{what}, {}", spec.input_words());
    Ok((spec, what))
}

/// A spinner saying `message`, ticking on its own while the work runs.
fn spinner(message: String) -> indicatif::ProgressBar {
    let spinner = indicatif::ProgressBar::new_spinner();
    spinner.enable_steady_tick(std::time::Duration::from_millis(120));
    spinner.set_message(message);
    spinner
}

/// The modes `arg` asks for, at `precision`: plain SGD is not a mixed-precision mode (wick's
/// masters update with momentum or AdamW), so `all` leaves it out under AMP and `sgd` is refused.
pub fn modes(arg: ModeArg, precision: Precision) -> Result<Vec<Mode>> {
    let amp = precision == Precision::AmpBf16;
    Ok(match arg {
        ModeArg::Inference => vec![Mode::Inference],
        ModeArg::Sgd if amp => bail!("{}", measure::PLAIN_SGD_UNDER_AMP),
        ModeArg::Sgd => vec![Mode::TrainSgd],
        ModeArg::SgdMomentum => vec![Mode::TrainSgdMomentum],
        ModeArg::Adamw => vec![Mode::TrainAdamW],
        ModeArg::All if amp => vec![Mode::Inference, Mode::TrainSgdMomentum, Mode::TrainAdamW],
        ModeArg::All => vec![Mode::Inference, Mode::TrainSgd, Mode::TrainSgdMomentum, Mode::TrainAdamW],
    })
}

/// The batches a profile runs, in words ("2, 4, 8 and 16").
fn batch_list(checkpointing: bool) -> String {
    let batches = wick_zoo::estimate::profile_batches(checkpointing).iter().map(|b| b.to_string()).collect::<Vec<_>>();
    format!("{} and {}", batches[..batches.len() - 1].join(", "), batches[batches.len() - 1])
}

/// A model's profile.
pub struct Profiled {
    /// What it is.
    pub what: String,
    /// Its parameter count.
    pub numel: usize,
    /// Its parameter bytes.
    pub param_bytes: ParamBytes,
    /// Its memory profile.
    pub profile: ActivationProfile,
    /// Seconds the profile took.
    pub seconds: f64,
    /// Its precision.
    pub precision: Precision,
    /// Whether training was profiled with activation checkpointing.
    pub checkpointing: bool,
    /// The data-parallel layout the figures are one rank's of.
    pub ranks: Ranks,
    /// Under ZeRO stage 3: the block whose gather is the largest, and its bytes whole.
    pub largest_block: Option<(String, usize)>,
    /// The model's architecture and size.
    spec: ModelSpec,
}

impl Profiled {
    /// Builds the model on the CPU and profiles it (a spinner meanwhile), the batches of
    /// `extra` inside the profiled range too (see `ActivationProfile::measure_at`).
    pub fn new(args: &ModelArgs, extra: &[usize]) -> Result<Self> {
        crate::ranks::check_stage_options(args.zero, args.no_overlap, args.prefetch, args.no_recompute)?;
        let dtype = match args.precision {
            Precision::F32 => DType::F32,
            Precision::AmpBf16 => DType::BF16,
        };
        let spinner = spinner("building the model on the CPU".into());
        let (spec, what) = spec_of(args)?;
        let how = if spec.profiled_by_layers() {
            "through one and two layers".to_string()
        } else {
            format!("at batches {}", batch_list(args.checkpointing))
        };
        spinner.set_message(format!("profiling {what} {how} on the CPU"));
        let started = Instant::now();
        let (profile, param_bytes, blocks, largest_block) = if args.zero == 3 {
            // Each block as a stage-3 rank runs it: gathered, recomputed (or kept, gathered
            // again), its gradients reduce-scattered (see `ModelSpec::profile_sharded`).
            let (profile, bytes, blocks, name) = spec
                .profile_sharded(dtype, args.ranks as usize, !args.no_recompute, extra)
                .context("profiling the model")?;
            (profile, bytes, Some(blocks), Some((name, blocks.largest)))
        } else {
            let (profile, bytes) = spec.profile(dtype, args.checkpointing, extra).context("profiling the model")?;
            (profile, bytes, None, None)
        };
        // The largest reduction buffer is bounded from the parameter bytes: the zoo's large
        // models are estimated without being built.
        let mut ranks = Ranks { blocks, ..Ranks::bounded(args.ranks as usize, args.zero, 25 << 20, param_bytes) };
        if args.no_overlap {
            ranks.overlap = None;
        }
        ranks.prefetch = args.prefetch;
        ranks.recompute = !args.no_recompute;
        // Every parameter at 4 bytes: the count.
        let numel = param_bytes.f32_total / 4;
        spinner.finish_and_clear();
        Ok(Profiled {
            what,
            numel,
            param_bytes,
            profile,
            seconds: started.elapsed().as_secs_f64(),
            precision: args.precision,
            checkpointing: args.checkpointing || args.zero == 3,
            ranks,
            largest_block,
            spec,
        })
    }

    /// The estimate of `mode` at `batch`, its update run on `on`.
    pub fn estimate(&self, batch: usize, mode: Mode, on: Target) -> Estimate {
        self.rank_estimate(batch, mode, on).estimate
    }

    fn rank_estimate(&self, batch: usize, mode: Mode, on: Target) -> RankEstimate {
        let update = match on {
            Target::Cpu => Update::InPlace,
            Target::Cuda => Update::Fused,
        };
        let amp = self.precision == Precision::AmpBf16;
        estimate_per_rank(self.param_bytes, &self.profile, batch, mode, amp, update, self.ranks_on(on))
    }

    /// The run's layout as it trains on `on`: GPU parameters reduce their buckets over NCCL
    /// after backward (wick-train starts no bucket from inside a GPU's backward), so nothing is
    /// in flight beside backward's activations there; at stage 3 GPU ranks gather on the compute
    /// stream, with no prefetch (refused there).
    pub fn ranks_on(&self, on: Target) -> Ranks {
        match on {
            Target::Cpu => self.ranks,
            Target::Cuda => Ranks { overlap: None, prefetch: false, ..self.ranks },
        }
    }

    /// Under ZeRO stage 3, the phase of the step that sets the peak of `mode` at `batch`.
    pub fn peak_phase(&self, batch: usize, mode: Mode, on: Target) -> Option<PeakPhase> {
        self.rank_estimate(batch, mode, on).peak_phase
    }

    /// How the profile was made, in a sentence.
    pub fn how(&self) -> String {
        let batches = format!(
            "at batches {}{}",
            batch_list(self.checkpointing),
            if self.spec.profiled_by_layers() {
                " with one and with two layers, extrapolated to the depth,"
            } else {
                ""
            }
        );
        format!(
            "profiled on the CPU {batches} in {:.1} s (activations from the graph's tensors{}; backward \
             transients {}; inference profiled under no_grad)",
            self.seconds,
            match (self.checkpointing, self.ranks.zero_stage == 3 && !self.ranks.recompute) {
                (true, true) => ", training with ZeRO-3's blocks kept, gathered again for backward",
                (true, false) => ", training with activation checkpointing",
                (false, _) => "",
            },
            if self.profile.backward_workspace.is_some() { "measured by the caching heap" } else { "a lower bound" },
        )
    }
}

/// Runs `wick estimate`.
pub fn run(args: &EstimateArgs) -> Result<()> {
    if args.batch == 0 {
        bail!("--batch must be at least 1");
    }
    let wanted = modes(args.mode, args.model.precision)?;
    // Every argument check before the profile, which takes seconds.
    if args.measure && args.on != Target::Cpu {
        bail!("--measure runs the step on the CPU: estimate --on cpu");
    }
    if args.model.prefetch && args.on != Target::Cpu {
        bail!("--prefetch is stage 3's on host ranks: GPU ranks gather on the compute stream (wick train refuses it there)");
    }
    if args.measure && (args.model.ranks > 1 || args.model.zero > 0) {
        bail!(
            "--measure runs one process; a data-parallel step's per-rank peak is measured under mpirun \
             (wick-train's tests/multi_rank.rs)"
        );
    }
    // The batch asked for is profiled too when it lies between two profiled batches.
    let p = Profiled::new(&args.model, &[args.batch])?;
    let (profile, profile_s) = (&p.profile, p.seconds);
    let estimates: Vec<Estimate> = wanted.into_iter().map(|mode| p.estimate(args.batch, mode, args.on)).collect();
    let warning = (args.on == Target::Cuda).then_some(GPU_CAVEAT);
    if let Some(w) = warning {
        eprintln!("{w}");
    }
    let measured: Vec<Option<usize>> = if args.measure {
        let spinner = spinner(format!("running batch {} on the CPU to measure its peak", args.batch));
        let step =
            measure::Step { spec: &p.spec, amp: p.precision == Precision::AmpBf16, checkpointing: p.checkpointing };
        let m = estimates.iter().map(|e| measure::peak(&step, args.batch, e.mode)).collect::<Result<Vec<_>>>()?;
        spinner.finish_and_clear();
        m
    } else {
        vec![None; estimates.len()]
    };
    let batches = wick_zoo::estimate::profile_batches(p.checkpointing);
    let verb = if batches.contains(&args.batch) {
        "read at"
    } else if batches[0] < args.batch && args.batch < batches[batches.len() - 1] {
        "profiled at"
    } else {
        "extrapolated to"
    };
    let how = format!("{}; {verb} batch {}", p.how(), args.batch);
    if args.json {
        let out = serde_json::json!({
            "model": p.what,
            "precision": format!("{:?}", args.model.precision),
            "checkpointing": p.checkpointing,
            "batch": args.batch,
            "ranks": p.ranks_on(args.on),
            "largest_block": p.largest_block,
            "parameters": p.numel,
            "profile": profile,
            "profile_seconds": profile_s,
            "estimates": estimates,
            "graph_pools": estimates.iter().map(Estimate::graph_pool).collect::<Vec<_>>(),
            "measured_peaks": measured,
            "warning": warning,
        });
        println!("{}", serde_json::to_string_pretty(&out)?);
        return Ok(());
    }
    let checkpointed = if p.checkpointing { ", activation checkpointing" } else { "" };
    let per_rank = if p.ranks.ranks > 1 || p.ranks.zero_stage > 0 {
        format!(
            " per rank (global {}), {} ranks, ZeRO stage {}",
            args.batch.saturating_mul(p.ranks.ranks),
            p.ranks.ranks,
            p.ranks.zero_stage
        )
    } else {
        String::new()
    };
    println!(
        "{} — {} parameters, {:?}{checkpointed}, batch {}{per_rank}",
        p.what, p.numel, args.model.precision, args.batch
    );
    println!(
        "| {:<18} | {:>11} | {:>11} | {:>11} | {:>11} | {:>11} | {:>11} | {:>11} | {:>11} |",
        "mode", "parameters", "gradients", "optimizer", "masters", "activations", "workspace", "allowance", "total"
    );
    println!("|{}|", "-".repeat(138));
    let b = |n: usize| format_bytes(n as u64);
    for e in &estimates {
        println!(
            "| {:<18} | {:>11} | {:>11} | {:>11} | {:>11} | {:>11} | {:>11} | {:>11} | {:>11} |",
            format!("{:?}", e.mode),
            b(e.parameters),
            b(e.gradients),
            b(e.optimizer_state),
            b(e.master_weights),
            b(e.activations),
            b(e.workspace),
            b(e.allowance),
            b(e.total)
        );
    }
    for (e, m) in estimates.iter().zip(&measured) {
        if let Some(m) = m {
            let off = (e.total as f64 / *m as f64 - 1.0) * 100.0;
            println!("measured {:?} at batch {}: {} (the estimate is {off:+.1} %)", e.mode, args.batch, b(*m));
        }
    }
    if args.on == Target::Cuda {
        let pools: Vec<String> = estimates.iter().map(|e| format!("{:?} {}", e.mode, b(e.graph_pool()))).collect();
        println!(
            "as a CUDA graph (wick train --cuda-graph) the step's own tensors come from the driver's graph pool: {} \
             (the rest stays in wick's pool)",
            pools.join(", ")
        );
    }
    if let Some((name, bytes)) = &p.largest_block {
        let phases: Vec<String> = estimates
            .iter()
            .filter_map(|e| p.peak_phase(e.batch, e.mode, args.on).map(|phase| format!("{:?}: {phase}", e.mode)))
            .collect();
        println!(
            "ZeRO stage 3: the largest block gathered whole is {name} ({}); the peak is in {}",
            b(*bytes),
            phases.join(", ")
        );
    }
    println!("{how}");
    Ok(())
}
