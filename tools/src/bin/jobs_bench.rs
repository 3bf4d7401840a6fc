//! Figures of the long-job path for BENCHMARKS.md: for every zoo model at the trial's test size,
//! a training step's time, a checkpoint's size, the time to write it (and how long a background
//! write holds training), the time to resume from it; the data loader's throughput against a
//! plain loop; and the heap after each of 20 epochs.
//!
//! `cargo run --release -p wick-tools --bin jobs-bench` (one JSON object per line, then tables).

use std::time::Instant;

use anyhow::Result;
use candle_core::{DType, Device, Tensor};
use wick_nn::Model;
use wick_tools::trial::{model_and_batch, MODELS};
use wick_train::data::{DataError, Dataset, Loader, LoaderConfig, Position};
use wick_train::trainer::{TrainOptions, Trainer};
use wick_train::CheckpointDir;

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn ms<T>(f: impl FnOnce() -> Result<T>) -> Result<(T, f64)> {
    let start = Instant::now();
    let out = f()?;
    Ok((out, start.elapsed().as_secs_f64() * 1e3))
}

/// One model's row: step, checkpoint size, write, background stall, resume.
fn bench<M: Model>(name: &str, model: M, batch: M::Batch) -> Result<serde_json::Value> {
    let dir = std::env::temp_dir().join(format!("wick-jobs-bench-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let checkpoints = CheckpointDir::new(&dir, 1)?;
    let mut trainer = Trainer::new(model, serde_json::json!({"kind": name}), None, TrainOptions::default())?;
    trainer.train_step(std::slice::from_ref(&batch))?;
    let mut step = Vec::new();
    for _ in 0..5 {
        step.push(ms(|| Ok(trainer.train_step(std::slice::from_ref(&batch))?))?.1);
    }
    let (mut save, mut stall, mut load) = (Vec::new(), Vec::new(), Vec::new());
    let mut bytes = 0;
    for _ in 0..3 {
        let (path, t) = ms(|| Ok(trainer.save(&checkpoints, serde_json::Value::Null)?))?;
        save.push(t);
        let manifest: wick_train::checkpoint::Manifest = serde_json::from_slice(&std::fs::read(&path)?)?;
        bytes = manifest.bytes + std::fs::metadata(&path)?.len();
        let pending = trainer.save_in_background(&checkpoints, serde_json::Value::Null)?;
        stall.push(pending.stall_s * 1e3);
        pending.wait()?;
        load.push(ms(|| Ok(trainer.resume(&checkpoints)?))?.1);
    }
    let _ = std::fs::remove_dir_all(&dir);
    let (step, save) = (median(step), median(save));
    Ok(serde_json::json!({"model": name, "params": trainer.model().params().numel(), "step_ms": step,
        "checkpoint_bytes": bytes, "save_ms": save, "save_share_of_step": save / step,
        "background_stall_ms": median(stall), "resume_ms": median(load)}))
}

/// 32×32 RGB images with labels, in memory.
struct Images(Tensor);

impl Dataset for Images {
    fn len(&self) -> usize {
        self.0.dims()[0]
    }
    fn get(&self, i: usize) -> Result<Vec<Tensor>, DataError> {
        let x = self.0.get(i).map_err(|e| DataError::sample(i, e))?;
        let y = Tensor::new((i % 10) as u32, &Device::Cpu).map_err(|e| DataError::sample(i, e))?;
        Ok(vec![x, y])
    }
}

fn loader_figures() -> Result<Vec<serde_json::Value>> {
    let n = 4096;
    let images = Images(Tensor::rand(0f32, 1.0, (n, 3, 32, 32), &Device::Cpu)?);
    // The plain loop: read and stack each batch inline, in order.
    let plain = |d: &Images| -> Result<f64> {
        let mut total = 0f64;
        for start in (0..n).step_by(64) {
            let samples: Vec<Vec<Tensor>> = (start..start + 64).map(|i| d.get(i)).collect::<Result<_, _>>()?;
            let x: Vec<Tensor> = samples.iter().map(|s| s[0].clone()).collect();
            total += Tensor::stack(&x, 0)?.sum_all()?.to_scalar::<f32>()? as f64;
        }
        Ok(total)
    };
    let mut rows = Vec::new();
    let mut plain_ms = Vec::new();
    for _ in 0..5 {
        plain_ms.push(ms(|| plain(&images))?.1);
    }
    let plain_ms = median(plain_ms);
    rows.push(serde_json::json!({"loader": "plain loop", "ms_per_epoch": plain_ms, "samples_per_s": n as f64 / plain_ms * 1e3}));
    let mut images = Some(images);
    for workers in [0usize, 1, 2, 4] {
        let dataset = images.take().ok_or_else(|| anyhow::anyhow!("dataset moved"))?;
        let loader = Loader::new(dataset, LoaderConfig { batch_size: 64, workers, ..LoaderConfig::default() });
        let mut times = Vec::new();
        for epoch in 0..5 {
            let (_, t) = ms(|| {
                let mut total = 0f64;
                for batch in loader.epoch(Position::start(epoch)) {
                    total += batch?.tensors[0].sum_all()?.to_scalar::<f32>()? as f64;
                }
                Ok(total)
            })?;
            times.push(t);
        }
        let t = median(times);
        rows.push(serde_json::json!({"loader": format!("wick_train::data, {workers} workers"), "ms_per_epoch": t,
            "samples_per_s": n as f64 / t * 1e3, "vs_plain": plain_ms / t}));
        // Heap after each of 20 epochs with this loader (the first loader only).
        if workers == 2 {
            let mut heap = Vec::new();
            for epoch in 0..20 {
                for batch in loader.epoch(Position::start(epoch)) {
                    batch?;
                }
                heap.push(wick::host_memory::counted_heap().unwrap_or(0));
            }
            let after = &heap[2..];
            rows.push(serde_json::json!({"heap_after_epochs_bytes": heap,
                "heap_range_after_epoch_2": after.iter().max().unwrap_or(&0) - after.iter().min().unwrap_or(&0)}));
        }
        images = Some(Images(loader.dataset().0.clone()));
    }
    Ok(rows)
}

/// An image folder of 1024 PNGs (64×64, two classes) decoded and resized to 32×32 per sample:
/// the plain loop against the loader with 0, 1 and 2 workers.
fn image_folder_figures() -> Result<Vec<serde_json::Value>> {
    let root = std::env::temp_dir().join(format!("wick-jobs-bench-images-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&root);
    for class in ["a", "b"] {
        std::fs::create_dir_all(root.join(class))?;
        for k in 0..512u32 {
            let img =
                image::RgbImage::from_fn(64, 64, |x, y| image::Rgb([(x * 4) as u8, (y * 4) as u8, (k % 256) as u8]));
            img.save(root.join(class).join(format!("{k:04}.png")))?;
        }
    }
    let folder = wick_train::data::ImageFolder::open(&root, 32, 32)?;
    let n = folder.len();
    let mut plain = Vec::new();
    for _ in 0..3 {
        plain.push(
            ms(|| {
                let mut total = 0f64;
                for start in (0..n).step_by(64) {
                    let x: Vec<Tensor> =
                        (start..start + 64).map(|i| Ok(folder.get(i)?.remove(0))).collect::<Result<_>>()?;
                    total += Tensor::stack(&x, 0)?.sum_all()?.to_scalar::<f32>()? as f64;
                }
                Ok(total)
            })?
            .1,
        );
    }
    let plain = median(plain);
    let mut rows = vec![
        serde_json::json!({"images": "plain loop", "ms_per_epoch": plain, "samples_per_s": n as f64 / plain * 1e3}),
    ];
    let mut folder = Some(folder);
    for workers in [0usize, 1, 2] {
        let loader = Loader::new(
            folder.take().ok_or_else(|| anyhow::anyhow!("moved"))?,
            LoaderConfig { batch_size: 64, workers, ..LoaderConfig::default() },
        );
        let mut times = Vec::new();
        for epoch in 0..3 {
            times.push(
                ms(|| {
                    let mut total = 0f64;
                    for batch in loader.epoch(Position::start(epoch)) {
                        total += batch?.tensors[0].sum_all()?.to_scalar::<f32>()? as f64;
                    }
                    Ok(total)
                })?
                .1,
            );
        }
        let t = median(times);
        rows.push(serde_json::json!({"images": format!("wick_train::data, {workers} workers"), "ms_per_epoch": t,
            "samples_per_s": n as f64 / t * 1e3, "vs_plain": plain / t}));
        folder = Some(wick_train::data::ImageFolder::open(&root, 32, 32)?);
    }
    let _ = std::fs::remove_dir_all(&root);
    Ok(rows)
}

fn run() -> Result<()> {
    let cpu = Device::Cpu;
    let mut rows = Vec::new();
    for name in MODELS {
        let (name, model, batch) = model_and_batch(name, DType::F32, &cpu)?;
        rows.push(bench(name, model, batch)?);
    }
    rows.extend(loader_figures()?);
    rows.extend(image_folder_figures()?);
    for r in &rows {
        println!("{r}");
    }
    println!("\n| model | parameters | step ms | checkpoint | write ms (share of a step) | background stall ms | resume ms |");
    println!("|---|---|---|---|---|---|---|");
    for r in rows.iter().filter(|r| r.get("model").is_some()) {
        println!(
            "| {} | {} | {:.1} | {} | {:.1} ({:.2}×) | {:.2} | {:.1} |",
            r["model"].as_str().unwrap_or("?"),
            r["params"],
            r["step_ms"].as_f64().unwrap_or(0.0),
            wick_memory::format_bytes(r["checkpoint_bytes"].as_u64().unwrap_or(0)),
            r["save_ms"].as_f64().unwrap_or(0.0),
            r["save_share_of_step"].as_f64().unwrap_or(0.0),
            r["background_stall_ms"].as_f64().unwrap_or(0.0),
            r["resume_ms"].as_f64().unwrap_or(0.0),
        );
    }
    Ok(())
}

wick::main!(run, heap = counting);
