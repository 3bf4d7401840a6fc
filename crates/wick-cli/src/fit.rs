//! `wick fit-batch MODEL --budget 24GiB | --gpu A100-80GB | --device cuda:0`: the largest batch
//! whose estimate, with the estimator's stated margin, fits a memory budget, and the gradient
//! accumulation that reaches a target effective batch.

use anyhow::{bail, Context, Result};
use clap::{Args, ValueEnum};
use wick_memory::format_bytes;
use wick_zoo::estimate::{fit_margin, largest_fitting, profile_batches, Mode, INFERENCE_PROFILE_BATCHES};

use crate::estimate::{ModelArgs, Profiled, Target};

/// Memory the CUDA context and the kernels' images take on a device before any tensor (PyTorch's
/// context is 300–500 MiB on recent GPUs); subtracted from a `--gpu` size.
pub const CONTEXT_RESERVE: u64 = 512 << 20;

/// Common GPUs by their total memory as the driver reports it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum GpuModel {
    /// Tesla T4, 16 GB.
    #[value(name = "T4")]
    T4,
    /// V100 16 GB.
    #[value(name = "V100-16GB")]
    V100_16,
    /// V100 32 GB.
    #[value(name = "V100-32GB")]
    V100_32,
    /// A10, 24 GB.
    #[value(name = "A10")]
    A10,
    /// L4, 24 GB.
    #[value(name = "L4")]
    L4,
    /// GeForce RTX 3090 / 4090, 24 GB.
    #[value(name = "RTX-4090")]
    Rtx4090,
    /// A100 40 GB.
    #[value(name = "A100-40GB")]
    A100_40,
    /// L40S, 48 GB.
    #[value(name = "L40S")]
    L40s,
    /// A100 80 GB.
    #[value(name = "A100-80GB")]
    A100_80,
    /// H100 80 GB (SXM).
    #[value(name = "H100-80GB")]
    H100_80,
    /// H200, 141 GB.
    #[value(name = "H200")]
    H200,
}

impl GpuModel {
    /// Total device memory in MiB as NVML reports it (rounded; cards differ by a few MiB).
    pub fn total_mib(self) -> u64 {
        match self {
            GpuModel::T4 => 15_360,
            GpuModel::V100_16 => 16_160,
            GpuModel::V100_32 => 32_510,
            GpuModel::A10 => 23_028,
            GpuModel::L4 => 23_034,
            GpuModel::Rtx4090 => 24_564,
            GpuModel::A100_40 => 40_960,
            GpuModel::L40s => 46_068,
            GpuModel::A100_80 => 81_920,
            GpuModel::H100_80 => 81_559,
            GpuModel::H200 => 143_771,
        }
    }
}

/// The training mode to fit.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum FitMode {
    /// Forward only.
    Inference,
    /// SGD.
    Sgd,
    /// SGD with momentum.
    SgdMomentum,
    /// AdamW.
    Adamw,
}

/// `wick fit-batch` arguments.
#[derive(Debug, Args)]
pub struct FitArgs {
    /// The model.
    #[command(flatten)]
    pub model: ModelArgs,
    /// A memory budget: `24GiB`, `80GB`, `512MiB`, or bytes (planned for a step on the CPU,
    /// whose update runs in place; `--gpu` and `--device` plan a GPU's).
    #[arg(long, required_unless_present_any = ["gpu", "device"], conflicts_with_all = ["gpu", "device"])]
    pub budget: Option<String>,
    /// A GPU by name: its memory less a CUDA context reserve.
    #[arg(long, value_enum, conflicts_with = "device")]
    pub gpu: Option<GpuModel>,
    /// A GPU of this machine (`cuda:N`): its free memory now, from the driver.
    #[arg(long)]
    pub device: Option<String>,
    /// Mode.
    #[arg(long, value_enum, default_value = "adamw")]
    pub mode: FitMode,
    /// An effective batch to reach with gradient accumulation.
    #[arg(long)]
    pub target_batch: Option<usize>,
    /// The largest batch to consider.
    #[arg(long, default_value_t = 65_536)]
    pub max_batch: usize,
    /// Print JSON instead of text.
    #[arg(long)]
    pub json: bool,
}

