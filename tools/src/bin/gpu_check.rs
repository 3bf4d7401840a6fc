//! GPU checks for `scripts/gpu-check.sh` (feature `cuda`). Prints one table row per check; exits
//! non-zero if any check fails. Every figure is measured in this run, side by side.

use std::time::Instant;

use candle_core::{CudaDevice, DType, Device, Tensor};
use wick::cuda::GovernedCuda;
use wick::DriverPool;
use wick_memory::open_device;
use wick_memory::{
    AllocRequest, Backend, CachingAllocator, CudaBackend, MemoryError, MemoryResource, RawBlock, StreamId, TraceOp,
};
use wick_trace::Trace;

const MIB: usize = 1 << 20;

fn row(name: &str, ok: bool, detail: String) -> bool {
    // candle's errors carry a backtrace after the first line; the table keeps the message.
    let detail = detail.lines().next().unwrap_or_default().to_string();
    println!("| {name} | {} | {detail} |", if ok { "PASS" } else { "FAIL" });
    ok
}

fn sync(device: &Device) -> candle_core::Result<()> {
    device.synchronize()
}

/// Many candle temporaries per step, then a synchronise (the end of a training step).
fn alloc_heavy_loop(device: &Device, steps: usize) -> candle_core::Result<f64> {
    let sizes: Vec<usize> = (0..32).map(|i| (1 + (i * 7) % 32) * MIB / 4).collect();
    let start = Instant::now();
    for _ in 0..steps {
        let mut temps = Vec::with_capacity(sizes.len());
        for &n in &sizes {
            temps.push(Tensor::zeros(n, DType::F32, device)?);
        }
        drop(temps);
        sync(device)?;
    }
    Ok(start.elapsed().as_secs_f64() / steps as f64)
}

fn replay_wick(trace: &Trace, expandable: bool) -> Result<(f64, usize, usize), MemoryError> {
    let backend = CudaBackend::new(0)?;
    let s1 = backend.create_stream()?;
    let config = wick_memory::AllocatorConfig { expandable_segments: expandable, ..Default::default() };
    let a = CachingAllocator::with_config(backend, config)?;
    let stream = |s: u64| if s == 0 { StreamId::DEFAULT } else { s1 };
    // Warm-up pass fills the cache, as a training loop's first step does.
    let mut timed = 0.0;
    for pass in 0..2 {
        let mut live: std::collections::HashMap<u64, RawBlock> = std::collections::HashMap::new();
        let start = Instant::now();
        for op in &trace.ops {
            match op {
                TraceOp::Alloc { id, size, stream: s } => {
                    live.insert(*id, a.allocate_raw(AllocRequest::new(*size).on_stream(stream(*s)))?);
                }
                TraceOp::Free { id } => {
                    if let Some(b) = live.remove(id) {
                        a.deallocate_raw(b)?;
                    }
                }
            }
        }
        a.backend().synchronize()?;
        if pass == 1 {
            timed = start.elapsed().as_secs_f64();
        }
    }
    let stats = a.memory_stats();
    Ok((timed, stats.allocated_bytes.all.peak as usize, stats.reserved_bytes.all.peak as usize))
}

fn replay_raw_async(trace: &Trace) -> Result<f64, MemoryError> {
    use cudarc::driver::result;
    let ctx = open_device(0)?;
    ctx.bind_to_thread().map_err(|e| MemoryError::Backend(wick_memory::BackendError::Other(e.to_string())))?;
    let s0 = ctx.default_stream();
    let s1 = ctx.new_stream().map_err(|e| MemoryError::Backend(wick_memory::BackendError::Other(e.to_string())))?;
    let mut timed = 0.0;
    for pass in 0..2 {
        let mut live = std::collections::HashMap::new();
        let start = Instant::now();
        for op in &trace.ops {
            match op {
                TraceOp::Alloc { id, size, stream } => {
                    let s = if *stream == 0 { s0.cu_stream() } else { s1.cu_stream() };
                    // SAFETY: a device allocation on a live stream, freed below on the same stream.
                    let ptr = unsafe { result::malloc_async(s, *size) }
                        .map_err(|e| MemoryError::Backend(wick_memory::BackendError::Other(e.to_string())))?;
                    live.insert(*id, (ptr, s));
                }
                TraceOp::Free { id } => {
                    if let Some((ptr, s)) = live.remove(id) {
                        // SAFETY: freeing an allocation made above, once.
                        unsafe { result::free_async(ptr, s) }
                            .map_err(|e| MemoryError::Backend(wick_memory::BackendError::Other(e.to_string())))?;
                    }
                }
            }
        }
        ctx.synchronize().map_err(|e| MemoryError::Backend(wick_memory::BackendError::Other(e.to_string())))?;
        if pass == 1 {
            timed = start.elapsed().as_secs_f64();
        }
    }
    Ok(timed)
}

