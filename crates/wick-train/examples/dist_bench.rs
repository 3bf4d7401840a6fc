//! Data-parallel speed: one process or one rank of `mpirun`, timing training steps of a zoo
//! model at a global batch split over the ranks, or the all-reduce of wick's gradient buckets
//! against one plain MPI all-reduce of the same bytes. Prints one JSON line (rank 0).
//!
//! ```text
//! dist_bench train --model decoder|decoder-512|decoder-1024|minilm|bert-base|vit|resnet18|mobilenet_v2 --batch 8
//!                  [--image 224] [--steps 5] [--warmup 2]
//!                  [--zero 0..3] [--checkpointing] [--no-overlap] [--prefetch] [--no-recompute]
//!                  [--tensor-path]
//! dist_bench allreduce --mb 1,4,25,100 [--reps 5]
//! ```
//! (`scripts/torch-reference/ddp_bench.py` runs it next to PyTorch DDP.)

mod common;

use std::time::Instant;

use anyhow::{bail, Context, Result};
use candle_core::{DType, Device, Tensor, Var};
use wick_train::dist::buckets::{GradBuckets, BUCKET_BYTES, FIRST_BUCKET_BYTES};
use wick_train::dist::{DataParallelOptions, ProcessGroup, ReduceOp, Sharding};
use wick_train::trainer::{TrainOptions, Trainer};
use wick_train::Optimizer;
use wick_zoo::bert::BertConfig;
use wick_zoo::registry::ModelSpec;
use wick_zoo::resnet::ResNetDepth;
use wick_zoo::vit::VitConfig;

fn arg(args: &[String], name: &str, default: &str) -> String {
    args.iter().position(|a| a == name).and_then(|i| args.get(i + 1)).cloned().unwrap_or_else(|| default.into())
}

fn peak_rss_mib() -> f64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let kb = status.lines().find(|l| l.starts_with("VmHWM:")).and_then(|l| l.split_whitespace().nth(1));
    kb.and_then(|k| k.parse::<f64>().ok()).unwrap_or(0.0) / 1024.0
}

