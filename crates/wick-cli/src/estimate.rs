//! `wick estimate MODEL`: the memory a zoo model needs at a batch size, per mode, from the
//! estimator (`wick_zoo::estimate`): the model is built on the CPU and profiled at batches 2, 4,
//! 8 and 16 (its graph's tensors counted; the backward pass's transients measured by the caching
//! heap this binary installs), then extrapolated to the batch asked for.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use candle_core::{DType, Device, Tensor};
use clap::{Args, ValueEnum};
use wick_memory::format_bytes;
use wick_nn::checkpoint::Checkpointing;
use wick_nn::Model;
use wick_zoo::estimate::{estimate_bytes, ActivationProfile, Estimate, Mode, ParamBytes};
use wick_zoo::registry::{Input, ModelSpec, ZooModel, NAMED};

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
    /// Also run the step once at `--batch` on the CPU and print its measured peak beside the
    /// estimate (inference under no_grad, and SGD; the model's memory: parameters, batch, graph,
    /// gradients, transients).
    #[arg(long)]
    pub measure: bool,
    /// Print JSON instead of a table.
    #[arg(long)]
    pub json: bool,
}

/// The model's peak heap bytes over one `mode` step at `batch` (parameters included, nothing
/// else the process held before), from the caching heap's exact counters.
fn measure(built: &Built, batch: usize, mode: Mode, checkpointing: bool) -> Result<Option<usize>> {
    use wick::host_memory::{exact_heap, exact_peak, reset_exact_peak};
    let Some((before, _)) = exact_heap() else { return Ok(None) };
    reset_exact_peak();
    match mode {
        Mode::Inference => drop(wick_nn::no_grad(|| built.loss(batch, None))?),
        Mode::TrainSgd => {
            let checkpoint = checkpointing.then(Checkpointing::new);
            let loss = built.loss(batch, checkpoint.as_ref())?;
            let grads = match &checkpoint {
                Some(c) => c.backward(&loss, built.model.params())?,
                None => loss.backward()?,
            };
            // The graph goes before the update, as in the trainer.
            drop(loss);
            built.model.params().sgd_step(&grads, 1e-6)?;
        }
        _ => return Ok(None),
    }
    Ok(exact_peak().map(|(peak, _)| peak.saturating_sub(before) + ParamBytes::of(built.model.params()).total))
}

/// A model built whole on the CPU, with its synthetic batches.
pub struct Built {
    spec: ModelSpec,
    model: ZooModel,
    dtype: DType,
}

impl Built {
    fn new(spec: ModelSpec, dtype: DType) -> Result<Self> {
        let model = spec.build(dtype, &Device::Cpu)?;
        Ok(Built { spec, model, dtype })
    }

    /// The loss of a synthetic batch of `batch`, checkpointed in `c` when given.
    fn loss(&self, batch: usize, c: Option<&Checkpointing>) -> Result<Tensor> {
        Ok(self.model.loss_with(&self.spec.batch(batch, self.dtype, &Device::Cpu)?, c)?)
    }
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

fn modes(arg: ModeArg) -> Vec<Mode> {
    match arg {
        ModeArg::Inference => vec![Mode::Inference],
        ModeArg::Sgd => vec![Mode::TrainSgd],
        ModeArg::SgdMomentum => vec![Mode::TrainSgdMomentum],
        ModeArg::Adamw => vec![Mode::TrainAdamW],
        ModeArg::All => vec![Mode::Inference, Mode::TrainSgd, Mode::TrainSgdMomentum, Mode::TrainAdamW],
    }
}

/// The batches a profile runs, in words ("2, 4, 8 and 16").
fn batch_list(checkpointing: bool) -> String {
    let batches = wick_zoo::estimate::profile_batches(checkpointing).map(|b| b.to_string());
    format!("{} and {}", batches[..batches.len() - 1].join(", "), batches[batches.len() - 1])
}

/// A model's profile, and the model itself where it was built whole.
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
    /// The model's architecture and size.
    spec: ModelSpec,
    /// Its dtype.
    dtype: DType,
    /// The model, when it was built whole (not the LLaMA sizes, profiled through two layers).
    built: Option<Built>,
}

