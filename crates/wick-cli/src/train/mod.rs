//! `wick train`: a long training run outside the notebook — a LLaMA-style decoder on a seeded
//! synthetic language — that saves training checkpoints as it goes, continues exactly from the
//! newest with `--resume` (bit for bit on the CPU: the same losses and final weights as a run
//! that was never stopped), and on SIGTERM finishes its step, saves and exits 0.
//!
//! The folder holds the checkpoints (`step-*.json` + `.safetensors`), `metrics.jsonl` (one line
//! per step: step, loss, learning rate, milliseconds, resident bytes) and, when the run ends,
//! `final.json` (steps, last loss, SHA-256 of every f32 master).

use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

use anyhow::{bail, Context, Result};
use candle_core::{DType, Device, Tensor};
use clap::Args;
use sha2::{Digest, Sha256};
use wick_nn::Autocast;
use wick_nn::Model;
use wick_train::amp::masters_by_name;
use wick_train::dist::{DataParallelOptions, ProcessGroup};
use wick_train::jobs::{write_status, Progress, RankFigures};
use wick_train::optim::{AdamW, LrSchedule};
use wick_train::trainer::{GraphOptions, TrainOptions, Trainer};
use wick_train::CheckpointDir;
use wick_train::Optimizer;
use wick_zoo::llama::{Llama, LlamaConfig};

mod source;
use source::Source;

