//! Policy tests: each checks one rule of PyTorch's allocator against numbers worked out by hand.

use crate::backend::{HostBackend, SimulatedBackend};
use crate::caching::CachingAllocator;
use crate::config::{AllocatorConfig, MemoryLimit};
use crate::error::MemoryError;
use crate::resource::{AllocRequest, AllocateExt, Allocation, MemoryResource};
use crate::snapshot::BlockStateName;
use crate::stream::StreamId;

const MIB: usize = 1 << 20;

/// PyTorch's policy (classic segments): what these tests work out by hand.
fn sim(capacity: usize) -> CachingAllocator<SimulatedBackend> {
    CachingAllocator::with_config(SimulatedBackend::new(capacity), AllocatorConfig::pytorch())
        .unwrap_or_else(|e| panic!("{e}"))
}

#[test]
fn small_requests_share_a_2mib_segment_and_are_reused() {
    let a = sim(1 << 30);
    let x = a.allocate(100).unwrap();
    let y = a.allocate(1000).unwrap();
    assert_eq!(x.block_size(), 512);
    assert_eq!(y.block_size(), 1024);
    assert_eq!(y.addr(), x.addr() + 512, "split from the same segment");
    let stats = a.memory_stats();
    assert_eq!(stats.reserved_bytes.small_pool.current, 2 * MIB as i64);
    assert_eq!(stats.allocated_bytes.all.current, 1536);
    assert_eq!(stats.requested_bytes.all.current, 1100);
    let addr = x.addr();
    drop(x);
    let z = a.allocate(300).unwrap();
    assert_eq!(z.addr(), addr, "best fit reuses the freed 512 B block");
    assert_eq!(a.memory_stats().num_device_alloc, 1);
}

#[test]
fn medium_requests_get_20mib_segments_large_ones_their_own() {
    let a = sim(1 << 30);
    let m = a.allocate(3 * MIB).unwrap();
    assert_eq!(a.memory_stats().reserved_bytes.large_pool.current, 20 * MIB as i64);
    // 11 MiB fits in the 17 MiB left of that segment (best fit), so no new segment.
    let fits = a.allocate(11 * MIB + 1).unwrap();
    assert_eq!(fits.block_size(), 11 * MIB + 512);
    assert_eq!(a.memory_stats().segment.all.current, 1);
    // 21 MiB does not: rounded to 21 MiB + 512 in a 22 MiB segment, the < 1 MiB tail not split.
    let l = a.allocate(21 * MIB + 1).unwrap();
    assert_eq!(l.block_size(), 22 * MIB);
    assert_eq!(a.memory_stats().reserved_bytes.large_pool.current, (20 + 22) as i64 * MIB as i64);
    drop((m, fits, l));
}

#[test]
fn freeing_coalesces_neighbours_and_empty_cache_releases() {
    let a = sim(1 << 30);
    let blocks: Vec<_> = (0..3).map(|_| a.allocate(4 * MIB).unwrap()).collect();
    // 3 × 4 MiB from one 20 MiB segment, 8 MiB remainder free (> 1 MiB, so it was split).
    let stats = a.memory_stats();
    assert_eq!(stats.segment.all.current, 1);
    assert_eq!(stats.inactive_split_bytes.all.current, 8 * MIB as i64);
    assert_eq!(a.empty_cache().unwrap().bytes, 0, "a segment with live blocks stays");
    drop(blocks);
    let snap = a.snapshot();
    assert_eq!(snap.segments.len(), 1);
    assert_eq!(snap.segments[0].blocks.len(), 1, "all four blocks merged back into one");
    assert_eq!(a.memory_stats().inactive_split_bytes.all.current, 0);
    let released = a.empty_cache().unwrap();
    assert_eq!((released.segments, released.bytes), (1, 20 * MIB));
    assert_eq!(a.memory_stats().reserved_bytes.all.current, 0);
    assert_eq!(a.backend().bytes_in_segments(), 0, "the backend got it back");
}

#[test]
fn large_pool_does_not_split_small_remainders() {
    let a = sim(1 << 30);
    // 19.5 MiB from a 20 MiB segment leaves 0.5 MiB: not > 1 MiB, so no split (PyTorch rule).
    let x = a.allocate(19 * MIB + 512 * 1024).unwrap();
    assert_eq!(x.block_size(), 20 * MIB);
    assert_eq!(x.size(), 19 * MIB + 512 * 1024);
    let snap = a.snapshot();
    assert_eq!(snap.segments[0].blocks.len(), 1);
    assert_eq!(snap.segments[0].blocks[0].size, 20 * MIB);
    assert_eq!(a.memory_stats().allocated_bytes.all.current, 20 * MIB as i64, "whole block is allocated");
}

