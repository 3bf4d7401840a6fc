//! The engine's CPU figures with wick's caching heap as the global allocator: exact heap bytes
//! and peaks from the heap itself, and `empty_cache` returning its unused segments.

use wick::{Engine, FigureSource};
use wick_memory::CachingHeap;

#[global_allocator]
static HEAP: CachingHeap = CachingHeap::new();

#[test]
fn cpu_figures_come_from_the_caching_heap() {
    let engine = Engine::cpu();
    let buffer = vec![1u8; 16 << 20];
    let allocated = engine.allocated();
    assert_eq!(allocated.source, FigureSource::CachingHeap);
    assert!(allocated.bytes >= 16 << 20, "the live buffer is counted: {allocated:?}");
    engine.reset_peak_stats();
    let second = vec![2u8; 8 << 20];
    let peak = engine.peak_allocated().unwrap_or_else(|| panic!("an exact source has a peak"));
    assert_eq!(peak.source, FigureSource::CachingHeap);
    assert!(peak.bytes >= (16 << 20) + (8 << 20), "both buffers are under the peak: {peak:?}");
    drop((buffer, second));
    // The freed buffers stay cached until the engine empties the cache.
    let reserved = HEAP.memory_stats().reserved_bytes.all.current;
    assert!(reserved >= 24 << 20, "cached after the drop: {reserved}");
    engine.empty_cache().unwrap_or_else(|e| panic!("{e}"));
    let after = HEAP.memory_stats().reserved_bytes.all.current;
    assert!(after <= reserved - (24 << 20), "the unused segments went back: {reserved} → {after}");
}