/// Settings of `wick train`.
#[derive(Args, Debug, Clone)]
pub struct TrainArgs {
    /// Folder for checkpoints, metrics and the final summary (created when missing).
    #[arg(long)]
    dir: PathBuf,
    /// Training steps in all.
    #[arg(long, default_value_t = 200)]
    steps: u64,
    /// Save a checkpoint every this many steps (and at the end).
    #[arg(long, default_value_t = 20)]
    save_every: u64,
    /// Checkpoints kept.
    #[arg(long, default_value_t = 3)]
    keep: usize,
    /// Continue from the newest usable checkpoint in --dir (an error when there is none).
    #[arg(long, conflicts_with = "resume_if_any")]
    resume: bool,
    /// Continue from the newest usable checkpoint in --dir when it holds any, else start fresh:
    /// one command line for every attempt of a preemptible job (SLURM requeue, spot instances).
    /// Checkpoints that are there but all damaged are an error, as with --resume.
    #[arg(long)]
    resume_if_any: bool,
    /// The device to train on: cpu, or cuda (GPU 0, or each rank its node-local rank's GPU; a wick
    /// built with the `cuda` feature, and for several ranks `nccl`).
    #[arg(long, default_value = "cpu", value_parser = ["cpu", "cuda"])]
    device: String,
    /// Run each step as a CUDA graph after three eager ones (with --device cuda; several ranks
    /// at ZeRO stage 0 only, the step's NCCL collectives inside the graph): the host launches one
    /// graph a step instead of every kernel. Checkpoints are the same and resume either way.
    #[arg(long)]
    cuda_graph: bool,
    /// With --cuda-graph, the eager steps before the capture (each of them through the same
    /// device step the graph holds; more than --steps: every step eager, the graph's reference).
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u64).range(1..))]
    graph_warmup: u64,
    /// Mixed precision: off, bf16 or f16.
    #[arg(long, default_value = "off")]
    precision: String,
    /// Seed of the data (the initial weights are the zoo's seeded ones).
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Sequences per micro-batch.
    #[arg(long, default_value_t = 8)]
    batch: usize,
    /// Tokens per sequence.
    #[arg(long, default_value_t = 32)]
    seq: usize,
    /// Micro-batches per step (gradient accumulation).
    #[arg(long, default_value_t = 1)]
    accumulate: usize,
    /// Model width.
    #[arg(long, default_value_t = 64)]
    hidden: usize,
    /// Decoder layers.
    #[arg(long, default_value_t = 2)]
    layers: usize,
    /// Peak learning rate (AdamW).
    #[arg(long, default_value_t = 3e-3)]
    lr: f64,
    /// Warm-up steps (then cosine decay to a tenth at the last step).
    #[arg(long, default_value_t = 10)]
    warmup: u64,
    /// Recompute each layer in backward instead of keeping its activations.
    #[arg(long)]
    checkpointing: bool,
    /// Clip the gradients to this total 2-norm before each update (PyTorch's `clip_grad_norm_`;
    /// the norm before clipping is in each step's metrics as `grad_norm`).
    #[arg(long, value_parser = positive_norm)]
    clip_grad_norm: Option<f64>,
    /// Train on this token file (little-endian u16 ids below 32, windows of --seq tokens, shuffled
    /// by --seed, read by `wick_train::data`) instead of the synthetic language.
    #[arg(long)]
    data: Option<PathBuf>,
    /// Every this many steps, the loss on a fixed held-out batch (0: never), in the metrics.
    #[arg(long, default_value_t = 0)]
    eval_every: u64,
    /// Record the allocation history of this many steps, after this run's first (warm-up)
    /// step, into DIR/memory-history.json and .html (`wick report` renders the JSON again).
    #[arg(long, default_value_t = 0)]
    record_history: u64,
    /// Start the run as a job in its own session (it survives the terminal and the notebook
    /// kernel; output in DIR/log.txt), print its id and return (`wick jobs` lists it).
    #[arg(long)]
    detach: bool,
    /// Train data-parallel on this many ranks, started under the system's `mpirun` (each rank
    /// takes `--accumulate` micro-batches of `--batch`: the global batch is ranks × accumulate ×
    /// batch). Under `mpirun -n N wick train ...` leave it out: each process joins by itself.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u64).range(1..=4096))]
    ranks: u64,
    /// ZeRO stage of a multi-rank run: 1 shards the f32 masters and the optimizer state over the
    /// ranks, 2 also reduce-scatters the gradients, 3 also shards the blocks' parameters (each
    /// block gathered whole only while it runs, forward and recomputed backward); checkpoints are
    /// then written a shard per rank and resume at any number of ranks and any stage. Ignored on
    /// one rank. With --device cuda, every stage over NCCL (stage 3 without --prefetch).
    #[arg(long, default_value_t = 0, value_parser = clap::value_parser!(u8).range(0..=3))]
    zero: u8,
    /// Reduce the gradients after backward instead of starting each bucket from inside it (a
    /// multi-rank run on the CPU at ZeRO stages 0–2 overlaps by default, GPU parameters reduce
    /// after backward; this gives back the bucket in flight that overlap adds to backward's peak).
    #[arg(long)]
    no_overlap: bool,
    /// At ZeRO stage 3, start the next block's gather while the current block runs (FSDP's
    /// prefetch; one more block whole beside it). Host ranks only: GPU ranks gather on the
    /// compute stream.
    #[arg(long)]
    prefetch: bool,
    /// At ZeRO stage 3, keep each block's activations instead of recomputing the block in
    /// backward (FSDP without checkpointing): one forward pass a block fewer, all kept.
    #[arg(long)]
    no_recompute: bool,
}

const VOCAB: usize = 32;

static STOP: AtomicBool = AtomicBool::new(false);

/// Writes the recorded history as DIR/memory-history.json (for `wick report`) and .html.
fn write_history(engine: &wick::Engine, dir: &Path, from: u64, to: u64) -> Result<()> {
    let history = engine.memory_history();
    history.write_json(&dir.join("memory-history.json")).context("writing the memory history")?;
    let title = format!("wick train: steps {}–{to}", from + 1);
    history.write_html(&dir.join("memory-history.html"), &title).context("writing the memory history's report")?;
    Ok(())
}

/// SIGTERM sets a flag the loop reads after each step (an atomic store: async-signal-safe).
fn on_sigterm() -> Result<()> {
    // SAFETY: the action only stores to an atomic, which is async-signal-safe.
    unsafe { signal_hook_registry::register(libc::SIGTERM, || STOP.store(true, Ordering::SeqCst)) }
        .context("installing the SIGTERM handler")?;
    Ok(())
}