#[test]
fn max_split_size_keeps_oversize_blocks_for_large_requests() {
    let config = AllocatorConfig::parse("max_split_size_mb:64,expandable_segments:False").unwrap();
    let a = CachingAllocator::with_config(SimulatedBackend::new(1 << 30), config).unwrap();
    let big = a.allocate(100 * MIB).unwrap();
    assert_eq!(a.memory_stats().oversize_allocations.current, 1);
    drop(big);
    // A small request must not carve up the 100 MiB oversize block.
    let small = a.allocate(2 * MIB).unwrap();
    assert_eq!(a.memory_stats().segment.all.current, 2);
    // A request within 20 MiB of it reuses it whole; a much smaller large one does not.
    let near = a.allocate(90 * MIB).unwrap();
    assert_eq!(near.block_size(), 100 * MIB, "oversize blocks are handed out whole");
    assert_eq!(a.memory_stats().segment.all.current, 2);
    let snap = a.snapshot();
    assert!(snap.segments.iter().any(|s| s.total_size == 100 * MIB && s.blocks.len() == 1));
    drop((small, near));
}

#[test]
fn oom_flushes_the_cache_retries_then_errs_and_stays_usable() {
    let a = sim(64 * MIB);
    let x = a.allocate(30 * MIB).unwrap();
    drop(x); // cached, 30 MiB reserved
             // 40 MiB does not fit beside the cached 30 MiB: the cache is released and the request retried.
    let y = a.allocate(40 * MIB).unwrap();
    let stats = a.memory_stats();
    assert_eq!(stats.num_alloc_retries, 1);
    assert_eq!(stats.num_ooms, 0);
    assert_eq!(stats.reserved_bytes.all.current, 40 * MIB as i64);
    let err = a.allocate(30 * MIB).unwrap_err();
    let oom = err.as_out_of_memory().expect("typed OOM");
    assert_eq!(oom.requested, 30 * MIB);
    assert_eq!(oom.allocated, 40 * MIB);
    assert_eq!(oom.capacity, 64 * MIB);
    assert_eq!(oom.device_free, 24 * MIB);
    assert!(err.to_string().contains("Advice:"));
    assert_eq!(a.memory_stats().num_ooms, 1);
    // Still usable: a smaller request succeeds.
    let z = a.allocate(20 * MIB).unwrap();
    drop((y, z));
}

#[test]
fn hard_cap_is_enforced_before_any_segment() {
    let config = AllocatorConfig { limit: Some(MemoryLimit::Bytes(32 * MIB)), ..AllocatorConfig::pytorch() };
    let a = CachingAllocator::with_config(SimulatedBackend::new(1 << 30), config).unwrap();
    let x = a.allocate(20 * MIB).unwrap();
    let err = a.allocate(20 * MIB).unwrap_err();
    let oom = err.as_out_of_memory().unwrap();
    assert!(oom.limited_by_cap);
    assert!(err.to_string().contains("raise the limit"), "{err}");
    assert_eq!(a.backend().bytes_in_segments(), 20 * MIB, "the device was never asked");
    drop(x);
    a.set_memory_limit(Some(MemoryLimit::Fraction(0.5))).unwrap();
    assert_eq!(a.memory_limit(), Some(512 * MIB));
    assert!(a.set_memory_limit(Some(MemoryLimit::Fraction(1.5))).is_err());
}

#[test]
fn lowering_the_cap_releases_cache() {
    let a = sim(1 << 30);
    drop(a.allocate(100 * MIB).unwrap());
    assert_eq!(a.memory_stats().reserved_bytes.all.current, 100 * MIB as i64);
    a.set_memory_limit(Some(MemoryLimit::Bytes(50 * MIB))).unwrap();
    assert_eq!(a.memory_stats().reserved_bytes.all.current, 0);
}

