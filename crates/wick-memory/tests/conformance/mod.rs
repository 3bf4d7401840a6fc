//! One conformance suite for every memory resource (RMM's `mr_ref_*` tests): random operation
//! sequences, and after every operation the resource's statistics and snapshot are checked
//! against a recomputation from the set of live allocations the test itself keeps.

#![allow(dead_code)]

use proptest::prelude::*;
use wick_memory::BlockStateName;
use wick_memory::{AllocRequest, MemoryResource, RawBlock, StreamId};

pub const MIB: usize = 1 << 20;

/// One step of a random sequence.
#[derive(Debug, Clone)]
pub enum Op {
    Alloc {
        size: usize,
        align_log2: u8,
        stream: usize,
    },
    Free {
        index: usize,
    },
    RecordStream {
        index: usize,
        stream: usize,
    },
    EmptyCache,
    /// Pretend device work runs on a stream (blocks used there are "in flight").
    Launch {
        stream: usize,
    },
    /// All device work completes.
    FinishAll,
}

/// Sizes across the small pool, the 20 MiB-segment class and own-segment requests.
pub fn size_strategy() -> impl Strategy<Value = usize> {
    prop_oneof![
        6 => 1usize..=4096,
        3 => 4097usize..=MIB,
        2 => (MIB + 1)..=(10 * MIB),
        1 => (10 * MIB)..=(40 * MIB),
    ]
}

pub fn op_strategy(streams: usize) -> impl Strategy<Value = Op> {
    prop_oneof![
        10 => (size_strategy(), 0u8..=9, 0..streams).prop_map(|(size, align_log2, stream)| Op::Alloc { size, align_log2, stream }),
        6 => any::<usize>().prop_map(|index| Op::Free { index }),
        1 => (any::<usize>(), 0..streams).prop_map(|(index, stream)| Op::RecordStream { index, stream }),
        1 => Just(Op::EmptyCache),
        1 => (0..streams).prop_map(|stream| Op::Launch { stream }),
        1 => Just(Op::FinishAll),
    ]
}

/// What the suite needs to know about the device under the resource.
pub struct Harness<'a, R: MemoryResource> {
    pub resource: &'a R,
    /// Bytes the backend itself says it has handed out in segments.
    pub backend_bytes: Box<dyn Fn() -> usize + 'a>,
    pub streams: Vec<StreamId>,
    pub launch: Box<dyn Fn(StreamId) + 'a>,
    pub finish_all: Box<dyn Fn() + 'a>,
    /// The cap the resource must never exceed, if any.
    pub limit: Option<usize>,
}

struct Live {
    block: RawBlock,
    tag: u8,
    align: usize,
}

fn pattern_write(resource: &impl MemoryResource, block: &RawBlock, tag: u8) {
    if !resource.is_host_accessible() {
        return;
    }
    // SAFETY: host-accessible resources hand out valid, exclusively owned host memory of
    // `block.size()` bytes; the test writes only inside it while the block is live.
    let bytes = unsafe { std::slice::from_raw_parts_mut(block.addr() as *mut u8, block.size()) };
    let n = bytes.len();
    for i in [0, n / 2, n - 1] {
        bytes[i] = tag;
    }
    bytes[..n.min(64)].fill(tag);
}

fn pattern_intact(resource: &impl MemoryResource, live: &Live) -> bool {
    if !resource.is_host_accessible() {
        return true;
    }
    // SAFETY: as in pattern_write; read-only.
    let bytes = unsafe { std::slice::from_raw_parts(live.block.addr() as *const u8, live.block.size()) };
    let n = bytes.len();
    [0, n / 2, n - 1].iter().all(|&i| bytes[i] == live.tag) && bytes[..n.min(64)].iter().all(|&b| b == live.tag)
}