/// Keeps the metrics lines of steps up to `step` (the rest were taken again after a resume).
fn truncate_metrics(path: &Path, step: u64) -> Result<()> {
    let Ok(text) = std::fs::read_to_string(path) else { return Ok(()) };
    let kept: String = text
        .lines()
        .filter(|l| {
            serde_json::from_str::<serde_json::Value>(l)
                .ok()
                .and_then(|v| v["step"].as_u64())
                .is_some_and(|s| s <= step)
        })
        .map(|l| format!("{l}\n"))
        .collect();
    wick::files::write_atomic(path, kept.as_bytes()).with_context(|| format!("rewriting {}", path.display()))
}

/// SHA-256 of `tensors`' values widened to f32, in order (little-endian), hex.
fn f32_digest<'a>(tensors: impl IntoIterator<Item = &'a Tensor>) -> Result<String> {
    let mut hash = Sha256::new();
    for t in tensors {
        for x in t.flatten_all()?.to_dtype(DType::F32)?.to_vec1::<f32>()? {
            hash.update(x.to_le_bytes());
        }
    }
    Ok(hash.finalize().iter().map(|b| format!("{b:02x}")).collect())
}

/// SHA-256 of the f32 masters, in order (wherever they live: the device's under CUDA graphs);
/// `None` when a sharded run holds only its share.
fn masters_digest(trainer: &Trainer<Llama>) -> Result<Option<String>> {
    let masters: Vec<&Tensor> = (0..).map_while(|i| trainer.master(i)).collect();
    if masters.is_empty() {
        return Ok(None);
    }
    f32_digest(masters).map(Some)
}

/// What the CUDA graph did, for the log: the graph's nodes and its pool beside the last warm-up
/// step's own tensors at their peak (`warm`, measured in wick's pool), or why steps ran eagerly.
#[cfg(feature = "cuda")]
fn graph_line(trainer: &Trainer<Llama>, engine: &wick::Engine, warm: Option<usize>) -> Option<String> {
    let step = trainer.graph_step()?;
    let b = |n: u64| wick::memory::format_bytes(n);
    let pool = wick::cuda_graph::graph_memory(engine.device()).map(|m| b(m.reserved)).unwrap_or_else(|e| e.to_string());
    let warm = warm.map_or_else(|| "not measured".into(), |w| b(w as u64));
    let shapes = step.shapes();
    Some(match (shapes.graph(), shapes.refused(), shapes.eager_reason()) {
        (Some(g), _, None) => format!(
            "CUDA graph: {} nodes ({} kernels), replayed each step after the warm-up; graph pool {pool} (the last \
             warm-up step's own tensors peaked at {warm})",
            g.shape().nodes,
            g.shape().kernels
        ),
        (_, _, Some(why)) => format!("CUDA graph: the last step ran eagerly: {why}"),
        (None, Some(why), None) => format!("CUDA graph refused: {why}"),
        (None, None, None) => "CUDA graph: not captured yet (still warming up)".into(),
    })
}

#[cfg(not(feature = "cuda"))]
fn graph_line(_: &Trainer<Llama>, _: &wick::Engine, _: Option<usize>) -> Option<String> {
    None
}

/// SHA-256 of the model's parameters, widened to f32, in order (for an f32 run they are the
/// masters). Gathered from every rank under ZeRO-3, where the model's copies of the blocks'
/// parameters are handed back (a collective: every rank calls it).
fn params_digest(trainer: &Trainer<Llama>) -> Result<String> {
    let params = trainer.gathered_parameters()?;
    f32_digest(params.iter().map(|(_, t)| t))
}

/// Starts this same command without `--detach` as a job; prints its id.
fn detach(args: &TrainArgs) -> Result<()> {
    let exe = std::env::current_exe().context("finding the wick binary")?;
    let (program, argv) = if args.ranks > 1 {
        crate::ranks::mpirun(args.ranks as usize, &exe, &crate::ranks::forwarded_args())?
    } else {
        (exe, std::env::args().skip(1).filter(|a| a != "--detach").collect())
    };
    let argv: Vec<&str> = argv.iter().map(String::as_str).collect();
    let job = wick_train::jobs::Job::spawn(&program, &argv, &args.dir)?;
    println!(
        "started job {} (pid {}); log in {}",
        job.id(),
        job.registration().pid,
        args.dir.join("log.txt").display()
    );
    println!("watch: wick jobs    stop (checkpoint and exit): wick jobs stop {}", job.id());
    Ok(())
}

