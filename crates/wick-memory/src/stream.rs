//! Streams and events as the allocator sees them. A stream is an ordered queue of device work;
//! an event marks a point in a stream and completes when the work before it is done.

/// Identifies a stream of a backend. `StreamId::DEFAULT` (0) always exists; `StreamId(u64::MAX)`
/// is reserved by the caching allocator (it tags blocks every stream may reuse) and refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, serde::Serialize, serde::Deserialize)]
pub struct StreamId(pub u64);

impl StreamId {
    /// The default stream every backend has.
    pub const DEFAULT: StreamId = StreamId(0);
}

impl std::fmt::Display for StreamId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.0)
    }
}

/// Identifies an event recorded by a backend.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct EventId(pub u64);
