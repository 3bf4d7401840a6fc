//! The engine's CPU figures with wick's caching heap as the global allocator: exact heap bytes
//! and peaks from the heap itself, `empty_cache` returning its unused segments, and the engine's
//! PyTorch-named statistics being the heap's own.

use wick::{Engine, FigureSource};

wick::heap!(caching);

#[test]
fn cpu_figures_come_from_the_caching_heap() {
    let engine = Engine::cpu();
    let buffer = vec![1u8; 16 << 20];
    let allocated = engine.allocated();
    assert_eq!(allocated.source, FigureSource::CachingHeap);
    assert!(allocated.bytes >= 16 << 20, "the live buffer is counted: {allocated:?}");
    engine.reset_peak_memory_stats();
    let second = vec![2u8; 8 << 20];
    let peak = engine.peak_allocated().unwrap_or_else(|| panic!("an exact source has a peak"));
    assert_eq!(peak.source, FigureSource::CachingHeap);
    assert!(peak.bytes >= (16 << 20) + (8 << 20), "both buffers are under the peak: {peak:?}");
    drop((buffer, second));
    // The freed buffers stay cached until the engine empties the cache.
    let reserved = WICK_HEAP.memory_stats().reserved_bytes.all.current;
    assert!(reserved >= 24 << 20, "cached after the drop: {reserved}");
    engine.empty_cache().unwrap_or_else(|e| panic!("{e}"));
    let after = WICK_HEAP.memory_stats().reserved_bytes.all.current;
    assert!(after <= reserved - (24 << 20), "the unused segments went back: {reserved} → {after}");
}

#[test]
fn engine_statistics_are_the_caching_heaps_own() {
    let engine = Engine::cpu();
    let buffer = vec![3u8; 12 << 20];
    let ours = engine.memory_stats();
    let heap = WICK_HEAP.memory_stats().to_map();
    // Every key of the cache is there, with the same values for what did not move in between.
    for key in heap.keys() {
        assert!(ours.contains_key(key), "{key} missing");
    }
    for key in ["reserved_bytes.all.current", "segment.all.current", "allocated_bytes.large_pool.peak"] {
        assert_eq!(ours[key], heap[key], "{key}");
    }
    assert!(ours["allocated_bytes.all.current"] >= 12 << 20, "the live buffer: {ours:?}");
    let reserved = engine.max_memory_reserved().expect("the cache reserves segments");
    assert!(reserved >= 12 << 20 && reserved as i64 >= heap["reserved_bytes.all.current"]);
    assert_eq!(engine.max_memory_allocated(), usize::try_from(WICK_HEAP.memory_stats().allocated_bytes.all.peak).ok());
    let summary = engine.memory_summary();
    let reserved_row = summary.lines().find(|l| l.starts_with("| Reserved memory")).expect("the PyTorch layout");
    assert!(!reserved_row.contains(" - "), "the cache knows its reservation: {reserved_row}");
    assert!(summary.contains("caching heap"), "the figures keep their sources: {summary}");
    drop(buffer);
}
