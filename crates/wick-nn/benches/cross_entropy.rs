//! Cross-entropy over a vocabulary, the op alone: the loss (forward) and the loss with the
//! logits' gradient (forward and backward through candle's autograd), milliseconds a call, the
//! median of 7 calls after 2 untimed. One JSON line per case. Set up as a wick program is
//! (`wick::main!`: the caching heap reuses the gradient's memory from one call to the next).
//!
//! `cargo bench -p wick-nn --bench cross_entropy -- ROWSxVOCAB:DTYPE ...` (DTYPE f32 or bf16;
//! default: 2048x32000:f32). `scripts/torch-reference/cross_entropy.py --wick BINARY` runs these
//! cases in turn with PyTorch's `cross_entropy` on the same shapes and prints the side-by-side table.

use candle_core::{DType, Device, Tensor, Var};
use wick_nn::ops;
use wick_nn::params::normal_tensor;

/// Milliseconds of `f`: the median of 7 calls after 2 untimed.
fn median_ms(f: &mut dyn FnMut() -> candle_core::Result<()>) -> candle_core::Result<f64> {
    for _ in 0..2 {
        f()?;
    }
    let mut t = Vec::new();
    for _ in 0..7 {
        let start = std::time::Instant::now();
        f()?;
        t.push(start.elapsed().as_secs_f64() * 1e3);
    }
    t.sort_by(f64::total_cmp);
    Ok(t[t.len() / 2])
}

fn case(spec: &str) -> Result<String, String> {
    let bad = || format!("{spec:?} is not ROWSxVOCAB:DTYPE (DTYPE f32 or bf16)");
    let (shape, dtype) = spec.split_once(':').ok_or_else(bad)?;
    let (rows, vocab) = shape.split_once('x').ok_or_else(bad)?;
    let (rows, vocab): (usize, usize) = (rows.parse().map_err(|_| bad())?, vocab.parse().map_err(|_| bad())?);
    let dtype = match dtype {
        "f32" => DType::F32,
        "bf16" => DType::BF16,
        _ => return Err(bad()),
    };
    let run = || -> candle_core::Result<(f64, f64)> {
        let logits = Var::from_tensor(&normal_tensor(&[rows, vocab], 2.0, 7, dtype, &Device::Cpu)?)?;
        let ids: Vec<u32> = (0..rows).map(|i| ((i * 7919) % vocab) as u32).collect();
        let targets = Tensor::new(ids.as_slice(), &Device::Cpu)?;
        let forward = median_ms(&mut || ops::cross_entropy(logits.as_tensor(), &targets).map(drop))?;
        let step = median_ms(&mut || ops::cross_entropy(logits.as_tensor(), &targets)?.backward().map(drop))?;
        Ok((forward, step))
    };
    let (forward, step) = run().map_err(|e| format!("{spec}: {e}"))?;
    Ok(format!(
        "{{\"rows\":{rows},\"vocab\":{vocab},\"dtype\":\"{}\",\"forward_ms\":{forward:.3},\"forward_backward_ms\":{step:.3}}}",
        if dtype == DType::F32 { "f32" } else { "bf16" }
    ))
}

fn run() -> Result<(), String> {
    let specs: Vec<String> = std::env::args().skip(1).filter(|a| !a.starts_with('-')).collect();
    let specs = if specs.is_empty() { vec!["2048x32000:f32".to_string()] } else { specs };
    for spec in &specs {
        println!("{}", case(spec)?);
    }
    Ok(())
}

wick::main!(run);