/// Runs `wick train`, reporting the run's state in DIR/status.json (and why it ended).
pub fn run(args: &TrainArgs) -> Result<()> {
    crate::ranks::check_stage_options(args.zero, args.no_overlap, args.prefetch, args.no_recompute)?;
    // Refused before any rank starts (each would refuse it at its start).
    if args.device == "cuda" && args.prefetch {
        bail!("--prefetch overlaps stage 3's MPI gathers on the host: GPU ranks gather on the compute stream (leave it out)");
    }
    if args.cuda_graph && args.zero > 0 {
        bail!("--cuda-graph steps are replicated (--zero 0): ZeRO's sharded update agrees on the host every step");
    }
    let launched = wick_train::dist::Launch::from_env()?;
    if args.ranks > 1 && launched.world_size > 1 {
        bail!(
            "--ranks {} under a launcher that started {} ranks already: give one or the other",
            args.ranks,
            launched.world_size
        );
    }
    if args.ranks > 1 && !cfg!(feature = "mpi") {
        bail!("--ranks needs a wick built with MPI: cargo build --release -p wick-cli --features mpi");
    }
    if args.detach {
        return detach(args);
    }
    if args.ranks > 1 {
        let exe = std::env::current_exe().context("finding the wick binary")?;
        let (program, argv) = crate::ranks::mpirun(args.ranks as usize, &exe, &crate::ranks::forwarded_args())?;
        let status = std::process::Command::new(&program).args(&argv).status().context("starting mpirun")?;
        if !status.success() {
            bail!("the {}-rank run failed ({status}); mpirun's message above names the rank", args.ranks);
        }
        return Ok(());
    }
    let group = wick_train::dist::ProcessGroup::from_env()?;
    let mut progress = Progress { steps: args.steps, state: "running".into(), ..Progress::default() };
    let result = train(args, &mut progress, &group);
    if let Err(e) = &result {
        progress.state = "failed".into();
        progress.exit_reason =
            Some(if group.world_size() > 1 { format!("rank {}: {e:#}", group.rank()) } else { format!("{e:#}") });
    }
    // The run folder may be what failed; the status is then only best effort.
    if (group.is_root() || result.is_err()) && args.dir.is_dir() {
        let _ = write_status(&args.dir, &progress);
    }
    if let (Err(e), true) = (&result, group.world_size() > 1) {
        // A rank that fails outside a step would leave the others waiting in their next
        // collective: it ends the whole job instead, after saying why (mpirun names the rank).
        eprintln!("rank {} of {}: {e:#}", group.rank(), group.world_size());
        group.abort(1);
    }
    result
}

