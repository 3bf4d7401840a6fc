//! The CPU engine's figures against independent truth, step scopes, caps and recovery. This test
//! binary installs the counting allocator, so heap figures are exact; tests share its counters
//! and therefore run one at a time.

use candle_core::{DType, Tensor, Var};
use wick::{Engine, Error, FigureSource};
use wick_memory::{MemoryError, MemoryLimit};

wick::heap!(counting);

const MIB: usize = 1 << 20;

/// One test function, so no other test thread allocates while figures are compared exactly.
#[test]
fn cpu_engine() {
    allocated_matches_tensor_bytes_and_rss_follows_touched_memory();
    scoped_training_steps_return_allocated_to_baseline_exactly();
    cap_refuses_before_allocating_and_smaller_request_succeeds();
    batch_finder_returns_the_largest_batch_that_fits_and_the_accumulation();
    retry_on_oom_frees_the_cache_and_tries_again();
    reports_name_their_sources_and_render();
    publishing_the_status_moves_no_heap_figure();
    statistics_follow_the_counting_allocator_by_pytorch_names();
}

/// `memory_stats()` under the counting allocator: the keys it can know, equal to its counters,
/// moving with a tensor's bytes; what it cannot know (a reservation) absent; the engine's own
/// OOM and retry counts; the PyTorch-layout summary with `-` for the absent and the sources kept.
fn statistics_follow_the_counting_allocator_by_pytorch_names() {
    let engine = Engine::cpu();
    let now = engine.allocated().bytes;
    let s0 = engine.memory_stats();
    assert_eq!(s0["allocated_bytes.all.current"], now as i64, "the counter itself");
    assert_eq!(s0["requested_bytes.all.current"], now as i64);
    for key in ["allocated_bytes.all.peak", "allocated_bytes.all.allocated", "allocated_bytes.all.freed"] {
        assert!(s0.contains_key(key), "{key}");
    }
    assert_eq!(
        s0["allocation.all.current"],
        s0["allocation.all.allocated"] - s0["allocation.all.freed"],
        "live allocations are made minus freed"
    );
    for key in ["reserved_bytes.all.current", "reserved_bytes.all.peak", "segment.all.current", "num_sync_all_streams"]
    {
        assert!(!s0.contains_key(key), "{key} cannot be known by the counting allocator");
    }
    assert_eq!(engine.max_memory_reserved(), None);
    let tensor_bytes: i64 = 4 << 20;
    let t = Tensor::zeros(1 << 20, DType::F32, engine.device()).unwrap();
    let s1 = engine.memory_stats();
    let grew = s1["allocated_bytes.all.current"] - s0["allocated_bytes.all.current"];
    // The tensor's buffer, plus candle's small bookkeeping and the first map (still alive).
    assert!((tensor_bytes..tensor_bytes + (64 << 10)).contains(&grew), "grew {grew}");
    assert!(s1["allocated_bytes.all.allocated"] - s0["allocated_bytes.all.allocated"] >= tensor_bytes);
    assert!(s1["allocated_bytes.all.peak"] >= s1["allocated_bytes.all.current"]);
    drop(t);
    let s2 = engine.memory_stats();
    assert!(s2["allocated_bytes.all.freed"] - s1["allocated_bytes.all.freed"] >= tensor_bytes);
    assert!(s2["allocated_bytes.all.current"] <= s1["allocated_bytes.all.current"] - tensor_bytes + (64 << 10));
    assert!(engine.max_memory_allocated().unwrap() as i64 >= s1["allocated_bytes.all.current"], "the peak saw it");
    engine.reset_peak_memory_stats();
    let reset = engine.max_memory_allocated().unwrap() as i64;
    assert!(reset < s1["allocated_bytes.all.current"], "reset to the current value: {reset}");

    assert_eq!((s2["num_ooms"], s2["num_alloc_retries"]), (0, 0));
    assert!(engine.preflight(usize::MAX / 2, "too much").is_err());
    let mut calls = 0;
    let _ = engine.retry_on_oom(|e| {
        calls += 1;
        if calls == 1 {
            e.preflight(usize::MAX / 2, "too much")?;
        }
        Ok(())
    });
    let s3 = engine.memory_stats();
    assert_eq!((s3["num_ooms"], s3["num_alloc_retries"]), (2, 1), "two refusals, one retry");

    engine.account("optimizer state (f32)", 3 << 20);
    let text = engine.memory_summary();
    let row = |label: &str| text.lines().find(|l| l.starts_with(label)).unwrap_or_else(|| panic!("{label}: {text}"));
    assert!(!row("| Allocated memory").contains(" - "), "{text}");
    assert_eq!(row("| Reserved memory").matches(" - ").count(), 4, "{text}");
    assert!(text.contains("OOMs: 2") && text.contains("alloc retries: 1"), "{text}");
    assert!(text.contains("counting allocator (exact heap)") && text.contains("optimizer state (f32)"), "{text}");
}

