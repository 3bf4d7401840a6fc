//! What the allocation history costs while it is off (PyTorch's `_record_memory_history` is off
//! by default too): the check every heap allocation and free makes, and a label push and pop
//! (steps, trainer phases and zoo layers push one each). Each figure is the median of 11 runs of
//! 10 million calls; multiply by a step's calls (BENCHMARKS.md, issue 16) for the step's cost.
//!
//! `cargo bench -p wick-memory --bench history_off`

use std::hint::black_box;
use std::time::Instant;

use wick_memory::{heap_history_recording, push_label, record_heap_event, HeapAction};

const CALLS: usize = 10_000_000;

fn median_ns(mut f: impl FnMut()) -> f64 {
    let mut runs: Vec<f64> = (0..11)
        .map(|_| {
            let start = Instant::now();
            for _ in 0..CALLS {
                f();
            }
            start.elapsed().as_secs_f64() * 1e9 / CALLS as f64
        })
        .collect();
    runs.sort_by(f64::total_cmp);
    runs[runs.len() / 2]
}

fn main() {
    assert!(!heap_history_recording(), "the history must be off for this benchmark");
    let block = vec![0u8; 4096];
    let empty = median_ns(|| {
        black_box(&block);
    });
    let check = median_ns(|| record_heap_event(HeapAction::Alloc, black_box(block.as_ptr()), black_box(4096)));
    // A label already interned (every step after the first pushes the same names).
    drop(push_label("layer3.1"));
    let label = median_ns(|| drop(black_box(push_label(black_box("layer3.1")))));
    println!("empty loop: {empty:.2} ns per iteration");
    println!("recording off, per heap allocation or free: {check:.2} ns");
    println!("label push + pop (an interned name): {label:.2} ns");
}
