//! The one-rank NCCL check of `scripts/gpu-check.sh`: a communicator of one rank on GPU 0 (the
//! id made and "broadcast" through the process group alone), its all-reduce of CUDA tensors
//! against the input (one rank's sum, mean, maximum and minimum are the input itself, to the
//! bit), and its time beside a device copy of the same bytes. One GPU cannot host two ranks of a
//! communicator (NCCL refuses a duplicate device), so two-rank correctness is the MPI tests'.
//! Then the trainer on the GPU: alone and data-parallel in a one-rank group (gradients through
//! NCCL's buckets), the same parameters to the bit; ZeRO stages 1 and 2 likewise (f32, bf16 and
//! f16 with the loss scaler; clipping's norm; a sharded checkpoint resumed); a CUDA tensor's
//! memory handed back and given back (`wick_nn::pages`); ZeRO stage 3 likewise, recomputing its
//! blocks or keeping their graphs, with gradient accumulation, and the model's GPU copies of the
//! blocks' parameters holding no device memory after the first step (the decoder; a ResNet-18
//! with its batch-norm buffers too); and the same with every step a CUDA graph after its warm-up
//! (two micro-batches a step; the data-parallel graph holds the gradient buckets' and the loss's
//! all-reduces): captured, and the same losses and parameters to the bit as the graph trainer
//! alone. Prints one JSON line; exits 1 when a check fails.

use std::time::Instant;

use anyhow::{ensure, Result};
use candle_core::{DType, Device, Tensor};
use wick_train::dist::nccl::NcclGroup;
use wick_train::dist::{ProcessGroup, ReduceOp};

fn run() -> Result<()> {
    let group = ProcessGroup::from_env()?;
    ensure!(group.world_size() == 1, "the check runs as one rank (not under mpirun)");
    let device = Device::new_cuda(0)?;
    let nccl = NcclGroup::new(&group, &device)?;
    let mut checks = Vec::new();
    for dtype in [DType::F32, DType::BF16, DType::F16, DType::F64] {
        let x = Tensor::randn(0f32, 1.0, (257, 33), &device)?.to_dtype(dtype)?;
        for op in [ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max, ReduceOp::Min] {
            let y = nccl.all_reduce(&x, op)?;
            let same = y.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?
                == x.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
            checks.push(serde_json::json!({"dtype": format!("{dtype:?}"), "op": format!("{op:?}"), "same": same}));
            ensure!(same, "{dtype:?} {op:?}: one rank's all-reduce changed the tensor");
        }
    }
    // One rank's broadcast, all-gather and reduce-scatter are the input itself.
    let x = Tensor::randn(0f32, 1.0, (64, 3), &device)?;
    let bits = |t: &Tensor| -> Result<Vec<u32>> {
        Ok(t.flatten_all()?.to_vec1::<f32>()?.iter().map(|v| v.to_bits()).collect())
    };
    for (name, y) in [
        ("broadcast", nccl.broadcast(&x, 0)?),
        ("all_gather", nccl.all_gather(&x)?),
        ("reduce_scatter", nccl.reduce_scatter(&x, ReduceOp::Sum)?),
    ] {
        let same = y.dims() == x.dims() && bits(&y)? == bits(&x)?;
        checks.push(serde_json::json!({"dtype": "F32", "op": name, "same": same}));
        ensure!(same, "one rank's {name} changed the tensor");
    }
    ensure!(nccl.broadcast(&x, 1).is_err(), "a root outside the group must be refused");
    let host = Tensor::zeros(4, DType::F32, &Device::Cpu)?;
    ensure!(nccl.all_reduce(&host, ReduceOp::Sum).is_err(), "a host tensor must be refused");
    let mut timings = Vec::new();
    for mb in [1usize, 4, 25, 100] {
        let n = mb * (1 << 20) / 4;
        let x = Tensor::ones(n, DType::F32, &device)?;
        let time = |f: &dyn Fn() -> Result<Tensor>| -> Result<f64> {
            let mut best = f64::MAX;
            for _ in 0..5 {
                device.synchronize()?;
                let t = Instant::now();
                let y = f()?;
                device.synchronize()?;
                best = best.min(t.elapsed().as_secs_f64());
                drop(y);
            }
            Ok(best)
        };
        let reduce = time(&|| Ok(nccl.all_reduce(&x, ReduceOp::Sum)?))?;
        let copy = time(&|| Ok(x.copy()?))?;
        timings.push(serde_json::json!({"mb": mb, "all_reduce_ms": reduce * 1e3, "copy_ms": copy * 1e3}));
    }
    // The trainer's checks each on their own: one that fails is reported and the others still
    // run (a device run is scarce), then the run fails naming them.
    let mut failed = Vec::new();
    let mut part = |name: &str, outcome: Result<serde_json::Value>| {
        outcome.unwrap_or_else(|e| {
            failed.push(name.to_string());
            serde_json::json!({"error": format!("{e:#}")})
        })
    };
    let trainer = part("trainer", trainer_on_nccl(&group, &device));
    let zero = part("zero", zero_on_nccl(&group, &device));
    let pages = part("pages", pages_on_gpu(&device));
    let zero3 = part("zero3", zero3_on_nccl(&group, &device));
    let zero3_cnn = part("zero3_cnn", zero3_cnn_on_nccl(&group, &device));
    let graphs = part("graph_trainer", graph_trainer_on_nccl(&group, &device));
    println!(
        "{}",
        serde_json::json!({"nccl": format!("{nccl:?}"), "checks": checks, "timings": timings, "trainer": trainer,
            "zero": zero, "pages": pages, "zero3": zero3, "zero3_cnn": zero3_cnn, "graph_trainer": graphs, "failed": failed})
    );
    ensure!(failed.is_empty(), "failed: {failed:?}");
    Ok(())
}

