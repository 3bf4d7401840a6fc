//! What can go wrong building or running a network: an argument outside what an op or layer
//! supports, memory that cannot be had, or candle failing underneath.

/// What went wrong in an op, a layer or a model's forward and backward pass.
#[derive(Debug, thiserror::Error)]
pub enum NnError {
    /// A setting, an argument or an input is outside what the model or operation supports
    /// (`what` names the thing: a configuration type, an input, a step).
    #[error("{what}: {message}")]
    Invalid {
        /// What was given.
        what: String,
        /// What is wrong with it.
        message: String,
    },
    /// Memory for the parameters or activations cannot be had: refused by pre-flight before
    /// anything was allocated (out of memory, with advice), or a size that cannot be represented.
    #[error("{0}")]
    Memory(#[from] wick::memory::MemoryError),
    /// candle failed while running the op or model.
    #[error("candle: {0}")]
    Candle(#[from] candle_core::Error),
}

impl NnError {
    /// [`NnError::Invalid`] from its two parts.
    pub fn invalid(what: impl Into<String>, message: impl Into<String>) -> Self {
        NnError::Invalid { what: what.into(), message: message.into() }
    }
}

/// An error of this crate as a candle error (for candle's `Module` traits), keeping it as the
/// source: candle's own errors come back unwrapped.
pub fn to_candle(e: NnError) -> candle_core::Error {
    match e {
        NnError::Candle(e) => e,
        other => candle_core::Error::wrap(other),
    }
}
