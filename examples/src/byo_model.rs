//! candle-transformers models as a user brings them, timed two ways by the same code: governed
//! by wick (`byo-model`: the caching heap, an engine, weights through
//! [`wick_zoo::weights::SafetensorsWeights`], layers labelled by [`wick::span_labels`]) and
//! alone (`byo-model-alone`: the system allocator, candle's own memory-mapped `VarBuilder`, no
//! subscriber) — what a candle user runs without wick.
//!
//! ```text
//! byo-model --model llama --prepare DIR     # writes the random-weight models' files once
//! byo-model --model minilm --dir DIR --batch 8 --seq 128 --steps 5
//! byo-model-alone --model minilm --dir DIR --batch 8 --seq 128 --steps 5
//! ```
//!
//! Each prints one JSON line: load time, median forward time, the process's peak resident set.

use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{bail, Context, Result};
use candle_core::{DType, Device, Tensor};
use candle_nn::VarBuilder;
use candle_transformers::models::{bert, llama};
use clap::{Parser, ValueEnum};

/// The models.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum ByoModel {
    /// all-MiniLM-L6-v2, its real weights (a folder with `config.json` and `model.safetensors`).
    Minilm,
    /// BERT-base (candle-transformers' default configuration), random weights.
    BertBase,
    /// A LLaMA of 8 layers 512 wide with a 32 000-token vocabulary, random weights.
    Llama,
}

/// The command line of both programs.
#[derive(Debug, Parser)]
pub struct ByoArgs {
    /// Which model.
    #[arg(long, value_enum)]
    pub model: ByoModel,
    /// The model's folder (MiniLM's own; for the random ones, where `--prepare` wrote them).
    #[arg(long)]
    pub dir: Option<PathBuf>,
    /// Write the random-weight model's file into this folder and exit.
    #[arg(long)]
    pub prepare: Option<PathBuf>,
    /// Sequences per forward pass.
    #[arg(long, default_value_t = 1)]
    pub batch: usize,
    /// Tokens per sequence.
    #[arg(long, default_value_t = 128)]
    pub seq: usize,
    /// Timed forward passes (one more is run first, untimed).
    #[arg(long, default_value_t = 5)]
    pub steps: usize,
    /// Governed only: record the allocation history while timing.
    #[arg(long)]
    pub history: bool,
    /// Governed only: no span labels (what labelling the layers costs).
    #[arg(long)]
    pub no_labels: bool,
    /// Governed only: the device (`cpu`, or `cuda` with the `cuda` feature).
    #[arg(long, default_value = "cpu")]
    pub device: String,
    /// Governed only, CUDA: the engine's pool capped at this many MiB (a cap below the weights
    /// shows the load refused, and a cap below a forward pass's peak its out-of-memory `Err`).
    #[arg(long)]
    pub cap_mib: Option<usize>,
}

/// The LLaMA timed here.
pub fn llama_config() -> llama::Config {
    llama::Config {
        hidden_size: 512,
        intermediate_size: 1376,
        vocab_size: 32_000,
        num_hidden_layers: 8,
        num_attention_heads: 8,
        num_key_value_heads: 8,
        use_flash_attn: false,
        rms_norm_eps: 1e-5,
        rope_theta: 10_000.0,
        bos_token_id: None,
        eos_token_id: None,
        rope_scaling: None,
        max_position_embeddings: 2048,
        tie_word_embeddings: false,
    }
}

fn bert_config(model: ByoModel, dir: &Path) -> Result<bert::Config> {
    Ok(match model {
        ByoModel::Minilm => {
            let path = dir.join("config.json");
            serde_json::from_str(&std::fs::read_to_string(&path).with_context(|| path.display().to_string())?)?
        }
        _ => bert::Config::default(),
    })
}