#[test]
fn bad_requests_are_clear_errors() {
    let a = sim(1 << 30);
    assert!(matches!(a.allocate(0), Err(MemoryError::ZeroSize)));
    assert!(matches!(a.allocate(usize::MAX), Err(MemoryError::TooLarge { .. })));
    assert!(matches!(a.allocate((1 << 30) + 1), Err(MemoryError::TooLarge { .. })));
    // Rounding must not overflow just below usize::MAX either.
    let huge = CachingAllocator::new(SimulatedBackend::new(usize::MAX));
    assert!(matches!(huge.allocate(usize::MAX - 3), Err(MemoryError::TooLarge { .. })));
    assert!(matches!(a.allocate_with(AllocRequest::new(64).aligned(3)), Err(MemoryError::InvalidAlignment(3))));
    assert!(matches!(
        a.allocate_with(AllocRequest::new(64).aligned(4096)),
        Err(MemoryError::UnsupportedAlignment { requested: 4096, supported: 512 })
    ));
    let ok = a.allocate_with(AllocRequest::new(64).aligned(256)).unwrap();
    assert_eq!(ok.addr() % 256, 0);
    assert!(matches!(a.allocate_with(AllocRequest::new(64).on_stream(StreamId(9))), Err(MemoryError::Backend(_))));
    let stats = a.memory_stats();
    assert_eq!(stats.allocation.all.current, 1, "failed requests leave no trace");
}

#[test]
fn foreign_and_stale_blocks_are_refused() {
    let a = sim(1 << 30);
    let b = sim(1 << 30);
    let raw = a.allocate(4096).unwrap().into_raw();
    let err = b.deallocate_raw(raw).unwrap_err();
    assert!(matches!(err, MemoryError::ForeignBlock { .. }), "{err}");
    assert_eq!(a.memory_stats().allocation.all.current, 1, "still accounted where it came from");
}

#[test]
fn stream_ordered_reuse_waits_for_the_freeing_stream() {
    let backend = SimulatedBackend::new(1 << 30);
    let s1 = backend.streams().create_stream();
    let a = CachingAllocator::new(backend);
    let x = a.allocate_with(AllocRequest::new(4 * MIB)).unwrap();
    let x_addr = x.addr();
    a.backend().streams().launch(StreamId::DEFAULT).unwrap(); // a kernel still uses x
    drop(x);
    // Same stream: reused at once.
    let again = a.allocate(4 * MIB).unwrap();
    assert_eq!(again.addr(), x_addr);
    drop(again);
    // Another stream: not before stream 0's work is done.
    let other = a.allocate_with(AllocRequest::new(4 * MIB).on_stream(s1)).unwrap();
    assert!(other.addr() < x_addr || other.addr() >= x_addr + 20 * MIB as u64, "must not overlap the cached segment");
    drop(other);
    a.backend().streams().finish(StreamId::DEFAULT).unwrap();
    let third = a.allocate_with(AllocRequest::new(16 * MIB).on_stream(s1)).unwrap();
    let segs = a.memory_stats().segment.all.current;
    // Once the event completed, stream 1 reuses stream 0's cached 20 MiB segment or its own.
    assert_eq!(segs, 2, "no new segment needed");
    drop(third);
}

#[test]
fn record_stream_delays_reuse_until_that_stream_finishes() {
    let backend = SimulatedBackend::new(1 << 30);
    let s1 = backend.streams().create_stream();
    let a = CachingAllocator::new(backend);
    let x = a.allocate(1000).unwrap();
    let addr = x.addr();
    a.backend().streams().launch(s1).unwrap();
    x.record_stream(s1).unwrap();
    drop(x);
    let snap = a.snapshot();
    assert!(snap.blocks().any(|b| b.address == addr && b.state == BlockStateName::ActivePendingFree));
    assert_eq!(a.memory_stats().active.all.current, 1);
    let y = a.allocate(1000).unwrap();
    assert_ne!(y.addr(), addr, "not reused while stream 1 may still read it");
    a.backend().streams().finish(s1).unwrap();
    drop(y);
    let z = a.allocate(1000).unwrap();
    assert_eq!(a.memory_stats().active.all.current, 1);
    assert!(z.addr() == addr || a.snapshot().blocks().all(|b| b.state != BlockStateName::ActivePendingFree));
    drop(z);
    assert_eq!(a.backend().streams().live_events(), 0, "events are destroyed");
}

#[test]
fn garbage_collection_frees_old_cached_blocks_above_threshold() {
    let config =
        AllocatorConfig::parse("garbage_collection_threshold:0.5,memory_limit_mb:100,expandable_segments:False")
            .unwrap();
    let a = CachingAllocator::with_config(SimulatedBackend::new(1 << 30), config).unwrap();
    let old = a.allocate(30 * MIB).unwrap();
    let young = a.allocate(30 * MIB).unwrap();
    drop(old);
    drop(young);
    // Reserved 60 MiB > 50 MiB threshold: the next miss reclaims the oldest cached block first.
    let x = a.allocate(40 * MIB).unwrap();
    let stats = a.memory_stats();
    assert_eq!(stats.num_alloc_retries, 0, "GC, not the OOM path, made room");
    assert!(stats.reserved_bytes.all.current <= 100 * MIB as i64);
    assert_eq!(stats.num_device_free, 1);
    drop(x);
}

