//! A model built for the estimator: what `estimate` builds for the zoo's models and `llama_size`
//! for LLaMA configurations too large to build whole, each profiled the same way.

use candle_core::{Device, Tensor};
use wick_nn::checkpoint::Checkpointing;
use wick_nn::params::Params;
use wick_nn::Model;

/// A model's loss at a batch size, its blocks checkpointed in the context when one is given.
pub type LossFn = dyn Fn(usize, Option<&Checkpointing>) -> candle_core::Result<Tensor>;

/// A model built for profiling: its parameters and its loss at a batch size.
pub struct Built {
    /// Its parameters.
    pub params: &'static Params,
    /// Its loss at a batch size (the batch made inside), its blocks checkpointed in the given
    /// context.
    pub loss: Box<LossFn>,
    /// What it is, for the report.
    pub what: String,
}

/// Token ids (batch, seq) spread over a vocabulary (a multiplicative hash of the position).
pub fn token_ids(batch: usize, seq: usize, vocab: usize) -> candle_core::Result<Tensor> {
    let vocab = vocab.max(1) as u32;
    let ids: Vec<u32> = (0..batch * seq).map(|i| (i as u32).wrapping_mul(2_654_435_761) % vocab).collect();
    Tensor::from_vec(ids, (batch, seq), &Device::Cpu)
}

/// Leaks the model: it lives as long as the command (one model per process), which lets the
/// profile's closures borrow it without a self-referential struct.
pub fn leak<M: Model + 'static>(model: M) -> &'static M {
    Box::leak(Box::new(model))
}
