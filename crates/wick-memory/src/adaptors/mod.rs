//! Adaptors in the spirit of RMM's: each wraps an upstream resource and adds one concern.
//! They compose by wrapping, e.g. `Statistics::new(Limiting::new(CachingAllocator::new(b), cap))`.

mod event_log;
mod failure_callback;
mod limiting;
mod statistics;
mod tracking;

pub use event_log::{EventLog, TraceOp};
pub use failure_callback::FailureCallback;
pub use limiting::Limiting;
pub use statistics::{Counters, Statistics};
pub use tracking::{Tracked, Tracking};
