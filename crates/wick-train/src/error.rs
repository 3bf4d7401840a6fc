//! What can go wrong training: a checkpoint file, the loss scaler used out of order, a setting
//! out of range, or the network underneath (an op, memory, candle: [`NnError`]).

use std::path::PathBuf;

use wick_nn::NnError;

use crate::amp::ScalerError;

/// What went wrong in a training step, an optimizer update or a training checkpoint.
#[derive(Debug, thiserror::Error)]
pub enum TrainError {
    /// A checkpoint file or folder is missing, unreadable, damaged or cannot be written.
    #[error("{path}: {message}")]
    File {
        /// The file or folder.
        path: PathBuf,
        /// What happened.
        message: String,
    },
    /// A setting or an argument is outside what the trainer or the update supports (`what`
    /// names the thing: a checkpoint, a step, the fused CUDA update).
    #[error("{what}: {message}")]
    Invalid {
        /// What was given.
        what: String,
        /// What is wrong with it.
        message: String,
    },
    /// The loss scaler was used out of order or set up with a value out of range.
    #[error("loss scaler: {0}")]
    Scaler(#[from] ScalerError),
    /// Between processes: ranks that disagree, a collective the group cannot carry, a step
    /// another rank failed.
    #[error(transparent)]
    Dist(#[from] crate::dist::DistError),
    /// The model's forward or backward pass, or memory for it, failed.
    #[error(transparent)]
    Nn(#[from] NnError),
}

impl From<candle_core::Error> for TrainError {
    fn from(e: candle_core::Error) -> Self {
        TrainError::Nn(NnError::Candle(e))
    }
}

impl From<wick::memory::MemoryError> for TrainError {
    fn from(e: wick::memory::MemoryError) -> Self {
        TrainError::Nn(NnError::Memory(e))
    }
}