fn train(args: &TrainArgs, progress: &mut Progress, group: &ProcessGroup) -> Result<()> {
    let (rank, world, root) = (group.rank(), group.world_size(), group.is_root());
    if args.steps == 0 || args.batch == 0 || args.seq < 2 || args.accumulate == 0 || args.save_every == 0 {
        bail!("need at least one step, one sequence of two tokens, one micro-batch and --save-every ≥ 1");
    }
    let autocast = Autocast::parse(&args.precision)?;
    let config = LlamaConfig {
        hidden_size: args.hidden,
        num_layers: args.layers,
        num_heads: 4,
        intermediate_size: 2 * args.hidden,
        max_seq: args.seq,
        ..LlamaConfig::tiny(VOCAB)
    };
    let data = args.data.as_ref().map(|p| p.display().to_string());
    let describe = serde_json::json!({"kind": "llama", "config": config, "seed": args.seed, "batch": args.batch,
        "seq": args.seq, "micro_batches_per_step": args.accumulate * world, "steps": args.steps, "warmup": args.warmup, "data": data});
    let mut source = Source::open(args, rank, world)?;
    // The device the run trains on: while it lives, `wick monitor` lists this process among the
    // engines (allocated, peak, reserved, budget), beside its job row.
    let engine = match args.device.as_str() {
        // Each rank of a node on its own GPU (NCCL refuses two ranks on one device).
        "cuda" => wick::Engine::cuda(group.local_rank(), None).context("--device cuda")?,
        _ => wick::Engine::cpu(),
    };
    if args.cuda_graph && !engine.device().is_cuda() {
        bail!("--cuda-graph needs --device cuda");
    }
    let model = Llama::new(config, autocast.model_dtype(), engine.device())?;
    let start = if autocast.enabled() {
        let f32_model = Llama::new(config, DType::F32, engine.device())?;
        Some(masters_by_name(&model.params, &f32_model.params)?)
    } else {
        None
    };
    let options = TrainOptions {
        optimizer: Optimizer::AdamW(AdamW { lr: args.lr, beta1: 0.9, beta2: 0.95, eps: 1e-8, weight_decay: 0.01 }),
        schedule: LrSchedule::WarmupCosine { warmup: args.warmup, total: args.steps, min_factor: 0.1 },
        autocast,
        activation_checkpointing: args.checkpointing,
        clip_grad_norm: args.clip_grad_norm,
        cuda_graph: args.cuda_graph.then(|| GraphOptions {
            warmup: usize::try_from(args.graph_warmup).unwrap_or(usize::MAX),
            ..GraphOptions::default()
        }),
    };
    // Several ranks start in their group: sharded (ZeRO), each rank makes only its shard of the
    // masters and optimizer state, and a resume reads only its share.
    let mut trainer = if world > 1 {
        let sharding = wick_train::dist::Sharding::from_stage(args.zero)?;
        let (overlap, prefetch, recompute) = (!args.no_overlap, args.prefetch, !args.no_recompute);
        let parallel = DataParallelOptions { sharding, overlap, prefetch, recompute, ..Default::default() };
        Trainer::new_data_parallel(model, describe, start.as_deref(), options, group.clone(), parallel)?
    } else {
        Trainer::new(model, describe, start.as_deref(), options)?
    };
    let checkpoints = CheckpointDir::new(&args.dir, args.keep)?;
    let metrics_path = args.dir.join("metrics.jsonl");
    // Temporary files of a run killed while rewriting its metrics or summary.
    for entry in std::fs::read_dir(&args.dir)?.filter_map(|e| e.ok()).filter(|_| root) {
        let name = entry.file_name().to_string_lossy().into_owned();
        if (name.starts_with(".metrics.jsonl.tmp-") || name.starts_with(".final.json.tmp-")) && entry.path().is_file() {
            let _ = std::fs::remove_file(entry.path());
        }
    }
    // Every rank sees the same folder; `Trainer::resume` checks that they agree on its steps.
    let resume = args.resume || (args.resume_if_any && !checkpoints.steps()?.is_empty());
    if args.resume_if_any && !resume {
        eprintln!("no checkpoint in {} yet: starting fresh", args.dir.display());
    }
    if resume {
        let resumed = trainer.resume(&checkpoints)?;
        for why in &resumed.skipped {
            eprintln!("passed over a damaged checkpoint: {why}");
        }
        eprintln!("resumed from {} (step {})", resumed.manifest.display(), resumed.step);
        source.seek(&resumed.data["loader"])?;
        if root {
            truncate_metrics(&metrics_path, resumed.step)?;
        }
    } else {
        // A fresh run: nothing of an earlier one may be mistaken for its own.
        if !checkpoints.steps()?.is_empty() {
            bail!(
                "{} holds checkpoints of an earlier run: pass --resume (or --resume-if-any) to continue it, or use \
                 another --dir",
                args.dir.display()
            );
        }
        if root {
            let _ = std::fs::remove_file(&metrics_path);
        }
    }
    on_sigterm()?;
    // Rank 0 writes the run's files and shows the progress; the others train.
    let mut metrics: Box<dyn Write> = if root {
        Box::new(
            std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(&metrics_path)
                .with_context(|| format!("opening {}", metrics_path.display()))?,
        )
    } else {
        Box::new(std::io::sink())
    };
    let bar = if root { indicatif::ProgressBar::new(args.steps) } else { indicatif::ProgressBar::hidden() };
    let bar = bar.with_style(
        indicatif::ProgressStyle::with_template("{pos}/{len} [{bar:24}] {elapsed_precise} eta {eta} · {msg}")
            .context("the progress bar's template")?,
    );
    bar.set_position(trainer.step());
    let save = |trainer: &Trainer<Llama>, source: &Source| -> Result<PathBuf> {
        let data = serde_json::json!({"next_batch": trainer.step(), "loader": source.position()});
        Ok(trainer.save(&checkpoints, data)?)
    };
    let held_out = source.held_out(args)?.to_device(engine.device())?;
    let tokens_per_step = (args.batch * args.seq * args.accumulate * world) as f64;
    progress.step = trainer.step();
    progress.last_checkpoint = checkpoints.steps()?.last().map(|s| checkpoints.manifest_path(*s).display().to_string());
    if root {
        write_status(&args.dir, progress)?;
    }
    let budget = wick::host_memory::host_budget().0;
    let mut reported = Instant::now();
    let mut last_loss = f32::NAN;
    // The history window (steps after this run's first) and the leak finder (quiet unless the
    // step-end memory keeps growing after a warm-up; then it says so in the log).
    let record_from = trainer.step() + 1;
    let record_to = record_from.saturating_add(args.record_history);
    let mut leaks = wick::LeakFinder::new(3, 5);
    let mut leak_reported = false;
    // With --cuda-graph: the last warm-up step's own tensors at their peak (what the graph's pool
    // will hold), measured in wick's pool; a resumed run warms up again.
    let (mut steps_here, mut warm_own) = (0u64, None::<usize>);
    while trainer.step() < args.steps {
        let step = trainer.step();
        if args.record_history > 0 && step == record_from {
            engine.record_memory_history(Some(1 << 20))?;
        }
        let started = Instant::now();
        // Rank r's m-th micro-batch is the step's (m·ranks + r)-th: the ranks together take what
        // one process accumulating ranks × accumulate micro-batches takes.
        let batches = (0..args.accumulate)
            .map(|m| Ok(source.next(args, step, m * world + rank)?.to_device(engine.device())?))
            .collect::<Result<Vec<_>>>()?;
        let measuring = args.cuda_graph && steps_here + 1 == args.graph_warmup;
        let before = measuring.then(|| {
            engine.reset_peak_memory_stats();
            engine.allocated().bytes
        });
        let record = trainer.train_step(&batches)?;
        if let Some(before) = before {
            warm_own = engine.peak_allocated().map(|p| p.bytes.saturating_sub(before));
        }
        steps_here += 1;
        let ms = started.elapsed().as_secs_f64() * 1e3;
        last_loss = record.loss;
        let rss = wick::host_memory::process_rss();
        let heap = wick::host_memory::heap_figures(budget);
        if world > 1 {
            // Every rank's memory, every step (a fixed point of the step, so the ranks meet).
            let mine = [rss, heap.map(|h| h.allocated), heap.map(|h| h.peak)].map(|v| v.map_or(-1.0, |v| v as f64));
            let all = group.all_gather(&Tensor::new(&mine, &Device::Cpu)?)?.to_vec1::<f64>()?;
            let figure = |v: f64| (v >= 0.0).then_some(v as usize);
            progress.ranks = all
                .chunks(3)
                .enumerate()
                .map(|(r, c)| RankFigures {
                    rank: r,
                    rss_bytes: figure(c[0]),
                    heap_allocated: figure(c[1]),
                    heap_peak: figure(c[2]),
                })
                .collect();
        }
        let mut line = serde_json::json!({
            "step": record.step, "loss": record.loss, "lr": record.lr, "ms": ms, "rss_bytes": rss, "heap": heap,
        });
        if let Some(norm) = record.grad_norm {
            line["grad_norm"] = serde_json::json!(norm);
        }
        if let Some(r) = trainer.last_reduce() {
            // The step's gradient reduction: buckets, those started inside backward, the time in
            // MPI calls and the time the step waited for it after backward (ZeRO-3: the
            // blocks' gathers that were prefetched).
            line["reduce"] = serde_json::json!({"buckets": r.buckets, "in_backward": r.overlapped,
                "comm_ms": r.comm_s * 1e3, "exposed_ms": r.exposed_s * 1e3, "hidden": r.hidden_fraction(),
                "prefetched": r.prefetched});
        }
        if args.eval_every > 0 && record.step % args.eval_every == 0 {
            let eval = wick_nn::no_grad(|| trainer.model().loss(&held_out))?;
            line["eval_loss"] = serde_json::json!(eval.to_dtype(DType::F32)?.to_scalar::<f32>()?);
        }
        writeln!(metrics, "{line}").and_then(|()| metrics.flush()).context("writing metrics")?;
        bar.set_position(record.step);
        let memory = match (&heap, rss) {
            (Some(h), _) => format!(" · {h}"),
            (None, Some(b)) => format!(" · rss {}", wick::memory::format_bytes(b as u64)),
            (None, None) => String::new(),
        };
        bar.set_message(format!("loss {:.4} · {:.0} tok/s{memory}", record.loss, tokens_per_step / ms * 1e3));
        if args.record_history > 0 && record.step == record_to {
            engine.record_memory_history(None)?;
        }
        if args.record_history > 0 && record.step == record_to && root {
            write_history(&engine, &args.dir, record_from, record_to)?;
            bar.println(format!("memory history of steps {}–{record_to} in {}", record_from + 1, args.dir.display()));
        }
        if let Some(report) = leaks.end_step(&engine).filter(|_| !leak_reported) {
            bar.println(format!("step {}: {report}", record.step));
            leak_reported = true;
        }
        // Every rank stops after the same step (mpirun passes SIGTERM to each, not at once).
        let stopping = group.any(STOP.load(Ordering::SeqCst))?;
        (progress.step, progress.loss, progress.rss_bytes, progress.heap) =
            (record.step, Some(f64::from(record.loss)), rss, heap);
        let saved = record.step % args.save_every == 0 || record.step == args.steps || stopping;
        if saved {
            progress.last_checkpoint = Some(save(&trainer, &source)?.display().to_string());
        }
        if stopping {
            bar.abandon();
            progress.state = "stopped".into();
            progress.exit_reason =
                Some(format!("SIGTERM: checkpoint saved at step {}; --resume continues", record.step));
            if root {
                println!("stopped by SIGTERM after step {} (checkpoint saved)", record.step);
            }
            return Ok(());
        }
        if root && (saved || reported.elapsed().as_secs_f64() >= 0.5) {
            write_status(&args.dir, progress)?;
            reported = Instant::now();
        }
    }
    bar.finish();
    if let Some(line) = graph_line(&trainer, &engine, warm_own).filter(|_| root) {
        println!("{line}");
    }
    progress.state = "finished".into();
    progress.exit_reason = Some(format!("completed {} steps", trainer.step()));
    let summary = serde_json::json!({"steps": trainer.step(), "loss": last_loss, "masters_sha256": masters_digest(&trainer)?,
        "params_sha256": params_digest(&trainer)?});
    let path = args.dir.join("final.json");
    if !root {
        return Ok(());
    }
    wick::files::write_atomic(&path, serde_json::to_string_pretty(&summary)?.as_bytes())?;
    println!("trained {} steps; final loss {last_loss:.4}; summary in {}", trainer.step(), path.display());
    Ok(())
}

/// `--clip-grad-norm`'s value: a positive finite number.
fn positive_norm(text: &str) -> Result<f64, String> {
    match text.parse::<f64>() {
        Ok(v) if v.is_finite() && v > 0.0 => Ok(v),
        _ => Err(format!("expected a positive number (the largest total gradient norm), not {text:?}")),
    }
}
