//! What the check before every candle CPU buffer from 16 MiB up costs (wick's patched
//! candle-core asks `wick_alloc_check::check`, which reads the host's figures each time), beside
//! what candle does with the buffer: making it (`Tensor::zeros`) and an op writing it (`add`),
//! at 16 MiB (the smallest size checked, the worst ratio), 64 MiB and 256 MiB. Samples
//! interleaved in one run, medians compared. Under `wick::main!`, as a wick program runs.
//!
//! `cargo bench -p wick --bench cpu_check`

use std::time::Instant;

use candle_core::{DType, Device, Tensor};

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

fn time(mut f: impl FnMut() -> candle_core::Result<()>) -> candle_core::Result<f64> {
    let t = Instant::now();
    f()?;
    Ok(t.elapsed().as_secs_f64() * 1e6)
}

fn run() -> candle_core::Result<()> {
    println!("| buffer | check (µs) | zeros (µs) | add (µs) | check / zeros | check / add |");
    println!("|---|---|---|---|---|---|");
    for mib in [16usize, 64, 256] {
        let elems = (mib << 20) / 4;
        let a = Tensor::randn(0f32, 1.0, elems, &Device::Cpu)?;
        let b = Tensor::randn(0f32, 1.0, elems, &Device::Cpu)?;
        let (mut check, mut zeros, mut add) = (Vec::new(), Vec::new(), Vec::new());
        for _ in 0..40 {
            check.push(time(|| {
                wick_alloc_check::check(Some(mib << 20)).map_err(candle_core::Error::Msg)
            })?);
            zeros.push(time(|| Tensor::zeros(elems, DType::F32, &Device::Cpu).map(|t| drop(std::hint::black_box(t))))?);
            add.push(time(|| a.add(&b).map(|t| drop(std::hint::black_box(t))))?);
        }
        let (c, z, s) = (median(check), median(zeros), median(add));
        println!("| {mib} MiB | {c:.1} | {z:.0} | {s:.0} | {:.3} | {:.3} |", c / z, c / s);
    }
    Ok(())
}

wick::main!(run);
