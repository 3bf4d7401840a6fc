//! Typed errors. Out-of-memory is a value the caller can match on and recover from, never a panic.

use crate::stream::StreamId;
use wick_alloc_check::format_bytes;

/// Why the allocator refused a request, or why an operation failed.
#[derive(Debug, thiserror::Error)]
pub enum MemoryError {
    /// Transient: the request may succeed after memory is freed. Carries the numbers and advice.
    #[error("{0}")]
    OutOfMemory(Box<OutOfMemory>),
    /// Permanent: the request exceeds the device's whole capacity and can never succeed
    /// (CubeCL's `BufferTooBig` as opposed to its transient `OutOfMemory`).
    #[error(
        "a request of {} can never succeed on {device}: it exceeds the device's total capacity of {}",
        format_bytes(*requested as u64),
        format_bytes(*capacity as u64)
    )]
    TooLarge {
        /// Bytes asked for.
        requested: usize,
        /// Total bytes of the device.
        capacity: usize,
        /// The device the request was made on.
        device: String,
    },
    /// A zero-byte request: there is no block to hand out.
    #[error("zero-size allocation requested; ask for at least one byte")]
    ZeroSize,
    /// The alignment is not a power of two.
    #[error("alignment {0} is not a power of two")]
    InvalidAlignment(usize),
    /// The alignment is a power of two but larger than the allocator guarantees.
    #[error("alignment {requested} is larger than the {supported}-byte alignment this allocator guarantees")]
    UnsupportedAlignment {
        /// Alignment asked for.
        requested: usize,
        /// Largest alignment every block has.
        supported: usize,
    },
    /// The block was not allocated by this resource (or was already returned).
    #[error("block at {addr:#x} does not belong to this allocator (foreign or already freed)")]
    ForeignBlock {
        /// Address of the offending block.
        addr: u64,
    },
    /// The stream is not known to the backend.
    #[error("stream {0} is not known to this backend")]
    UnknownStream(StreamId),
    /// A configuration value is malformed or out of range.
    #[error("invalid allocator configuration: {0}")]
    InvalidConfig(String),
    /// The backend (driver) failed in a way that is not out-of-memory (kept as its typed
    /// [`BackendError`](crate::BackendError), which is the error's source).
    #[error("backend error: {0}")]
    Backend(#[from] BackendError),
    /// The device or driver is missing or too old.
    #[error("device unavailable: {0}")]
    Unavailable(String),
    /// A trace could not be read or is malformed.
    #[error("invalid trace: {0}")]
    InvalidTrace(String),
    /// A snapshot could not be read or is malformed.
    #[error("invalid snapshot: {0}")]
    InvalidSnapshot(String),
    /// A file read to size a request (a weights file's header) could not be read or is malformed.
    #[error("{}: {message}", path.display())]
    InvalidFile {
        /// The file.
        path: std::path::PathBuf,
        /// What is wrong with it.
        message: String,
    },
    /// The operation is not supported by this resource.
    #[error("unsupported operation: {0}")]
    Unsupported(String),
}

impl MemoryError {
    /// True for the transient out-of-memory condition (freeing memory may help).
    pub fn is_out_of_memory(&self) -> bool {
        matches!(self, MemoryError::OutOfMemory(_))
    }

    /// The out-of-memory details, when this is one.
    pub fn as_out_of_memory(&self) -> Option<&OutOfMemory> {
        match self {
            MemoryError::OutOfMemory(oom) => Some(oom),
            _ => None,
        }
    }
}

/// Everything known at the moment an allocation failed. `Display` reads like PyTorch's message
/// and ends with advice chosen from the numbers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OutOfMemory {
    /// Device description, e.g. `host:0` or `cuda:0`.
    pub device: String,
    /// Bytes the caller asked for.
    pub requested: usize,
    /// Bytes the allocator would have had to reserve from the backend for it.
    pub segment_size: usize,
    /// Total capacity of the device.
    pub capacity: usize,
    /// Free bytes on the device as the backend reports them.
    pub device_free: usize,
    /// Bytes handed out to live allocations.
    pub allocated: usize,
    /// Bytes reserved from the backend (allocated plus cached).
    pub reserved: usize,
    /// The hard cap on reserved bytes, if one is set.
    pub limit: Option<usize>,
    /// True when the cap, not the device, refused the memory.
    pub limited_by_cap: bool,
    /// Largest cached free block at the time of failure (fragmentation indicator).
    pub largest_free_block: usize,
    /// Whose memory `allocated` and `reserved` are.
    pub owner: UsageOwner,
    /// This process's resident set, where it is said beside figures that are not its own.
    pub process_resident: Option<usize>,
}

