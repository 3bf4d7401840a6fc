//! `wick`: command-line tools around the allocator.
//!
//! - `wick info [--json]`: what this machine offers a run (CPU, memory, cgroup, /dev/shm, GPUs,
//!   allocator policy, candle's build);
//! - `wick estimate MODEL [--batch N] [--precision f32|amp-bf16] [--mode …] [--json]`: the memory
//!   a zoo model needs, per mode;
//! - `wick fit-batch MODEL --budget 24GiB|--gpu A100-80GB|--device cuda:0 [--target-batch N]`:
//!   the largest batch that fits and the accumulation for an effective batch;
//! - `wick report FILE [--text | --out PAGE.html]`: a saved snapshot or history as the HTML report;
//! - `wick monitor [--interval S] [--once [--json]]`: a live view of host, GPU and job memory;
//! - `wick replay TRACE.json…`: replays allocation traces through a policy and backend and prints
//!   peak allocated, peak reserved, fragmentation, retries, OOMs and ops/s;
//! - `wick traces DIR`: writes the standard trace suite (realistic workloads) as JSON;
//! - `wick convert-pth IN.pth OUT.safetensors`: converts a legacy PyTorch checkpoint safely;
//! - `wick fetch REPO [--file F]… [--all]`: a model repository from the Hugging Face hub into its
//!   cache, pre-flighted, resumable and checksummed;
//! - `wick train --dir DIR [--resume] [--detach]`: a training run with checkpoints and exact
//!   resume, in the foreground or as a job in its own session;
//! - `wick jobs [stop|status|forget ID]`: the detached runs.

mod estimate;
mod fetch;
mod fit;
mod measure;
mod monitor;
mod ranks;
mod report;
mod train;

use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use clap::{Parser, Subcommand, ValueEnum};
use wick_memory::format_bytes;
use wick_memory::{AllocatorConfig, CachingAllocator, HostBackend};
use wick_trace::{replay, replay_simulated, workloads, ReplayReport, Trace};

#[derive(Parser)]
#[command(name = "wick", version, about = "wick: memory tools and long training runs")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Clone, Copy, ValueEnum)]
enum BackendKind {
    /// Address space only: any size, no memory used.
    Sim,
    /// Real host memory: only for traces that fit in RAM.
    Host,
}