impl Profiled {
    /// Builds the model on the CPU and profiles it (a spinner meanwhile).
    pub fn new(args: &ModelArgs) -> Result<Self> {
        let dtype = match args.precision {
            Precision::F32 => DType::F32,
            Precision::AmpBf16 => DType::BF16,
        };
        let spinner = spinner("building the model on the CPU".into());
        let (spec, what) = spec_of(args)?;
        let started;
        let (profile, built, numel, param_bytes) = if spec.profiled_by_layers() {
            spinner.set_message(format!("profiling {what} through one and two layers on the CPU"));
            started = Instant::now();
            let profile = spec.profile(dtype, args.checkpointing).context("profiling the model")?;
            let numel = spec.parameter_count().context("the parameter count overflows")?;
            let bytes = spec.param_bytes(dtype).context("the parameter bytes overflow")?;
            (profile, None, numel, bytes)
        } else {
            let built = Built::new(spec.clone(), dtype).context("building the model")?;
            spinner.set_message(format!("profiling {what} at batches {} on the CPU", batch_list(args.checkpointing)));
            started = Instant::now();
            let params = built.model.params();
            let profile = ActivationProfile::measure_with(
                params,
                |b, c| built.loss(b, c).map_err(candle_core::Error::wrap),
                args.checkpointing,
            )
            .context("profiling the model")?;
            let (numel, bytes) = (params.numel(), ParamBytes::of(params));
            (profile, Some(built), numel, bytes)
        };
        spinner.finish_and_clear();
        Ok(Profiled {
            what,
            numel,
            param_bytes,
            profile,
            seconds: started.elapsed().as_secs_f64(),
            precision: args.precision,
            checkpointing: args.checkpointing,
            spec,
            dtype,
            built,
        })
    }

    /// The estimate of `mode` at `batch`.
    pub fn estimate(&self, batch: usize, mode: Mode) -> Estimate {
        estimate_bytes(self.param_bytes, &self.profile, batch, mode, self.precision == Precision::AmpBf16)
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
            if self.checkpointing { ", training with activation checkpointing" } else { "" },
            if self.profile.backward_workspace.is_some() { "measured by the caching heap" } else { "a lower bound" },
        )
    }
}

/// Runs `wick estimate`.
pub fn run(args: &EstimateArgs) -> Result<()> {
    if args.batch == 0 {
        bail!("--batch must be at least 1");
    }
    let p = Profiled::new(&args.model)?;
    let (profile, profile_s) = (&p.profile, p.seconds);
    let estimates: Vec<Estimate> = modes(args.mode).into_iter().map(|mode| p.estimate(args.batch, mode)).collect();
    if args.measure && args.model.precision != Precision::F32 {
        bail!("--measure runs f32 steps only (a mixed-precision step needs its masters and optimizer)");
    }
    let measured: Vec<Option<usize>> = if args.measure {
        let spinner = spinner(format!("running batch {} on the CPU to measure its peak", args.batch));
        let whole;
        let built = match &p.built {
            Some(built) => built,
            None => {
                // A model profiled through fewer layers, built whole now (pre-flight refuses
                // one that does not fit).
                whole = Built::new(p.spec.clone(), p.dtype).context("building the whole model")?;
                &whole
            }
        };
        let m = estimates
            .iter()
            .map(|e| measure(built, args.batch, e.mode, p.checkpointing))
            .collect::<Result<Vec<_>>>()?;
        spinner.finish_and_clear();
        m
    } else {
        vec![None; estimates.len()]
    };
    let batches = wick_zoo::estimate::profile_batches(p.checkpointing);
    let verb = if batches.contains(&args.batch) {
        "read at"
    } else if batches[0] < args.batch && args.batch < batches[batches.len() - 1] {
        "interpolated to"
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
            "parameters": p.numel,
            "profile": profile,
            "profile_seconds": profile_s,
            "estimates": estimates,
            "measured_peaks": measured,
        });
        println!("{}", serde_json::to_string_pretty(&out)?);
        return Ok(());
    }
    let checkpointed = if p.checkpointing { ", activation checkpointing" } else { "" };
    println!("{} — {} parameters, {:?}{checkpointed}, batch {}", p.what, p.numel, args.model.precision, args.batch);
    println!(
        "| {:<18} | {:>11} | {:>11} | {:>11} | {:>11} | {:>11} | {:>11} | {:>11} |",
        "mode", "parameters", "gradients", "optimizer", "masters", "activations", "workspace", "total"
    );
    println!("|{}|", "-".repeat(124));
    let b = |n: usize| format_bytes(n as u64);
    for e in &estimates {
        println!(
            "| {:<18} | {:>11} | {:>11} | {:>11} | {:>11} | {:>11} | {:>11} | {:>11} |",
            format!("{:?}", e.mode),
            b(e.parameters),
            b(e.gradients),
            b(e.optimizer_state),
            b(e.master_weights),
            b(e.activations),
            b(e.workspace),
            b(e.total)
        );
    }
    for (e, m) in estimates.iter().zip(&measured) {
        if let Some(m) = m {
            let off = (e.total as f64 / *m as f64 - 1.0) * 100.0;
            println!("measured {:?} at batch {}: {} (the estimate is {off:+.1} %)", e.mode, args.batch, b(*m));
        }
    }
    println!("{how}");
    Ok(())
}