/// Whose memory an [`OutOfMemory`]'s usage figures (`allocated`, `reserved`) are: a refusal must
/// never call another process's memory wick's.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum UsageOwner {
    /// wick's allocator counted them (its live blocks, and its cache): "allocated by wick".
    #[default]
    Allocator,
    /// This process's heap, counted by wick's global allocator (the caching heap or the counting
    /// allocator).
    ProcessHeap,
    /// This process's resident set: nothing counts its heap (no wick global allocator).
    ProcessResident,
    /// Every process on the machine and the kernel (`MemTotal` less `MemAvailable`).
    Machine,
    /// Every process of this process's memory cgroup (its working set).
    Cgroup,
    /// This process's mappings, which the address-space limit (`ulimit -v`) counts.
    AddressSpace,
    /// Every process's committed memory, under strict overcommit.
    Committed,
}

impl OutOfMemory {
    /// A refusal of `requested` bytes on `device` (a device name, with what was asked for in
    /// brackets where that helps). The figures the `with_` setters fill start unknown: 0, no
    /// limit, and a segment the size of the request. Finish with [`OutOfMemory::into_error`].
    pub fn refused(device: impl Into<String>, requested: usize) -> Self {
        OutOfMemory {
            device: device.into(),
            requested,
            segment_size: requested,
            capacity: 0,
            device_free: 0,
            allocated: 0,
            reserved: 0,
            limit: None,
            limited_by_cap: false,
            largest_free_block: 0,
            owner: UsageOwner::Allocator,
            process_resident: None,
        }
    }

    /// Whose memory the usage figures are (by default wick's allocator's).
    pub fn with_owner(mut self, owner: UsageOwner) -> Self {
        self.owner = owner;
        self
    }

    /// This process's resident set, said beside usage figures that are not (only) its own.
    pub fn with_process_resident(mut self, bytes: Option<usize>) -> Self {
        self.process_resident = bytes;
        self
    }

    /// The bytes that would have been reserved from the device for the request.
    pub fn with_segment(mut self, bytes: usize) -> Self {
        self.segment_size = bytes;
        self
    }

    /// The device's total capacity and its free bytes.
    pub fn with_device(mut self, capacity: usize, free: usize) -> Self {
        (self.capacity, self.device_free) = (capacity, free);
        self
    }

    /// Bytes handed out to live allocations and bytes reserved (allocated plus cached).
    pub fn with_usage(mut self, allocated: usize, reserved: usize) -> Self {
        (self.allocated, self.reserved) = (allocated, reserved.max(allocated));
        self
    }

    /// The cap, and whether the cap (not the device) refused the request.
    pub fn with_limit(mut self, limit: Option<usize>, limited_by_cap: bool) -> Self {
        (self.limit, self.limited_by_cap) = (limit, limited_by_cap);
        self
    }

    /// The largest cached free block (fragmentation).
    pub fn with_largest_free_block(mut self, bytes: usize) -> Self {
        self.largest_free_block = bytes;
        self
    }

    /// The error.
    pub fn into_error(self) -> MemoryError {
        MemoryError::OutOfMemory(Box::new(self))
    }

    /// Reserved but not allocated bytes (the cache).
    pub fn reserved_unallocated(&self) -> usize {
        self.reserved.saturating_sub(self.allocated)
    }

    /// Concrete advice chosen from the numbers.
    pub fn advice(&self) -> String {
        let cached = self.reserved_unallocated();
        if self.limited_by_cap && self.device_free >= self.segment_size {
            return format!(
                "the memory limit refused it while the device still has {} free: raise the limit \
                 (set_memory_limit) if other work can spare it, or reduce the batch size",
                format_bytes(self.device_free as u64)
            );
        }
        if cached >= self.requested && self.largest_free_block < self.requested {
            return format!(
                "{} is cached but fragmented (largest free block {}): set max_split_size_mb \
                 (e.g. WICK_ALLOC_CONF=max_split_size_mb:128) to limit splitting of large blocks, \
                 or allocate long-lived tensors first",
                format_bytes(cached as u64),
                format_bytes(self.largest_free_block as u64)
            );
        }
        "reduce the batch size (halve it and use gradient accumulation to keep the effective \
         batch), drop tensors you no longer need before the step, or use activation checkpointing \
         or mixed precision to shrink activations"
            .to_string()
    }
}