fn train(group: &ProcessGroup, args: &[String]) -> Result<serde_json::Value> {
    let (rank, world) = (group.rank(), group.world_size());
    let model = arg(args, "--model", "decoder");
    let batch: usize = arg(args, "--batch", "8").parse()?;
    let image: usize = arg(args, "--image", "224").parse()?;
    let (steps, warmup): (usize, usize) = (arg(args, "--steps", "5").parse()?, arg(args, "--warmup", "2").parse()?);
    if !batch.is_multiple_of(world) {
        bail!("a global batch of {batch} does not split over {world} ranks");
    }
    let (spec, optimizer) = match model.as_str() {
        // zoo-speed's decoder (the main job's) and optimizer.
        "decoder" => (ModelSpec::Llama { config: common::main_job_decoder(64), seq: 64 }, common::adamw(1e-4)),
        // 512 × 8 and 1024 × 8 decoders over a real vocabulary (32 000), 58 M and 168 M
        // parameters: where the parameters themselves weigh (the embeddings and the head are
        // read outside the blocks: 56 % and 39 % of them).
        "decoder-512" | "decoder-1024" => {
            let h = if model == "decoder-512" { 512 } else { 1024 };
            let config = wick_zoo::llama::LlamaConfig {
                hidden_size: h,
                num_layers: 8,
                num_heads: h / 64,
                intermediate_size: h * 11 / 4,
                max_seq: 64,
                ..wick_zoo::llama::LlamaConfig::tiny(32_000)
            };
            (ModelSpec::Llama { config, seq: 64 }, common::adamw(1e-4))
        }
        "resnet18" => (
            ModelSpec::ResNet { depth: ResNetDepth::R18, classes: 10, width: 64, image },
            Optimizer::SgdMomentum { lr: 0.01, momentum: 0.9 },
        ),
        // zoo-speed's shapes: MiniLM-L6 and BERT-base at 128 tokens, ViT-S/16 and MobileNetV2
        // over 10 classes.
        "minilm" => (ModelSpec::Bert { config: BertConfig::minilm_l6(), seq: 128 }, common::adamw(1e-4)),
        "bert-base" => (ModelSpec::Bert { config: BertConfig::base(), seq: 128 }, common::adamw(1e-4)),
        "vit" => {
            let config = VitConfig {
                image_size: image,
                patch_size: 16,
                hidden: 384,
                layers: 12,
                heads: 6,
                mlp_dim: 1536,
                num_classes: 10,
            };
            (ModelSpec::Vit(config), common::adamw(1e-4))
        }
        "mobilenet_v2" => (
            ModelSpec::MobileNetV2 { classes: 10, width_mult: 1.0, image },
            Optimizer::SgdMomentum { lr: 0.01, momentum: 0.9 },
        ),
        m => bail!("unknown model {m}"),
    };
    let zero: u8 = arg(args, "--zero", "0").parse()?;
    let activation_checkpointing = args.iter().any(|a| a == "--checkpointing");
    let net = spec.build(DType::F32, &Device::Cpu)?;
    let options = TrainOptions { optimizer, activation_checkpointing, ..TrainOptions::default() };
    let describe = serde_json::json!({"model": model});
    // `--no-overlap`: every bucket reduced after backward (the default starts them inside it).
    let overlap = !args.iter().any(|a| a == "--no-overlap");
    // `--prefetch`: stage 3 starts the next block's gather while the current one runs.
    let prefetch = args.iter().any(|a| a == "--prefetch");
    // `--no-recompute`: stage 3's blocks keep their activations (FSDP without checkpointing).
    let recompute = !args.iter().any(|a| a == "--no-recompute");
    // `--tensor-path`: stage 3 takes GPU ranks' tensor path on the host.
    let tensor_path = args.iter().any(|a| a == "--tensor-path");
    let parallel = DataParallelOptions {
        sharding: Sharding::from_stage(zero)?,
        overlap,
        prefetch,
        recompute,
        tensor_path,
        ..DataParallelOptions::default()
    };
    let mut trainer = if world > 1 || zero > 0 {
        Trainer::new_data_parallel(net, describe, None, options, group.clone(), parallel)?
    } else {
        Trainer::new(net, describe, None, options)?
    };
    // The high-water mark of the start (the model built whole, then sharded), apart from the
    // measured steps' (`clear_refs` 5 resets it, Linux ≥ 4.0).
    let start_rss = peak_rss_mib();
    let per_rank = batch / world;
    let all = spec.batch(batch, DType::F32, &Device::Cpu)?;
    let mine = all.narrow(rank * per_rank, per_rank)?;
    let (mut ms, mut comm_ms, mut reduce) = (Vec::new(), Vec::new(), Vec::new());
    let mut heap_base = 0;
    for i in 0..warmup + steps {
        if i == warmup {
            // The heap's peak over the measured steps, above what was live before them (the
            // parameters, masters and optimizer state are live throughout).
            heap_base = wick::host_memory::exact_heap().map_or(0, |h| h.0);
            wick::host_memory::reset_exact_peak();
            let _ = std::fs::write("/proc/self/clear_refs", "5");
        }
        group.barrier()?;
        let start = Instant::now();
        let record = trainer.train_step(std::slice::from_ref(&mine))?;
        let t = start.elapsed().as_secs_f64() * 1e3;
        if !record.loss.is_finite() {
            bail!("loss {}", record.loss);
        }
        if i >= warmup {
            ms.push(t);
            comm_ms.push(trainer.last_reduce().map_or(0.0, |r| r.comm_s * 1e3));
            if let Some(r) = trainer.last_reduce() {
                reduce.push(serde_json::json!({"buckets": r.buckets, "overlapped": r.overlapped,
                    "exposed_ms": r.exposed_s * 1e3, "wait_ms": r.wait_s * 1e3, "flight_ms": r.flight_s * 1e3,
                    "pack_ms": r.pack_s * 1e3, "hidden": r.hidden_fraction(), "prefetched": r.prefetched}));
            }
        }
    }
    let heap = wick::host_memory::exact_peak().map_or(0.0, |p| p.0 as f64 / (1 << 20) as f64);
    let mine = [peak_rss_mib(), heap, heap_base as f64 / (1 << 20) as f64, start_rss];
    let peaks = group.all_gather(&Tensor::new(&mine, &Device::Cpu)?)?.to_vec1::<f64>()?;
    Ok(serde_json::json!({"model": model, "batch": batch, "world": world, "zero": zero,
        "checkpointing": activation_checkpointing, "overlap": overlap, "prefetch": prefetch, "recompute": recompute, "ms": ms, "comm_ms": comm_ms, "reduce": reduce,
        "peak_rss_mib": peaks.iter().step_by(4).collect::<Vec<_>>(),
        "heap_peak_mib": peaks.iter().skip(1).step_by(4).collect::<Vec<_>>(),
        "heap_before_mib": peaks.iter().skip(2).step_by(4).collect::<Vec<_>>(),
        "start_rss_mib": peaks.iter().skip(3).step_by(4).collect::<Vec<_>>()}))
}

