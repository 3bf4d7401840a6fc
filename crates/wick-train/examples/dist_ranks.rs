//! One rank of the multi-process checks (`tests/multi_rank.rs` starts it under `mpirun`, and
//! alone as the one-process reference). What it runs comes from the environment:
//!
//! - `WICK_DIST_SCENARIO`: `train` (steps of a model; alone it takes both micro-batches of a
//!   step itself, as gradient accumulation), `inf` (f16 with the loss scaler, an inf loss on
//!   rank 1 only at step 2), `oom` (a memory cap on rank 1 only refuses step 2's activations),
//!   `collectives` (each collective against a recomputation, and the refusals), `memory` (one
//!   AdamW step's measured peak on each rank beside the estimator's per-rank figure);
//! - `WICK_DIST_MODEL` `decoder`|`cnn`, `WICK_DIST_PRECISION` `f32`|`bf16`|`f16`,
//!   `WICK_DIST_ZERO` `0`|`1`|`2`|`3`, `WICK_DIST_STEPS`, `WICK_DIST_OVERLAP` (`0`: every bucket
//!   reduced after backward), `WICK_DIST_PREFETCH` (`1`: stage 3 prefetches the next block),
//!   `WICK_DIST_RECOMPUTE` (`0`: stage 3's blocks keep their activations),
//!   `WICK_DIST_TENSOR_PATH` (`1`: stage 3 takes the tensor path of GPU ranks on the host);
//! - `WICK_DIST_CKPT`: a checkpoint folder; with `WICK_DIST_SAVE_AT=k` the run saves after step
//!   k and stops there, with `WICK_DIST_RESUME=1` it resumes from the folder first (and with
//!   `WICK_DIST_SAVE_NOW=1` saves again at once, at its own world size, and stops);
//!   `WICK_DIST_JOIN=1` builds the whole state and joins the group after resuming instead of
//!   starting in the group (sharded from the start);
//! - `WICK_DIST_OUT`: where rank 0 writes what happened (JSON).

mod common;

use std::cell::Cell;

use anyhow::{bail, ensure, Context, Result};
use candle_core::{DType, Device, Tensor};
use sha2::{Digest, Sha256};
use wick_nn::checkpoint::Checkpointing;
use wick_nn::params::Params;
use wick_nn::{Autocast, Model, NnError};
use wick_train::dist::{DataParallelOptions, DistError, ProcessGroup, ReduceOp, Sharding};
use wick_train::trainer::{TrainOptions, Trainer};
use wick_train::TrainError;
use wick_zoo::registry::{ModelSpec, ZooBatch, ZooModel};
use wick_zoo::resnet::ResNetDepth;

fn env(name: &str, default: &str) -> String {
    std::env::var(name).unwrap_or_else(|_| default.to_string())
}

/// The model with a fault on one rank at one step (none for `train`).
struct Faulty {
    inner: ZooModel,
    fault: Option<(&'static str, u64)>,
    calls: Cell<u64>,
    engine: wick::Engine,
}

impl Model for Faulty {
    type Batch = ZooBatch;

    fn params(&self) -> &Params {
        self.inner.params()
    }