/// A decoder's AdamW steps on the GPU, alone and data-parallel in a one-rank group (its
/// gradients through NCCL's buckets): the same parameters to the bit (one rank's sum is its
/// own gradient). The sharded stages: [`zero_on_nccl`], [`zero3_on_nccl`].
fn trainer_on_nccl(group: &ProcessGroup, device: &Device) -> Result<serde_json::Value> {
    use wick_train::dist::DataParallelOptions;
    use wick_train::trainer::{TrainOptions, Trainer};
    use wick_zoo::llama::{Llama, LlamaConfig};
    let config = LlamaConfig::tiny(64);
    let ids = Tensor::arange(0u32, 32, device)?.reshape((2, 16))?;
    // The same initial values for both runs (the zoo's initialisation is seeded on the host).
    let build = || -> Result<Llama> { Ok(Llama::new(config, DType::F32, device)?) };
    let mut alone = Trainer::new(build()?, serde_json::json!({}), None, TrainOptions::default())?;
    let parallel = DataParallelOptions::default();
    let mut grouped = Trainer::new_data_parallel(
        build()?,
        serde_json::json!({}),
        None,
        TrainOptions::default(),
        group.clone(),
        parallel,
    )?;
    let mut losses = Vec::new();
    for _ in 0..3 {
        let a = alone.train_step(std::slice::from_ref(&ids))?;
        let b = grouped.train_step(std::slice::from_ref(&ids))?;
        losses.push((a.loss, b.loss));
    }
    let same = parameter_bits(&alone)? == parameter_bits(&grouped)?;
    ensure!(same, "one-rank NCCL data parallel differs from the plain trainer: {losses:?}");
    let reduce = grouped.last_reduce().map(|r| serde_json::json!({"buckets": r.buckets, "comm_s": r.comm_s}));
    Ok(serde_json::json!({"same_parameters": same, "losses": losses, "reduce": reduce}))
}