/// Parses `24GiB`, `80GB`, `1.5TiB`, `512MiB`, `4096` (bytes): binary units with `i`, decimal without.
pub fn parse_bytes(text: &str) -> Result<u64> {
    let t = text.trim();
    let split = t.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(t.len());
    let (number, unit) = t.split_at(split);
    let value: f64 = number.parse().with_context(|| format!("`{text}`: expected a size such as 24GiB or 80GB"))?;
    let scale: f64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1.0,
        "kb" => 1e3,
        "mb" => 1e6,
        "gb" => 1e9,
        "tb" => 1e12,
        "kib" => 1024.0,
        "mib" => 1024f64.powi(2),
        "gib" => 1024f64.powi(3),
        "tib" => 1024f64.powi(4),
        other => bail!("`{text}`: unknown unit `{other}` (B, KB, MB, GB, TB, KiB, MiB, GiB, TiB)"),
    };
    let bytes = value * scale;
    if !(bytes.is_finite() && bytes >= 1.0 && bytes < u64::MAX as f64) {
        bail!("`{text}`: not a positive size");
    }
    Ok(bytes as u64)
}

/// The budget and where it came from.
fn budget(args: &FitArgs) -> Result<(u64, String)> {
    if let Some(text) = &args.budget {
        return Ok((parse_bytes(text).context("--budget")?, format!("--budget {text}")));
    }
    if let Some(gpu) = args.gpu {
        let total = gpu.total_mib() << 20;
        let name = gpu.to_possible_value().map_or_else(String::new, |v| v.get_name().to_string());
        return Ok((
            total.saturating_sub(CONTEXT_RESERVE),
            format!("{name}: {} less {} for the CUDA context", format_bytes(total), format_bytes(CONTEXT_RESERVE)),
        ));
    }
    let Some(device) = &args.device else { bail!("give --budget, --gpu or --device") };
    let index: u32 = device
        .strip_prefix("cuda:")
        .and_then(|n| n.parse().ok())
        .with_context(|| format!("--device {device}: expected cuda:N"))?;
    let report = wick::gpu::GpuReport::probe();
    let Some(gpu) = report.devices.iter().find(|g| g.index == index) else {
        bail!("--device {device}: {}", report.summary());
    };
    Ok((gpu.free_bytes, format!("{device} ({}): free memory now", gpu.name)))
}

/// The accumulation plan for an effective batch `target` with micro-batches of at most `largest`:
/// the fewest steps whose micro-batch divides the target exactly.
pub fn accumulation(target: usize, largest: usize) -> Option<(usize, usize)> {
    if target == 0 || largest == 0 {
        return None;
    }
    (target.div_ceil(largest)..=target)
        .find(|s| target.is_multiple_of(*s) && target / s <= largest)
        .map(|s| (target / s, s))
}