/// Checks every invariant against the live set. Returns a description of the first violation.
fn verify<R: MemoryResource>(h: &Harness<'_, R>, live: &[Live]) -> Result<(), String> {
    let r = h.resource;
    // No two live blocks overlap; alignment holds; bytes written are intact.
    let mut spans: Vec<(u64, u64)> =
        live.iter().map(|l| (l.block.addr(), l.block.addr() + l.block.block_size() as u64)).collect();
    spans.sort();
    for w in spans.windows(2) {
        if w[0].1 > w[1].0 {
            return Err(format!("overlap: {:x?} and {:x?}", w[0], w[1]));
        }
    }
    for l in live {
        if l.block.addr() % 512 != 0 || l.block.addr() % l.align as u64 != 0 {
            return Err(format!("misaligned block {:#x} (align {})", l.block.addr(), l.align));
        }
        if l.block.block_size() < l.block.size() {
            return Err("block smaller than request".into());
        }
        if !pattern_intact(r, l) {
            return Err(format!("bytes of block {:#x} were overwritten", l.block.addr()));
        }
    }
    // Statistics equal a recomputation from the live set and the snapshot.
    let stats = r.memory_stats();
    let snap = r.snapshot();
    let live_count = live.len() as i64;
    let live_bytes: i64 = live.iter().map(|l| l.block.block_size() as i64).sum();
    let live_requested: i64 = live.iter().map(|l| l.block.size() as i64).sum();
    let check = |name: &str, got: i64, want: i64| {
        if got == want {
            Ok(())
        } else {
            Err(format!("{name}: stats say {got}, recomputed {want}"))
        }
    };
    check("allocation.all.current", stats.allocation.all.current, live_count)?;
    check("allocated_bytes.all.current", stats.allocated_bytes.all.current, live_bytes)?;
    check("requested_bytes.all.current", stats.requested_bytes.all.current, live_requested)?;
    let mut reserved = [0i64; 2];
    let (mut segments, mut inactive_split, mut inactive_split_bytes, mut active, mut active_bytes) = (0, 0, 0, 0, 0);
    let mut allocated_blocks = Vec::new();
    for seg in &snap.segments {
        segments += 1;
        reserved[(seg.segment_type == "large") as usize] += seg.total_size as i64;
        let mut cursor = seg.address;
        for b in &seg.blocks {
            if b.address != cursor {
                return Err(format!(
                    "segment {:#x}: blocks do not tile it (gap/overlap at {:#x})",
                    seg.address, cursor
                ));
            }
            cursor += b.size as u64;
            match b.state {
                BlockStateName::Inactive if seg.blocks.len() > 1 => {
                    inactive_split += 1;
                    inactive_split_bytes += b.size as i64;
                }
                BlockStateName::Inactive => {}
                BlockStateName::ActiveAllocated => {
                    active += 1;
                    active_bytes += b.size as i64;
                    allocated_blocks.push((b.address, b.size));
                }
                BlockStateName::ActivePendingFree => {
                    active += 1;
                    active_bytes += b.size as i64;
                }
            }
        }
        if cursor != seg.address + seg.total_size as u64 {
            return Err(format!(
                "segment {:#x}: blocks cover {} of {} bytes",
                seg.address,
                cursor - seg.address,
                seg.total_size
            ));
        }
    }
    allocated_blocks.sort();
    let mut mine: Vec<(u64, usize)> = live.iter().map(|l| (l.block.addr(), l.block.block_size())).collect();
    mine.sort();
    if allocated_blocks != mine {
        return Err(format!("allocated blocks in snapshot {allocated_blocks:x?} != live set {mine:x?}"));
    }
    check("segment.all.current", stats.segment.all.current, segments)?;
    check("reserved_bytes.small_pool.current", stats.reserved_bytes.small_pool.current, reserved[0])?;
    check("reserved_bytes.large_pool.current", stats.reserved_bytes.large_pool.current, reserved[1])?;
    check("reserved_bytes.all.current", stats.reserved_bytes.all.current, reserved[0] + reserved[1])?;
    check("backend bytes", (h.backend_bytes)() as i64, reserved[0] + reserved[1])?;
    check("inactive_split.all.current", stats.inactive_split.all.current, inactive_split)?;
    check("inactive_split_bytes.all.current", stats.inactive_split_bytes.all.current, inactive_split_bytes)?;
    check("active.all.current", stats.active.all.current, active)?;
    check("active_bytes.all.current", stats.active_bytes.all.current, active_bytes)?;
    for (name, stat) in [("allocated", &stats.allocated_bytes.all), ("reserved", &stats.reserved_bytes.all)] {
        if stat.peak < stat.current || stat.allocated - stat.freed != stat.current {
            return Err(format!("{name} bytes: inconsistent {stat:?}"));
        }
    }
    if let Some(limit) = h.limit {
        if stats.reserved_bytes.all.current > limit as i64 || stats.reserved_bytes.all.peak > limit as i64 {
            return Err(format!("cap {limit} exceeded: {:?}", stats.reserved_bytes.all));
        }
    }
    Ok(())
}

