//! The transformers' linear-layer shapes the f32 product benches time, and their operands.

/// (model, layer, k, n) of each projection.
pub const LAYERS: [(&str, &str, usize, usize); 13] = [
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

/// `len` values in [−0.5, 0.5), a different sequence for each `seed`.
pub fn data(len: usize, seed: u64) -> Vec<f32> {
    (0..len).map(|i| (((i as u64 * seed + 7) % 1013) as f32 / 1013.0) - 0.5).collect()
}
