//! Runs the AMP trial of one zoo model (`wick_tools::trial`: the same task, start and AdamW
//! steps in f32, bf16 and f16) and prints the losses; with `--out DIR` it also writes the trial's
//! start for an outside reference: `start.safetensors` (the f32 initial parameters by name, the
//! input images and labels), `wick.json` (wick's losses per precision and the settings) and
//! `grads-{f32,bf16,f16}.safetensors` (the first step's gradients, unscaled); `wick.json` also
//! carries the trial's ViT, BERT and LLaMA configurations (for BERT, the inputs are `input.ids`,
//! `input.mask`, `input.head` — the fixed readout — and `input.labels`; for LLaMA `input.ids`).
//! `scripts/torch-reference/amp_trial.py DIR` trains the same start in PyTorch (f64, f32 and
//! `torch.autocast` bf16) and compares.
//!
//! `cargo run --release -p wick-tools --bin amp-trial -- --model mobilenet_v2 --out /tmp/trial`

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use candle_core::{DType, Device, Tensor};
use clap::Parser;
use wick_nn::Autocast;
use wick_tools::trial::{bert_batch, llama_batch, task, train, trial_optimizer, vision_batch, Task};
use wick_train::optim::{AdamW, Optimizer};

#[derive(Parser, Debug)]
#[command(about = "Run one model's AMP trial and export its start for a reference framework")]
struct Args {
    /// A model of the trial: resnet18, resnet50, mobilenet_v2, vit (torchvision's parameter
    /// names), bert (Hugging Face's) or llama (wick's names; the reference script maps them to
    /// Hugging Face's Llama).
    #[arg(long, default_value = "mobilenet_v2")]
    model: String,
    /// Optimizer steps.
    #[arg(long, default_value_t = 12)]
    steps: usize,
    /// Directory for start.safetensors and wick.json.
    #[arg(long)]
    out: Option<PathBuf>,
    /// Start from these parameters (a safetensors file with every parameter by name, such as
    /// an exported start.safetensors a reference script has perturbed) instead of the seeded
    /// initial values; the images and labels stay the trial's.
    #[arg(long)]
    start: Option<PathBuf>,
}

/// Sets every parameter of `t` from `start` (converted to the parameter's dtype) and makes
/// `start`'s values the masters' starting values.
fn load_start(t: &mut Task, start: &HashMap<String, Tensor>, path: &std::path::Path) -> Result<()> {
    let mut masters = Vec::with_capacity(t.vars.len());
    for (name, var) in t.names.iter().zip(&t.vars) {
        let value = start.get(name).with_context(|| format!("{}: no tensor `{name}`", path.display()))?;
        if value.dims() != var.dims() {
            bail!("{}: `{name}` has shape {:?}, the model's is {:?}", path.display(), value.dims(), var.dims());
        }
        var.set(&value.to_dtype(var.dtype())?)?;
        masters.push(value.to_dtype(DType::F32)?);
    }
    t.masters = masters;
    Ok(())
}

/// Writes `start.safetensors` in `dir`: the f32 values every precision's masters start from
/// (the same in each task) and the inputs of `model`'s trial.
fn write_start(dir: &Path, model: &str, t: &Task, device: &Device) -> Result<()> {
    let mut tensors: HashMap<String, Tensor> = t.names.iter().cloned().zip(t.masters.iter().cloned()).collect();
    if model == "llama" {
        tensors.insert("input.ids".into(), llama_batch(device)?.to_dtype(DType::I64)?);
    } else if model == "bert" {
        let batch = bert_batch(device)?;
        tensors.insert("input.ids".into(), batch.ids.to_dtype(DType::I64)?);
        tensors.insert("input.mask".into(), batch.mask.to_dtype(DType::I64)?);
        tensors.insert("input.head".into(), batch.readout);
        tensors.insert("input.labels".into(), batch.labels.to_dtype(DType::I64)?);
    } else {
        let (images, labels) = vision_batch(device)?;
        tensors.insert("input.images".into(), images);
        tensors.insert("input.labels".into(), labels.to_dtype(DType::I64)?);
    }
    let path = dir.join("start.safetensors");
    save(&tensors, &path)
}

/// Saves tensors atomically (no truncated file on failure).
fn save(tensors: &HashMap<String, Tensor>, path: &std::path::Path) -> Result<()> {
    wick::tensor_files::write_safetensors(path, tensors)
        .map(drop)
        .with_context(|| format!("writing {}", path.display()))
}

fn run() -> Result<()> {
    let args = Args::parse();
    if !wick_tools::trial::MODELS.contains(&args.model.as_str()) {
        bail!("--model {}: expected one of {:?}", args.model, wick_tools::trial::MODELS);
    }
    if args.steps == 0 {
        bail!("--steps must be at least 1");
    }
    let device = Device::Cpu;
    let start = match &args.start {
        Some(path) => {
            Some(candle_core::safetensors::load(path, &device).with_context(|| format!("reading {}", path.display()))?)
        }
        None => None,
    };
    if let Some(dir) = &args.out {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    let mut runs = serde_json::Map::new();
    for autocast in [Autocast::off(), Autocast::bf16(), Autocast::f16()] {
        let mut t = task(&args.model, autocast, &device)?;
        if let (Some(start), Some(path)) = (&start, &args.start) {
            load_start(&mut t, start, path)?;
        }
        if let Some(dir) = &args.out {
            if autocast == Autocast::off() {
                write_start(dir, &args.model, &t, &device)?;
            }
            // The first step's gradients (unscaled), for a per-parameter comparison.
            let grads = (t.loss)()?.backward()?;
            let mut tensors = HashMap::new();
            for (name, var) in t.names.iter().zip(&t.vars) {
                if let Some(g) = grads.get(var.as_tensor()) {
                    tensors.insert(name.clone(), g.to_dtype(DType::F32)?);
                }
            }
            let dtype = format!("{:?}", autocast.model_dtype()).to_lowercase();
            let path = dir.join(format!("grads-{dtype}.safetensors"));
            save(&tensors, &path)?;
        }
        let report = train(&t, autocast, args.steps, trial_optimizer())?;
        println!(
            "{} {}: loss {:.5} → {:.5} after {} steps ({} skipped)",
            args.model,
            report.dtype,
            report.losses[0],
            report.losses.last().copied().unwrap_or(f32::NAN),
            args.steps,
            report.skipped_steps
        );
        runs.insert(report.dtype.clone(), serde_json::json!(report.losses));
    }
    if let Some(dir) = &args.out {
        let Optimizer::AdamW(AdamW { lr, beta1, beta2, eps, weight_decay }) = trial_optimizer() else {
            bail!("the trial optimizer is expected to be AdamW");
        };
        let json = serde_json::json!({
            "model": args.model,
            "steps": args.steps,
            "adamw": { "lr": lr, "beta1": beta1, "beta2": beta2, "eps": eps, "weight_decay": weight_decay },
            "losses": runs,
            "vit": wick_tools::trial::VIT,
            "bert": wick_tools::trial::BERT,
            "llama": wick_tools::trial::llama_config(),
        });
        let path = dir.join("wick.json");
        wick::files::write_atomic(&path, serde_json::to_string_pretty(&json)?.as_bytes())
            .with_context(|| format!("writing {}", path.display()))?;
        println!("wrote {} and start.safetensors", path.display());
    }
    Ok(())
}

wick::main!(run);
