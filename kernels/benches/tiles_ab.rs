//! Experiment: tiles against the crate, alternating in one process.
use wick_kernels::cpu::gemm::{gemm, use_tiles, Mat};
mod timing;
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
fn main() {
    let args: Vec<String> = std::env::args().skip(1).filter(|a| !a.starts_with('-')).collect();
    let rows: Vec<usize> =
        args.first().map(|a| a.split(',').filter_map(|m| m.parse().ok()).collect()).unwrap_or(vec![128, 256]);
    let rounds: usize = args.get(1).and_then(|r| r.parse().ok()).unwrap_or(7);
    for &m in &rows {
        let mut ratios_all = vec![];
        for (model, layer, k, n) in LAYERS {
            let copies = ((96 << 20) / (n * k * 4)).max(1);
            let x = data(m * k, 97);
            let ws: Vec<Vec<f32>> = (0..copies).map(|c| data(n * k, 89 + c as u64)).collect();
            let mut y = vec![0f32; m * n];
            let mut turn = 0;
            let reps = ((5e8 / (m * k * n) as f64) as usize).max(2);
            let mut ratios = vec![];
            let (mut best_c, mut best_t) = (f64::MAX, f64::MAX);
            for r in 0..rounds {
                let mut t = [0.0; 2];
                for which in if r % 2 == 0 { [0, 1] } else { [1, 0] } {
                    use_tiles(which == 1);
                    t[which] = timing::best(1, reps, &mut || {
                        let w = &ws[turn % copies];
                        turn += 1;
                        drop(gemm(&mut y, Mat::rows(&x, m, k), Mat::rows(w, n, k).t(), 1.0, false, true))
                    });
                }
                best_c = best_c.min(t[0]);
                best_t = best_t.min(t[1]);
                ratios.push(t[0] / t[1]);
            }
            ratios.sort_by(|a, b| a.partial_cmp(b).unwrap());
            let med = ratios[ratios.len() / 2];
            ratios_all.push(med);
            let g = |t: f64| (m * k * n) as f64 / t / 1e9;
            println!("| {model} {layer} {m}×{k}×{n} | crate {:.1} | tiles {:.1} | median ratio {med:.2} (range {:.2}–{:.2}) |", g(best_c), g(best_t), ratios[0], ratios[ratios.len() - 1]);
        }
        ratios_all.sort_by(|a, b| a.partial_cmp(b).unwrap());
        println!("rows {m}: median of shape medians {:.3}", ratios_all[ratios_all.len() / 2]);
    }
}
