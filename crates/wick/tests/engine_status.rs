//! Engines publish their figures for `wick monitor`: the status file appears with the engine,
//! follows what it holds and its limit, and goes with it; files left by processes that are gone
//! are recognised and removed by readers. One test function: it sets the process's environment.

use std::path::Path;
use std::time::{Duration, Instant};

use candle_core::{DType, Tensor};
use wick::engine_status::{live_engines, EngineStatus, PUBLISH_ENV, PUBLISH_INTERVAL};
use wick::Engine;
use wick_memory::MemoryLimit;

fn read(path: &Path) -> EngineStatus {
    serde_json::from_slice(&std::fs::read(path).expect("the status file is there")).expect("it parses")
}

/// Polls the status file for up to ten publishing intervals until `check` holds.
fn published(path: &Path, what: &str, check: impl Fn(&EngineStatus) -> bool) -> EngineStatus {
    let start = Instant::now();
    loop {
        let s = read(path);
        if check(&s) {
            return s;
        }
        assert!(start.elapsed() < 10 * PUBLISH_INTERVAL, "never published: {what}; last: {s:?}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// A pid that is certainly not running: a child that has exited and been reaped.
fn dead_pid() -> u32 {
    let mut child = std::process::Command::new("true").spawn().expect("`true` runs");
    let pid = child.id();
    child.wait().expect("reaped");
    pid
}

#[test]
fn engines_publish_follow_and_withdraw_their_status_and_stale_files_are_removed() {
    let out = std::env::temp_dir().join(format!("wick-engine-status-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&out);
    std::env::set_var("WICK_OUTPUT_DIR", &out);
    std::env::remove_var(PUBLISH_ENV);

    let mut engine = Engine::cpu();
    let path = engine.status_file().expect("publishing is on by default").to_path_buf();
    assert!(path.starts_with(out.join("engines")), "{}", path.display());
    let first = published(&path, "the first status", |_| true);
    assert_eq!(first.pid, std::process::id());
    assert_eq!(first.device, "cpu");
    assert!(first.program.starts_with("engine_status"), "the test binary's name, got {}", first.program);
    assert_eq!(first.budget, engine.budget().bytes);
    let listed = live_engines().expect("the folder reads");
    assert_eq!(listed.iter().filter(|s| s.id == first.id).count(), 1, "{listed:?}");

    // 256 MiB written to (so resident): the published allocated figure (the resident set here,
    // no counting allocator) follows within a few intervals.
    let held = Tensor::ones((64, 1 << 20), DType::F32, engine.device()).expect("allocates");
    let grown = published(&path, "the tensor's bytes", |s| s.allocated >= first.allocated + (200 << 20));
    assert!(grown.updated_unix_ms >= first.updated_unix_ms);
    drop(held);

    // A limit set after the start is what the thread publishes as the budget.
    engine.set_memory_limit(Some(MemoryLimit::Bytes(96 << 20))).expect("a valid limit");
    published(&path, "the user's limit as the budget", |s| s.budget == 96 << 20);
    // A refused limit keeps the one before.
    assert!(engine.set_memory_limit(Some(MemoryLimit::Fraction(1.5))).is_err());
    assert_eq!(engine.budget().bytes, 96 << 20);

    // Dropped: the thread stops and the file goes at once.
    drop(engine);
    assert!(!path.exists(), "the status file outlived its engine");
    assert!(live_engines().unwrap().iter().all(|s| s.id != first.id));

    // Files of processes that are gone: a dead pid, this pid with another start time (a reused
    // pid), a temporary a killed writer left, and a file no engine wrote. All are removed.
    let dir = out.join("engines");
    let dead = dead_pid();
    let stale = |id: &str, pid: u32, start_ticks: u64| EngineStatus {
        id: id.into(),
        pid,
        start_ticks,
        program: "gone".into(),
        device: "cpu".into(),
        allocated: 1,
        reserved: 1,
        peak: None,
        budget: 1,
        updated_unix_ms: 0,
    };
    let planted = [
        (dir.join(format!("{dead}-1.json")), serde_json::to_vec(&stale("a", dead, first.start_ticks)).unwrap()),
        (dir.join("reused.json"), serde_json::to_vec(&stale("b", std::process::id(), first.start_ticks + 1)).unwrap()),
        (dir.join(format!(".{dead}-2.json.tmp")), b"{\"half".to_vec()),
        (dir.join("garbage.json"), b"not json".to_vec()),
    ];
    for (path, bytes) in &planted {
        std::fs::write(path, bytes).unwrap();
    }
    let live = Engine::cpu();
    let listed = live_engines().expect("the folder reads");
    assert_eq!(listed.len(), 1, "only the live engine: {listed:?}");
    assert_eq!(listed[0].pid, std::process::id());
    for (path, _) in &planted {
        assert!(!path.exists(), "{} was left", path.display());
    }
    drop(live);

    // Publishing off: no file, no thread; the engine works the same.
    std::env::set_var(PUBLISH_ENV, "0");
    let quiet = Engine::cpu();
    assert!(quiet.status_file().is_none());
    assert!(live_engines().unwrap().is_empty());
    assert!(quiet.budget().bytes > 0);
    drop(quiet);
    std::env::remove_var(PUBLISH_ENV);
    let _ = std::fs::remove_dir_all(&out);
}
