//! One interface for every trainable model: its parameters and its training loss on a batch,
//! with optional activation checkpointing ([`Model`]). Code that trains "a model" — the trainer,
//! the AMP trial, benchmarks, a user's own loop — is written once against it instead of once per
//! architecture. The zoo's models implement it (and candle's `Module`/`ModuleT` beside it, so a
//! candle user can put one where a candle module goes); so can a user's own model:
//!
//! ```
//! use candle_core::{DType, Device, Tensor};
//! use wick_nn::checkpoint::Checkpointing;
//! use wick_nn::params::{Init, Params};
//! use wick_nn::{Model, NnError};
//!
//! /// Least squares on one linear map.
//! struct Probe {
//!     params: Params,
//! }
//!
//! impl Model for Probe {
//!     type Batch = (Tensor, Tensor);
//!     fn params(&self) -> &Params {
//!         &self.params
//!     }
//!     fn loss_with(&self, (x, y): &(Tensor, Tensor), _: Option<&Checkpointing>) -> Result<Tensor, NnError> {
//!         let w = self.params.tensor("w")?;
//!         Ok(wick_nn::ops::linear(x, &w, None)?.sub(y)?.sqr()?.mean_all()?)
//!     }
//! }
//!
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let mut params = Params::default();
//! params.create("w", &[1, 3], Init::Normal(0.1), DType::F32, &Device::Cpu)?;
//! let model = Probe { params };
//! let x = Tensor::new(&[[1f32, 2., 3.], [0., 1., 0.]], &Device::Cpu)?;
//! let y = Tensor::new(&[[1f32], [2.]], &Device::Cpu)?;
//! let grads = model.loss(&(x, y))?.backward()?;
//! assert!(model.vars().iter().all(|v| grads.get(v.as_tensor()).is_some()));
//! # Ok(())
//! # }
//! ```

use candle_core::{Tensor, Var};

use crate::checkpoint::Checkpointing;
use crate::error::NnError;
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
    fn loss_with(&self, batch: &Self::Batch, checkpoint: Option<&Checkpointing>) -> Result<Tensor, NnError>;

    /// [`Model::loss_with`] without checkpointing.
    fn loss(&self, batch: &Self::Batch) -> Result<Tensor, NnError> {
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
