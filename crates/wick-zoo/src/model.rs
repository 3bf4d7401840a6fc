//! One interface for every zoo model: its parameters and its training loss on a batch, with
//! optional activation checkpointing ([`Model`]). Code that trains "a model" — the AMP trial,
//! benchmarks, a user's own loop — is written once against it instead of once per architecture.
//!
//! The models also speak candle: [`Llama`](crate::llama::Llama) and [`Vit`](crate::vit::Vit)
//! implement [`candle_core::Module`] (ids or images to logits), the CNNs
//! [`candle_core::ModuleT`] (the flag is batch norm's training mode), so a candle user can put a
//! zoo model where a candle module goes. BERT takes an attention mask beside its ids and so has
//! no `Module` form; call [`Bert::forward`](crate::bert::Bert::forward).
//!
//! ```
//! use candle_core::{DType, Device, Module, Tensor};
//! use wick_zoo::llama::{Llama, LlamaConfig};
//! use wick_zoo::Model;
//!
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let model = Llama::new(LlamaConfig::tiny(16), DType::F32, &Device::Cpu)?;
//! let ids = Tensor::new(&[[1u32, 2, 3, 4]], &Device::Cpu)?;
//! let loss = model.loss(&ids)?; // next-token cross-entropy
//! let grads = loss.backward()?;
//! assert!(model.vars().iter().all(|v| grads.get(v.as_tensor()).is_some()));
//! let logits = Module::forward(&model, &ids)?; // the candle way
//! assert_eq!(logits.dims(), &[1, 4, 16]);
//! # Ok(())
//! # }
//! ```

use candle_core::{Tensor, Var};

use crate::checkpoint::Checkpointing;
use crate::error::ZooError;
use crate::params::Params;

/// A trainable model: named parameters and a loss on a batch of its inputs.
pub trait Model {
    /// What one training batch holds (token ids for a decoder, images and labels for a
    /// classifier, ...).
    type Batch;

    /// Every parameter by name (the names of the reference implementation: Hugging Face's or
    /// torchvision's).
    fn params(&self) -> &Params;

    /// The training loss of `batch` (batch norm in training mode, its running statistics
    /// updated once), with each block checkpointed when `checkpoint` is given: its activations
    /// are recomputed in backward instead of kept.
    fn loss_with(&self, batch: &Self::Batch, checkpoint: Option<&Checkpointing>) -> Result<Tensor, ZooError>;

    /// [`Model::loss_with`] without checkpointing.
    fn loss(&self, batch: &Self::Batch) -> Result<Tensor, ZooError> {
        self.loss_with(batch, None)
    }

    /// The trainable parameters, in the order of [`Model::params`].
    fn vars(&self) -> Vec<Var> {
        self.params().iter().map(|(_, v)| v.clone()).collect()
    }
}

/// A classification batch: inputs (images (N, 3, H, W) for the vision models) and their class
/// labels (N, u32).
#[derive(Debug, Clone)]
pub struct Labelled {
    /// The inputs, in the model's dtype.
    pub inputs: Tensor,
    /// Class indices (N), u32.
    pub labels: Tensor,
}

/// A zoo error as a candle error (for the candle traits), keeping it as the source.
pub(crate) fn to_candle(e: ZooError) -> candle_core::Error {
    match e {
        ZooError::Candle(e) => e,
        other => candle_core::Error::wrap(other),
    }
}

/// [`Model`] (classification: cross-entropy of the logits, batch norm in training mode, against
/// [`Labelled`] labels) and candle's [`candle_core::ModuleT`] (the flag is batch norm's mode, as
/// PyTorch's `model.train()`) for a CNN with `forward(x, train)` and
/// `forward_with(x, train, checkpoint)`.
macro_rules! cnn_classifier {
    ($ty:ident) => {
        /// Trained on classification: cross-entropy of the logits (batch norm in training mode)
        /// against the labels.
        impl $crate::model::Model for $ty {
            type Batch = $crate::model::Labelled;

            fn params(&self) -> &$crate::params::Params {
                &self.params
            }

            fn loss_with(
                &self,
                batch: &$crate::model::Labelled,
                checkpoint: Option<&$crate::checkpoint::Checkpointing>,
            ) -> Result<candle_core::Tensor, $crate::error::ZooError> {
                let logits = self.forward_with(&batch.inputs, true, checkpoint)?;
                Ok($crate::ops::cross_entropy(&logits, &batch.labels)?)
            }
        }

        /// Images (N, 3, H, W) to logits (N, classes); `train` is batch norm's mode (batch
        /// statistics, running statistics updated) as in PyTorch's `model.train()`.
        impl candle_core::ModuleT for $ty {
            fn forward_t(&self, x: &candle_core::Tensor, train: bool) -> candle_core::Result<candle_core::Tensor> {
                $ty::forward(self, x, train).map_err($crate::model::to_candle)
            }
        }
    };
}
pub(crate) use cnn_classifier;