impl std::fmt::Display for OutOfMemory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let b = |n: usize| format_bytes(n as u64);
        write!(
            f,
            "out of memory on {}: tried to allocate {}. The device has a total capacity of {} of \
             which {} is free. Of the memory in use, ",
            self.device,
            b(self.requested),
            b(self.capacity),
            b(self.device_free),
        )?;
        let (a, cached) = (b(self.allocated), b(self.reserved_unallocated()));
        match self.owner {
            UsageOwner::Allocator => {
                write!(f, "{a} is allocated by wick and {cached} is reserved by wick but unallocated")?
            }
            UsageOwner::ProcessHeap => {
                write!(f, "{a} is allocated by this process's heap (counted by wick) and {cached} is held by it freed")?
            }
            UsageOwner::ProcessResident => {
                write!(f, "this process holds {a} (its resident set: nothing counts its heap here)")?
            }
            UsageOwner::Machine => write!(f, "{a} is used by all processes on the machine and the kernel")?,
            UsageOwner::Cgroup => write!(f, "{a} is used by the processes of this process's memory cgroup")?,
            UsageOwner::AddressSpace => write!(f, "{a} is mapped by this process (the address-space limit counts it)")?,
            UsageOwner::Committed => write!(f, "{a} is committed by all processes (strict overcommit)")?,
        }
        if let (Some(r), false) = (self.process_resident, self.owner == UsageOwner::ProcessResident) {
            write!(f, "; this process holds {} resident", b(r))?;
        }
        if let Some(limit) = self.limit {
            write!(
                f,
                "; the memory limit is {} ({} allowed beyond what is reserved)",
                b(limit),
                b(limit.saturating_sub(self.reserved))
            )?;
        }
        write!(f, ". Advice: {}.", self.advice())
    }
}

/// Result type of this crate.
pub type Result<T, E = MemoryError> = std::result::Result<T, E>;

/// Why a backend call failed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum BackendError {
    /// The device has no memory left for this segment (transient).
    OutOfMemory,
    /// The stream does not exist.
    UnknownStream(StreamId),
    /// Any other driver failure, with its message.
    Other(String),
}

impl std::fmt::Display for BackendError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            BackendError::OutOfMemory => write!(f, "device out of memory"),
            BackendError::UnknownStream(s) => write!(f, "unknown stream {s}"),
            BackendError::Other(msg) => write!(f, "{msg}"),
        }
    }
}

impl std::error::Error for BackendError {}

#[cfg(test)]
mod tests {
    use super::*;

    fn oom() -> OutOfMemory {
        OutOfMemory {
            device: "sim:0".into(),
            requested: 2 << 30,
            segment_size: 2 << 30,
            capacity: 80 << 30,
            device_free: 1 << 30,
            allocated: 70 << 30,
            reserved: 75 << 30,
            limit: None,
            limited_by_cap: false,
            largest_free_block: 1 << 30,
            owner: UsageOwner::Allocator,
            process_resident: None,
        }
    }

    #[test]
    fn message_reads_like_pytorch_and_ends_with_advice() {
        let text = oom().to_string();
        assert!(text.contains("tried to allocate 2.00 GiB"), "{text}");
        assert!(text.contains("total capacity of 80.00 GiB of which 1.00 GiB is free"), "{text}");
        assert!(text.contains("70.00 GiB is allocated by wick and 5.00 GiB is reserved"), "{text}");
        assert!(text.contains("Advice: "), "{text}");
        assert!(text.contains("fragmented"), "fragmentation advice expected: {text}");
    }

    #[test]
    fn cap_advice_when_device_has_room() {
        let mut o = oom();
        o.limit = Some(75 << 30);
        o.limited_by_cap = true;
        o.device_free = 4 << 30;
        assert!(o.advice().contains("raise the limit"));
        assert!(o.to_string().contains("memory limit is 75.00 GiB"));
    }

    #[test]
    fn batch_advice_otherwise() {
        let mut o = oom();
        o.reserved = o.allocated;
        assert!(o.advice().contains("reduce the batch size"));
    }

    #[test]
    fn each_owner_names_whose_memory_the_figures_are() {
        let mut o = oom();
        o.reserved = o.allocated;
        o.process_resident = Some(100 << 20);
        let text = |owner| OutOfMemory { owner, ..o.clone() }.to_string();
        let machine = text(UsageOwner::Machine);
        assert!(machine.contains("70.00 GiB is used by all processes on the machine and the kernel"), "{machine}");
        assert!(
            machine.contains("this process holds 100.00 MiB resident") && !machine.contains("by wick"),
            "{machine}"
        );
        let rss = text(UsageOwner::ProcessResident);
        assert!(rss.contains("this process holds 70.00 GiB (its resident set") && !rss.contains("by wick"), "{rss}");
        assert!(!rss.contains("100.00 MiB"), "the resident set is not said twice: {rss}");
        assert!(text(UsageOwner::Cgroup).contains("memory cgroup"));
        assert!(text(UsageOwner::ProcessHeap).contains("allocated by this process's heap"));
        assert!(text(UsageOwner::AddressSpace).contains("address-space limit"));
        assert!(text(UsageOwner::Committed).contains("strict overcommit"));
        assert!(text(UsageOwner::Allocator).contains("allocated by wick"));
    }
}
