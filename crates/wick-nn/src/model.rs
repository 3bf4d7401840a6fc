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

    /// The batch's tensors in a fixed order, for a training step captured as a CUDA graph (which
    /// copies each batch into tensors of its own and replays on those); `None`, the default, for
    /// a batch that is not tensors alone — such a model's steps then run eagerly, with the reason
    /// said. A batch type that implements [`TensorBatch`] returns `Some(batch.tensors())`.
    fn batch_tensors(batch: &Self::Batch) -> Option<Vec<Tensor>> {
        let _ = batch;
        None
    }

    /// `batch` with its tensors replaced by `tensors` (as many as [`Model::batch_tensors`] gave,
    /// in its order, of the same shapes): the batch a captured step runs on. An error by default.
    fn batch_with(batch: &Self::Batch, tensors: &[Tensor]) -> Result<Self::Batch, NnError> {
        let _ = (batch, tensors);
        Err(NnError::invalid("batch", "this model's batch is not tensors alone (Model::batch_tensors)"))
    }
}

/// A batch made of tensors alone: what a training step captured as a CUDA graph copies into
/// tensors of its own (see [`Model::batch_tensors`]).
pub trait TensorBatch: Sized {
    /// The batch's tensors, in a fixed order.
    fn tensors(&self) -> Vec<Tensor>;

    /// The batch with its tensors replaced by `tensors` (as many as [`TensorBatch::tensors`]
    /// gives, in its order); a wrong count is an error.
    fn with_tensors(&self, tensors: &[Tensor]) -> Result<Self, NnError>;
}

/// Inside an `impl Model`, the two methods that give a [`TensorBatch`] batch to a step captured
/// as a CUDA graph ([`Model::batch_tensors`] and [`Model::batch_with`] through the batch type's
/// [`TensorBatch`]).
#[macro_export]
macro_rules! tensor_batches {
    () => {
        fn batch_tensors(batch: &Self::Batch) -> Option<Vec<candle_core::Tensor>> {
            Some($crate::TensorBatch::tensors(batch))
        }

        fn batch_with(batch: &Self::Batch, tensors: &[candle_core::Tensor]) -> Result<Self::Batch, $crate::NnError> {
            $crate::TensorBatch::with_tensors(batch, tensors)
        }
    };
}

/// `tensors` as exactly `N` tensors, or the error saying how many came.
pub fn exactly<const N: usize>(tensors: &[Tensor]) -> Result<&[Tensor; N], NnError> {
    tensors.try_into().map_err(|_| NnError::invalid("batch", format!("{} tensors for a batch of {N}", tensors.len())))
}

/// Token ids, or any one tensor.
impl TensorBatch for Tensor {
    fn tensors(&self) -> Vec<Tensor> {
        vec![self.clone()]
    }

    fn with_tensors(&self, tensors: &[Tensor]) -> Result<Self, NnError> {
        let [t] = exactly::<1>(tensors)?;
        Ok(t.clone())
    }
}

/// Inputs and targets.
impl TensorBatch for (Tensor, Tensor) {
    fn tensors(&self) -> Vec<Tensor> {
        vec![self.0.clone(), self.1.clone()]
    }

    fn with_tensors(&self, tensors: &[Tensor]) -> Result<Self, NnError> {
        let [a, b] = exactly::<2>(tensors)?;
        Ok((a.clone(), b.clone()))
    }
}

/// Inputs, then labels.
impl TensorBatch for Labelled {
    fn tensors(&self) -> Vec<Tensor> {
        vec![self.inputs.clone(), self.labels.clone()]
    }

    fn with_tensors(&self, tensors: &[Tensor]) -> Result<Self, NnError> {
        let [inputs, labels] = exactly::<2>(tensors)?;
        Ok(Labelled { inputs: inputs.clone(), labels: labels.clone() })
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