/// ZeRO stages 1 and 2 on the GPU in a one-rank group (each bucket reduced and gathered by NCCL,
/// the shard's masters and state on the device, the fused kernels' update): the plain trainer's
/// losses and parameters to the bit, in f32, in bf16 (f32 masters) and in f16 with the loss
/// scaler; with clipping, the same norms to 1e-6; a ZeRO-2 checkpoint (its shard read back from
/// the device) resumed by a plain trainer takes the ZeRO run's next steps to the bit.
fn zero_on_nccl(group: &ProcessGroup, device: &Device) -> Result<serde_json::Value> {
    use wick_nn::Autocast;
    use wick_train::dist::{DataParallelOptions, Sharding};
    use wick_train::trainer::{TrainOptions, Trainer};
    use wick_zoo::llama::{Llama, LlamaConfig};
    let config = LlamaConfig::tiny(64);
    let build = |dtype: DType| -> Result<Llama> { Ok(Llama::new(config, dtype, device)?) };
    let ids = |step: u32| -> Result<Tensor> {
        let values: Vec<u32> = (0..32u32).map(|i| (i * 11 + step * 7) % 64).collect();
        Ok(Tensor::from_vec(values, (2, 16), device)?)
    };
    let sharded = |stage: Sharding, dtype: DType, options: TrainOptions| -> Result<Trainer<Llama>> {
        let parallel = DataParallelOptions { sharding: stage, ..DataParallelOptions::default() };
        Ok(Trainer::new_data_parallel(build(dtype)?, serde_json::json!({}), None, options, group.clone(), parallel)?)
    };
    let mut rows = Vec::new();
    for (name, dtype, autocast) in [
        ("f32", DType::F32, Autocast::off()),
        ("bf16", DType::BF16, Autocast::bf16()),
        ("f16", DType::F16, Autocast::f16()),
    ] {
        let options = TrainOptions { autocast, ..TrainOptions::default() };
        let mut alone = Trainer::new(build(dtype)?, serde_json::json!({}), None, options)?;
        let mut stages =
            [sharded(Sharding::OptimizerState, dtype, options)?, sharded(Sharding::Gradients, dtype, options)?];
        let mut same_losses = true;
        for step in 0..4 {
            let batch = [ids(step)?];
            let a = alone.train_step(&batch)?;
            for z in stages.iter_mut() {
                let b = z.train_step(&batch)?;
                same_losses &= a.loss.to_bits() == b.loss.to_bits() && a.outcome == b.outcome;
            }
        }
        let reference = parameter_bits(&alone)?;
        let same: Vec<bool> = stages.iter().map(|z| Ok(parameter_bits(z)? == reference)).collect::<Result<_>>()?;
        let (masters, state) = stages[1].optimizer_bytes();
        rows.push(serde_json::json!({"dtype": name, "same_parameters": same, "same_losses": same_losses,
            "zero2_master_bytes": masters, "zero2_state_bytes": state}));
        ensure!(
            same_losses && same.iter().all(|s| *s),
            "{name}: one-rank ZeRO-1/2 on the GPU differs from the plain trainer"
        );
    }
    // Clipping: the norm over the shard's pieces (in bucket order) against the plain trainer's;
    // then a ZeRO-2 checkpoint resumed by a plain trainer: the same next steps.
    let clipped = TrainOptions { clip_grad_norm: Some(0.05), ..TrainOptions::default() };
    let alone = Trainer::new(build(DType::F32)?, serde_json::json!({}), None, clipped)?;
    let zero2 = sharded(Sharding::Gradients, DType::F32, clipped)?;
    let fresh = Trainer::new(build(DType::F32)?, serde_json::json!({}), None, clipped)?;
    let (norms, same_resumed) = clipped_then_resumed(alone, zero2, fresh, &|step| Ok(vec![ids(step)?]), "zero2")?;
    ensure!(same_resumed, "a plain trainer resumed from a GPU ZeRO-2 checkpoint took other steps");
    Ok(serde_json::json!({"rows": rows, "clipped_norms": norms, "resumed_same": same_resumed}))
}

