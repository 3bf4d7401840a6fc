//! What the zoo's CNNs share: [`wick_nn::Model`] (classification: cross-entropy of the logits,
//! batch norm in training mode, against [`wick_nn::Labelled`] labels) and candle's
//! [`candle_core::ModuleT`] (the flag is batch norm's mode, as PyTorch's `model.train()`) for a
//! CNN with `forward(x, train)` and `forward_with(x, train, checkpoint)`.

/// Implements both traits for a CNN type (see the module docs).
macro_rules! cnn_classifier {
    ($ty:ident) => {
        /// Trained on classification: cross-entropy of the logits (batch norm in training mode)
        /// against the labels.
        impl wick_nn::Model for $ty {
            type Batch = wick_nn::Labelled;

            fn params(&self) -> &wick_nn::params::Params {
                &self.params
            }

            fn loss_with(
                &self,
                batch: &wick_nn::Labelled,
                checkpoint: Option<&wick_nn::Checkpointing>,
            ) -> Result<candle_core::Tensor, wick_nn::NnError> {
                let logits = self.forward_with(&batch.inputs, true, checkpoint)?;
                Ok(wick_nn::ops::cross_entropy(&logits, &batch.labels)?)
            }

            wick_nn::tensor_batches!();
        }

        /// Images (N, 3, H, W) to logits (N, classes); `train` is batch norm's mode (batch
        /// statistics, running statistics updated) as in PyTorch's `model.train()`.
        impl candle_core::ModuleT for $ty {
            fn forward_t(&self, x: &candle_core::Tensor, train: bool) -> candle_core::Result<candle_core::Tensor> {
                $ty::forward(self, x, train).map_err(wick_nn::to_candle)
            }
        }
    };
}
pub(crate) use cnn_classifier;
