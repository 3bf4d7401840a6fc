//! # wick-zoo
//!
//! Models that train, and what loads them: what candle-transformers, torchvision's `models` and
//! the hub client are to their stacks. Each model is built from `wick-nn`'s differentiable ops
//! (so no gradient is lost silently), implements [`wick_nn::Model`] (and candle's `Module` or
//! `ModuleT` beside it), and loads real weights where a package ships them.
//!
//! | module | what it owns |
//! |---|---|
//! | [`bert`] | BERT / MiniLM (Hugging Face's layout and weights), its tokenizer and sentence embeddings |
//! | [`llama`] | a LLaMA-style decoder (RMS norm, RoPE, SwiGLU) |
//! | [`vit`] | ViT-B/16 and smaller vision transformers |
//! | [`resnet`] | ResNet-18/34/50 (torchvision's layout) |
//! | [`mobilenet`] | MobileNetV2 (torchvision's layout and ImageNet weights) |
//! | [`hub`] | fetching a model repository from the Hugging Face hub into its cache: pre-flighted, resumed, checksummed, placed atomically |
//! | [`weights`] | safetensors weight files checked by name, shape and dtype; the offline hub cache |
//! | [`pth`] | PyTorch's legacy `.pth` files, read without executing pickle, and their conversion |
//! | [`registry`] | the zoo by name and size: [`registry::ModelSpec`] → a built [`registry::ZooModel`] with synthetic batches and its memory profile |
//! | [`estimate`] | the memory estimator: parameters, gradients, optimizer state, masters and profiled activations per batch |
//! | [`error`] | [`ZooError`] (files, configurations, tensors, tokenizers; [`wick_nn::NnError`] inside) |
//!
//! Training these models is `wick-train`'s (its `Trainer` takes any [`wick_nn::Model`]).

pub mod bert;
mod classifier;
pub mod error;
pub mod estimate;
pub mod hub;
pub mod llama;
pub mod mobilenet;
pub mod pth;
pub mod registry;
pub mod resnet;
pub mod vit;
pub mod weights;

pub use error::ZooError;

/// Moved to `wick_nn::ops`.
#[deprecated(since = "0.1.0", note = "moved to `wick_nn::ops`")]
pub mod ops {
    pub use wick_nn::ops::*;
}
/// Moved to `wick_nn::cnn`.
#[deprecated(since = "0.1.0", note = "moved to `wick_nn::cnn`")]
pub mod cnn {
    pub use wick_nn::cnn::*;
}
/// Moved to `wick_nn::fused`.
#[deprecated(since = "0.1.0", note = "moved to `wick_nn::fused`")]
pub mod fused {
    pub use wick_nn::fused::*;
}
/// Moved to `wick_nn::params`.
#[deprecated(since = "0.1.0", note = "moved to `wick_nn::params`")]
pub mod params {
    pub use wick_nn::params::*;
}
/// Moved to `wick_nn::checkpoint` (activation checkpointing; training checkpoints are
/// `wick_train::checkpoint`).
#[deprecated(since = "0.1.0", note = "moved to `wick_nn::checkpoint`")]
pub mod checkpoint {
    pub use wick_nn::checkpoint::*;
}
/// Moved to `wick_nn::model`.
#[deprecated(since = "0.1.0", note = "moved to `wick_nn::model`")]
pub mod model {
    pub use wick_nn::model::*;
}
/// Moved to `wick_nn::native` (first `wick_nn::cpu`).
#[deprecated(since = "0.1.0", note = "moved to `wick_nn::native`")]
pub mod kernels {
    pub use wick_nn::native::*;
}
/// Moved to `wick_nn::no_grad`.
#[deprecated(since = "0.1.0", note = "moved to `wick_nn::no_grad`")]
pub fn no_grad<R>(f: impl FnOnce() -> R) -> R {
    wick_nn::no_grad(f)
}
/// Moved to `wick_nn::grad_enabled`.
#[deprecated(since = "0.1.0", note = "moved to `wick_nn::grad_enabled`")]
pub fn grad_enabled() -> bool {
    wick_nn::grad_enabled()
}