/// `wick_nn::pages` on the GPU: a released CUDA tensor (and its view) holds host zeros and no
/// device memory, a GPU op on it is an error, not a crash; refilled, it holds the new values on
/// the device (no copy: the values' tensor reads as zeros after); a tensor holding device memory
/// cannot be refilled.
fn pages_on_gpu(device: &Device) -> Result<serde_json::Value> {
    use candle_core::Storage;
    let on_device = |t: &Tensor| matches!(&*t.storage_and_layout().0, Storage::Cuda(_));
    let v = candle_core::Var::from_tensor(&Tensor::arange(0f32, 4096.0, device)?.reshape((64, 64))?)?;
    let view = v.as_tensor().narrow(0, 3, 2)?;
    wick_nn::pages::release(v.as_tensor())?;
    let zeros = v.as_tensor().flatten_all()?.to_vec1::<f32>()?.iter().all(|x| *x == 0.0)
        && view.flatten_all()?.to_vec1::<f32>()?.iter().all(|x| *x == 0.0);
    let released = !on_device(v.as_tensor()) && !on_device(&view);
    let other = Tensor::ones((64, 64), DType::F32, device)?;
    let mixed_refused = (v.as_tensor() + &other).is_err();
    wick_nn::pages::release(v.as_tensor())?;
    let values = Tensor::randn(0f32, 1.0, (64, 64), device)?;
    let expected = values.flatten_all()?.to_vec1::<f32>()?;
    wick_nn::pages::refill(v.as_tensor(), &values)?;
    let refilled = on_device(v.as_tensor())
        && v.as_tensor().flatten_all()?.to_vec1::<f32>()? == expected
        && view.flatten_all()?.to_vec1::<f32>()? == expected[3 * 64..5 * 64]
        && !on_device(&values);
    let twice_refused = wick_nn::pages::refill(v.as_tensor(), &Tensor::zeros((64, 64), DType::F32, device)?).is_err();
    ensure!(zeros && released && mixed_refused && refilled && twice_refused, "pages on the GPU: zeros {zeros}, released \
         {released}, mixed op refused {mixed_refused}, refilled {refilled}, refill of a live tensor refused {twice_refused}");
    Ok(serde_json::json!({"zeros": zeros, "released": released, "mixed_refused": mixed_refused, "refilled": refilled}))
}

