//! Errors that name the file and tensor at fault.

use std::path::PathBuf;

/// What went wrong loading or running a zoo model.
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
    /// A setting, an argument or an input is outside what the model or operation supports (no
    /// file is involved; `what` names the thing: a configuration type, an input, a step).
    #[error("{what}: {message}")]
    Invalid {
        /// What was given.
        what: String,
        /// What is wrong with it.
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
    /// Memory for the model cannot be had: refused by pre-flight before anything was allocated
    /// (out of memory, with advice), or a size that cannot be represented.
    #[error("{0}")]
    Memory(#[from] wick::memory::MemoryError),
    /// candle failed while running the model.
    #[error("candle: {0}")]
    Candle(#[from] candle_core::Error),
    /// The loss scaler was used out of order or set up with a value out of range.
    #[error("loss scaler: {0}")]
    Scaler(#[from] crate::amp::ScalerError),
    /// The tokenizer failed.
    #[error("tokenizer: {0}")]
    Tokenizer(String),
}