/// Writes the random-weight model's `model.safetensors` into `dir`.
pub fn prepare(model: ByoModel, dir: &Path) -> Result<()> {
    std::fs::create_dir_all(dir)?;
    let map = candle_nn::VarMap::new();
    let vb = VarBuilder::from_varmap(&map, DType::F32, &Device::Cpu);
    match model {
        ByoModel::Minilm => bail!("MiniLM has real weights: pass its folder with --dir"),
        ByoModel::BertBase => drop(bert::BertModel::load(vb, &bert::Config::default())?),
        ByoModel::Llama => drop(llama::Llama::load(vb, &llama_config())?),
    }
    let data = map.data().lock().map_err(|_| anyhow::anyhow!("poisoned"))?;
    let tensors: std::collections::HashMap<String, Tensor> =
        data.iter().map(|(k, v)| (k.clone(), v.as_tensor().clone())).collect();
    wick::tensor_files::write_safetensors(&dir.join("model.safetensors"), &tensors)?;
    Ok(())
}

enum Loaded {
    Bert(bert::BertModel),
    Llama(llama::Llama),
}

fn load(model: ByoModel, dir: &Path, vb: VarBuilder<'_>) -> Result<Loaded> {
    Ok(match model {
        ByoModel::Llama => Loaded::Llama(llama::Llama::load(vb, &llama_config())?),
        _ => Loaded::Bert(bert::BertModel::load(vb, &bert_config(model, dir)?)?),
    })
}

fn forward(model: &Loaded, ids: &Tensor) -> Result<Tensor> {
    Ok(match model {
        Loaded::Bert(m) => m.forward(ids, &ids.zeros_like()?, None)?,
        Loaded::Llama(m) => {
            let mut cache = llama::Cache::new(false, DType::F32, &llama_config(), ids.device())?;
            m.forward(ids, 0, &mut cache)?
        }
    })
}

/// The peak resident set of this process so far (`VmHWM`), in MiB.
fn peak_rss_mib() -> Option<f64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kib: f64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib / 1024.0)
}

/// Loads and times the model; `engine` is `Some` for the governed run.
pub fn run(args: &ByoArgs, engine: Option<&wick::Engine>) -> Result<()> {
    if let Some(dir) = &args.prepare {
        return prepare(args.model, dir);
    }
    let Some(dir) = &args.dir else { bail!("--dir: the model's folder") };
    let weights = dir.join("model.safetensors");
    let start = Instant::now();
    let model = match engine {
        Some(engine) => {
            let vb = wick_zoo::weights::SafetensorsWeights::open(&[&weights])?.var_builder(engine, DType::F32)?;
            load(args.model, dir, vb)?
        }
        None => {
            // SAFETY: the benchmark's own file, which nothing changes while it runs.
            let vb = unsafe { VarBuilder::from_mmaped_safetensors(&[&weights], DType::F32, &Device::Cpu)? };
            load(args.model, dir, vb)?
        }
    };
    let load_ms = start.elapsed().as_secs_f64() * 1e3;
    let vocab = match args.model {
        ByoModel::Llama => 32_000,
        _ => 30_000,
    };
    // Token ids spread over the vocabulary, the same in both programs.
    let ids: Vec<u32> = (0..args.batch * args.seq).map(|i| ((i * 7919 + 13) % vocab) as u32).collect();
    let device = engine.map_or(Device::Cpu, |e| e.device().clone());
    let ids = Tensor::from_vec(ids, (args.batch, args.seq), &device)?;
    forward(&model, &ids)?;
    if let (Some(engine), true) = (engine, args.history) {
        engine.record_memory_history(Some(1_000_000))?;
    }
    let mut times = Vec::with_capacity(args.steps);
    for _ in 0..args.steps {
        let t = Instant::now();
        let out = forward(&model, &ids)?;
        drop(out);
        times.push(t.elapsed().as_secs_f64() * 1e3);
    }
    times.sort_by(f64::total_cmp);
    let median = times.get(times.len() / 2).copied().unwrap_or(f64::NAN);
    let line = serde_json::json!({
        "model": format!("{:?}", args.model),
        "governed": engine.is_some(),
        "history": args.history,
        "batch": args.batch,
        "seq": args.seq,
        "load_ms": load_ms,
        "step_ms": median,
        "peak_rss_mib": peak_rss_mib(),
        "engine_peak_mib": engine.and_then(|e| e.max_memory_allocated()).map(|b| b as f64 / (1 << 20) as f64),
        "device": if device.is_cuda() { "cuda" } else { "cpu" },
    });
    println!("{line}");
    Ok(())
}
