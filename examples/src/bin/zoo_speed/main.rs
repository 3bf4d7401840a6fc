//! Step time of every zoo model at benchmark sizes: an f32 training step, an AMP training step
//! (bf16 on the CPU, f32 masters and optimizer state) and an eval forward pass.
//!
//! ```text
//! zoo-speed --list                                  # the configurations, as JSON
//! zoo-speed --model resnet18 --mode train --steps 5 # one JSON line: milliseconds per step
//! zoo-speed --model resnet50 --image 224 --batch 8   # the vision models at other sizes
//! zoo-speed --model bert-base --mode eval --batch 32 --seq 128  # the text models too
//! zoo-speed --model decoder-512 --seq 512 --set hidden_size=768 --set num_layers=12 --set num_heads=12
//! WICK_PROFILE_OPS=1 zoo-speed --model vit           # and each kernel op's time, on stderr
//! zoo-speed --model resnet18 --record-history DIR   # and the timed steps' allocation history
//! ```
//!
//! `--device cuda` (a build with `--features cuda`) runs on GPU 0 under a governed engine: AMP is
//! bf16 there too, each step ends with the device synchronised, and the line also carries the
//! timed steps' peak allocated and reserved bytes (`peak_allocated`, `peak_reserved`).
//!
//! `--record-history DIR` records the timed steps (`Engine::record_memory_history`) and writes
//! `DIR/MODEL-MODE.{history.json,trace.json,pickle,html}`: the history (for `wick report`), a
//! wick trace (for `wick replay`), a PyTorch memory_viz snapshot and the HTML report.
//!
//! `--against-cpu` checks the device's step against the CPU's instead of timing it (see
//! `against_cpu`): `zoo-speed --model resnet18 --image 64 --batch 4 --against-cpu --device cuda`.
//!
//! `--cuda-graph` (CUDA) captures the training step — or with `--mode eval` the forward pass — as
//! a CUDA graph after the warm-up and replays it (the `graph` module); `--check-graph` also runs
//! an eager twin and requires the same bits:
//! `zoo-speed --model minilm --device cuda --cuda-graph --check-graph`.
//!
//! `scripts/torch-reference/zoo_speed.py` reads the same configurations, runs PyTorch on them in
//! turn with this binary, and prints the side-by-side table of BENCHMARKS.md.

use std::time::Instant;

use anyhow::{bail, Context, Result};
use candle_core::{DType, Device, Tensor};
use clap::{Parser, ValueEnum};
use serde_json::{json, Value};
use wick_examples::zoo_bench::{self, Sizes};
use wick_nn::params::normal_tensor;
use wick_nn::Autocast;
use wick_nn::{Labelled, Model};
use wick_train::amp::MasterWeights;
use wick_train::optim::Optimizer;
use wick_zoo::bert::SentenceBatch;
use wick_zoo::registry::{ModelSpec, ZooBatch, ZooModel};

mod graph;
use graph::graph_steps;

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Mode {
    /// Forward, backward and an f32 optimizer step.
    Train,
    /// The same under autocast (bf16 model, f32 masters and optimizer state).
    Amp,
    /// Forward only, inside `no_grad`, batch norm on its running statistics.
    Eval,
}

