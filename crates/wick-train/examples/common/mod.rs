//! What the multi-process example programs share.

use wick_train::optim::AdamW;
use wick_train::Optimizer;
use wick_zoo::llama::LlamaConfig;

/// The main job's decoder (`wick_examples::DECODER`: 4 layers 128 wide, 4 heads, a SwiGLU of
/// 256, 64 positions — written out here because wick-examples depends on this crate) with a
/// vocabulary of `vocab` tokens.
pub fn main_job_decoder(vocab: usize) -> LlamaConfig {
    LlamaConfig {
        hidden_size: 128,
        num_layers: 4,
        num_heads: 4,
        intermediate_size: 256,
        max_seq: 64,
        ..LlamaConfig::tiny(vocab)
    }
}

/// AdamW at `lr` with zoo-speed's settings (β 0.9/0.999, ε 1e-8, weight decay 0.01).
pub fn adamw(lr: f64) -> Optimizer {
    Optimizer::AdamW(AdamW { lr, beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.01 })
}
