//! bf16 products at ResNet-18's convolution shapes (224², per image), one thread: multiply-adds
//! a second with `a` packed by each product and packed once beforehand (`PackedA`), against the
//! core's `vdpbf16ps` peak (a register-only loop of 24 independent sums). BENCHMARKS.md,
//! "Convolutional networks at every size (issue 30)", cites its output.
//!
//! `cargo bench -p wick-kernels --bench bf16_products`

use half::bf16;
use wick_kernels::cpu::gemm::{bf16 as kernel, Mat};

mod timing;

fn main() {
    if !kernel::available() {
        println!("this CPU has no AVX512-BF16: nothing to measure");
        return;
    }
    rayon::ThreadPoolBuilder::new().num_threads(1).build_global().ok();
    println!("vdpbf16ps peak (one core): {:.1} G multiply-adds/s", peak());
    println!("| m × k × n | packed per product | packed once | |");
    println!("|---|---|---|---|");
    // Weights × columns (forward), then the weight gradient's dY × colsᵀ.
    for (m, k, n) in
        [(64, 576, 3136), (128, 1152, 784), (256, 2304, 196), (512, 4608, 98), (64, 3136, 576), (512, 98, 4608)]
    {
        let a: Vec<bf16> = (0..m * k).map(|i| bf16::from_f32((i % 97) as f32 * 0.01)).collect();
        let b: Vec<bf16> = (0..k * n).map(|i| bf16::from_f32((i % 89) as f32 * 0.01)).collect();
        let (ma, mb) = (Mat::rows(&a, m, k), Mat::rows(&b, k, n));
        let mut c = vec![0f32; m * n];
        let Ok(packed) = kernel::PackedA::new(ma, n) else { return };
        let rate = |f: &mut dyn FnMut()| timing::rate(m * k * n, f);
        let per_call = rate(&mut || drop(kernel::gemm_bf16(&mut c, ma, mb, 1.0, false, false)));
        let once = rate(&mut || drop(kernel::gemm_bf16_packed(&mut c, &packed, mb, 1.0, false, false)));
        println!("| {m} × {k} × {n} | {per_call:.1} G/s | {once:.1} G/s | {:.2}× |", once / per_call);
    }
}

/// Multiply-adds a second of 24 independent `vdpbf16ps` chains on this core.
fn peak() -> f64 {
    #[cfg(target_arch = "x86_64")]
    {
        #[target_feature(enable = "avx512bf16,avx512f")]
        fn chains(iters: usize) -> f32 {
            use std::arch::x86_64::*;
            let mut acc = [_mm512_setzero_ps(); 24];
            // SAFETY: plain bit patterns reinterpreted as bf16 pairs.
            let (a, b): (__m512bh, __m512bh) = unsafe {
                (
                    std::mem::transmute::<__m512i, __m512bh>(_mm512_set1_epi32(0x3f80_3f80)),
                    std::mem::transmute::<__m512i, __m512bh>(_mm512_set1_epi32(0x3c00_3c00)),
                )
            };
            for _ in 0..iters {
                for s in acc.iter_mut() {
                    *s = _mm512_dpbf16_ps(*s, a, b);
                }
            }
            let mut total = _mm512_setzero_ps();
            for s in acc {
                total = _mm512_add_ps(total, s);
            }
            _mm512_reduce_add_ps(total)
        }
        let iters = 20_000_000;
        let t = std::time::Instant::now();
        // SAFETY: `available()` (checked in main) means AVX512-BF16 and AVX-512F.
        let sink = unsafe { chains(iters) };
        std::hint::black_box(sink);
        (iters * 24 * 32) as f64 / t.elapsed().as_secs_f64() / 1e9
    }
    #[cfg(not(target_arch = "x86_64"))]
    0.0
}