/// The engine's status thread rewrites its file every second while the heap is being measured
/// exactly: it must not allocate, or a step's peak and `allocated` would move with it.
fn publishing_the_status_moves_no_heap_figure() {
    let engine = Engine::cpu();
    let file = engine.status_file().expect("publishing is on by default").to_path_buf();
    let stamp = || -> u64 {
        let s: wick::engine_status::EngineStatus = serde_json::from_slice(&std::fs::read(&file).unwrap()).unwrap();
        s.updated_unix_ms
    };
    let first = stamp();
    let before = engine.allocated().bytes;
    engine.reset_peak_memory_stats();
    // Two and a half intervals: at least two writes by the thread.
    std::thread::sleep(wick::engine_status::PUBLISH_INTERVAL * 5 / 2);
    let (after, peak) = (engine.allocated().bytes, engine.peak_allocated().unwrap().bytes);
    assert!(stamp() > first, "the thread did not write in 2.5 intervals");
    assert_eq!(after, before, "publishing left bytes allocated");
    assert_eq!(peak, before, "publishing allocated transiently (the peak moved)");
}

fn allocated_matches_tensor_bytes_and_rss_follows_touched_memory() {
    let engine = Engine::cpu();
    let base = engine.allocated();
    assert_eq!(base.source, FigureSource::CountingAllocator);
    let t = Tensor::zeros((1024, 1024), DType::F32, engine.device()).unwrap();
    let with = engine.allocated().bytes;
    let delta = with - base.bytes;
    assert!((4 * MIB..4 * MIB + 4096).contains(&delta), "4 MiB tensor moved allocated by {delta}");
    drop(t);
    assert_eq!(engine.allocated().bytes, base.bytes, "dropping the tensor frees exactly what it took");
    // RSS (an independent source) grows by what is written.
    let rss0 = engine.reserved().bytes;
    let ones = Tensor::ones(64 * MIB, DType::F32, engine.device()).unwrap();
    let grown = engine.reserved().bytes as f64 - rss0 as f64;
    let expected = (256 * MIB) as f64;
    assert!((grown - expected).abs() < 0.15 * expected, "RSS grew {grown} for a 256 MiB tensor");
    drop(ones);
    engine.empty_cache().unwrap();
}

fn train_step(engine: &Engine, w: &Var, x: &Tensor, y: &Tensor) -> Result<f32, Error> {
    let pred = x.matmul(w.as_tensor())?;
    let loss = (pred - y)?.sqr()?.mean_all()?;
    let grads = loss.backward()?;
    let g = grads.get(w).ok_or_else(|| Error::Memory(MemoryError::Unsupported("no gradient".into())))?;
    w.set(&(w.as_tensor() - (g * 0.1)?)?)?;
    let _ = engine;
    Ok(loss.to_scalar::<f32>()?)
}

fn scoped_training_steps_return_allocated_to_baseline_exactly() {
    let engine = Engine::cpu();
    let device = engine.device().clone();
    let x = Tensor::randn(0f32, 1.0, (256, 64), &device).unwrap();
    let true_w = Tensor::randn(0f32, 1.0, (64, 1), &device).unwrap();
    let y = x.matmul(&true_w).unwrap();
    let w = Var::zeros((64, 1), DType::F32, &device).unwrap();
    // One warm-up step: first use may create lasting state (thread pools, caches).
    engine.try_step("warm-up", |e| train_step(e, &w, &x, &y)).unwrap();
    // The test's own bookkeeping is allocated before the baseline is read.
    let mut losses = Vec::with_capacity(20);
    let baseline = engine.allocated().bytes;
    for i in 0..20 {
        let (loss, report) = engine.try_step("train step", |e| train_step(e, &w, &x, &y)).unwrap();
        assert_eq!(report.after, baseline, "step {i}: allocated back to the baseline");
        assert!(
            report.peak > Some(report.after) && report.freed() > Some(0),
            "step {i} used and released memory: {report:?}"
        );
        assert_eq!(report.retained(), 0);
        losses.push(loss);
    }
    assert!(losses[19] < losses[0] * 0.5, "training made progress: {losses:?}");
    // An error inside the step still releases the step's tensors.
    let (result, report) = engine.step("failing", |e| -> Result<(), Error> {
        let _big = Tensor::ones((1024, 1024), DType::F32, e.device())?;
        Err(Error::Memory(MemoryError::ZeroSize))
    });
    assert!(result.is_err());
    assert_eq!(report.after, baseline);
    assert!(report.freed() >= Some(4 * MIB));
}