#[test]
fn history_records_timeline() {
    let a = sim(1 << 30);
    a.record_history(100);
    drop(a.allocate(5 * MIB).unwrap());
    let h = a.history();
    use crate::caching::Action::*;
    let actions: Vec<_> = h.iter().map(|e| e.action).collect();
    assert_eq!(actions, vec![SegmentAlloc, Alloc, FreeRequested, FreeCompleted]);
    assert_eq!(h[1].allocated, 5 * MIB as i64);
    assert_eq!(h[1].reserved, 20 * MIB as i64);
    assert_eq!(h[3].allocated, 0);
}

#[test]
fn host_memory_is_real_and_writable() {
    let a = CachingAllocator::new(HostBackend::with_capacity(1 << 30));
    let mut x = a.allocate(1 << 16).unwrap();
    x.as_mut_slice().unwrap().fill(7);
    assert!(x.as_mut_slice().unwrap().iter().all(|&b| b == 7));
    // Simulated memory has no bytes: `as_mut_slice` does not even compile for it (a doc test on
    // `Allocation::as_mut_slice` checks that).
}

#[test]
fn a_block_of_another_allocator_gets_no_slice() {
    // `from_raw` over the wrong resource, then `as_mut_slice`: before, a slice over memory the
    // resource did not own (and that its owner would hand out again).
    let a = CachingAllocator::new(HostBackend::with_capacity(1 << 30));
    let b = CachingAllocator::new(HostBackend::with_capacity(1 << 30));
    let raw = b.allocate_raw(AllocRequest::new(4096)).unwrap();
    let mut wrong = Allocation::from_raw(&a, raw);
    assert!(matches!(wrong.as_mut_slice(), Err(MemoryError::ForeignBlock { .. })));
    let raw = wrong.into_raw();
    b.deallocate_raw(raw).unwrap();
}

#[test]
fn a_handle_from_a_dropped_allocator_cannot_free_a_live_block_of_a_new_one() {
    // The identity was the address of a boxed byte, which the next allocator usually reuses;
    // slot 0, generation 0 then matched a live block of the new allocator.
    let old = CachingAllocator::new(SimulatedBackend::new(1 << 30));
    let stale = old.allocate_raw(AllocRequest::new(4096)).unwrap();
    drop(old); // the handle outlives its allocator
               // Many new allocators, each with a live block in slot 0: with address identities one of them
               // usually sits where the old one was, and took the stale handle as its own.
    let news: Vec<_> = (0..256).map(|_| CachingAllocator::new(SimulatedBackend::new(1 << 30))).collect();
    let live: Vec<_> = news.iter().map(|a| a.allocate(4096).unwrap()).collect();
    for a in &news {
        let copy = crate::resource::RawBlock {
            owner: stale.owner,
            slot: stale.slot,
            generation: stale.generation,
            addr: stale.addr,
            block_size: stale.block_size,
            requested: stale.requested,
            stream: stale.stream,
        };
        assert!(matches!(a.deallocate_raw(copy), Err(MemoryError::ForeignBlock { .. })));
        assert_eq!(a.memory_stats().allocation.all.current, 1, "the live block is still allocated");
    }
    drop(live);
}

#[test]
fn summary_and_snapshot_agree_with_stats() {
    let a = sim(1 << 30);
    let _x = a.allocate(3 * MIB).unwrap();
    let text = a.memory_summary();
    assert!(text.contains("3.00 MiB") && text.contains("20.00 MiB"), "{text}");
    let snap = a.snapshot();
    assert_eq!(snap.reserved_bytes(), 20 * MIB);
    assert_eq!(snap.allocated_bytes(), 3 * MIB);
    let round = crate::snapshot::Snapshot::from_json(&snap.to_json()).unwrap();
    assert_eq!(round, snap);
}

