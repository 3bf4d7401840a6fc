//! The same small training loop in plain candle and through wick's step scopes, side by side in
//! one run (samples interleaved, medians compared): time overhead and peak heap.
//!
//! `cargo bench -p wick --bench engine`

use std::time::Instant;

use candle_core::{Device, Tensor, Var};
use wick::host_memory::{counted_peak, reset_counted_peak};
use wick::{Engine, Error};

struct Model {
    w1: Var,
    w2: Var,
}

fn step(m: &Model, x: &Tensor, y: &Tensor) -> Result<f32, Error> {
    let h = x.matmul(m.w1.as_tensor())?.relu()?;
    let pred = h.matmul(m.w2.as_tensor())?;
    let loss = (pred - y)?.sqr()?.mean_all()?;
    let grads = loss.backward()?;
    for w in [&m.w1, &m.w2] {
        if let Some(g) = grads.get(w) {
            w.set(&(w.as_tensor() - (g * 0.01)?)?)?;
        }
    }
    Ok(loss.to_scalar::<f32>()?)
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

fn run() -> Result<(), Error> {
    let device = Device::Cpu;
    let x = Tensor::randn(0f32, 1.0, (256, 512), &device)?;
    let y = Tensor::randn(0f32, 1.0, (256, 1), &device)?;
    let model =
        Model { w1: Var::randn(0f32, 0.05, (512, 512), &device)?, w2: Var::randn(0f32, 0.05, (512, 1), &device)? };
    let engine = Engine::cpu();
    let steps = 20;
    for _ in 0..3 {
        step(&model, &x, &y)?;
    }
    let (mut plain, mut wick) = (Vec::new(), Vec::new());
    let (mut plain_peak, mut wick_peak) = (0usize, 0usize);
    for _ in 0..15 {
        reset_counted_peak();
        let t = Instant::now();
        for _ in 0..steps {
            step(&model, &x, &y)?;
        }
        plain.push(t.elapsed().as_secs_f64() / steps as f64);
        plain_peak = plain_peak.max(counted_peak().unwrap_or(0));
        reset_counted_peak();
        let t = Instant::now();
        for _ in 0..steps {
            engine.try_step("train", |_| step(&model, &x, &y))?;
        }
        wick.push(t.elapsed().as_secs_f64() / steps as f64);
        wick_peak = wick_peak.max(counted_peak().unwrap_or(0));
    }
    let (p, w) = (median(plain), median(wick));
    println!("| loop (MLP 512-512-1, batch 256, SGD) | plain candle | through wick steps | ratio |");
    println!("|---|---|---|---|");
    println!("| median time per step | {:.1} µs | {:.1} µs | {:+.2} % |", p * 1e6, w * 1e6, (w / p - 1.0) * 100.0);
    println!(
        "| peak heap (counting allocator) | {:.2} MiB | {:.2} MiB | {:+.3} % |",
        plain_peak as f64 / 1048576.0,
        wick_peak as f64 / 1048576.0,
        (wick_peak as f64 / plain_peak as f64 - 1.0) * 100.0
    );
    Ok(())
}

wick::main!(run, heap = counting);
