//! f32 products at the transformers' linear-layer shapes (`y = x·Wᵀ`, x: m × k, W: n × k) on
//! every thread of the pool, G multiply-adds a second: `wick_kernels::cpu::gemm::gemm` as the
//! layers call it (the `gemm` crate, the destination's columns split between the threads, W's
//! columns copied to it a block at a time; wick's own kernel up to 64 rows). m is
//! the tokens of a batch: 128 (BERT, one sentence), 197 (ViT at 224², one image), 256 (the
//! decoder's prefill, one sequence), 1 024 (eight sentences). The weights are read from memory,
//! as in a model, not from a cache that one weight matrix timed again and again would stay in.
//! `scripts/torch-reference/f32_products.py` times PyTorch's on the same shapes.
//!
//! `cargo bench -p wick-kernels --bench f32_products [-- M,M,...]`

use wick_kernels::cpu::gemm::{gemm, Mat};

mod layers;
mod timing;

use layers::{data, LAYERS};

/// `len` elements of `v` from its first 64-byte boundary (the cache line).
fn aligned(v: &[f32], len: usize) -> &[f32] {
    let skip = (64 - v.as_ptr() as usize % 64) % 64 / 4;
    &v[skip..skip + len]
}

fn main() {
    let rows: Vec<usize> = std::env::args()
        .skip(1)
        .find(|a| !a.starts_with('-'))
        .map(|a| a.split(',').filter_map(|m| m.parse().ok()).collect())
        .unwrap_or_else(|| vec![128, 197, 256, 1024]);
    println!("{} threads", rayon::current_num_threads());
    println!("| model | layer | m × k × n | G multiply-adds/s |");
    println!("|---|---|---|---|");
    for &m in &rows {
        for (model, layer, k, n) in LAYERS {
            // Weights as a model reads them, from memory rather than the cache: enough copies
            // to pass 96 MiB (more than the last-level caches here), taken in turn.
            let copies = ((96 << 20) / (n * k * 4)).max(1);
            let xa = data(m * k + 16, 97);
            let was: Vec<Vec<f32>> = (0..copies).map(|c| data(n * k + 16, 89 + c as u64)).collect();
            let x = aligned(&xa, m * k);
            let ws: Vec<&[f32]> = was.iter().map(|wa| aligned(wa, n * k)).collect();
            let mut y = vec![0f32; m * n];
            let mut turn = 0;
            let rate = timing::rate(m * k * n, &mut || {
                let w = ws[turn % copies];
                turn += 1;
                drop(gemm(&mut y, Mat::rows(x, m, k), Mat::rows(w, n, k).t(), 1.0, false, true))
            });
            println!("| {model} | {layer} | {m} × {k} × {n} | {rate:.1} |");
        }
    }
}