#[test]
fn expandable_segments_grow_at_the_tail_and_trim_on_release() {
    let config = AllocatorConfig::parse("expandable_segments:True").unwrap();
    let a = CachingAllocator::with_config(SimulatedBackend::new(1 << 30), config).unwrap();
    let x = a.allocate(30 * MIB).unwrap();
    assert_eq!(a.memory_stats().reserved_bytes.all.current, 40 * MIB as i64, "two 20 MiB pages mapped");
    let y = a.allocate(8 * MIB).unwrap();
    assert_eq!(y.addr(), x.addr() + 30 * MIB as u64, "served from the mapped tail");
    assert_eq!(y.block_size(), 8 * MIB, "split exactly: expandable blocks split like small ones");
    // 15 MiB does not fit the 2 MiB tail: one more page is mapped and merged into it.
    let z = a.allocate(15 * MIB).unwrap();
    assert_eq!(z.addr(), y.addr() + 8 * MIB as u64, "contiguous with the old tail");
    let stats = a.memory_stats();
    assert_eq!(stats.reserved_bytes.all.current, 60 * MIB as i64);
    assert_eq!(stats.segment.all.current, 1, "one reservation per stream and pool");
    drop(z);
    // Releasing unmaps the whole free pages at the end, keeping the page y still touches.
    let released = a.empty_cache().unwrap();
    assert_eq!(released.bytes, 20 * MIB);
    assert_eq!(a.memory_stats().reserved_bytes.all.current, 40 * MIB as i64);
    assert_eq!(a.backend().bytes_in_segments(), 40 * MIB);
    drop((x, y));
    a.empty_cache().unwrap();
    let stats = a.memory_stats();
    assert_eq!((stats.reserved_bytes.all.current, stats.segment.all.current), (0, 0));
    assert_eq!(a.backend().bytes_in_segments(), 0);
}

#[test]
fn expandable_segments_respect_the_cap() {
    let config = AllocatorConfig::parse("expandable_segments:True,memory_limit_mb:50").unwrap();
    let a = CachingAllocator::with_config(SimulatedBackend::new(1 << 30), config).unwrap();
    let x = a.allocate(30 * MIB).unwrap();
    let err = a.allocate(30 * MIB).unwrap_err();
    assert!(err.as_out_of_memory().is_some_and(|o| o.limited_by_cap), "{err}");
    assert!(a.memory_stats().reserved_bytes.all.peak <= 50 * MIB as i64);
    drop(x);
    assert!(a.allocate(45 * MIB).is_err(), "45 MiB needs 60 MiB of 20 MiB pages, over the cap");
    assert!(a.allocate(39 * MIB).is_ok());
}

#[test]
fn expandable_segments_on_a_device_the_size_of_the_address_space_never_overlap() {
    // `wick replay --capacity-gib 1e11 --config expandable_segments:True`: the reservation's
    // span rounded past u64::MAX and wrapped to 0, so every stream's segment began at the same
    // address and blocks overlapped (release builds).
    let config = AllocatorConfig { expandable_segments: true, ..AllocatorConfig::default() };
    let a = CachingAllocator::with_config(SimulatedBackend::new(usize::MAX), config).unwrap();
    let mut spans: Vec<(u64, u64)> = Vec::new();
    let mut live = Vec::new();
    for (i, size) in [64 * MIB, 3 * MIB, 100, 700 * MIB, 5000].into_iter().enumerate() {
        match a.allocate_with(AllocRequest::new(size).on_stream(StreamId(i as u64 % 2))) {
            Ok(block) => {
                spans.push((block.addr(), block.addr() + block.block_size() as u64));
                live.push(block);
            }
            Err(e) => assert!(e.is_out_of_memory() || matches!(e, MemoryError::Backend(_)), "{e}"),
        }
    }
    spans.sort();
    assert!(spans.windows(2).all(|w| w[0].1 <= w[1].0), "overlapping blocks: {spans:x?}");
}

#[test]
fn the_reserved_stream_id_is_refused() {
    // u64::MAX tagged a block "shared by every stream": a request on it was served from, and
    // freed into, the shared tag.
    let backend = HostBackend::with_capacity(1 << 30);
    let reserved = StreamId(u64::MAX);
    let a = CachingAllocator::new(backend);
    assert!(matches!(a.allocate_with(AllocRequest::new(64).on_stream(reserved)), Err(MemoryError::UnknownStream(_))));
    let x = a.allocate(64).unwrap();
    assert!(matches!(x.record_stream(reserved), Err(MemoryError::UnknownStream(_))));
    // A stream the backend does not know is refused by record_stream too (it was accepted).
    assert!(x.record_stream(StreamId(77)).is_err());
}