#[derive(Parser)]
#[command(about = "Step time of the zoo's models at benchmark sizes")]
struct Args {
    /// Print the configurations as JSON and exit.
    #[arg(long)]
    list: bool,
    /// The model (see --list).
    #[arg(long)]
    model: Option<String>,
    /// What to time.
    #[arg(long, value_enum, default_value = "train")]
    mode: Mode,
    /// Timed steps.
    #[arg(long, default_value_t = 5)]
    steps: usize,
    /// Untimed steps first.
    #[arg(long, default_value_t = 2)]
    warmup: usize,
    /// Record the timed steps' allocation history and write it here (see the module docs).
    #[arg(long)]
    record_history: Option<std::path::PathBuf>,
    /// With `--record-history`: record allocations of at least this many bytes (0: every one).
    #[arg(long, default_value_t = wick::memory::DEFAULT_MIN_EVENT_SIZE)]
    history_min_size: usize,
    /// The recorder's cost: timed steps alternate between recording off and on (a fresh ring
    /// each time, made outside the timing); prints `ms_off` and `ms_on`.
    #[arg(long, conflicts_with = "record_history")]
    history_overhead: bool,
    /// Side of the vision models' square images (ViT's patch size, 16, must divide it).
    #[arg(long, default_value_t = 112)]
    image: usize,
    /// Inputs per batch: images for the vision models (default 16), sequences for the text
    /// models (default 8).
    #[arg(long)]
    batch: Option<usize>,
    /// Tokens per sequence for the text models (default 128 for the encoders, 64 for `decoder`,
    /// 256 for `decoder-512`; a decoder trains on one more).
    #[arg(long)]
    seq: Option<usize>,
    /// cpu, or cuda (GPU 0; needs `--features cuda`).
    #[arg(long, default_value = "cpu")]
    device: String,
    /// Instead of timing: two steps (train, amp) or the forward pass (eval) on `--device` and on
    /// the CPU from the same seeded model and batch, and their losses, parameters after the steps
    /// (or outputs) compared (see `against_cpu`); exits non-zero beyond the stated bounds.
    #[arg(long)]
    against_cpu: bool,
    /// Train through the fused device step, captured as a CUDA graph after the warm-up and
    /// replayed at every timed step (`wick_train::amp::graph_step`); the line adds the host's
    /// milliseconds to issue each step (`host_ms`) and the graph's nodes and memory. CUDA only.
    #[arg(long)]
    cuda_graph: bool,
    /// With `--cuda-graph`: step the same seeded model eagerly beside it through the same fused
    /// step, and require every step's loss and every parameter at the end to be the same bits,
    /// and the device's graph memory back where it was once the graph is dropped.
    #[arg(long, requires = "cuda_graph")]
    check_graph: bool,
    /// With `--cuda-graph`: never capture — the same fused device step run eagerly at every step
    /// (the baseline a graph's time and host time are compared with).
    #[arg(long, requires = "cuda_graph", conflicts_with = "check_graph")]
    graph_eager: bool,
    /// Train with the gradients clipped to this total norm (the norm taken after backward, its
    /// coefficient folded into the update), timed in the optimizer's phase.
    #[arg(long)]
    clip_grad_norm: Option<f64>,
    /// Change a field of the model's configuration, as `--list` prints it (`KEY=VALUE`,
    /// repeatable): a transformer's width, depth, heads or vocabulary (`--set hidden_size=768
    /// --set num_layers=12`), a ResNet's `width`, MobileNetV2's `width_mult`. Needs `--model`;
    /// with `--list`, that model's entry shows the change (what PyTorch's side then builds).
    #[arg(long = "set", value_name = "KEY=VALUE", value_parser = zoo_bench::parse_set)]
    set: Vec<(String, Value)>,
}

/// Seeded token ids in `0..vocab`.
fn token_ids(batch: usize, seq: usize, vocab: usize, device: &Device) -> Result<Tensor> {
    let u = normal_tensor(&[batch * seq], 1.0, 31, DType::F32, device)?.to_vec1::<f32>()?;
    let ids: Vec<u32> = u.iter().map(|x| ((x.abs() * 1e4) as u32) % vocab as u32).collect();
    Ok(Tensor::from_vec(ids, (batch, seq), device)?)
}

fn labels(n: usize, classes: usize, device: &Device) -> Result<Tensor> {
    let ids: Vec<u32> = (0..n).map(|i| ((i * 7 + 3) % classes) as u32).collect();
    Ok(Tensor::new(ids, device)?)
}

/// A model at its benchmark size, built by the zoo's registry: the model, its training batch,
/// its eval batch and its optimizer.
struct Bench {
    model: ZooModel,
    batch: ZooBatch,
    eval: ZooBatch,
    optimizer: Optimizer,
}

