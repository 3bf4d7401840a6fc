//! Allocator benchmarks, each measured side by side with its reference in one run (samples
//! interleaved, medians compared), printed as a Markdown table for BENCHMARKS.md.
//!
//! `cargo bench -p wick-trace --bench memory` (it lives with the trace machinery it replays).

use std::alloc::{alloc, dealloc, Layout};
use std::hint::black_box;
use std::time::Instant;

use wick_memory::format_bytes;
use wick_memory::{AllocRequest, AllocatorConfig, CachingAllocator, HostBackend, MemoryResource};
use wick_trace::{replay_simulated, workloads};

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

/// Runs `a` and `b` alternately `samples` times; returns their median times per iteration (ns).
fn side_by_side(samples: usize, iters: usize, mut a: impl FnMut(), mut b: impl FnMut()) -> (f64, f64) {
    let (mut ta, mut tb) = (Vec::new(), Vec::new());
    for _ in 0..samples {
        let t = Instant::now();
        for _ in 0..iters {
            a();
        }
        ta.push(t.elapsed().as_nanos() as f64 / iters as f64);
        let t = Instant::now();
        for _ in 0..iters {
            b();
        }
        tb.push(t.elapsed().as_nanos() as f64 / iters as f64);
    }
    (median(ta), median(tb))
}

fn main() {
    println!("| benchmark | wick | reference | ratio (reference / wick) |");
    println!("|---|---|---|---|");

    // 1. A cached alloc+free pair: the steady state of a training loop.
    let host = CachingAllocator::new(HostBackend::with_capacity(8 << 30));
    let warm = host.allocate_raw(AllocRequest::new(4096)).expect("warm-up allocation");
    host.deallocate_raw(warm).expect("warm-up free");
    let layout = Layout::from_size_align(4096, 512).expect("layout");
    let (wick_ns, sys_ns) = side_by_side(
        41,
        200_000,
        || {
            let b = host.allocate_raw(AllocRequest::new(4096)).expect("cached alloc");
            host.deallocate_raw(black_box(b)).expect("free");
        },
        || {
            // SAFETY: non-zero layout; freed with the same layout.
            unsafe {
                let p = alloc(layout);
                dealloc(black_box(p), layout);
            }
        },
    );
    println!(
        "| cached 4 KiB alloc+free pair (median ns) | {wick_ns:.1} ns | {sys_ns:.1} ns (std::alloc) | {:.2}x |",
        sys_ns / wick_ns
    );

    // 2. 64 MiB alloc + first touch of every page + free, as an activation buffer would be used.
    const BIG: usize = 64 << 20;
    let touch = |p: *mut u8| {
        for off in (0..BIG).step_by(4096) {
            // SAFETY: p points to BIG writable bytes.
            unsafe { p.add(off).write_volatile(1) };
        }
    };
    let big_layout = Layout::from_size_align(BIG, 4096).expect("layout");
    let (wick_big, sys_big) = side_by_side(
        21,
        5,
        || {
            let b = host.allocate_raw(AllocRequest::new(BIG)).expect("64 MiB");
            touch(b.addr() as *mut u8);
            host.deallocate_raw(b).expect("free");
        },
        || {
            // SAFETY: non-zero layout; freed with the same layout.
            unsafe {
                let p = alloc(big_layout);
                touch(p);
                dealloc(p, big_layout);
            }
        },
    );
    println!(
        "| 64 MiB alloc + first touch + free (median) | {:.1} µs | {:.1} µs (std::alloc) | {:.1}x |",
        wick_big / 1e3,
        sys_big / 1e3,
        sys_big / wick_big
    );
    println!();

    // 3. Fragmentation on the trace suite (simulated 80 GiB device), PyTorch's default policy and
    //    with expandable segments.
    println!("| trace | policy | ops | peak live (requested) | peak allocated | peak reserved | fragmentation (reserved/allocated) | retries | OOMs | replay ops/s |");
    println!("|---|---|---|---|---|---|---|---|---|---|");
    for trace in workloads::standard_suite() {
        for policy in ["", "expandable_segments:True"] {
            let config = AllocatorConfig::parse(policy).expect("policy");
            let r = replay_simulated(&trace, 80 << 30, config).expect("replay");
            println!(
                "| {} | {} | {} | {} | {} | {} | {:.3} | {} | {} | {:.0} |",
                r.name,
                if policy.is_empty() { "default" } else { policy },
                r.ops,
                format_bytes(r.peak_requested as u64),
                format_bytes(r.peak_allocated as u64),
                format_bytes(r.peak_reserved as u64),
                r.fragmentation,
                r.retries,
                r.ooms,
                r.ops_per_sec
            );
        }
    }
}
