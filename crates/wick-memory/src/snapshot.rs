//! The allocator's state as data: segments and their blocks (PyTorch's `memory_snapshot()`),
//! serialisable to JSON for reports and offline analysis.

use crate::stats::MemoryStats;

/// State of one block.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum BlockStateName {
    /// Handed out to a user.
    ActiveAllocated,
    /// Returned, waiting for stream events before reuse.
    ActivePendingFree,
    /// Cached, free.
    Inactive,
}

/// One block of a segment.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct BlockSnapshot {
    /// Address.
    pub address: u64,
    /// Bytes of the block.
    pub size: usize,
    /// Bytes the user asked for (0 when free).
    pub requested_size: usize,
    /// State.
    pub state: BlockStateName,
    /// Stream of the last use.
    pub stream: u64,
}

/// One segment (backend allocation).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct SegmentSnapshot {
    /// Address of the segment.
    pub address: u64,
    /// Bytes.
    pub total_size: usize,
    /// Stream it was reserved for.
    pub stream: u64,
    /// `small` or `large`.
    pub segment_type: String,
    /// Bytes in allocated blocks.
    pub allocated_size: usize,
    /// Bytes in active blocks (allocated or pending free).
    pub active_size: usize,
    /// Blocks in address order; they tile the segment exactly.
    pub blocks: Vec<BlockSnapshot>,
}

/// Every segment plus the statistics at the same instant.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Snapshot {
    /// Device description.
    pub device: String,
    /// Device capacity in bytes.
    pub capacity: usize,
    /// Hard cap, if set.
    pub limit: Option<usize>,
    /// Segments in address order.
    pub segments: Vec<SegmentSnapshot>,
    /// Statistics at the time of the snapshot.
    pub stats: MemoryStats,
}

impl Snapshot {
    /// Pretty JSON.
    pub fn to_json(&self) -> String {
        serde_json::to_string_pretty(self).unwrap_or_else(|e| format!("{{\"error\": \"{e}\"}}"))
    }

    /// Parses a snapshot written by `to_json`.
    pub fn from_json(text: &str) -> crate::Result<Self> {
        serde_json::from_str(text).map_err(|e| crate::MemoryError::InvalidSnapshot(e.to_string()))
    }

    /// Bytes of all segments.
    pub fn reserved_bytes(&self) -> usize {
        self.segments.iter().map(|s| s.total_size).sum()
    }

    /// Bytes of allocated blocks.
    pub fn allocated_bytes(&self) -> usize {
        self.segments.iter().map(|s| s.allocated_size).sum()
    }

    /// Blocks of all segments.
    pub fn blocks(&self) -> impl Iterator<Item = &BlockSnapshot> {
        self.segments.iter().flat_map(|s| s.blocks.iter())
    }
}
