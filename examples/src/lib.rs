//! What the example programs share: the decoder of the main job (`train-amp`), which
//! `zoo-speed` also times; the candle-transformers models `byo-model` and `byo-model-alone` time
//! governed and alone ([`byo_model`]); the zoo's benchmark configurations, which `zoo-speed`
//! builds and prints for PyTorch's side, any field changeable by `--set` ([`zoo_bench`]); and
//! [`open_engine`], the engine for their `--device`.

pub mod byo_model;
pub mod zoo_bench;

use wick_zoo::llama::LlamaConfig;

/// The engine for a `--device` argument: `cpu`, or `cuda` (GPU 0's governed pool, capped at
/// `cap` bytes when given; a build without this crate's `cuda` feature says how to get it).
pub fn open_engine(device: &str, cap: Option<usize>) -> anyhow::Result<wick::Engine> {
    match device {
        "cpu" => Ok(wick::Engine::cpu()),
        "cuda" if !cfg!(feature = "cuda") => {
            anyhow::bail!("this build has no CUDA support: rebuild with `--features wick-examples/cuda`")
        }
        "cuda" => Ok(wick::Engine::cuda(0, cap)?),
        other => anyhow::bail!("unknown device `{other}` (expected cpu or cuda)"),
    }
}

/// The main job's vocabulary: a synthetic language of 64 tokens.
pub const VOCAB: usize = 64;

/// The main job's decoder (`train-amp`): 4 layers 128 wide with 4 heads, a SwiGLU of 256, on
/// [`VOCAB`] tokens and 64 positions.
pub const DECODER: LlamaConfig = LlamaConfig {
    vocab_size: VOCAB,
    hidden_size: 128,
    num_layers: 4,
    num_heads: 4,
    intermediate_size: 256,
    max_seq: 64,
    rms_eps: 1e-6,
    rope_theta: 10_000.0,
};