    fn loss_with(&self, batch: &ZooBatch, checkpoint: Option<&Checkpointing>) -> Result<Tensor, NnError> {
        let call = self.calls.get() + 1;
        self.calls.set(call);
        match self.fault {
            Some(("oom", at)) if at == call => self.engine.preflight(1 << 40, "activations")?,
            _ => {}
        }
        let loss = self.inner.loss_with(batch, checkpoint)?;
        match self.fault {
            Some(("inf", at)) if at == call => Ok((loss * f64::INFINITY)?),
            _ => Ok(loss),
        }
    }
}

fn spec(model: &str) -> Result<ModelSpec> {
    Ok(match model {
        "decoder" => ModelSpec::Llama { config: wick_zoo::llama::LlamaConfig::tiny(64), seq: 8 },
        "cnn" => ModelSpec::ResNet { depth: ResNetDepth::R18, classes: 10, width: 8, image: 32 },
        m => bail!("unknown model {m}"),
    })
}

/// The parameters' hash: every value whole (gathered under ZeRO-3: a collective).
fn param_hash<M: Model>(trainer: &Trainer<M>) -> Result<String> {
    let mut h = Sha256::new();
    for (name, v) in trainer.gathered_parameters()? {
        h.update(name.as_bytes());
        let t = v.flatten_all()?.to_dtype(DType::F32)?;
        for x in t.to_vec1::<f32>()? {
            h.update(x.to_bits().to_le_bytes());
        }
    }
    Ok(format!("{:x}", h.finalize()))
}

fn train(group: &ProcessGroup, scenario: &str) -> Result<serde_json::Value> {
    let (rank, world) = (group.rank(), group.world_size());
    let model_name = env("WICK_DIST_MODEL", "decoder");
    let precision = env("WICK_DIST_PRECISION", "f32");
    let zero: u8 = env("WICK_DIST_ZERO", "0").parse()?;
    let steps: usize = env("WICK_DIST_STEPS", "4").parse()?;
    let micro = 2;
    let spec = spec(&model_name)?;
    let (dtype, autocast) = match precision.as_str() {
        "f32" => (DType::F32, Autocast::off()),
        "bf16" => (DType::BF16, Autocast::bf16()),
        "f16" => (DType::F16, Autocast::f16()),
        p => bail!("unknown precision {p}"),
    };
    let fault = match scenario {
        "inf" if rank == 1 => Some(("inf", 2)),
        "oom" if rank == 1 => Some(("oom", 2)),
        _ => None,
    };
    let mut engine = wick::Engine::cpu();
    if fault.is_some_and(|f| f.0 == "oom") {
        engine.set_memory_limit(Some(wick::memory::MemoryLimit::Bytes(1 << 30)))?;
    }
    let inner = spec.build(dtype, &Device::Cpu)?;
    let model = Faulty { inner, fault, calls: Cell::new(0), engine };
    // `WICK_DIST_CLIP=x`: the gradients clipped to a total norm of x.
    let clip_grad_norm = std::env::var("WICK_DIST_CLIP").ok().map(|s| s.parse()).transpose()?;
    let options = TrainOptions { optimizer: common::adamw(1e-3), autocast, clip_grad_norm, ..TrainOptions::default() };
    let describe = serde_json::json!({ "model": model_name, "precision": precision });
    let checkpoints =
        std::env::var("WICK_DIST_CKPT").ok().map(|d| wick_train::CheckpointDir::new(d.as_ref(), 3)).transpose()?;
    let save_at: Option<usize> = std::env::var("WICK_DIST_SAVE_AT").ok().map(|s| s.parse()).transpose()?;
    let resume = checkpoints.as_ref().filter(|_| env("WICK_DIST_RESUME", "0") == "1");
    let parallel = DataParallelOptions {
        sharding: Sharding::from_stage(zero)?,
        // Small buckets so that even the test models span several (and a parameter straddles
        // two ranks' blocks under ZeRO).
        bucket_bytes: 16 << 10,
        first_bucket_bytes: 4 << 10,
        // `WICK_DIST_OVERLAP=0`: every bucket reduced after backward.
        overlap: env("WICK_DIST_OVERLAP", "1") == "1",
        // `WICK_DIST_PREFETCH=1`: stage 3 starts the next block's gather ahead of it.
        prefetch: env("WICK_DIST_PREFETCH", "0") == "1",
        // `WICK_DIST_RECOMPUTE=0`: stage 3's blocks keep their activations.
        recompute: env("WICK_DIST_RECOMPUTE", "1") == "1",
        // `WICK_DIST_TENSOR_PATH=1`: stage 3 takes GPU ranks' tensor path on the host.
        tensor_path: env("WICK_DIST_TENSOR_PATH", "0") == "1",
    };
    let distributed = world > 1 || zero > 0;
    // `WICK_DIST_JOIN=1`: the whole state first (and the resume into it), then joining the group;
    // otherwise the run starts in the group (sharded from the start) and resumes its share.
    let join = env("WICK_DIST_JOIN", "0") == "1" || !distributed;
    let mut trainer = if join {
        Trainer::new(model, describe, None, options)?
    } else {
        Trainer::new_data_parallel(model, describe, None, options, group.clone(), parallel)?
    };
    let mut resumed = None;
    if let Some(dir) = resume {
        use wick::host_memory::{exact_heap, exact_peak, reset_exact_peak};
        let before = exact_heap().map_or(0, |h| h.0);
        reset_exact_peak();
        let r = trainer.resume(dir)?;
        let peak = exact_peak().map_or(0, |p| p.0).saturating_sub(before);
        resumed = Some(serde_json::json!({"step": r.step, "skipped": r.skipped, "peak": peak}));
    }
    let save_now = env("WICK_DIST_SAVE_NOW", "0") == "1";
    if join && distributed {
        trainer = trainer.data_parallel(group.clone(), parallel)?;
    }
    if let (Some(dir), true) = (&checkpoints, save_now) {
        // Saved again as this world size's shards, no step taken.
        trainer.save(dir, serde_json::json!({}))?;
        return Ok(serde_json::json!({ "saved": trainer.step() }));
    }
    let all = spec.batch(steps * 2 * micro, dtype, &Device::Cpu)?;
    let (mut losses, mut hashes, mut outcomes, mut errors) = (vec![], vec![], vec![], vec![]);
    let mut norms = vec![];
    for step in trainer.step() as usize..steps {
        let mine: Vec<ZooBatch> = if world == 1 {
            vec![all.narrow(2 * step * micro, micro)?, all.narrow((2 * step + 1) * micro, micro)?]
        } else {
            vec![all.narrow((2 * step + rank) * micro, micro)?]
        };
        match trainer.train_step(&mine) {
            Ok(record) => {
                losses.push(record.loss.to_bits());
                norms.push(record.grad_norm);
                outcomes.push(format!("{:?}", record.outcome));
                errors.push(String::new());
            }
            Err(e) => {
                losses.push(0);
                outcomes.push("Error".to_string());
                errors.push(match &e {
                    TrainError::Dist(DistError::PeerFailed { rank, .. }) => format!("peer {rank}"),
                    other => format!("own: {other}"),
                });
            }
        }
        let hash = param_hash(&trainer)?;
        // Every rank's parameters must be the same after every step.
        let bytes = Tensor::from_vec(hash.as_bytes().to_vec(), hash.len(), &Device::Cpu)?;
        let gathered = group.all_gather(&bytes)?.to_vec1::<u8>()?;
        ensure!(gathered.chunks(hash.len()).all(|c| c == hash.as_bytes()), "ranks differ after step {step}");
        hashes.push(hash);
        if let (Some(dir), Some(at)) = (&checkpoints, save_at) {
            if step + 1 == at {
                trainer.save(dir, serde_json::json!({}))?;
                break;
            }
        }
    }
    let (master, state) = trainer.optimizer_bytes();
    let peak = resumed.as_ref().and_then(|r| r["peak"].as_f64()).unwrap_or(0.0);
    let resume_peaks = group.all_gather(&Tensor::new(&[peak], &Device::Cpu)?)?.to_vec1::<f64>()?;
    let per_rank = group.all_gather(&Tensor::new(&[master as u64 as f64, state as u64 as f64], &Device::Cpu)?)?;
    Ok(serde_json::json!({
        "losses": losses,
        "norms": norms,
        "hashes": hashes,
        "outcomes": outcomes,
        "errors": errors,
        "optimizer_bytes": per_rank.to_vec1::<f64>()?,
        "reduce": trainer.last_reduce().map(|r| r.buckets),
        "overlapped": trainer.last_reduce().map(|r| r.overlapped),
        "resumed": resumed,
        "resume_peaks": resume_peaks,
    }))
}

/// One AdamW step at 4 examples per rank: each rank's measured peak (the caching heap's, from
/// the step's start, plus what the run held then: parameters, masters, optimizer state) and the
/// estimator's per-rank figure.
fn memory(group: &ProcessGroup) -> Result<serde_json::Value> {
    use wick::host_memory::{exact_heap, exact_peak, reset_exact_peak};
    use wick_zoo::estimate::{estimate_per_rank, Mode, Overlap, Ranks, Update};
    let world = group.world_size();
    let model_name = env("WICK_DIST_MODEL", "decoder");
    let amp = env("WICK_DIST_PRECISION", "f32") == "bf16";
    let zero: u8 = env("WICK_DIST_ZERO", "0").parse()?;
    let batch = 4;
    let spec = match model_name.as_str() {
        "decoder" => ModelSpec::Llama { config: common::main_job_decoder(4096), seq: 64 },
        _ => ModelSpec::ResNet { depth: ResNetDepth::R18, classes: 10, width: 16, image: 64 },
    };
    let (dtype, autocast) = if amp { (DType::BF16, Autocast::bf16()) } else { (DType::F32, Autocast::off()) };
    // Stage 3 is profiled as its ranks run the blocks (see `ModelSpec::profile_sharded`).
    let recompute = env("WICK_DIST_RECOMPUTE", "1") == "1";
    let (profile, bytes, blocks) = if zero == 3 {
        let (profile, bytes, blocks, _) = spec.profile_sharded(dtype, world, recompute, &[batch])?;
        (profile, bytes, Some(blocks))
    } else {
        let (profile, bytes) = spec.profile(dtype, false, &[batch])?;
        (profile, bytes, None)
    };
    let input = spec.batch(batch, dtype, &Device::Cpu)?;
    // What the heap holds before the model exists (stage 3's figure is measured from here).
    let base = exact_heap().map_or(0, |h| h.0);
    let model = spec.build(dtype, &Device::Cpu)?;
    let param_vars: Vec<_> = model.params().iter().map(|(_, v)| v.clone()).collect();
    let buckets = wick_train::dist::buckets::GradBuckets::new(
        &param_vars,
        &model.params().registration_order(),
        wick_train::dist::buckets::FIRST_BUCKET_BYTES,
        wick_train::dist::buckets::BUCKET_BYTES,
    );
    let largest_bucket = buckets.largest_buffer(&param_vars, zero > 0, world);
    let overlap = env("WICK_DIST_OVERLAP", "1") == "1";
    let (largest, total) = buckets.in_backward_bytes(&param_vars, zero > 0, world);
    let overlap_bytes = (overlap && zero < 3).then_some(Overlap { largest, total });
    let ranks = Ranks {
        ranks: world,
        zero_stage: zero,
        largest_bucket,
        blocks,
        overlap: overlap_bytes,
        prefetch: false,
        recompute,
    };
    let estimate = estimate_per_rank(bytes, &profile, batch, Mode::TrainAdamW, amp, Update::InPlace, ranks);
    let options = TrainOptions { optimizer: common::adamw(1e-6), autocast, ..TrainOptions::default() };
    // How much the start holds at its peak (the whole state, or only this rank's shard).
    let before = exact_heap().map_or(0, |h| h.0);
    reset_exact_peak();
    let parallel =
        DataParallelOptions { sharding: Sharding::from_stage(zero)?, overlap, recompute, ..Default::default() };
    let mut trainer = if world == 1 && zero == 0 {
        Trainer::new(model, serde_json::json!({}), None, options)?
    } else if env("WICK_DIST_JOIN", "0") == "1" {
        Trainer::new(model, serde_json::json!({}), None, options)?.data_parallel(group.clone(), parallel)?
    } else {
        Trainer::new_data_parallel(model, serde_json::json!({}), None, options, group.clone(), parallel)?
    };
    let start_peak = exact_peak().map_or(0, |p| p.0).saturating_sub(before);
    // One process's f32 masters (low-precision parameters) and AdamW state, and the largest
    // parameter in f32: what a sharded start may hold besides its shard.
    let vars: Vec<_> = trainer.model().params().iter().map(|(_, v)| v.clone()).collect();
    let whole_state: usize = vars.iter().map(|v| v.elem_count() * 4 * (2 + usize::from(v.dtype() != DType::F32))).sum();
    let largest_f32 = vars.iter().map(|v| v.elem_count() * 4).max().unwrap_or(0);
    let params: usize = trainer.model().params().iter().map(|(_, v)| v.elem_count() * v.dtype().size_in_bytes()).sum();
    // The second step is measured: a sharded start makes its optimizer state at the first.
    let batch = input;
    trainer.train_step(std::slice::from_ref(&batch))?;
    // What the run holds between steps (before this scenario's own engine and summary).
    let held_at_step = exact_heap().map_or(0, |h| h.0).saturating_sub(base);
    let (master, state) = trainer.optimizer_bytes();
    let engine = wick::Engine::cpu();
    trainer.account(&engine);
    let summary = engine.memory_report().to_string();
    let Some((before, _)) = exact_heap() else { bail!("no exact heap") };
    reset_exact_peak();
    trainer.train_step(std::slice::from_ref(&batch))?;
    let Some((peak, _)) = exact_peak() else { bail!("no exact heap") };
    // Stage 3 hands the model's copies of the blocks' parameters back and keeps pieces whose
    // bytes the trainer does not list one by one: the step's peak above its start, and what the
    // heap held between steps above what it held before the model existed. The other stages: the step's peak above its start, and what
    // the run held then.
    let measured = if zero == 3 {
        (peak.saturating_sub(before) + held_at_step) as f64
    } else {
        (peak.saturating_sub(before) + params + master + state) as f64
    };
    // With a checkpoint folder: saved, and resumed by a fresh run started in the group; its
    // peak while resuming.
    let mut resume_peak = 0;
    if let Ok(dir) = std::env::var("WICK_DIST_CKPT") {
        let dir = wick_train::CheckpointDir::new(dir.as_ref(), 1)?;
        trainer.save(&dir, serde_json::json!({}))?;
        drop(trainer);
        let model = spec.build(dtype, &Device::Cpu)?;
        let mut again =
            Trainer::new_data_parallel(model, serde_json::json!({}), None, options, group.clone(), parallel)?;
        let before = exact_heap().map_or(0, |h| h.0);
        reset_exact_peak();
        again.resume(&dir)?;
        resume_peak = exact_peak().map_or(0, |p| p.0).saturating_sub(before);
    }
    let figures = group.all_gather(&Tensor::new(&[estimate.estimate.total as f64, measured], &Device::Cpu)?)?;
    Ok(serde_json::json!({
        "per_rank": figures.to_vec1::<f64>()?,
        "held": [params, master, state],
        "start_peak": start_peak,
        "whole_state": whole_state,
        "largest_f32": largest_f32,
        "resume_peak": resume_peak,
        "held_at_step": held_at_step,
        "estimate": estimate,
        "summary": summary,
    }))
}

fn collectives(group: &ProcessGroup) -> Result<serde_json::Value> {
    let (rank, world) = (group.rank(), group.world_size());
    let r = rank as f32;
    let dev = Device::Cpu;
    let t = Tensor::new(&[[1f32 + r, 2. * r], [3., -r]], &dev)?;
    // Recomputed on every rank from the formula each rank used.
    let ranks: Vec<f32> = (0..world).map(|k| k as f32).collect();
    let sum: Vec<f32> = vec![
        ranks.iter().map(|k| 1. + k).sum(),
        ranks.iter().map(|k| 2. * k).sum(),
        3. * world as f32,
        ranks.iter().map(|k| -k).sum(),
    ];
    ensure!(group.all_reduce(&t, ReduceOp::Sum)?.flatten_all()?.to_vec1::<f32>()? == sum, "sum");
    let avg: Vec<f32> = sum.iter().map(|s| s / world as f32).collect();
    ensure!(group.all_reduce(&t, ReduceOp::Avg)?.flatten_all()?.to_vec1::<f32>()? == avg, "avg");
    let max = vec![world as f32, 2. * (world - 1) as f32, 3., 0.];
    ensure!(group.all_reduce(&t, ReduceOp::Max)?.flatten_all()?.to_vec1::<f32>()? == max, "max");
    let bf = group.all_reduce(&t.to_dtype(DType::BF16)?, ReduceOp::Sum)?;
    ensure!(bf.dtype() == DType::BF16 && bf.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()? == sum, "bf16");
    let ids = Tensor::new(&[rank as u32 * 10, 7], &dev)?;
    let b = group.broadcast(&ids, world - 1)?.to_vec1::<u32>()?;
    ensure!(b == vec![(world as u32 - 1) * 10, 7], "broadcast {b:?}");
    let g = group.all_gather(&Tensor::new(&[r, r + 0.5], &dev)?)?.to_vec1::<f32>()?;
    ensure!(g == ranks.iter().flat_map(|k| [*k, k + 0.5]).collect::<Vec<_>>(), "all_gather {g:?}");
    // Half floats (sent as their bits) and a view that is not contiguous (sent from a copy).
    for dtype in [DType::BF16, DType::F16] {
        let h = group.all_gather(&Tensor::new(&[r, r + 0.5], &dev)?.to_dtype(dtype)?)?;
        let h = h.to_dtype(DType::F32)?.to_vec1::<f32>()?;
        ensure!(h == g && group.all_gather(&Tensor::new(&[r], &dev)?.to_dtype(dtype)?)?.dtype() == dtype, "{dtype:?}");
    }
    let strided = Tensor::new(&[[r, 1.0], [r + 0.5, 2.0]], &dev)?.t()?.narrow(0, 0, 1)?;
    let s = group.all_gather(&strided)?.flatten_all()?.to_vec1::<f32>()?;
    ensure!(s == g, "all_gather of a strided view {s:?}");
    let long = Tensor::arange(0f32, (4 * world) as f32, &dev)?.reshape((2 * world, 2))?;
    let rs = group.reduce_scatter(&(&long + r as f64)?, ReduceOp::Sum)?.flatten_all()?.to_vec1::<f32>()?;
    let expect: Vec<f32> =
        (4 * rank..4 * rank + 4).map(|i| i as f32 * world as f32 + ranks.iter().sum::<f32>()).collect();
    ensure!(rs == expect, "reduce_scatter {rs:?} vs {expect:?}");
    let uneven = group.reduce_scatter(&Tensor::zeros(2 * world + 1, DType::F32, &dev)?, ReduceOp::Sum);
    let uneven = uneven.err().map(|e| e.to_string()).unwrap_or_default();
    ensure!(world == 1 || uneven.contains("pad it"), "uneven reduce_scatter: {uneven}");
    // Shapes that differ between ranks: an error on every rank naming each rank's shape.
    let odd = Tensor::zeros(3 + rank, DType::F32, &dev)?;
    let mismatch = group.all_reduce(&odd, ReduceOp::Sum).err().map(|e| e.to_string()).unwrap_or_default();
    ensure!(world == 1 || (mismatch.contains("rank 0: all_reduce F32 [3]") && mismatch.contains("[4]")), "{mismatch}");
    // A setting that differs: refused naming the field.
    let setting = serde_json::json!({"model": "decoder", "options": {"lr": 1e-3 * (1 + rank) as f64}});
    let differs = group.check_same("training setup", &setting).err().map(|e| e.to_string()).unwrap_or_default();
    ensure!(world == 1 || differs.contains("`options.lr`"), "{differs}");
    group.barrier()?;
    Ok(serde_json::json!({ "world": world, "mismatch": mismatch, "differs": differs }))
}

fn run() -> Result<()> {
    let group = ProcessGroup::from_env().context("joining the process group")?;
    let scenario = env("WICK_DIST_SCENARIO", "train");
    let out = match scenario.as_str() {
        "collectives" => collectives(&group),
        "train" | "inf" | "oom" => train(&group, &scenario),
        "memory" => memory(&group),
        s => Err(anyhow::anyhow!("unknown scenario {s}")),
    };
    // A rank that fails outside the trainer's agreed steps ends the whole job: the others would
    // wait for it in their next collective.
    let out = match out {
        Ok(out) => out,
        Err(e) => {
            eprintln!("rank {}: {e:#}", group.rank());
            group.abort(1);
        }
    };
    if group.is_root() {
        if let Ok(path) = std::env::var("WICK_DIST_OUT") {
            let tmp = format!("{path}.tmp");
            std::fs::write(&tmp, serde_json::to_vec_pretty(&out)?)?;
            std::fs::rename(&tmp, &path)?;
        }
    }
    Ok(())
}

wick::main!(run);