/// ZeRO stage 3 on the GPU in a one-rank group (blocks gathered and their gradients
/// reduce-scattered by NCCL, the pieces updated by the fused kernels): the plain trainer's losses
/// and parameters to the bit, in f32, bf16 (f32 masters) and f16 (loss scaler), recomputing the
/// blocks and keeping their graphs, two micro-batches a step; clipping's norms to 1e-6; the
/// model's copies of the blocks' parameters without device memory after the first step; a
/// ZeRO-3 checkpoint resumed by a plain trainer taking the same next steps.
fn zero3_on_nccl(group: &ProcessGroup, device: &Device) -> Result<serde_json::Value> {
    use candle_core::Storage;
    use wick_nn::{Autocast, Model};
    use wick_train::dist::{DataParallelOptions, Sharding};
    use wick_train::trainer::{TrainOptions, Trainer};
    use wick_zoo::llama::{Llama, LlamaConfig};
    let config = LlamaConfig::tiny(64);
    let build = |dtype: DType| -> Result<Llama> { Ok(Llama::new(config, dtype, device)?) };
    let micro = |step: u32| -> Result<[Tensor; 2]> {
        let ids = |m: u32| -> Result<Tensor> {
            let values: Vec<u32> = (0..32u32).map(|i| (i * 11 + step * 7 + m * 3) % 64).collect();
            Ok(Tensor::from_vec(values, (2, 16), device)?)
        };
        Ok([ids(0)?, ids(1)?])
    };
    let zero3 = |dtype: DType, options: TrainOptions, recompute: bool| -> Result<Trainer<Llama>> {
        let parallel =
            DataParallelOptions { sharding: Sharding::Parameters, recompute, ..DataParallelOptions::default() };
        Ok(Trainer::new_data_parallel(build(dtype)?, serde_json::json!({}), None, options, group.clone(), parallel)?)
    };
    let mut rows = Vec::new();
    for (name, dtype, autocast) in [
        ("f32", DType::F32, Autocast::off()),
        ("bf16", DType::BF16, Autocast::bf16()),
        ("f16", DType::F16, Autocast::f16()),
    ] {
        let options = TrainOptions { autocast, ..TrainOptions::default() };
        let mut alone = Trainer::new(build(dtype)?, serde_json::json!({}), None, options)?;
        let mut runs = [zero3(dtype, options, true)?, zero3(dtype, options, false)?];
        let mut same_losses = true;
        for step in 0..4 {
            let batch = micro(step)?;
            let a = alone.train_step(&batch)?;
            for z in runs.iter_mut() {
                let b = z.train_step(&batch)?;
                same_losses &= a.loss.to_bits() == b.loss.to_bits() && a.outcome == b.outcome;
            }
        }
        let reference = parameter_bits(&alone)?;
        let same: Vec<bool> = runs.iter().map(|z| Ok(gathered_bits(z)? == reference)).collect::<Result<_>>()?;
        // The model's copies of the blocks' parameters: host zeros, no device memory.
        let (mut released, mut released_bytes) = (0usize, 0usize);
        for (_, v) in runs[0].model().params().iter() {
            if !matches!(&*v.as_tensor().storage_and_layout().0, Storage::Cuda(_)) {
                ensure!(v.as_tensor().flatten_all()?.to_dtype(DType::F32)?.to_vec1::<f32>()?.iter().all(|x| *x == 0.0));
                released += 1;
                released_bytes += v.elem_count() * dtype.size_in_bytes();
            }
        }
        let reduce = runs[0].last_reduce().map(|r| serde_json::json!({"buckets": r.buckets, "bytes": r.bytes}));
        rows.push(serde_json::json!({"dtype": name, "same_parameters [recompute, kept]": same,
            "same_losses": same_losses, "released_parameters": released, "released_bytes": released_bytes,
            "reduce": reduce}));
        ensure!(
            same_losses && same.iter().all(|s| *s) && released > 0,
            "{name}: one-rank ZeRO-3 on the GPU differs from the plain trainer (losses {same_losses}, parameters \
             {same:?}) or released no block parameter ({released})"
        );
    }
    let clipped = TrainOptions { clip_grad_norm: Some(0.05), ..TrainOptions::default() };
    let alone = Trainer::new(build(DType::F32)?, serde_json::json!({}), None, clipped)?;
    let sharded = zero3(DType::F32, clipped, true)?;
    let fresh = Trainer::new(build(DType::F32)?, serde_json::json!({}), None, clipped)?;
    let (norms, same_resumed) =
        clipped_then_resumed(alone, sharded, fresh, &|step| Ok(micro(step)?.to_vec()), "zero3")?;
    ensure!(same_resumed, "a plain trainer resumed from a GPU ZeRO-3 checkpoint took other steps");
    let prefetch =
        DataParallelOptions { sharding: Sharding::Parameters, prefetch: true, ..DataParallelOptions::default() };
    let prefetch_refused = Trainer::new_data_parallel(
        build(DType::F32)?,
        serde_json::json!({}),
        None,
        TrainOptions::default(),
        group.clone(),
        prefetch,
    )
    .is_err();
    ensure!(prefetch_refused, "stage 3's prefetch must be refused on GPU ranks");
    Ok(serde_json::json!({"rows": rows, "clipped_norms": norms, "resumed_same": same_resumed}))
}