fn build(name: &str, sizes: Sizes, sets: &[(String, Value)], dtype: DType, device: &Device) -> Result<Bench> {
    let (images, sequences) = (sizes.images(), sizes.sequences());
    let all = zoo_bench::configs(sizes, Some(name), sets)?;
    let Some(entry) = all.get(name) else { bail!("unknown model `{name}`; --list shows the configurations") };
    let (spec, optimizer) = zoo_bench::spec(name, entry)?;
    let model = spec.build(dtype, device)?;
    let (batch, eval) = match &spec {
        ModelSpec::Llama { config, seq } => {
            let ids = token_ids(sequences, *seq, config.vocab_size, device)?;
            let inputs = ids.narrow(1, 0, seq - 1)?;
            (ZooBatch::Tokens(ids), ZooBatch::Tokens(inputs))
        }
        ModelSpec::Bert { config, seq } => {
            let batch = SentenceBatch {
                ids: token_ids(sequences, *seq, config.vocab_size, device)?,
                mask: Tensor::ones((sequences, *seq), DType::U32, device)?,
                readout: normal_tensor(&[config.hidden_size, 2], 0.5, 5, DType::F32, device)?,
                labels: labels(sequences, 2, device)?,
            };
            (ZooBatch::Sentences(batch.clone()), ZooBatch::Sentences(batch))
        }
        _ => {
            let (image, classes) = (sizes.image, entry["classes"].as_u64().context("no classes")? as usize);
            let x = normal_tensor(&[images, 3, image, image], 1.0, 11, DType::F32, device)?.to_dtype(dtype)?;
            let batch = ZooBatch::Images(Labelled { inputs: x, labels: labels(images, classes, device)? });
            (batch.clone(), batch)
        }
    };
    Ok(Bench { model, batch, eval, optimizer })
}

/// Under autocast, the values the f32 masters start at: the parameters of the same seeded model
/// built in f32 (not their bf16 rounding); `None` without autocast (the parameters are their own
/// masters).
fn f32_start(
    name: &str,
    (sizes, sets): (Sizes, &[(String, Value)]),
    autocast: Autocast,
    device: &Device,
) -> Result<Option<Vec<Tensor>>> {
    if !autocast.enabled() {
        return Ok(None);
    }
    let model = build(name, sizes, sets, DType::F32, device)?.model;
    Ok(Some(model.vars().iter().map(|v| v.as_tensor().clone()).collect()))
}

/// The elements of `t` in f64, on the host.
fn host_values(t: &Tensor) -> Result<Vec<f64>> {
    Ok(t.to_device(&Device::Cpu)?.to_dtype(DType::F64)?.flatten_all()?.to_vec1()?)
}

/// Largest |a − b| / (1 + |b|) over two lists of values (infinite when their lengths differ).
fn max_rel_err(a: &[f64], b: &[f64]) -> f64 {
    if a.len() != b.len() {
        return f64::INFINITY;
    }
    a.iter().zip(b).map(|(x, y)| if x == y { 0.0 } else { (x - y).abs() / (1.0 + y.abs()) }).fold(0.0, f64::max)
}