#[derive(Subcommand)]
enum Command {
    /// What this machine offers: CPU, host memory (cgroup limit, /dev/shm), GPUs and driver,
    /// the allocator policy from the environment, candle's build.
    Info {
        /// Print JSON instead of text.
        #[arg(long)]
        json: bool,
    },
    /// The memory a zoo model needs at a batch size (parameters, gradients, optimizer state,
    /// masters, activations, workspace), profiled on the CPU at small batches.
    Estimate(estimate::EstimateArgs),
    /// The largest batch of a zoo model that fits a memory budget (or a GPU), and the gradient
    /// accumulation for a target effective batch.
    FitBatch(fit::FitArgs),
    /// Render a saved allocator snapshot or history as the HTML report (or as text).
    Report(report::ReportArgs),
    /// A live view of memory: host and cgroup, GPUs and their processes, every wick job (`q`
    /// quits; plain text when not a terminal).
    Monitor(monitor::MonitorArgs),
    /// Replay traces through the caching allocator.
    Replay {
        /// Trace files (JSON), or recorded runs (`MemoryHistory` JSON, e.g. from
        /// `zoo-speed --record-history`), replayed as the trace of their allocations.
        #[arg(required = true)]
        traces: Vec<PathBuf>,
        /// Device capacity in GiB.
        #[arg(long, default_value_t = 80.0)]
        capacity_gib: f64,
        /// Policy, in WICK_ALLOC_CONF syntax (e.g. `max_split_size_mb:128`; an empty string is
        /// wick's defaults: PyTorch's policy with expandable segments). Without it:
        /// `WICK_ALLOC_CONF`, else `PYTORCH_CUDA_ALLOC_CONF`, else wick's defaults.
        #[arg(long)]
        config: Option<String>,
        /// Backend to replay on.
        #[arg(long, value_enum, default_value = "sim")]
        backend: BackendKind,
        /// Print JSON instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// Write the standard trace suite to a directory.
    Traces {
        /// Output directory.
        dir: PathBuf,
    },
    /// Convert a legacy (non-zip) PyTorch `.pth` state dict to safetensors, with wick's safe
    /// reader (it executes nothing from the file).
    ConvertPth {
        /// The `.pth` file.
        input: PathBuf,
        /// The safetensors file to write.
        output: PathBuf,
    },
    /// Fetch a model repository from the Hugging Face hub into its cache: disk and memory
    /// checked first, interrupted transfers resumed, every file checksummed before it is placed.
    Fetch(fetch::FetchArgs),
    /// Train a LLaMA-style decoder on a seeded synthetic language with checkpoints: `--resume`
    /// continues exactly from the newest; SIGTERM saves and exits 0.
    Train(train::TrainArgs),
    /// List the jobs started with `--detach` (or `wick_train::jobs::Job::spawn`), or act on one.
    Jobs {
        #[command(subcommand)]
        action: Option<JobAction>,
    },
}

#[derive(Subcommand)]
enum JobAction {
    /// Ask a job to finish its step, save a checkpoint and exit (SIGTERM).
    Stop {
        /// The job's id.
        id: String,
    },
    /// One job's status, as JSON.
    Status {
        /// The job's id.
        id: String,
    },
    /// Remove an ended job from the list (its run folder stays).
    Forget {
        /// The job's id.
        id: String,
    },
}

fn run() -> Result<()> {
    match Cli::parse().command {
        Command::Info { json } => {
            let info = wick::machine::MachineInfo::probe();
            if json {
                println!("{}", serde_json::to_string_pretty(&info)?);
            } else {
                println!("{info}");
            }
        }
        Command::Replay { traces, capacity_gib, config, backend, json } => {
            // A simulated device's addresses are 64-bit: at most 2³⁴ GiB (16 EiB), and at least a byte.
            let bytes = capacity_gib * (1u64 << 30) as f64;
            if !(capacity_gib.is_finite() && bytes >= 1.0 && bytes < usize::MAX as f64) {
                bail!("--capacity-gib must be a positive number below 2^34 GiB (got {capacity_gib})");
            }
            let capacity = bytes as usize;
            let (policy, source) = replay_policy(config.as_deref())?;
            eprintln!("policy: {source}");
            let progress = indicatif::ProgressBar::new(traces.len() as u64).with_style(
                indicatif::ProgressStyle::with_template("{bar:30} {pos}/{len} {msg}")
                    .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
            );
            let mut reports = Vec::new();
            for path in &traces {
                progress.set_message(path.display().to_string());
                let trace = load_trace(path)?;
                let report = match backend {
                    BackendKind::Sim => replay_simulated(&trace, capacity, policy.clone())?,
                    BackendKind::Host => {
                        let backend = HostBackend::with_capacity(capacity);
                        for stream in trace.streams() {
                            backend.streams().ensure_stream(stream);
                        }
                        let a = CachingAllocator::with_config(backend, policy.clone())?;
                        replay(&trace, &a)?
                    }
                };
                reports.push(report);
                progress.inc(1);
            }
            progress.finish_and_clear();
            if json {
                println!("{}", serde_json::to_string_pretty(&reports)?);
            } else {
                print_table(&reports);
            }
        }
        Command::ConvertPth { input, output } => {
            let n = wick_zoo::pth::convert_to_safetensors(&input, &output)?;
            println!("wrote {n} tensors to {}", output.display());
        }
        Command::Train(args) => train::run(&args)?,
        Command::Fetch(args) => fetch::run(&args)?,
        Command::Estimate(args) => estimate::run(&args)?,
        Command::FitBatch(args) => fit::run(&args)?,
        Command::Report(args) => report::run(&args)?,
        Command::Monitor(args) => monitor::run(&args)?,
        Command::Jobs { action: None } => {
            let jobs = wick_train::jobs::Job::list()?;
            if jobs.is_empty() {
                println!("no jobs");
            }
            for mut job in jobs {
                println!("{}  {}", job.status()?, job.registration().dir.display());
            }
        }
        Command::Jobs { action: Some(JobAction::Stop { id }) } => {
            let mut job = wick_train::jobs::Job::attach(&id)?;
            job.stop()?;
            println!("asked job {id} to checkpoint and exit");
        }
        Command::Jobs { action: Some(JobAction::Status { id }) } => {
            println!("{}", serde_json::to_string_pretty(&wick_train::jobs::Job::attach(&id)?.status()?)?);
        }
        Command::Jobs { action: Some(JobAction::Forget { id }) } => {
            let mut job = wick_train::jobs::Job::attach(&id)?;
            if job.is_running() {
                bail!("job {id} is running: stop it first");
            }
            job.forget()?;
        }
        Command::Traces { dir } => {
            std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
            for trace in workloads::standard_suite() {
                let path = dir.join(format!("{}.json", trace.name));
                wick::files::write_atomic(&path, trace.to_json().as_bytes())
                    .with_context(|| format!("writing {}", path.display()))?;
                println!(
                    "{} ({} ops, {} live at peak)",
                    path.display(),
                    trace.ops.len(),
                    format_bytes(trace.peak_live_bytes() as u64)
                );
            }
        }
    }
    Ok(())
}

/// A trace file, or a recorded run's history as the trace of its allocations.
fn load_trace(path: &std::path::Path) -> Result<Trace> {
    let text = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let value: serde_json::Value =
        serde_json::from_str(&text).with_context(|| format!("{}: not JSON", path.display()))?;
    if wick::MemoryHistory::is_recorded_run(&value) {
        let run: wick::MemoryHistory =
            serde_json::from_value(value).with_context(|| format!("{}: not a recorded run", path.display()))?;
        let name = path.file_name().map_or("run".into(), |n| n.to_string_lossy().replace(".history.json", ""));
        return Ok(Trace::from_heap_history(&name, &run.heap, 0));
    }
    Trace::from_json(&text).with_context(|| format!("trace {}", path.display()))
}

/// The policy a replay runs with and where it came from: `--config` when given, else the
/// environment (`WICK_ALLOC_CONF`, then `PYTORCH_CUDA_ALLOC_CONF`), else wick's defaults.
fn replay_policy(config: Option<&str>) -> Result<(AllocatorConfig, String)> {
    let (text, source) = match (config, wick_memory::alloc_conf_env()) {
        (Some(text), _) => (text.to_string(), "--config".to_string()),
        (None, Some((variable, text))) => (text, variable.to_string()),
        (None, None) => return Ok((AllocatorConfig::default(), wick::machine::DEFAULT_POLICY.into())),
    };
    let policy = AllocatorConfig::parse(&text).with_context(|| format!("{source}={text:?}"))?;
    let shown = if text.is_empty() { wick::machine::DEFAULT_POLICY.to_string() } else { format!("{text:?}") };
    Ok((policy, format!("{shown} (from {source})")))
}

fn print_table(reports: &[ReplayReport]) {
    println!(
        "| {:<20} | {:>7} | {:>12} | {:>12} | {:>13} | {:>7} | {:>4} | {:>11} |",
        "trace", "ops", "peak alloc", "peak reserv", "fragmentation", "retries", "OOMs", "ops/s"
    );
    println!("|{}|", "-".repeat(112));
    for r in reports {
        println!(
            "| {:<20} | {:>7} | {:>12} | {:>12} | {:>13.4} | {:>7} | {:>4} | {:>11.0} |",
            r.name,
            r.ops,
            format_bytes(r.peak_allocated as u64),
            format_bytes(r.peak_reserved as u64),
            r.fragmentation,
            r.retries,
            r.ooms,
            r.ops_per_sec
        );
    }
}

// Large buffers (candle's tensors) come from wick's caching allocator: they stay mapped and are
// reused, and the training progress reports its exact allocated, peak and reserved bytes.
wick::main!(run);