/// The CUDA allocation history (CUPTI callbacks on the driver's allocation calls): candle tensors
/// made under labels must appear with their sizes and labels, the freed one freed, and the
/// history's live bytes must end where the pool's used bytes end (within the pool's 2 MiB
/// granularity).
fn cuda_history(engine: &wick::Engine) -> bool {
    const NAME: &str = "CUDA memory history (CUPTI): labelled candle tensors, live bytes vs pool";
    if let Err(e) = engine.record_memory_history(Some(10_000)) {
        return row(NAME, false, e.to_string());
    }
    let made = (|| -> candle_core::Result<(Tensor, Tensor)> {
        let _outer = engine.label("gpu-check");
        let a = {
            let _l = engine.label("a");
            Tensor::zeros((1024, 1024), DType::F32, engine.device())?
        };
        let b = {
            let _l = engine.label("b");
            Tensor::ones((2048, 1024), DType::F32, engine.device())?
        };
        let c = {
            let _l = engine.label("c");
            a.matmul(&a)?
        };
        drop(b);
        engine.device().synchronize()?;
        Ok((a, c))
    })();
    let used = engine.allocated().bytes;
    let history = engine.memory_history();
    let _ = engine.record_memory_history(None);
    let (a, c) = match made {
        Ok(t) => t,
        Err(e) => return row(NAME, false, e.to_string()),
    };
    let lifetimes = history.heap.lifetimes();
    let find = |label: &str| lifetimes.iter().find(|l| history.label_text(l.label) == label).copied();
    let (la, lb, lc) = (find("gpu-check/a"), find("gpu-check/b"), find("gpu-check/c"));
    let sizes_ok = la.is_some_and(|l| l.size == 4 * MIB && l.freed.is_none())
        && lb.is_some_and(|l| l.size == 8 * MIB && l.freed.is_some())
        && lc.is_some_and(|l| l.size == 4 * MIB && l.freed.is_none());
    let live = history.heap.live_bytes().last().copied().unwrap_or(0);
    let out = std::env::var_os("OUT").map(std::path::PathBuf::from).unwrap_or_else(std::env::temp_dir);
    let _ = history.write_memory_viz(&out.join("gpu-memory-history.pickle"));
    let _ = std::fs::write(out.join("gpu-memory-history.html"), history.to_html("gpu-check on cuda:0"));
    drop((a, c));
    row(
        NAME,
        // The pool rounds blocks up to its granularity; sub-KiB buffers are below the threshold.
        sizes_ok && live.abs_diff(used) <= 2 * MIB,
        format!(
            "{} events; a {:?}, b {:?}, c {:?}; history live {live} B, pool used {used} B",
            history.heap.events.len(),
            la.map(|l| (l.size, l.freed.is_some())),
            lb.map(|l| (l.size, l.freed.is_some())),
            lc.map(|l| (l.size, l.freed.is_some()))
        ),
    )
}