/// `--against-cpu`: the same seeded model and batch on `device` and on the CPU. Training modes run
/// two steps (forward, backward, the optimizer's update; under AMP from f32 masters) and compare
/// both losses and every parameter afterwards; eval compares the outputs. Bounds: f32 (the
/// convolutions without TF32) 1e-4 on the losses and 1e-4 on the parameters and outputs, relative
/// to 1 + |value| — the two devices add their sums in different orders and nothing more; bf16
/// (AMP) 2e-2 on the losses, 1e-2 on parameters and outputs (a bf16 value may round either way).
fn against_cpu(name: &str, (sizes, sets): (Sizes, &[(String, Value)]), mode: Mode, device: &Device) -> Result<()> {
    #[cfg(feature = "cuda")]
    wick_nn::native::cuda::conv::set_tf32(false);
    let autocast = if mode == Mode::Amp { Autocast::bf16() } else { Autocast::off() };
    let run_on = |dev: &Device| -> Result<(Vec<f64>, Vec<Vec<f64>>)> {
        let bench = build(name, sizes, sets, autocast.model_dtype(), dev)?;
        if mode == Mode::Eval {
            let out = wick_nn::no_grad(|| bench.model.forward(&bench.eval))?;
            return Ok((Vec::new(), vec![host_values(&out)?]));
        }
        let start = f32_start(name, (sizes, sets), autocast, dev)?;
        let mut masters = MasterWeights::with_masters(&bench.model.vars(), start.as_deref(), bench.optimizer)?;
        let mut losses = Vec::new();
        for _ in 0..2 {
            let loss = bench.model.loss(&bench.batch)?;
            let grads = loss.backward()?;
            masters.step(&grads)?;
            losses.push(f64::from(loss.to_dtype(DType::F32)?.to_scalar::<f32>()?));
        }
        let params = bench.model.vars().iter().map(|v| host_values(v.as_tensor())).collect::<Result<Vec<_>>>()?;
        Ok((losses, params))
    };
    let (cpu_losses, cpu_values) = run_on(&Device::Cpu)?;
    let (losses, values) = run_on(device)?;
    let loss_err = max_rel_err(&losses, &cpu_losses);
    let value_err = values.iter().zip(&cpu_values).map(|(a, b)| max_rel_err(a, b)).fold(0.0, f64::max);
    let (loss_bound, value_bound) = if autocast.enabled() { (2e-2, 1e-2) } else { (1e-4, 1e-4) };
    let ok = values.len() == cpu_values.len() && loss_err <= loss_bound && value_err <= value_bound;
    let line = json!({
        "model": name,
        "mode": format!("{mode:?}").to_lowercase(),
        "against_cpu": if ok { "pass" } else { "FAIL" },
        "losses": losses,
        "cpu_losses": cpu_losses,
        "loss_max_rel_err": loss_err,
        "values_max_rel_err": value_err,
        "tensors": values.len(),
        "bounds": [loss_bound, value_bound],
    });
    println!("{line}");
    if !ok {
        bail!("{name} ({mode:?}) on {device:?} differs from the CPU beyond the bounds");
    }
    Ok(())
}

/// Writes the recorded history as JSON, a wick trace, a memory_viz snapshot and the HTML report.
fn write_history(engine: &wick::Engine, dir: &std::path::Path, name: &str, mode: Mode) -> Result<()> {
    let history = engine.memory_history();
    let stem = format!("{name}-{}", format!("{mode:?}").to_lowercase());
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    history.write_json(&dir.join(format!("{stem}.history.json")))?;
    let mut trace = wick_trace::Trace::from_heap_history(&stem, &history.heap, 0);
    trace.description = format!("zoo-speed --model {name} --mode {stem}: {}", trace.description);
    wick::files::write_atomic(&dir.join(format!("{stem}.trace.json")), trace.to_json().as_bytes())?;
    history.write_memory_viz(&dir.join(format!("{stem}.pickle")))?;
    history.write_html(&dir.join(format!("{stem}.html")), &format!("{name} ({mode:?}): the timed steps"))?;
    if let Some(held) = history.held_at_peak() {
        eprintln!("{held}");
    }
    Ok(())
}

