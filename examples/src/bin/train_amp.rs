//! The main job: trains a LLaMA-style decoder from the zoo with mixed precision — bf16 autocast on
//! the CPU by default, f16 with loss scaling on CUDA — with f32 master weights and f32 AdamW
//! state, a progress bar, and at the end the memory summary (what the parameters, masters and
//! optimizer state hold) and an HTML memory report written to a path it prints.
//!
//! `cargo run -p wick-examples --bin train-amp` (add `-- --help` for the options; with
//! `--features cuda`, `--device cuda` trains on GPU 0, and `--cuda-graph` runs each step after the
//! first as a CUDA graph).

use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use candle_core::{DType, Device, Tensor, Var};
use clap::Parser;
use indicatif::{ProgressBar, ProgressStyle};
use wick_examples::{DECODER, VOCAB};
use wick_nn::graph::graph_bytes;
use wick_nn::params::normal_tensor;
use wick_nn::Autocast;
use wick_nn::Model;
use wick_train::amp::{masters_by_name, StepOutcome};
use wick_train::optim::{AdamW, Optimizer};
use wick_train::updater::Updater;
use wick_zoo::llama::{Llama, LlamaConfig};

#[derive(Parser, Debug)]
#[command(about = "Train a zoo decoder with AMP and show where the memory went")]
struct Args {
    /// Optimizer steps.
    #[arg(long, default_value_t = 60)]
    steps: usize,
    /// Sequences per batch.
    #[arg(long, default_value_t = 8)]
    batch: usize,
    /// Tokens per sequence.
    #[arg(long, default_value_t = 64)]
    seq: usize,
    /// bf16, f16 or off (f32); the default is bf16 on the CPU and f16 on CUDA.
    #[arg(long)]
    precision: Option<String>,
    /// cpu, or cuda (needs `--features cuda`).
    #[arg(long, default_value = "cpu")]
    device: String,
    /// Where to write the HTML memory report.
    #[arg(long)]
    report: Option<PathBuf>,
    /// Clip the gradients to this total norm (PyTorch's `clip_grad_norm_` after `unscale_`),
    /// its coefficient folded into the update; the last step's norm is printed.
    #[arg(long)]
    clip_grad_norm: Option<f64>,
    /// Run each step as a CUDA graph after the first (`--device cuda`): forward, backward and the
    /// fused update captured once and replayed, each new batch copied into the graph's input.
    #[arg(long)]
    cuda_graph: bool,
}

/// A synthetic language: each token is followed by one of four successors (a fixed, seeded
/// table), so the best possible loss is ln 4 ≈ 1.386 and a model that learns gets close to it.
struct Language {
    successors: Vec<[u32; 4]>,
    state: u64,
}

impl Language {
    fn new() -> Result<Self> {
        let table: Vec<f32> = normal_tensor(&[VOCAB * 4], 1.0, 17, DType::F32, &Device::Cpu)?.to_vec1()?;
        let successors = (0..VOCAB)
            .map(|t| std::array::from_fn(|k| ((table[t * 4 + k].abs() * 1e4) as usize % VOCAB) as u32))
            .collect();
        Ok(Language { successors, state: 0x5EED })
    }

    fn next_random(&mut self) -> u64 {
        self.state ^= self.state << 13;
        self.state ^= self.state >> 7;
        self.state ^= self.state << 17;
        self.state
    }

    /// A batch of token sequences (batch, seq), on `device`.
    fn batch(&mut self, batch: usize, seq: usize, device: &Device) -> Result<Tensor> {
        let mut ids = Vec::with_capacity(batch * seq);
        for _ in 0..batch {
            let mut t = (self.next_random() % VOCAB as u64) as u32;
            for _ in 0..seq {
                ids.push(t);
                let k = (self.next_random() % 4) as usize;
                t = self.successors[t as usize][k];
            }
        }
        Ok(Tensor::from_vec(ids, (batch, seq), &Device::Cpu)?.to_device(device)?)
    }
}

/// The run's losses and steps: the first and last applied step's loss, the steps applied and
/// those the loss scaler skipped.
#[derive(Default)]
struct Progress {
    first: Option<f32>,
    last: f32,
    applied: usize,
    skipped: usize,
}

