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
use wick_nn::params::Params;
use wick_nn::{Labelled, Model};
use wick_zoo::bert::{Bert, BertConfig, SentenceBatch};
use wick_zoo::estimate::{estimate_bytes, ActivationProfile, Estimate, Mode, ParamBytes};
use wick_zoo::llama::LlamaConfig;
use wick_zoo::mobilenet::MobileNetV2;
use wick_zoo::resnet::{ResNet, ResNetDepth};
use wick_zoo::vit::{Vit, VitConfig};

use crate::llama_size;
use crate::models::{leak, token_ids, Built};

/// A model the command knows by name.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum ModelName {
    /// torchvision's ResNet-18 (11.7 M parameters).
    Resnet18,
    /// torchvision's ResNet-34 (21.8 M).
    Resnet34,
    /// torchvision's ResNet-50 (25.6 M).
    Resnet50,
    /// torchvision's MobileNetV2, width 1.0 (3.5 M).
    #[value(name = "mobilenet_v2")]
    MobilenetV2,
    /// torchvision's ViT-B/16 (86.6 M) at 224².
    #[value(name = "vit_b_16")]
    VitB16,
    /// BERT-base, uncased vocabulary (109 M), with a two-class readout.
    BertBase,
    /// all-MiniLM-L6-v2's encoder (22.7 M).
    Minilm,
    /// A LLaMA-style decoder with Llama-2-7B's shapes (6.7 B), profiled through one and two
    /// layers.
    #[value(name = "llama2-7b")]
    Llama2_7b,
    /// With Llama-2-13B's shapes (13 B).
    #[value(name = "llama2-13b")]
    Llama2_13b,
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
    #[arg(value_enum, required_unless_present = "config")]
    pub model: Option<ModelName>,
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
        Mode::Inference => drop(wick_nn::no_grad(|| (built.loss)(batch, None))?),
        Mode::TrainSgd => {
            let checkpoint = checkpointing.then(Checkpointing::new);
            let loss = (built.loss)(batch, checkpoint.as_ref())?;
            let grads = match &checkpoint {
                Some(c) => c.backward(&loss, built.params)?,
                None => loss.backward()?,
            };
            // The graph goes before the update, as in the trainer.
            drop(loss);
            built.params.sgd_step(&grads, 1e-6)?;
        }
        _ => return Ok(None),
    }
    Ok(exact_peak().map(|(peak, _)| peak.saturating_sub(before) + ParamBytes::of(built.params).total))
}

fn images(batch: usize, side: usize, classes: u32, dtype: DType) -> candle_core::Result<Labelled> {
    let inputs = Tensor::randn(0f32, 1.0, (batch, 3, side, side), &Device::Cpu)?.to_dtype(dtype)?;
    let labels: Vec<u32> = (0..batch as u32).map(|i| i % classes).collect();
    Ok(Labelled { inputs, labels: Tensor::new(labels, &Device::Cpu)? })
}

fn sentences(batch: usize, seq: usize, config: &BertConfig) -> candle_core::Result<SentenceBatch> {
    Ok(SentenceBatch {
        ids: token_ids(batch, seq, config.vocab_size)?,
        mask: Tensor::ones((batch, seq), DType::U32, &Device::Cpu)?,
        readout: Tensor::randn(0f32, 0.05, (config.hidden_size, 2), &Device::Cpu)?,
        labels: Tensor::new((0..batch as u32).map(|i| i % 2).collect::<Vec<_>>(), &Device::Cpu)?,
    })
}

fn build(args: &ModelArgs, dtype: DType) -> Result<Built> {
    let dev = Device::Cpu;
    let (image, seq) = (args.image, args.seq);
    if image < 32 || seq == 0 {
        bail!("--image must be at least 32 and --seq at least 1");
    }
    let cnn = |model: &'static dyn CnnModel, what: String| Built {
        params: model.params_ref(),
        loss: Box::new(move |b, c| model.loss_at(b, image, dtype, c)),
        what,
    };
    let bert = |config: BertConfig, what: String| -> Result<Built> {
        if seq > config.max_position_embeddings {
            bail!("--seq {seq} is longer than the model's {} positions", config.max_position_embeddings);
        }
        let model = leak(Bert::new(config.clone(), dtype, &dev)?);
        Ok(Built {
            params: model.params(),
            loss: Box::new(move |b, c| {
                model.loss_with(&sentences(b, seq, &config)?, c).map_err(candle_core::Error::wrap)
            }),
            what: format!("{what}, sequence {seq}"),
        })
    };
    Ok(match (args.model, &args.config) {
        (_, Some(path)) => bert(BertConfig::from_file(path)?, format!("BERT from {}", path.display()))?,
        (Some(ModelName::Llama2_7b | ModelName::Llama2_13b), _) => bail!("LLaMA sizes are profiled by layers"),
        (Some(ModelName::Resnet18), _) => {
            cnn(leak(ResNet::new(ResNetDepth::R18, 1000, 64, dtype, &dev)?), format!("ResNet-18, {image}²"))
        }
        (Some(ModelName::Resnet34), _) => {
            cnn(leak(ResNet::new(ResNetDepth::R34, 1000, 64, dtype, &dev)?), format!("ResNet-34, {image}²"))
        }
        (Some(ModelName::Resnet50), _) => {
            cnn(leak(ResNet::new(ResNetDepth::R50, 1000, 64, dtype, &dev)?), format!("ResNet-50, {image}²"))
        }
        (Some(ModelName::MobilenetV2), _) => {
            cnn(leak(MobileNetV2::new(1000, 1.0, dtype, &dev)?), format!("MobileNetV2, {image}²"))
        }
        (Some(ModelName::VitB16), _) => {
            let config = VitConfig::b16();
            let model = leak(Vit::new(config, dtype, &dev)?);
            Built {
                params: model.params(),
                loss: Box::new(move |b, c| {
                    model.loss_with(&images(b, config.image_size, 1000, dtype)?, c).map_err(candle_core::Error::wrap)
                }),
                what: format!("ViT-B/16, {}²", config.image_size),
            }
        }
        (Some(ModelName::BertBase), _) => bert(BertConfig::base(), "BERT-base".into())?,
        (Some(ModelName::Minilm), _) => bert(BertConfig::minilm_l6(), "all-MiniLM-L6-v2".into())?,
        (None, None) => bail!("name a model or give --config"),
    })
}

