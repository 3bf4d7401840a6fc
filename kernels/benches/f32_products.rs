//! f32 products at the transformers' linear-layer shapes (`y = x·Wᵀ`, x: m × k, W: n × k) on
//! every thread of the pool, G multiply-adds a second: `wick_kernels::cpu::gemm::gemm` as the
//! layers call it (wick's own kernel along the depth; `WICK_CPU_AVX512=0` its AVX2 form,
//! `WICK_CPU_GEMM_CRATE=1` the `gemm` crate as before). m is the tokens of a batch: 128 (BERT, one sentence), 197 (ViT at 224², one
//! image), 256 (the decoder's prefill, one sequence), 1 024 (eight sentences).
//! `scripts/torch-reference/f32_products.py` times PyTorch's on the same shapes.
//!
//! `cargo bench -p wick-kernels --bench f32_products [-- M,M,...]`

use wick_kernels::cpu::gemm::{gemm, Mat};

mod timing;

/// (model, layer, k, n) of each projection.
const LAYERS: [(&str, &str, usize, usize); 13] = [
    ("BERT-base", "qkv", 768, 2304),
    ("BERT-base", "out", 768, 768),
    ("BERT-base", "fc1", 768, 3072),
    ("BERT-base", "fc2", 3072, 768),
    ("MiniLM", "qkv", 384, 1152),
    ("MiniLM", "out", 384, 384),
    ("MiniLM", "fc1", 384, 1536),
    ("MiniLM", "fc2", 1536, 384),
    ("decoder-512", "qkv", 512, 1536),
    ("decoder-512", "out", 512, 512),
    ("decoder-512", "gate+up", 512, 2816),
    ("decoder-512", "down", 1408, 512),
    ("decoder-512", "head", 512, 32_000),
];

fn data(len: usize, seed: u64) -> Vec<f32> {
    (0..len).map(|i| (((i as u64 * seed + 7) % 1013) as f32 / 1013.0) - 0.5).collect()
}

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
            let (xa, wa) = (data(m * k + 16, 97), data(n * k + 16, 89));
            let (x, w) = (aligned(&xa, m * k), aligned(&wa, n * k));
            let mut y = vec![0f32; m * n];
            let rate = timing::rate(m * k * n, &mut || {
                drop(gemm(&mut y, Mat::rows(&x, m, k), Mat::rows(&w, n, k).t(), 1.0, false, true))
            });
            println!("| {model} | {layer} | {m} × {k} × {n} | {rate:.1} |");
        }
    }
}