impl Progress {
    /// Counts a step with loss `value`, skipped by the scaler or applied; true when applied. A
    /// hundred skips mean no scale makes the gradients finite: an error.
    fn record(&mut self, value: f32, skipped: bool) -> Result<bool> {
        if skipped {
            self.skipped += 1;
            if self.skipped > 100 {
                bail!("the loss scaler skipped 100 steps: the gradients are not finite at any scale");
            }
            return Ok(false);
        }
        self.applied += 1;
        self.first.get_or_insert(value);
        self.last = value;
        Ok(true)
    }

    /// The line the run ends with.
    fn summary(&self) -> String {
        format!(
            "loss {:.3} → {:.3} (the best possible is ln 4 = {:.3}); {} step(s) skipped by the loss scaler.",
            self.first.unwrap_or(self.last),
            self.last,
            4f32.ln(),
            self.skipped
        )
    }
}

fn mib(bytes: usize) -> String {
    format!("{:.2} MiB", bytes as f64 / 1048576.0)
}

fn run() -> Result<()> {
    let args = Args::parse();
    if args.steps == 0 || args.batch == 0 || args.seq < 2 {
        bail!("need at least one step, one sequence and two tokens per sequence");
    }
    let engine = wick_examples::open_engine(&args.device, None)?;
    let device = engine.device().clone();
    let autocast = match &args.precision {
        Some(p) => Autocast::parse(p)?,
        None => Autocast::default_for(&device),
    };
    let config = LlamaConfig { max_seq: DECODER.max_seq.max(args.seq), ..DECODER };
    engine.mark("start");
    let model = Llama::new(config, autocast.model_dtype(), &device)?;
    let vars: Vec<_> = model.params.iter().map(|(_, v)| v.clone()).collect();
    // The masters start at the f32 initial values (the same model built in f32: same seed), not
    // at their bf16/f16 rounding.
    let masters = if autocast.enabled() {
        masters_by_name(&model.params, &Llama::new(config, DType::F32, &device)?.params)?
    } else {
        vars.iter().map(|v| v.as_tensor().clone()).collect()
    };
    let optimizer = Optimizer::AdamW(AdamW { lr: 3e-3, beta1: 0.9, beta2: 0.95, eps: 1e-8, weight_decay: 0.01 });
    if args.cuda_graph {
        return graphed(&args, &engine, (&model, &vars, masters), optimizer, autocast);
    }
    let mut updater = Updater::new(&engine, &vars, &masters, optimizer, autocast)?;
    updater.clip_grad_norm(args.clip_grad_norm)?;
    if engine.device().is_cuda() {
        println!("{}", updater.describe());
    }
    drop(masters);
    engine.mark("model, masters and optimizer state");
    println!(
        "Training a {}-layer decoder ({} parameters) on {} with autocast {:?}{}; {} steps of {}×{} tokens.",
        config.num_layers,
        model.params.numel(),
        engine.name(),
        autocast.model_dtype(),
        if autocast.needs_loss_scaling() { " and loss scaling" } else { "" },
        args.steps,
        args.batch,
        args.seq
    );

    let mut language = Language::new()?;
    let bar = ProgressBar::new(args.steps as u64);
    bar.set_style(
        ProgressStyle::with_template("{bar:40} {pos}/{len} [{elapsed_precise}<{eta_precise}] {msg}")
            .context("progress bar template")?,
    );
    let (mut progress, mut kept) = (Progress::default(), 0);
    while progress.applied < args.steps {
        let applied = progress.applied;
        let ids = language.batch(args.batch, args.seq, &device)?;
        let loss = model.loss(&ids)?;
        if kept == 0 {
            kept = graph_bytes(&loss).total;
        }
        let value = loss.to_dtype(DType::F32)?.to_scalar::<f32>()?;
        engine.mark(&format!("step {applied}: forward"));
        let outcome = updater.step(&loss, &vars, || engine.mark(&format!("step {applied}: backward")))?;
        drop(loss);
        if !progress.record(value, outcome == StepOutcome::Skipped)? {
            continue;
        }
        let scale = updater.scale()?.map(|s| format!(" scale {s}")).unwrap_or_default();
        let norm = updater.last_grad_norm().map(|n| format!(" grad norm {n:.3}")).unwrap_or_default();
        bar.set_message(format!("loss {value:.3}{scale}{norm}"));
        bar.inc(1);
    }
    bar.finish();
    engine.mark("done");

    println!("\n{}", progress.summary());
    if let (Some(norm), Some(bound)) = (updater.last_grad_norm(), args.clip_grad_norm) {
        println!("The last step's gradient norm before clipping: {norm:.4} (bound {bound}).");
    }
    // The same step's graph in f32, measured on an f32 copy of the model, for comparison.
    let f32_model = Llama::new(config, DType::F32, &device)?;
    let f32_kept = graph_bytes(&f32_model.loss(&language.batch(args.batch, args.seq, &device)?)?).total;
    drop(f32_model);
    println!(
        "Activations kept for backward in one step: {} in {:?}, {} in f32 ({:.2}×).\n",
        mib(kept),
        autocast.model_dtype(),
        mib(f32_kept),
        kept as f64 / f32_kept as f64
    );
    println!("{}", engine.memory_summary());
    let path = match args.report {
        Some(path) => path,
        None => wick::files::output_dir()?.join("train-amp.html"),
    };
    wick::files::write_atomic(&path, engine.memory_report().to_html().as_bytes())
        .with_context(|| format!("writing {}", path.display()))?;
    println!("HTML memory report: {}", path.display());
    Ok(())
}