/// Runs one operation sequence and checks the invariants after every step.
pub fn run_sequence<R: MemoryResource>(h: &Harness<'_, R>, ops: &[Op]) -> Result<(), String> {
    let mut live: Vec<Live> = Vec::new();
    let mut next_tag = 1u8;
    let result = (|| {
        for (step, op) in ops.iter().enumerate() {
            let ctx = |e: String| format!("step {step} ({op:?}): {e}");
            match op {
                Op::Alloc { size, align_log2, stream } => {
                    let align = 1usize << align_log2;
                    let stream = h.streams[*stream % h.streams.len()];
                    match h.resource.allocate_raw(AllocRequest::new(*size).aligned(align).on_stream(stream)) {
                        Ok(block) => {
                            next_tag = next_tag.wrapping_add(1).max(1);
                            pattern_write(h.resource, &block, next_tag);
                            live.push(Live { block, tag: next_tag, align });
                        }
                        // OOM is an Err, and the allocator must stay consistent afterwards.
                        Err(e) if e.is_out_of_memory() => {
                            if e.to_string().is_empty() {
                                return Err(ctx("empty OOM message".into()));
                            }
                        }
                        Err(e) => return Err(ctx(format!("unexpected error {e}"))),
                    }
                }
                Op::Free { index } => {
                    if !live.is_empty() {
                        let l = live.swap_remove(index % live.len());
                        h.resource.deallocate_raw(l.block).map_err(|e| ctx(e.to_string()))?;
                    }
                }
                Op::RecordStream { index, stream } => {
                    if !live.is_empty() {
                        let l = &live[index % live.len()];
                        let stream = h.streams[*stream % h.streams.len()];
                        h.resource.record_stream(&l.block, stream).map_err(|e| ctx(e.to_string()))?;
                    }
                }
                Op::EmptyCache => {
                    h.resource.empty_cache().map_err(|e| ctx(e.to_string()))?;
                }
                Op::Launch { stream } => (h.launch)(h.streams[*stream % h.streams.len()]),
                Op::FinishAll => (h.finish_all)(),
            }
            verify(h, &live).map_err(ctx)?;
        }
        Ok(())
    })();
    // Free everything; afterwards nothing is allocated and empty_cache leaves no segment.
    for l in live.drain(..) {
        h.resource.deallocate_raw(l.block).map_err(|e| format!("final free: {e}"))?;
    }
    result?;
    verify(h, &[]).map_err(|e| format!("after freeing all: {e}"))?;
    h.resource.empty_cache().map_err(|e| e.to_string())?;
    let stats = h.resource.memory_stats();
    if stats.reserved_bytes.all.current != 0 || (h.backend_bytes)() != 0 {
        return Err(format!(
            "empty_cache left {} reserved, backend holds {}",
            stats.reserved_bytes.all.current,
            (h.backend_bytes)()
        ));
    }
    Ok(())
}

/// Cases per resource: 10 000 by default, `WICK_CONFORMANCE_CASES` to change.
pub fn cases() -> u32 {
    std::env::var("WICK_CONFORMANCE_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(10_000)
}

/// Runs the proptest over sequences for a resource built fresh per case by `make`.
pub fn run_suite(name: &str, streams: usize, check: impl Fn(&[Op]) -> Result<(), String>) {
    let mut runner = proptest::test_runner::TestRunner::new(proptest::test_runner::Config {
        cases: cases(),
        failure_persistence: None,
        ..Default::default()
    });
    let strategy = proptest::collection::vec(op_strategy(streams), 1..48);
    if let Err(e) = runner.run(&strategy, |ops| check(&ops).map_err(proptest::test_runner::TestCaseError::fail)) {
        panic!("{name}: conformance failed: {e}");
    }
    println!("{name}: {} random sequences passed", cases());
}
