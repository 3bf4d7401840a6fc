//! What can go wrong between processes that wick can see. A rank that dies or a network that
//! fails is not among them: rsmpi runs MPI with its errors-are-fatal handler, so such a failure
//! ends the whole job (mpirun names the rank) instead of becoming a `Result` here.

/// A multi-process setting or call that cannot go ahead.
#[derive(Debug, thiserror::Error)]
pub enum DistError {
    /// The launcher's environment is unusable (a malformed variable, a world size MPI does not
    /// see, a build without the `mpi` feature started as several ranks).
    #[error("process group: {message}")]
    Launch {
        /// What is wrong and what to do.
        message: String,
    },
    /// The ranks disagree on something that must be the same everywhere (a tensor's shape or
    /// dtype in a collective, the model, the training options).
    #[error("{what} differs between ranks: {message}")]
    Mismatch {
        /// The collective or the setting.
        what: String,
        /// Which ranks hold what.
        message: String,
    },
    /// A tensor or an operation the group does not carry (a CUDA tensor without NCCL, an
    /// average of integers, a dimension that does not split evenly).
    #[error("{what}: {message}")]
    Unsupported {
        /// The call.
        what: String,
        /// Why.
        message: String,
    },
    /// Another rank's step failed; every rank stopped the step with it (nothing was applied).
    #[error("rank {rank} failed this step ({message}); every rank stopped it, nothing was applied")]
    PeerFailed {
        /// The first rank that failed.
        rank: usize,
        /// What it reported.
        message: String,
    },
    /// A collective did not complete within its timeout (NCCL: a peer that never joined it);
    /// the communicator was aborted and cannot be used again.
    #[error("{what} did not complete within {seconds} s: the communicator was aborted (a rank stopped or hangs)")]
    Timeout {
        /// The collective.
        what: String,
        /// The timeout.
        seconds: f64,
    },
    /// A tensor operation failed.
    #[error(transparent)]
    Candle(#[from] candle_core::Error),
}

impl DistError {
    pub(crate) fn internal(message: impl Into<String>) -> Self {
        DistError::Unsupported { what: "collective".into(), message: message.into() }
    }

    pub(crate) fn unsupported(what: &str, message: impl Into<String>) -> Self {
        DistError::Unsupported { what: what.into(), message: message.into() }
    }
}