fn allreduce(group: &ProcessGroup, args: &[String]) -> Result<serde_json::Value> {
    let reps: usize = arg(args, "--reps", "5").parse()?;
    let mut rows = Vec::new();
    for mb in arg(args, "--mb", "1,4,25,100").split(',') {
        let mb: usize = mb.parse().context("--mb")?;
        let n = mb * (1 << 20) / 4;
        // Raw: one MPI all-reduce of n f32.
        let send = vec![1f32; n];
        let mut recv = vec![0f32; n];
        let mut raw = Vec::new();
        for _ in 0..reps {
            group.barrier()?;
            let t = Instant::now();
            group.all_reduce_slice(&send, &mut recv, ReduceOp::Sum)?;
            raw.push(t.elapsed().as_secs_f64());
        }
        drop((send, recv));
        // wick's path: gradients of 8 parameters of n/8 values each (a backward's result),
        // packed into 25 MiB buckets (1 MiB first), reduced, handed back as bucket views.
        let vars: Vec<Var> = (0..8)
            .map(|_| Var::from_tensor(&Tensor::ones(n / 8, DType::F32, &Device::Cpu)?))
            .collect::<Result<_, _>>()?;
        let buckets = GradBuckets::new(&vars, &(0..vars.len()).collect::<Vec<_>>(), FIRST_BUCKET_BYTES, BUCKET_BYTES);
        let (mut bucketed, mut comm, mut pack) = (Vec::new(), Vec::new(), Vec::new());
        for _ in 0..reps {
            let loss = vars.iter().map(|v| v.as_tensor().sum_all()).collect::<Result<Vec<_>, _>>()?;
            let mut grads = Tensor::stack(&loss, 0)?.sum_all()?.backward()?;
            group.barrier()?;
            let t = Instant::now();
            let stats = buckets.reduce(group, &mut grads, &vars)?;
            bucketed.push(t.elapsed().as_secs_f64());
            comm.push(stats.comm_s);
            pack.push(stats.pack_s);
        }
        let median = |v: &mut Vec<f64>| {
            v.sort_by(f64::total_cmp);
            v[v.len() / 2]
        };
        let (r, b) = (median(&mut raw), median(&mut bucketed));
        let bytes = (n * 4) as f64;
        rows.push(serde_json::json!({"mb": mb, "raw_s": r, "bucketed_s": b,
            "raw_gbps": bytes / r / 1e9, "bucketed_gbps": bytes / b / 1e9, "buckets": buckets.plan().len(),
            "comm_s": median(&mut comm), "pack_s": median(&mut pack)}));
    }
    Ok(serde_json::json!({"world": group.world_size(), "allreduce": rows}))
}

fn run() -> Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let group = ProcessGroup::from_env()?;
    let out = match args.get(1).map(String::as_str) {
        Some("train") => train(&group, &args)?,
        Some("allreduce") => allreduce(&group, &args)?,
        _ => bail!("usage: dist_bench train|allreduce ..."),
    };
    if group.is_root() {
        println!("{out}");
    }
    Ok(())
}

wick::main!(run);
