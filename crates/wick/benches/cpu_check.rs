//! What the check before every candle CPU buffer from 16 MiB up costs (wick's patched
//! candle-core asks `wick_alloc_check::check`), beside what candle does with the buffer: making
//! it (`Tensor::zeros`) and an op writing it (`add`), at 16 MiB (the smallest size checked, the
//! worst ratio), 64 MiB and 256 MiB. Two costs: the check as it runs without a caching heap's freed
//! blocks to count (a notebook, a program without `wick::main!`; under `wick::main!` they usually
//! cover the request and it costs nanoseconds), which reuses a recent reading of the host's
//! figures; and one reading (`HostMemory::read` + `room`), what a check costs when it cannot.
//! Samples interleaved in one run; the check's mean, the others' medians.
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
    // As in a notebook: no freed blocks counted.
    wick_alloc_check::set_freed_heap(None);
    println!("| buffer | check (µs) | a reading (µs) | zeros (µs) | add (µs) | check / zeros | check / add | reading / zeros | reading / add |");
    println!("|---|---|---|---|---|---|---|---|---|");
    for mib in [16usize, 64, 256] {
        let elems = (mib << 20) / 4;
        let a = Tensor::randn(0f32, 1.0, elems, &Device::Cpu)?;
        let b = Tensor::randn(0f32, 1.0, elems, &Device::Cpu)?;
        let (mut check, mut read, mut zeros, mut add) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        for _ in 0..100 {
            check.push(time(|| wick_alloc_check::check(Some(mib << 20)).map_err(candle_core::Error::Msg))?);
            read.push(time(|| {
                let room = wick_alloc_check::HostMemory::read().room().map_or(0, |r| r.bytes);
                (room >= mib << 20).then_some(()).ok_or_else(|| candle_core::Error::Msg("no room".into()))
            })?);
            zeros.push(time(|| Tensor::zeros(elems, DType::F32, &Device::Cpu).map(|t| drop(std::hint::black_box(t))))?);
            add.push(time(|| a.add(&b).map(|t| drop(std::hint::black_box(t))))?);
        }
        // The check's cost is bimodal (a reused reading, or a fresh one): its mean is what a
        // buffer pays on average; the others are medians.
        let c = check.iter().sum::<f64>() / check.len() as f64;
        let (r, z, s) = (median(read), median(zeros), median(add));
        println!(
            "| {mib} MiB | {c:.1} | {r:.1} | {z:.0} | {s:.0} | {:.4} | {:.4} | {:.3} | {:.3} |",
            c / z,
            c / s,
            r / z,
            r / s
        );
    }
    Ok(())
}

wick::main!(run);
