//! Errors that name the file and tensor at fault.

use std::path::PathBuf;

use wick_nn::NnError;

/// What went wrong loading a zoo model, its weights, configuration or tokenizer. Building and
/// running a model fails as [`NnError`] (wrapped here as [`ZooError::Nn`] where a loader builds
/// one).
#[derive(Debug, thiserror::Error)]
pub enum ZooError {
    /// A file is missing or unreadable.
    #[error("{path}: {message}")]
    File {
        /// The file.
        path: PathBuf,
        /// What happened.
        message: String,
    },
    /// A configuration file has a key or value wick does not support.
    #[error("{path}: {message}")]
    Config {
        /// The configuration file.
        path: PathBuf,
        /// What is wrong.
        message: String,
    },
    /// A tensor in a weight file is missing or has the wrong shape or dtype.
    #[error("{path}: tensor `{tensor}`: {message}")]
    Tensor {
        /// The weight file.
        path: PathBuf,
        /// The tensor's name.
        tensor: String,
        /// What is wrong.
        message: String,
    },
    /// The tokenizer failed.
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    /// Building or running the model failed: an invalid configuration, memory refused by
    /// pre-flight, or candle underneath.
    #[error(transparent)]
    Nn(#[from] NnError),
}

impl From<candle_core::Error> for ZooError {
    fn from(e: candle_core::Error) -> Self {
        ZooError::Nn(NnError::Candle(e))
    }
}

impl From<wick::memory::MemoryError> for ZooError {
    fn from(e: wick::memory::MemoryError) -> Self {
        ZooError::Nn(NnError::Memory(e))
    }
}
