//! `wick report`: an allocator's saved snapshot and history become the HTML report and text whose
//! figures are the allocator's own; other files are refused with what was expected.

use std::path::PathBuf;
use std::process::Command;

use wick_memory::{AllocateExt, CachingAllocator, HostBackend, MemoryResource};

fn wick(args: &[&str]) -> (bool, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_wick")).args(args).output().expect("wick runs");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

// The recorded-run test records this process's heap.
wick::heap!(counting);

fn dir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("wick-report-test-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&d).unwrap();
    d
}

#[test]
fn a_saved_snapshot_and_history_render_with_the_allocator_s_figures() {
    let d = dir("saved");
    let a = CachingAllocator::new(HostBackend::with_capacity(1 << 30));
    a.record_history(10_000);
    let kept = a.allocate(3 << 20).unwrap();
    {
        let _a = a.allocate(5 << 20).unwrap();
        let _b = a.allocate(100 << 10).unwrap();
    }
    let snapshot = d.join("snap.json");
    std::fs::write(&snapshot, a.snapshot().to_json()).unwrap();
    let history = d.join("history.json");
    std::fs::write(&history, serde_json::to_string(&a.history()).unwrap()).unwrap();
    let peak = a.memory_stats().allocated_bytes.all.peak;
    drop(kept);

    let (ok, text, err) = wick(&["report", snapshot.to_str().unwrap(), "--text"]);
    assert!(ok, "{err}");
    assert!(text.contains("segments") && text.contains("3.00 MiB allocated"), "{text}");
    let (ok, out, err) = wick(&["report", snapshot.to_str().unwrap()]);
    assert!(ok && out.contains("snap.html"), "{err}");
    let html = std::fs::read_to_string(d.join("snap.html")).unwrap();
    assert!(html.starts_with("<!DOCTYPE html>") && !html.contains("http://") && !html.contains("https://"));

    let (ok, text, err) = wick(&["report", history.to_str().unwrap(), "--text"]);
    assert!(ok, "{err}");
    let expected = format!("peak allocated {}", wick_memory::format_bytes(peak as u64));
    assert!(text.contains(&expected), "{text} lacks {expected}");
    let page = d.join("page.html");
    let (ok, _, err) = wick(&["report", history.to_str().unwrap(), "--out", page.to_str().unwrap()]);
    assert!(ok, "{err}");
    assert!(std::fs::read_to_string(&page).unwrap().contains("<svg"));
    let _ = std::fs::remove_dir_all(&d);
}

#[test]
fn other_files_are_refused_with_what_was_expected() {
    let d = dir("bad");
    let cases = [
        ("garbage.json", "\u{1}\u{2}not json", "not JSON"),
        ("object.json", "{\"ops\": []}", "neither a snapshot"),
        ("array.json", "[1, 2, 3]", "not an allocator history"),
        ("snapshot.json", "{\"segments\": 5}", "not a snapshot"),
    ];
    for (name, content, says) in cases {
        let path = d.join(name);
        std::fs::write(&path, content).unwrap();
        let (ok, _, err) = wick(&["report", path.to_str().unwrap(), "--text"]);
        assert!(!ok && err.contains(says), "{name}: {err}");
    }
    let (ok, _, err) = wick(&["report", "/nonexistent/x.json"]);
    assert!(!ok && err.contains("/nonexistent/x.json"), "{err}");
    let _ = std::fs::remove_dir_all(&d);
}

#[test]
fn a_recorded_run_renders_its_timeline_and_what_was_held_at_the_peak() {
    let d = dir("run");
    let engine = wick::Engine::cpu();
    engine.record_memory_history(Some(100_000)).unwrap();
    let (kept, _) = engine
        .try_step("train_step", |e| {
            let _forward = e.label("layer1");
            Ok(candle_core::Tensor::ones((1024, 1024), candle_core::DType::F32, e.device())?)
        })
        .unwrap();
    let run = engine.memory_history();
    engine.record_memory_history(None).unwrap();
    drop(kept);
    let file = d.join("run.history.json");
    run.write_json(&file).unwrap();
    let (ok, text, err) = wick(&["report", file.to_str().unwrap(), "--text"]);
    assert!(ok, "{err}");
    assert!(text.contains("held at the peak"), "{text}");
    // The 4 MiB tensor is the largest row, under the step and the label.
    let row = text.lines().find(|l| l.contains("train_step/layer1")).unwrap_or_else(|| panic!("{text}"));
    assert!(row.contains("4.00 MiB"), "{row}");
    let (ok, out, err) = wick(&["report", file.to_str().unwrap()]);
    assert!(ok, "{err}");
    let html = std::fs::read_to_string(d.join("run.history.html")).unwrap_or_else(|e| panic!("{e}: {out}"));
    assert!(html.contains("Active memory timeline") && html.contains("train_step/layer1"));
    let _ = std::fs::remove_dir_all(&d);
}
