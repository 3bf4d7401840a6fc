//! The allocator on its own, on the CPU: drives wick's caching allocator through a realistic
//! workload on real host memory, then shows what a user sees — the memory summary, the
//! fragmentation figure, an out-of-memory refused as an error (the program carries on), and
//! GPU-scale traces replayed on a simulated 80 GiB device.
//!
//! `cargo run -p wick-examples --bin allocator-workload`

use anyhow::Result;
use wick_memory::{AllocateExt, AllocatorConfig, CachingAllocator, HostBackend, MemoryLimit, MemoryResource, TraceOp};
use wick_trace::replay_simulated;
use wick_trace::workloads::{self, TransformerShape};

fn run() -> Result<()> {
    // A small decoder (4 layers, 256 wide, batch 4, seq 128) trained for 3 steps on host memory,
    // with a 1 GiB cap. Every block is written to, as a real kernel would.
    let shape =
        TransformerShape { layers: 4, hidden: 256, heads: 4, vocab: 8192, seq: 128, batch: 4, act_bytes: 4, steps: 3 };
    let trace = workloads::transformer_training(shape);
    let config = AllocatorConfig { limit: Some(MemoryLimit::Bytes(1 << 30)), ..AllocatorConfig::from_env()? };
    let allocator = CachingAllocator::with_config(HostBackend::new(), config)?;
    allocator.record_history(1 << 16);
    let mut live = std::collections::HashMap::new();
    for op in &trace.ops {
        match op {
            TraceOp::Alloc { id, size, .. } => {
                let mut block = allocator.allocate(*size)?;
                block.as_mut_slice()?.fill(1);
                live.insert(*id, block);
            }
            TraceOp::Free { id } => {
                live.remove(id);
            }
        }
    }
    println!("Trained a 4-layer decoder for 3 steps ({} allocator operations) on host memory.\n", trace.ops.len());
    println!("{}", allocator.memory_summary());
    let report =
        wick::HistoryReport::from_history("allocator-workload: 3 training steps on host:0", &allocator.history());
    let html = wick::files::output_dir()?.join("allocator-workload.html");
    report.write(&html)?;
    println!(
        "{}\nHTML memory report (timeline, peak, live blocks at the peak): {}\n",
        report.to_text(),
        html.display()
    );

    let released = allocator.empty_cache()?;
    println!(
        "empty_cache returned {} segment(s), {} bytes; reserved now {} bytes.\n",
        released.segments,
        released.bytes,
        allocator.memory_stats().reserved_bytes.all.current
    );

    // A request that cannot fit under the cap is an error with advice, not an abort.
    match allocator.allocate(2 << 30) {
        Ok(_) => println!("unexpected: a 2 GiB request fit under a 1 GiB cap"),
        Err(e) => println!("Refused as expected, and the program carries on:\n  {e}\n"),
    }
    // GPU-scale traces on a simulated 80 GiB device.
    println!("GPU-scale traces on a simulated 80 GiB device (WICK_ALLOC_CONF, else PYTORCH_CUDA_ALLOC_CONF, else wick's defaults):");
    println!("{:<20} {:>12} {:>12} {:>14}", "trace", "peak alloc", "peak reserv", "fragmentation");
    for trace in workloads::standard_suite() {
        let r = replay_simulated(&trace, 80 << 30, AllocatorConfig::from_env()?)?;
        println!(
            "{:<20} {:>12} {:>12} {:>14.3}",
            r.name,
            wick_memory::format_bytes(r.peak_allocated as u64),
            wick_memory::format_bytes(r.peak_reserved as u64),
            r.fragmentation
        );
    }
    Ok(())
}

wick::main!(run);
