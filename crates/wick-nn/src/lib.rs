//! # wick-nn
//!
//! The differentiable layer of wick, between the engine (`wick`: governed devices and memory) and
//! training (`wick-train`) or the models (`wick-zoo`): what candle-nn, burn-nn/burn-core's
//! `module` and `torch.nn` + `torch.autograd` are to their stacks. Every op here has a written-out
//! backward pass, so no gradient is lost silently (candle's fast fused ops drop theirs).
//!
//! | module | what it owns |
//! |---|---|
//! | [`ops`] | differentiable ops: linear, attention (plain and packed q/k/v), RoPE, norms, activations, cross-entropy, embeddings, residual adds |
//! | [`cnn`] | convolution, depthwise convolution, batch norm with running statistics, pooling |
//! | [`fused`] | composite ops as single graph nodes that recompute their forward during backward |
//! | [`native`] | wick's own ops: candle custom ops whose forward and backward are written out — on the CPU over plain slices (convolutions, norms, attention, activations, losses …) on `wick_kernels::cpu` (matrix products f32/bf16/AMX, vectorised math, batch-norm sums); with the `cuda` feature, the transformers' ops also on a CUDA device (`native::cuda`, on wick-kernels' CUDA C), the same node on both; and per-op timing and counts ([`native::profile`]) |
//! | [`params`] | named parameters with pre-flighted creation and the initialisers |
//! | [`autocast`] | the mixed-precision op policy ([`Autocast`]: which ops run in bf16/f16, which in f32) |
//! | [`checkpoint`] | activation checkpointing ([`Checkpointing`]: blocks recomputed in backward instead of kept); the blocks of parameters sharded over processes (recomputed, or kept with their parameters gathered again in backward) |
//! | [`pages`] | a CPU tensor's pages handed back while it lives, and counted again before it is written |
//! | [`grad`] | [`no_grad`] and [`grad_enabled`] |
//! | `gradcheck` | central finite differences against autograd, for gradient tests (feature `testing`) |
//! | [`graph`] | what an output's autograd graph keeps alive ([`graph::graph_bytes`]) |
//! | [`model`] | the [`Model`] trait every trainable model implements, [`Labelled`] batches, and [`TensorBatch`] (a batch of tensors alone, as a CUDA graph's step takes it) |
//! | [`error`] | [`NnError`] |
//!
//! Training checkpoints (files a run resumes from) are `wick-train`'s, not [`checkpoint`]'s.

pub mod autocast;
pub mod checkpoint;
pub mod cnn;
pub mod error;
pub mod fused;
pub mod grad;
#[cfg(any(test, feature = "testing"))]
pub mod gradcheck;
pub mod graph;
pub mod model;
pub mod native;
/// Renamed [`native`]: its ops have CUDA bodies too now (feature `cuda`), so they are no longer
/// the CPU's alone.
#[deprecated(since = "0.1.0", note = "renamed `wick_nn::native`")]
pub mod cpu {
    pub use crate::native::*;
}
pub mod ops;
pub mod pages;
pub mod params;

pub use autocast::Autocast;
pub use checkpoint::Checkpointing;
pub use error::{to_candle, NnError};
pub use grad::{grad_enabled, no_grad};
pub use model::{Labelled, Model, TensorBatch};