/// ZeRO stage 3 on the GPU with a CNN (ResNet-18 at width 8 on 32² images: batch norm's
/// running statistics as buffers, its blocks through `run_stateful`), f32 and bf16, blocks
/// recomputed and kept, two micro-batches a step: the plain trainer's losses and parameters to
/// the bit.
fn zero3_cnn_on_nccl(group: &ProcessGroup, device: &Device) -> Result<serde_json::Value> {
    use wick_nn::{Autocast, Model};
    use wick_train::dist::{DataParallelOptions, Sharding};
    use wick_train::trainer::{TrainOptions, Trainer};
    use wick_zoo::registry::ModelSpec;
    use wick_zoo::resnet::ResNetDepth;
    let spec = ModelSpec::ResNet { depth: ResNetDepth::R18, classes: 10, width: 8, image: 32 };
    let mut rows = Vec::new();
    for (name, dtype, autocast) in [("f32", DType::F32, Autocast::off()), ("bf16", DType::BF16, Autocast::bf16())] {
        let options = TrainOptions { autocast, ..TrainOptions::default() };
        let all = spec.batch(3 * 2 * 4, dtype, device)?;
        let mut alone = Trainer::new(spec.build(dtype, device)?, serde_json::json!({}), None, options)?;
        let mut runs = Vec::new();
        for recompute in [true, false] {
            let parallel =
                DataParallelOptions { sharding: Sharding::Parameters, recompute, ..DataParallelOptions::default() };
            let model = spec.build(dtype, device)?;
            runs.push(Trainer::new_data_parallel(
                model,
                serde_json::json!({}),
                None,
                options,
                group.clone(),
                parallel,
            )?);
        }
        let mut same_losses = true;
        for step in 0..3 {
            let micro = [all.narrow(2 * step * 4, 4)?, all.narrow((2 * step + 1) * 4, 4)?];
            let a = alone.train_step(&micro)?;
            for z in runs.iter_mut() {
                let b = z.train_step(&micro)?;
                same_losses &= a.loss.to_bits() == b.loss.to_bits() && a.outcome == b.outcome;
            }
        }
        let bits = |values: Vec<Tensor>| -> Result<Vec<u32>> {
            let mut out = Vec::new();
            for v in values {
                out.extend(v.flatten_all()?.to_dtype(DType::F32)?.to_vec1::<f32>()?.iter().map(|x| x.to_bits()));
            }
            Ok(out)
        };
        let reference = bits(alone.model().params().iter().map(|(_, v)| v.as_tensor().clone()).collect())?;
        let mut same = Vec::new();
        for z in &runs {
            same.push(bits(z.gathered_parameters()?.into_iter().map(|(_, v)| v).collect())? == reference);
        }
        // Batch norm's running statistics (buffers, whole on every rank) too.
        let buffers = |t: &Trainer<wick_zoo::registry::ZooModel>| -> Result<Vec<u32>> {
            bits(t.model().params().buffers().map(|(_, b)| b.get()).collect())
        };
        let same_buffers = runs.iter().map(|z| Ok(buffers(z)? == buffers(&alone)?)).collect::<Result<Vec<bool>>>()?;
        rows.push(serde_json::json!({"dtype": name, "same_losses": same_losses,
            "same_parameters [recompute, kept]": same, "same_buffers": same_buffers}));
        ensure!(
            same_losses && same.iter().all(|s| *s) && same_buffers.iter().all(|s| *s),
            "{name}: one-rank ZeRO-3 of a CNN on the GPU differs from the plain trainer"
        );
    }
    Ok(serde_json::json!({"rows": rows}))
}

/// One step's clipped norm, alone and sharded.
type NormPair = (Option<f64>, Option<f64>);

