//! The allocation history of a real run, recorded by the counting allocator: it replays back to
//! the allocator's own live figure at every point it was read, names the label stacks that
//! steps and labels push, groups the peak's live bytes by label, and exports a memory_viz
//! snapshot that unpickles to PyTorch's layout. One test: the history is process-wide, and other
//! tests' threads would allocate into it.

use candle_core::{DType, Tensor};
use wick::host_memory::counted_heap;
use wick::Engine;
use wick_memory::heap_history;

wick::heap!(counting);

fn counted() -> usize {
    counted_heap().unwrap_or_else(|| panic!("the counting allocator is installed"))
}

#[test]
fn the_history_of_a_run_replays_labels_and_exports() {
    let engine = Engine::cpu();
    // Every allocation, so the replayed live bytes are the allocator's exact figure.
    engine.record_memory_history_with(1 << 15, 0).unwrap_or_else(|e| panic!("{e}"));
    let mut checkpoints = Vec::new();
    let check = |checkpoints: &mut Vec<(usize, usize)>| {
        let h = heap_history();
        // The copy itself is not recorded (reading the history does not show in it).
        let now = counted() - h.max_entries * std::mem::size_of::<wick_memory::HeapEvent>();
        let live = h.live_bytes();
        assert_eq!(live.last().copied().unwrap_or(h.baseline), now, "replayed live bytes vs the allocator's");
        if let Some(last) = h.events.len().checked_sub(1) {
            checkpoints.push((last, now));
        }
    };
    check(&mut checkpoints);
    let kept = engine
        .try_step("train", |e| {
            let big = {
                let _forward = e.label("forward");
                let a = Tensor::ones((512, 512), DType::F32, e.device())?; // 1 MiB
                let b = (&a * 2.0)?;
                (a + b)?
            };
            let _backward = e.label("backward");
            let grad = Tensor::zeros((256, 256), DType::F32, e.device())?; // 256 KiB
            Ok((big.sum_all()? + grad.sum_all()?)?)
        })
        .unwrap_or_else(|e| panic!("{e}"))
        .0;
    check(&mut checkpoints);
    let parked = {
        let _cache = engine.label("cache");
        vec![7u8; 32 << 20]
    };
    check(&mut checkpoints);
    drop(parked);
    check(&mut checkpoints);

    let history = engine.memory_history();
    assert_eq!(history.heap.dropped, 0);
    // The whole history passes through every point read along the way.
    let live = history.heap.live_bytes();
    for (index, bytes) in &checkpoints {
        assert_eq!(live[*index], *bytes, "at event {index}");
    }
    // Label stacks, as pushed.
    let texts: std::collections::BTreeSet<String> =
        history.heap.events.iter().map(|e| history.label_text(e.label)).collect();
    for expected in ["train/forward", "train/backward", "cache"] {
        assert!(texts.contains(expected), "{expected} missing from {texts:?}");
    }
    // The forward's three 1 MiB tensors were born under train/forward.
    let forward_bytes: usize = history
        .heap
        .lifetimes()
        .iter()
        .filter(|l| history.label_text(l.label) == "train/forward" && l.size == 1 << 20)
        .map(|l| l.size)
        .sum();
    assert_eq!(forward_bytes, 3 << 20);
    // The peak is the parked 32 MiB vector's moment; the table accounts for every byte then.
    let held = history.held_at_peak().unwrap_or_else(|| panic!("a peak"));
    assert_eq!(held.rows[0].0, "cache");
    assert_eq!(held.rows[0].1, 32 << 20);
    let accounted: usize = held.rows.iter().map(|r| r.1).sum::<usize>() + held.before_recording + held.history_ring;
    assert_eq!(accounted, held.total);
    assert!(held.to_string().contains("cache"));
    drop(kept);

    // memory_viz: PyTorch's snapshot layout, read back.
    let bytes = history.to_memory_viz().unwrap_or_else(|e| panic!("{e}"));
    let value: serde_pickle::Value =
        serde_pickle::value_from_slice(&bytes, serde_pickle::DeOptions::new()).unwrap_or_else(|e| panic!("{e}"));
    let serde_pickle::Value::Dict(snapshot) = value else { panic!("a dict") };
    let key = |k: &str| serde_pickle::HashableValue::String(k.into());
    let Some(serde_pickle::Value::List(devices)) = snapshot.get(&key("device_traces")) else { panic!("device_traces") };
    let serde_pickle::Value::List(trace) = &devices[0] else { panic!("a trace") };
    let allocs = history.heap.events.iter().filter(|e| e.action == wick_memory::HeapAction::Alloc).count();
    assert_eq!(trace.len(), allocs + 2 * (history.heap.events.len() - allocs));
    let labelled = trace.iter().any(|entry| {
        let serde_pickle::Value::Dict(entry) = entry else { return false };
        let is_alloc = entry.get(&key("action")) == Some(&serde_pickle::Value::String("alloc".into()));
        let Some(serde_pickle::Value::List(frames)) = entry.get(&key("frames")) else { return false };
        // Innermost first: forward, then train.
        let names: Vec<&serde_pickle::Value> = frames
            .iter()
            .filter_map(|f| match f {
                serde_pickle::Value::Dict(f) => f.get(&key("name")),
                _ => None,
            })
            .collect();
        is_alloc
            && names == [&serde_pickle::Value::String("forward".into()), &serde_pickle::Value::String("train".into())]
    });
    assert!(labelled, "an alloc with frames [forward, train]");
    assert!(matches!(snapshot.get(&key("segments")), Some(serde_pickle::Value::List(_))));

    // JSON round trip for `wick report`.
    let text = serde_json::to_string(&history).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(wick::MemoryHistory::from_json(&text).unwrap_or_else(|e| panic!("{e}")), history);
    engine.record_memory_history(None).unwrap_or_else(|e| panic!("{e}"));
    assert!(!wick_memory::heap_history_recording());

    // The HTML report, rendered by a real browser.
    let html = history.to_html("a <test> run");
    assert!(html.contains("Held at the peak") && html.contains("a &lt;test&gt; run"));
    let dir = std::env::temp_dir().join(format!("wick-history-html-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap_or_else(|e| panic!("{e}"));
    let path = dir.join("history.html");
    history.write_html(&path, "a <test> run").unwrap_or_else(|e| panic!("{e}"));
    match browser::dump_dom(&path, "selftest") {
        None => browser::skipped("the history report's browser check"),
        Some(dom) => {
            assert!(!dom.contains("data-error"), "a script error: {dom}");
            let drawn = history.heap.lifetimes().len().min(wick::memory_history::DRAWN_ALLOCATIONS);
            assert!(
                dom.contains(&format!("data-ready=\"{drawn}\"")),
                "not drawn: {}",
                &dom[dom.len().saturating_sub(1500)..]
            );
            // Hovering the largest allocation names its size and label stack; zoom halves the view.
            assert!(
                dom.contains("data-hover=\"32.00 MiB (33554432 bytes)\nlabel: cache"),
                "hover: {}",
                &dom[..dom.len().min(3000)]
            );
            let events = history.heap.events.len() as f64;
            let zoomed = browser::attribute(&dom, "data-zoomed").unwrap_or_default();
            let view: Vec<f64> = zoomed.split(' ').filter_map(|v| v.parse().ok()).collect();
            assert!(
                view.len() == 4 && (view[0] - events / 4.0).abs() < 1.0 && (view[2] - events / 2.0).abs() < 1.0,
                "zoomed view {zoomed:?} of {events} events"
            );
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[path = "common/browser.rs"]
mod browser;