/// `--cuda-graph` without CUDA.
#[cfg(not(feature = "cuda"))]
fn graphed(_: &Args, _: &wick::Engine, _: (&Llama, &[Var], Vec<Tensor>), _: Optimizer, _: Autocast) -> Result<()> {
    bail!("--cuda-graph needs a build with --features cuda and --device cuda")
}

/// `--cuda-graph`: the same training through the fused device step (`GraphStep`), the first step
/// eager, the second captured, every later one replayed; each batch is copied into the input the
/// graph reads. Prints how the graph came out (or why it was refused), the host's time to issue a
/// step before and after, and the memory summary with the graph's memory as its own line.
#[cfg(feature = "cuda")]
fn graphed(
    args: &Args,
    engine: &wick::Engine,
    (model, vars, masters): (&Llama, &[Var], Vec<Tensor>),
    optimizer: Optimizer,
    autocast: Autocast,
) -> Result<()> {
    use wick_train::amp::device_step::DeviceAmp;
    use wick_train::amp::graph_step::GraphStep;
    use wick_train::amp::GradScalerConfig;
    let device = engine.device().clone();
    let scaler = autocast.needs_loss_scaling().then(GradScalerConfig::default);
    let amp = DeviceAmp::new(&device, vars, Some(&masters), optimizer, scaler)?;
    drop(masters);
    let mut step = GraphStep::new(amp, &device, args.clip_grad_norm, 1)?;
    let mut language = Language::new()?;
    // Each batch is copied into the step's own input, which the graph reads.
    let forward = |inputs: &[Tensor]| model.loss(&inputs[0]).map_err(candle_core::Error::wrap);
    println!("Training with each step as a CUDA graph after the first, on {}.", engine.name());
    let mut progress = Progress::default();
    let mut host = [Vec::new(), Vec::new()];
    while progress.applied < args.steps {
        let ids = language.batch(args.batch, args.seq, &device)?;
        let start = std::time::Instant::now();
        step.step(&[ids], &forward)?;
        host[usize::from(step.shapes().graph().is_some())].push(start.elapsed().as_secs_f64() * 1e3);
        let value = step.last_loss()?;
        let report = step.last_step()?;
        if report.bad_norm {
            bail!("the gradients' total norm is {:?}: the update was not applied", report.norm);
        }
        progress.record(value, report.skipped)?;
    }
    println!("{}", progress.summary());
    match (step.shapes().graph(), step.shapes().refused()) {
        (Some(graph), _) => {
            let s = graph.shape();
            println!(
                "CUDA graph: {} nodes ({} kernels, {} copies, {} allocations and their frees, {} asked).",
                s.nodes,
                s.kernels,
                s.copies,
                s.allocations,
                mib(s.allocated_bytes)
            );
        }
        (None, Some(why)) => println!("Ran eagerly: {why}"),
        (None, None) => println!("Ran eagerly (no step after the first)."),
    }
    let mean = |v: &[f64]| if v.is_empty() { f64::NAN } else { v.iter().sum::<f64>() / v.len() as f64 };
    println!("Host time to issue a step: eager {:.2} ms, replayed {:.2} ms.", mean(&host[0]), mean(&host[1]));
    step.account(engine)?;
    println!("{}", engine.memory_summary());
    Ok(())
}

// candle's tensor buffers come from wick's caching allocator (exact heap figures in the
// summary, no map/unmap per buffer); candle's workers parked, `main` a worker of the kernels' pool.
wick::main!(run);
