//! One of the f32 products' paths on and off at the transformers' linear-layer shapes, side by
//! side in one process: each round times both (the order reversed every other round, weights
//! read from memory as in `f32_products`), and each shape prints the median over the rounds of
//! time off / time on (above 1: the path faster), then the median over the shapes. The paths:
//! `tiles`, wick's own f32 tiles against the `gemm` crate's kernel (CPUs with AVX2 but not
//! AVX-512: run with `WICK_CPU_AVX512=0`, and a build from `scripts/build-avx2-binaries.sh`, for
//! an AVX2 machine's paths on an AVX-512 one); `transposed`, the product as its transpose with W
//! read in place against W's panels (AVX-512); `blocks`, W's columns copied a block at a time
//! for the crate against the crate reading them in place (more rows than the panels take). Where
//! the path does not run, both columns time the same code.
//!
//! `cargo bench -p wick-kernels --bench paths_ab [-- M,M,... [ROUNDS [tiles|transposed|blocks]]]`
//! (default 128,256, 7 and tiles)

use wick_kernels::cpu::gemm::{gemm, use_blocks, use_tiles, use_transposed, Mat};

mod layers;
mod timing;

use layers::{data, LAYERS};

/// The median of `v` (sorted here).
fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(f64::NAN)
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).filter(|a| !a.starts_with('-')).collect();
    let rows: Vec<usize> =
        args.first().map(|a| a.split(',').filter_map(|m| m.parse().ok()).collect()).unwrap_or(vec![128, 256]);
    let rounds: usize = args.get(1).and_then(|r| r.parse().ok()).unwrap_or(7).max(1);
    let path = args.get(2).map_or("tiles", String::as_str);
    let switch: fn(bool) = match path {
        "tiles" => use_tiles,
        "transposed" => use_transposed,
        "blocks" => use_blocks,
        other => {
            eprintln!("paths_ab: no path {other:?} (tiles, transposed or blocks)");
            std::process::exit(2);
        }
    };
    println!("{} threads, {rounds} rounds, path {path}", rayon::current_num_threads());
    for &m in &rows {
        let mut medians = vec![];
        for (model, layer, k, n) in LAYERS {
            let copies = ((96 << 20) / (n * k * 4)).max(1);
            let x = data(m * k, 97);
            let ws: Vec<Vec<f32>> = (0..copies).map(|c| data(n * k, 89 + c as u64)).collect();
            let mut y = vec![0f32; m * n];
            let mut turn = 0;
            let reps = ((5e8 / (m * k * n) as f64) as usize).max(2);
            let (mut ratios, mut best) = (vec![], [f64::MAX; 2]);
            for r in 0..rounds {
                let mut t = [0.0; 2];
                for on in if r % 2 == 0 { [false, true] } else { [true, false] } {
                    switch(on);
                    t[on as usize] = timing::best(1, reps, &mut || {
                        let w = &ws[turn % copies];
                        turn += 1;
                        drop(gemm(&mut y, Mat::rows(&x, m, k), Mat::rows(w, n, k).t(), 1.0, false, true))
                    });
                }
                best = [best[0].min(t[0]), best[1].min(t[1])];
                ratios.push(t[0] / t[1]);
            }
            let (lo, hi) = ratios.iter().fold((f64::MAX, 0f64), |(lo, hi), r| (lo.min(*r), hi.max(*r)));
            let med = median(&mut ratios);
            medians.push(med);
            let rate = |t: f64| (m * k * n) as f64 / t / 1e9;
            println!(
                "| {model} {layer} {m}×{k}×{n} | off {:.1} | on {:.1} | median ratio {med:.2} (range {lo:.2}–{hi:.2}) |",
                rate(best[0]),
                rate(best[1])
            );
        }
        println!("rows {m}: median of shape medians {:.3}", median(&mut medians));
    }
    switch(true);
}