/// Runs `wick fit-batch`.
pub fn run(args: &FitArgs) -> Result<()> {
    let (budget, source) = budget(args)?;
    let mode = match args.mode {
        FitMode::Inference => Mode::Inference,
        FitMode::Sgd if args.model.precision == crate::estimate::Precision::AmpBf16 => {
            bail!("{}", crate::measure::PLAIN_SGD_UNDER_AMP)
        }
        FitMode::Sgd => Mode::TrainSgd,
        FitMode::SgdMomentum => Mode::TrainSgdMomentum,
        FitMode::Adamw => Mode::TrainAdamW,
    };
    // A GPU's budget plans a GPU's update (and keeps the GPU's margin); a budget in bytes, the
    // CPU's.
    let on = if args.budget.is_some() { Target::Cpu } else { Target::Cuda };
    let margin = fit_margin(on == Target::Cuda);
    if on == Target::Cuda && args.model.prefetch {
        bail!("--prefetch is stage 3's on host ranks: GPU ranks gather on the compute stream (wick train refuses it there)");
    }
    if on == Target::Cuda {
        eprintln!("{}", crate::estimate::GPU_CAVEAT);
    }
    // The decision is about the largest batch that fits and the one above it: where they lie
    // between two profiled batches they are profiled too, and the search runs again on that
    // profile (until it stops moving; the kernels' scratch does not follow a line between
    // profiled batches exactly).
    let mut extra: Vec<usize> = Vec::new();
    let (p, largest) = loop {
        let p = Profiled::new(&args.model, &extra)?;
        let fits = |b: usize| (p.estimate(b, mode, on).total as f64 * (1.0 + margin)) <= budget as f64;
        let largest = largest_fitting(args.max_batch.max(1), fits);
        let profiled =
            if mode == Mode::Inference { INFERENCE_PROFILE_BATCHES } else { profile_batches(args.model.checkpointing) };
        let last = profiled[profiled.len() - 1];
        let next: Vec<usize> =
            [largest.max(1), largest + 1].into_iter().filter(|b| *b < last && !profiled.contains(b)).collect();
        if extra.len() >= 6 || next.iter().all(|b| extra.contains(b)) {
            break (p, largest);
        }
        extra.extend(next);
    };
    let at = p.estimate(largest.max(1), mode, on);
    // With several ranks the effective batch is split between them first: each rank accumulates
    // its share (which must divide evenly).
    let ranks = args.model.ranks as usize;
    let plan = args.target_batch.map(|t| if t.is_multiple_of(ranks) { accumulation(t / ranks, largest) } else { None });
    if args.json {
        let out = serde_json::json!({
            "model": p.what,
            "mode": format!("{mode:?}"),
            "budget_bytes": budget,
            "budget_source": source,
            "margin": margin,
            "largest_batch": largest,
            "ranks": ranks,
            "estimate": at,
            "target_batch": args.target_batch,
            "micro_batch": plan.flatten().map(|p| p.0),
            "accumulation_steps": plan.flatten().map(|p| p.1),
            "profile_seconds": p.seconds,
        });
        println!("{}", serde_json::to_string_pretty(&out)?);
        return Ok(());
    }
    println!("{} — {mode:?} in {} ({source})", p.what, format_bytes(budget));
    if largest == 0 {
        println!(
            "nothing fits: batch 1 needs {} (with the {:.0} % margin {})",
            format_bytes(at.total as u64),
            margin * 100.0,
            format_bytes((at.total as f64 * (1.0 + margin)) as u64)
        );
    } else {
        println!(
            "largest batch: {largest} — estimate {} (parameters {}, gradients {}, optimizer {}, masters {}, \
             activations {}, workspace {}), {:.0} % margin included",
            format_bytes(at.total as u64),
            format_bytes(at.parameters as u64),
            format_bytes(at.gradients as u64),
            format_bytes(at.optimizer_state as u64),
            format_bytes(at.master_weights as u64),
            format_bytes(at.activations as u64),
            format_bytes(at.workspace as u64),
            margin * 100.0
        );
    }
    match (args.target_batch, plan.flatten()) {
        (Some(t), Some((micro, steps))) if ranks > 1 => println!(
            "effective batch {t} over {ranks} ranks: on each, {steps} accumulation step(s) of micro-batch {micro}"
        ),
        (Some(t), Some((micro, steps))) => {
            println!("effective batch {t}: {steps} accumulation step(s) of micro-batch {micro}")
        }
        (Some(t), None) if ranks > 1 && !t.is_multiple_of(ranks) => {
            println!("effective batch {t}: does not split over {ranks} ranks")
        }
        (Some(t), None) => println!("effective batch {t}: not reachable (no micro-batch fits)"),
        (None, _) => {}
    }
    println!("{}", p.how());
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_parse_in_binary_and_decimal_units() {
        assert_eq!(parse_bytes("24GiB").unwrap(), 24 << 30);
        assert_eq!(parse_bytes("80GB").unwrap(), 80_000_000_000);
        assert_eq!(parse_bytes("1.5 KiB").unwrap(), 1536);
        assert_eq!(parse_bytes("4096").unwrap(), 4096);
        for bad in ["", "GiB", "-1GiB", "0", "12 parsecs", "1e999GB", "nan"] {
            assert!(parse_bytes(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn accumulation_reaches_the_target_exactly_with_the_fewest_steps() {
        assert_eq!(accumulation(256, 64), Some((64, 4)));
        assert_eq!(accumulation(256, 100), Some((64, 4)));
        assert_eq!(accumulation(30, 7), Some((6, 5)));
        assert_eq!(accumulation(13, 5), Some((1, 13)));
        assert_eq!(accumulation(8, 64), Some((8, 1)));
        assert_eq!(accumulation(8, 0), None);
        for t in 1..60 {
            for l in 1..20 {
                let (m, s) = accumulation(t, l).unwrap();
                assert!(m * s == t && m <= l);
                assert!((1..s).all(|f| t % f != 0 || t / f > l), "fewer steps possible for {t}/{l}");
            }
        }
    }
}