/// Clipping's norms of `sharded` against `alone` over three steps (equal to 1e-6 required);
/// then `sharded` saved and resumed by `fresh` (a plain trainer), both taking the next two
/// steps: the norms, and whether the resumed run took the same steps (losses and parameters,
/// gathered, to the bit).
fn clipped_then_resumed(
    mut alone: wick_train::Trainer<wick_zoo::llama::Llama>,
    mut sharded: wick_train::Trainer<wick_zoo::llama::Llama>,
    mut fresh: wick_train::Trainer<wick_zoo::llama::Llama>,
    batch: &dyn Fn(u32) -> Result<Vec<Tensor>>,
    tag: &str,
) -> Result<(Vec<NormPair>, bool)> {
    use wick_train::checkpoint::CheckpointDir;
    let mut norms = Vec::new();
    for step in 0..3 {
        let b = batch(step)?;
        let (x, y) = (alone.train_step(&b)?, sharded.train_step(&b)?);
        norms.push((x.grad_norm, y.grad_norm));
    }
    let close = norms.iter().all(|(a, b)| match (a, b) {
        (Some(a), Some(b)) => (a - b).abs() <= 1e-6 * a.abs().max(1e-12),
        _ => false,
    });
    ensure!(close, "{tag}: clipping's norms differ: {norms:?}");
    let folder = std::env::temp_dir().join(format!("wick-nccl-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&folder);
    std::fs::create_dir_all(&folder)?;
    let dir = CheckpointDir::new(&folder, 2)?;
    sharded.save(&dir, serde_json::json!({}))?;
    fresh.resume(&dir)?;
    let mut same = true;
    for step in 3..5 {
        let b = batch(step)?;
        let (x, y) = (sharded.train_step(&b)?, fresh.train_step(&b)?);
        same &= x.loss.to_bits() == y.loss.to_bits();
    }
    same &= gathered_bits(&sharded)? == gathered_bits(&fresh)?;
    let _ = std::fs::remove_dir_all(&folder);
    Ok((norms, same))
}

/// Every parameter's bits, whole (gathered from the shards under ZeRO-3), in order.
fn gathered_bits(t: &wick_train::Trainer<wick_zoo::llama::Llama>) -> Result<Vec<u32>> {
    let mut out = Vec::new();
    for (_, v) in t.gathered_parameters()? {
        out.extend(v.flatten_all()?.to_dtype(DType::F32)?.to_vec1::<f32>()?.iter().map(|x| x.to_bits()));
    }
    Ok(out)
}

/// Every parameter's bits, in order.
fn parameter_bits(t: &wick_train::Trainer<wick_zoo::llama::Llama>) -> Result<Vec<u32>> {
    use wick_nn::Model;
    let mut out = Vec::new();
    for (_, v) in t.model().params().iter() {
        out.extend(v.as_tensor().flatten_all()?.to_dtype(DType::F32)?.to_vec1::<f32>()?.iter().map(|x| x.to_bits()));
    }
    Ok(out)
}

/// A decoder's steps as CUDA graphs (two warm-up steps, two micro-batches a step), alone and
/// data-parallel in a one-rank group (the graph holds the NCCL all-reduces of the gradient
/// buckets and of the loss): both captured, and the same losses and parameters to the bit.
fn graph_trainer_on_nccl(group: &ProcessGroup, device: &Device) -> Result<serde_json::Value> {
    use wick_train::dist::DataParallelOptions;
    use wick_train::trainer::{GraphOptions, TrainOptions, Trainer};
    use wick_zoo::llama::{Llama, LlamaConfig};
    let config = LlamaConfig::tiny(64);
    let options = TrainOptions {
        cuda_graph: Some(GraphOptions { warmup: 2, recapture_per_shape: false }),
        clip_grad_norm: Some(1.0),
        ..TrainOptions::default()
    };
    let build = || -> Result<Llama> { Ok(Llama::new(config, DType::F32, device)?) };
    let mut alone = Trainer::new(build()?, serde_json::json!({}), None, options)?;
    let parallel = DataParallelOptions::default();
    let mut grouped =
        Trainer::new_data_parallel(build()?, serde_json::json!({}), None, options, group.clone(), parallel)?;
    let mut losses = Vec::new();
    for step in 0..6u32 {
        // Two micro-batches of 2 × 16 token ids below the vocabulary's 64, other ones each step.
        let ids = |m: u32| -> Result<Tensor> {
            let values: Vec<u32> = (0..32u32).map(|i| (i * 7 + step * 13 + m * 5) % 64).collect();
            Ok(Tensor::from_vec(values, (2, 16), device)?)
        };
        let micro = [ids(0)?, ids(1)?];
        let a = alone.train_step(&micro)?;
        let b = grouped.train_step(&micro)?;
        losses.push((a.loss, b.loss));
    }
    let captured = |t: &Trainer<Llama>| {
        t.graph_step().is_some_and(|g| g.shapes().graph().is_some() && g.shapes().eager_reason().is_none())
    };
    let (captured_alone, captured_grouped) = (captured(&alone), captured(&grouped));
    let same = parameter_bits(&alone)? == parameter_bits(&grouped)?;
    let same_losses = losses.iter().all(|(a, b)| a.to_bits() == b.to_bits());
    ensure!(captured_alone && captured_grouped, "a graph trainer was not captured");
    ensure!(same && same_losses, "the one-rank data-parallel graph step differs from the graph alone: {losses:?}");
    let nodes = grouped.graph_step().and_then(|g| g.shapes().graph()).map(|g| g.shape().nodes);
    Ok(serde_json::json!({"captured": [captured_alone, captured_grouped], "same_parameters": same,
        "same_losses": same_losses, "losses": losses, "data_parallel_graph_nodes": nodes}))
}

wick::main!(run);