fn cap_refuses_before_allocating_and_smaller_request_succeeds() {
    let mut engine = Engine::cpu();
    let cap = engine.allocated().bytes + 64 * MIB;
    engine.set_memory_limit(Some(MemoryLimit::Bytes(cap))).unwrap();
    assert_eq!(engine.budget().source, FigureSource::UserLimit);
    let before = engine.allocated().bytes;
    {
        let err = engine.preflight_tensor(&[32, 1024, 1024], DType::F32, "activations").unwrap_err();
        let oom = err.as_out_of_memory().expect("typed OOM");
        assert_eq!(oom.requested, 128 * MIB);
        assert!(oom.limited_by_cap);
        assert!(err.to_string().contains("Advice:"), "{err}");
    } // the error value itself is freed here
    assert_eq!(engine.allocated().bytes, before, "nothing was allocated for the refused request");
    engine.preflight_tensor(&[8, 1024, 1024], DType::F32, "activations").unwrap();
    let t = Tensor::zeros((8, 1024, 1024), DType::F32, engine.device()).unwrap();
    assert_eq!(t.dims(), &[8, 1024, 1024]);
    assert!(engine.available() < 32 * MIB + 4096);
    // A whole weight file is checked from its header before it is read.
    let dir = std::env::temp_dir().join(format!("wick-engine-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("big.safetensors");
    let w = Tensor::zeros((40, 1024, 1024), DType::F32, &candle_core::Device::Cpu).unwrap();
    candle_core::safetensors::save(&std::collections::HashMap::from([("w", w)]), &path).unwrap();
    let err = engine.preflight_safetensors(&path).unwrap_err();
    assert!(err.is_out_of_memory() && err.to_string().contains("big.safetensors"), "{err}");
    std::fs::remove_dir_all(&dir).ok();
}

fn batch_finder_returns_the_largest_batch_that_fits_and_the_accumulation() {
    let mut engine = Engine::cpu();
    engine.set_memory_limit(Some(MemoryLimit::Bytes(engine.allocated().bytes + 100 * MIB))).unwrap();
    let per_sample = 3 * MIB;
    let run = |e: &Engine, batch: usize| -> Result<(), Error> {
        e.preflight_tensor(&[batch, per_sample / 4], DType::F32, "batch activations")?;
        let t = Tensor::ones((batch, per_sample / 4), DType::F32, e.device())?;
        let _ = t.sum_all()?;
        Ok(())
    };
    let plan = engine.find_executable_batch_size(256, run).unwrap();
    // Independent truth: the largest batch whose activations fit in what is available.
    let expected = engine.available() / per_sample;
    assert!(plan.batch_size.abs_diff(expected) <= 1, "{plan:?} vs {expected}");
    assert!(run(&engine, plan.batch_size).is_ok());
    assert!(run(&engine, plan.batch_size + 1).unwrap_err().is_out_of_memory());
    assert_eq!(plan.accumulation_steps, 256usize.div_ceil(plan.batch_size));
    assert!(plan.tried.len() <= 10, "binary search: {:?}", plan.tried);
    // Non-memory errors are not mistaken for "too big".
    let err = engine.find_executable_batch_size(8, |_, _| Err(Error::Memory(MemoryError::ZeroSize))).unwrap_err();
    assert!(!err.is_out_of_memory());
    assert!(engine.find_executable_batch_size(0, |_, _| Ok(())).is_err());
}

fn retry_on_oom_frees_the_cache_and_tries_again() {
    let engine = Engine::cpu();
    let mut calls = 0;
    let out = engine
        .retry_on_oom(|e| {
            calls += 1;
            if calls == 1 {
                e.preflight(usize::MAX / 2, "too much")?;
            }
            Ok(calls)
        })
        .unwrap();
    assert_eq!(out, 2);
}

fn reports_name_their_sources_and_render() {
    let engine = Engine::cpu();
    engine.mark("start");
    let baseline = engine.allocated().bytes;
    engine.mark("no allocation for a mark");
    assert_eq!(engine.allocated().bytes, baseline, "recording a sample does not allocate");
    let _t = Tensor::zeros(1 << 20, DType::F32, engine.device()).unwrap();
    engine.mark("after tensor");
    let text = engine.memory_summary();
    assert!(text.contains("counting allocator (exact heap)") && text.contains("process RSS"), "{text}");
    let html = engine.memory_report().to_html();
    assert!(html.contains("<svg") && html.contains("after tensor"));
    let json: serde_json::Value = serde_json::from_str(&engine.memory_report_json()).unwrap();
    assert_eq!(json["timeline"]["samples"].as_array().map(|a| a.len()), Some(3));
}