fn run() {
    let mut all_ok = true;
    println!("| check | result | figures |");
    println!("|---|---|---|");

    // 1. candle allocations come from wick's pool, and the cap is enforced.
    match GovernedCuda::new(0, Some(8 << 30)) {
        Err(e) => all_ok &= row("open governed device", false, e.to_string()),
        Ok(g) => {
            let pool = g.pool();
            let used0 = pool.used();
            let t = g.run(256 * MIB, |d| Tensor::zeros((64, 1024, 1024), DType::F32, d));
            let _ = sync(g.device());
            let used1 = pool.used();
            drop(t);
            let _ = sync(g.device());
            let used2 = pool.used();
            all_ok &= row(
                "candle tensor drawn from wick pool",
                used1 >= used0 + 256 * MIB && used2 == used0,
                format!("USED_MEM_CURRENT {used0} -> {used1} (tensor alive) -> {used2} (dropped)"),
            );
            let big = g.run(10 << 30, |d| Tensor::zeros(10usize << 28, DType::F32, d));
            let refused = matches!(&big, Err(MemoryError::OutOfMemory(_)));
            let message = big.err().map(|e| e.to_string()).unwrap_or_default();
            let small = g.run(1 << 30, |d| Tensor::zeros(1usize << 28, DType::F32, d));
            all_ok &= row(
                "cap 8 GiB: 10 GiB candle op -> Err(OutOfMemory), then 1 GiB ok",
                refused && small.is_ok(),
                message.chars().take(300).collect(),
            );
            drop(small);
            println!("\n{}\n", pool.memory_summary().lines().take(12).collect::<Vec<_>>().join("\n"));
        }
    }

    // 2. The engine on CUDA: exact step scopes, pre-flight refusal, and the batch finder driven by
    //    real out-of-memory errors from the capped pool.
    match wick::Engine::cuda(0, Some(4 << 30)) {
        Err(e) => all_ok &= row("engine on cuda:0", false, e.to_string()),
        Ok(engine) => {
            let step = |e: &wick::Engine| -> Result<(), wick::Error> {
                let a = Tensor::zeros((2048, 2048), DType::F32, e.device())?;
                let b = a.matmul(&a)?; // cuBLAS: a temporary the scope must release
                e.device().synchronize()?;
                drop(b);
                Ok(())
            };
            let _ = engine.try_step("warm-up", step);
            let _ = engine.device().synchronize();
            let baseline = engine.allocated().bytes;
            let mut exact = true;
            let mut freed = 0;
            for _ in 0..10 {
                match engine.try_step("step", step) {
                    Ok(((), r)) => {
                        let _ = engine.device().synchronize();
                        exact &= engine.allocated().bytes == baseline;
                        freed = r.freed().unwrap_or(0).max(freed);
                    }
                    Err(e) => {
                        exact = false;
                        println!("step error: {}", e.to_string().lines().next().unwrap_or(""));
                    }
                }
            }
            all_ok &= row(
                "engine step scopes on CUDA: allocated back to baseline after 10 steps",
                exact,
                format!("baseline {baseline} B (pool USED_MEM_CURRENT), peak-to-end freed {freed} B per step"),
            );
            let refused = engine.preflight_tensor(&[5 << 28], DType::F32, "5 GiB activations");
            all_ok &= row(
                "engine pre-flight refuses 5 GiB under a 4 GiB cap",
                refused.as_ref().is_err_and(|e| e.is_out_of_memory()),
                refused.err().map(|e| e.to_string()).unwrap_or_default().chars().take(200).collect(),
            );
            // 256 MiB per sample, no pre-flight: the pool's own cap produces the OOMs.
            let plan = engine.find_executable_batch_size(64, |e, batch| {
                let t = Tensor::zeros((batch, 64 << 20), DType::F32, e.device())?;
                e.device().synchronize()?;
                drop(t);
                Ok(())
            });
            match plan {
                Ok(p) => {
                    all_ok &= row(
                        "batch finder on real CUDA OOMs (256 MiB/sample, 4 GiB cap)",
                        (14..=16).contains(&p.batch_size) && p.accumulation_steps == 64usize.div_ceil(p.batch_size),
                        format!(
                            "batch {} x {} accumulation steps; tried {:?}",
                            p.batch_size, p.accumulation_steps, p.tried
                        ),
                    )
                }
                Err(e) => all_ok &= row("batch finder on CUDA", false, e.to_string()),
            }
            all_ok &= cuda_history(&engine);
        }
    }

    // 2b. A notebook cell run twice: two governed pools on one device, the older dropped first.
    //     The newer pool must stay current (its cap still refuses), and dropping it afterwards
    //     must leave the device on its default pool, not on the destroyed older one.
    let stacked = (|| -> Result<(bool, bool, bool), String> {
        let first = GovernedCuda::new(0, Some(2 << 30)).map_err(|e| e.to_string())?;
        let second = GovernedCuda::new(0, Some(1 << 30)).map_err(|e| e.to_string())?;
        drop(first);
        let still_current = second.pool().is_current();
        let over = second.run(3 << 29, |d| Tensor::zeros(3usize << 27, DType::F32, d));
        let capped = matches!(over, Err(MemoryError::OutOfMemory(_)));
        let used = {
            let t = second.run(64 * MIB, |d| Tensor::zeros(16usize << 20, DType::F32, d)).map_err(|e| e.to_string())?;
            let _ = sync(second.device());
            let used = second.pool().used();
            drop(t);
            used
        };
        drop(second);
        Ok((still_current, capped, used >= 64 * MIB))
    })();
    match stacked {
        Ok((current, capped, counted)) => {
            all_ok &= row(
                "two pools on one device, older dropped: newer stays current, capped and counting",
                current && capped && counted,
                format!("current {current}, 1.5 GiB refused under 1 GiB cap {capped}, 64 MiB counted {counted}"),
            )
        }
        Err(e) => all_ok &= row("two pools on one device", false, e),
    }

    // 3. Alloc-heavy loop: candle on the driver's default pool vs on wick's governed pool.
    let loop_result = (|| -> Result<(f64, f64), String> {
        let device = CudaDevice::new_with_stream(0).map(Device::Cuda).map_err(|e| e.to_string())?;
        alloc_heavy_loop(&device, 5).map_err(|e| e.to_string())?;
        let default_pool = alloc_heavy_loop(&device, 100).map_err(|e| e.to_string())?;
        let ctx = open_device(0).map_err(|e| e.to_string())?;
        let pool = DriverPool::install(ctx, None).map_err(|e| e.to_string())?;
        alloc_heavy_loop(&device, 5).map_err(|e| e.to_string())?;
        let governed = alloc_heavy_loop(&device, 100).map_err(|e| e.to_string())?;
        drop(pool);
        Ok((default_pool, governed))
    })();
    match loop_result {
        Ok((d, g)) => {
            all_ok &= row(
                "alloc-heavy candle loop: default pool vs wick pool (target >= 5x)",
                d / g >= 5.0,
                format!("{:.1} us/step vs {:.1} us/step: {:.1}x", d * 1e6, g * 1e6, d / g),
            )
        }
        Err(e) => all_ok &= row("alloc-heavy candle loop", false, e),
    }

    // 4. Trace replay: wick's CUDA caching allocator vs raw cuMemAllocAsync (PyTorch: gpu_check.py).
    for path in ["crates/wick-trace/traces/transformer-train.json", "crates/wick-trace/traces/inference-server.json"] {
        let trace = match Trace::from_file(std::path::Path::new(path)) {
            Ok(t) => t,
            Err(e) => {
                all_ok &= row("trace replay", false, e.to_string());
                continue;
            }
        };
        match (replay_wick(&trace, false), replay_wick(&trace, true), replay_raw_async(&trace)) {
            (Ok((w, alloc, reserved)), Ok((we, alloc_e, reserved_e)), Ok(raw)) => {
                let ops = trace.ops.len() as f64;
                println!(
                    "| replay {} | INFO | wick {:.2} us/op (expandable {:.2}), raw cuMemAllocAsync {:.2} us/op (raw/wick {:.2}x); wick peak reserved/allocated {:.3} (expandable {:.3}) |",
                    trace.name,
                    w / ops * 1e6,
                    we / ops * 1e6,
                    raw / ops * 1e6,
                    raw / w,
                    reserved as f64 / alloc.max(1) as f64,
                    reserved_e as f64 / alloc_e.max(1) as f64
                );
            }
            (a, b, c) => {
                all_ok &= row("trace replay", false, format!("{:?} / {:?} / {:?}", a.err(), b.err(), c.err()));
            }
        }
    }
    std::process::exit(if all_ok { 0 } else { 1 });
}

wick::main!(run);