/// The CNN classifiers, through one object-safe door.
trait CnnModel {
    fn params_ref(&self) -> &Params;
    fn loss_at(
        &self,
        batch: usize,
        side: usize,
        dtype: DType,
        c: Option<&Checkpointing>,
    ) -> candle_core::Result<Tensor>;
}

impl<M: Model<Batch = Labelled>> CnnModel for M {
    fn params_ref(&self) -> &Params {
        self.params()
    }

    fn loss_at(
        &self,
        batch: usize,
        side: usize,
        dtype: DType,
        c: Option<&Checkpointing>,
    ) -> candle_core::Result<Tensor> {
        self.loss_with(&images(batch, side, 1000, dtype)?, c).map_err(candle_core::Error::wrap)
    }
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
    /// The model, when it was built whole (not the LLaMA sizes, profiled through two layers).
    pub built: Option<Built>,
    /// A LLaMA configuration to build whole for `--measure`.
    llama: Option<(LlamaConfig, DType, usize)>,
}

fn llama_of(args: &ModelArgs) -> Result<Option<(LlamaConfig, String)>> {
    Ok(match (args.model, &args.config) {
        (Some(ModelName::Llama2_7b), _) => Some((LlamaConfig::llama2_7b(), "LLaMA (Llama-2-7B shapes)".into())),
        (Some(ModelName::Llama2_13b), _) => Some((LlamaConfig::llama2_13b(), "LLaMA (Llama-2-13B shapes)".into())),
        (_, Some(path)) => LlamaConfig::from_hf_config(path)?.map(|c| (c, format!("LLaMA from {}", path.display()))),
        _ => None,
    })
}

impl Profiled {
    /// Builds the model on the CPU and profiles it (a spinner meanwhile).
    pub fn new(args: &ModelArgs) -> Result<Self> {
        let dtype = match args.precision {
            Precision::F32 => DType::F32,
            Precision::AmpBf16 => DType::BF16,
        };
        let spinner = spinner("building the model on the CPU".into());
        if let Some((config, what)) = llama_of(args)? {
            if args.seq == 0 || args.seq > config.max_seq {
                bail!("--seq must be between 1 and the model's {} positions", config.max_seq);
            }
            let what = format!("{what}, {} layers × {}, sequence {}", config.num_layers, config.hidden_size, args.seq);
            spinner.set_message(format!("profiling {what} through one and two layers on the CPU"));
            let started = Instant::now();
            let profile =
                llama_size::profile(config, dtype, args.seq, args.checkpointing).context("profiling the model")?;
            spinner.finish_and_clear();
            return Ok(Profiled {
                what,
                numel: config.parameter_count().unwrap_or(usize::MAX),
                param_bytes: llama_size::param_bytes(&config, dtype)?,
                profile,
                seconds: started.elapsed().as_secs_f64(),
                precision: args.precision,
                checkpointing: args.checkpointing,
                built: None,
                llama: Some((config, dtype, args.seq)),
            });
        }
        let built = build(args, dtype).context("building the model")?;
        spinner.set_message(format!(
            "profiling {} at batches {} on the CPU",
            built.what,
            batch_list(args.checkpointing)
        ));
        let started = Instant::now();
        let profile = ActivationProfile::measure_with(built.params, &*built.loss, args.checkpointing)
            .context("profiling the model")?;
        spinner.finish_and_clear();
        Ok(Profiled {
            what: built.what.clone(),
            numel: built.params.numel(),
            param_bytes: ParamBytes::of(built.params),
            profile,
            seconds: started.elapsed().as_secs_f64(),
            precision: args.precision,
            checkpointing: args.checkpointing,
            built: Some(built),
            llama: None,
        })
    }

    /// The estimate of `mode` at `batch`.
    pub fn estimate(&self, batch: usize, mode: Mode) -> Estimate {
        estimate_bytes(self.param_bytes, &self.profile, batch, mode, self.precision == Precision::AmpBf16)
    }

    /// The whole model, built now, for one profiled through fewer layers (a LLaMA size).
    fn build_whole(&self) -> Result<Built> {
        let Some((config, dtype, seq)) = self.llama else { bail!("{} has no other form to build", self.what) };
        llama_size::build(config, dtype, seq, self.what.clone())
    }

    /// How the profile was made, in a sentence.
    pub fn how(&self) -> String {
        let batches = format!(
            "at batches {}{}",
            batch_list(self.checkpointing),
            if self.llama.is_some() { " with one and with two layers, extrapolated to the depth," } else { "" }
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
                whole = p.build_whole()?;
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