fn run() -> Result<()> {
    let args = Args::parse();
    if args.image == 0 || args.batch == Some(0) || args.seq == Some(0) {
        bail!("--image, --batch and --seq must be at least 1");
    }
    let sizes = Sizes { image: args.image, batch: args.batch, seq: args.seq };
    if args.list {
        println!("{}", serde_json::to_string_pretty(&zoo_bench::configs(sizes, args.model.as_deref(), &args.set)?)?);
        return Ok(());
    }
    let name = args.model.clone().context("--model is required (see --list)")?;
    let engine = wick_examples::open_engine(&args.device, None)?;
    let device = engine.device().clone();
    if args.against_cpu {
        return against_cpu(&name, (sizes, &args.set), args.mode, &device);
    }
    if args.cuda_graph {
        return graph_steps(&args, &name, sizes, &engine);
    }
    // bf16 on both devices, as PyTorch's side runs autocast (no loss scaling needed).
    let autocast = if args.mode == Mode::Amp { Autocast::bf16() } else { Autocast::off() };
    let bench = build(&name, sizes, &args.set, autocast.model_dtype(), &device)?;
    let mut masters = if args.mode == Mode::Eval {
        None
    } else {
        let start = f32_start(&name, (sizes, &args.set), autocast, &device)?;
        Some(MasterWeights::with_masters(&bench.model.vars(), start.as_deref(), bench.optimizer)?)
    };
    let mut times = Vec::new();
    // Forward, backward and optimizer milliseconds of the timed steps.
    let mut phases = [0.0f64; 3];
    let mut last_loss = None;
    for step in 0..args.warmup + args.steps {
        if step == args.warmup {
            wick_nn::native::profile::reset();
            engine.reset_peak_memory_stats();
            if args.record_history.is_some() {
                engine.record_memory_history_with(1 << 21, args.history_min_size)?;
            }
        }
        let recording = args.history_overhead && step >= args.warmup && (step - args.warmup) % 2 == 1;
        if recording {
            engine.record_memory_history(Some(1 << 20))?;
        }
        let start = Instant::now();
        let _step = engine.label("train_step");
        match masters.as_mut() {
            Some(masters) => {
                let phase = engine.label("forward");
                let loss = bench.model.loss(&bench.batch)?;
                // A no-op on the CPU; on a GPU each phase's kernels finish inside its time.
                device.synchronize()?;
                let forward = start.elapsed();
                drop(phase);
                let phase = engine.label("backward");
                let grads = loss.backward()?;
                device.synchronize()?;
                let backward = start.elapsed();
                drop(phase);
                let _phase = engine.label("optimizer");
                match args.clip_grad_norm {
                    Some(max_norm) => {
                        let vars = bench.model.vars();
                        let refs: Vec<&candle_core::Var> = vars.iter().collect();
                        let norm = wick_train::clip::grad_norm(&grads, &refs)?;
                        masters.step_clipped(&grads, wick_train::clip::checked_coefficient(norm, max_norm)?)?;
                    }
                    None => masters.step(&grads)?,
                }
                device.synchronize()?;
                if step >= args.warmup {
                    let end = start.elapsed();
                    phases[0] += forward.as_secs_f64() * 1e3;
                    phases[1] += (backward - forward).as_secs_f64() * 1e3;
                    phases[2] += (end - backward).as_secs_f64() * 1e3;
                }
                last_loss = Some(loss.to_dtype(DType::F32)?.to_scalar::<f32>()?);
            }
            None => {
                let out = wick_nn::no_grad(|| bench.model.forward(&bench.eval))?;
                // Make sure the result is computed (it always is on the CPU; on a GPU reading it
                // back waits for the device) and cheap to keep.
                let _ = out.flatten_all()?.narrow(0, 0, 1)?.to_dtype(DType::F32)?.to_vec1::<f32>()?;
            }
        }
        if step >= args.warmup {
            times.push(start.elapsed().as_secs_f64() * 1e3);
        }
        if recording {
            engine.record_memory_history(None)?;
        }
    }
    if let Some(loss) = last_loss.filter(|l| !l.is_finite()) {
        bail!("{name}: the loss is {loss}");
    }
    if let Some(dir) = &args.record_history {
        engine.record_memory_history(None)?;
        write_history(&engine, dir, &name, args.mode)?;
    }
    let per_step = |v: f64| v / args.steps.max(1) as f64;
    let mut line = json!({
        "model": name,
        "mode": format!("{:?}", args.mode).to_lowercase(),
        "ms": times,
        "forward_backward_optimizer_ms": phases.map(per_step),
        "loss": last_loss,
        "device": engine.name(),
        "peak_allocated": engine.max_memory_allocated(),
        "peak_reserved": engine.max_memory_reserved(),
    });
    if args.history_overhead {
        line["ms_off"] = json!(times.iter().step_by(2).collect::<Vec<_>>());
        line["ms_on"] = json!(times.iter().skip(1).step_by(2).collect::<Vec<_>>());
    }
    println!("{line}");
    if wick_nn::native::profile::enabled() {
        eprintln!("{}", wick_nn::native::profile::report());
    }
    Ok(())
}

// The heap: candle's tensor buffers served by wick's caching allocator (`WICK_HEAP=system` in
// the environment: by the system allocator, for comparison); candle's workers parked, `main` a
// worker of the kernels' pool.
wick::main!(run);
