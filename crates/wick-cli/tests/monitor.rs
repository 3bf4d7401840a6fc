//! `wick monitor` driven in a real tmux pane: it shows the host, the GPU line, a running job's
//! memory from the job's own status file and the job's engine from the engine's, and `q` quits cleanly (the terminal restored,
//! exit status 0); `--once` prints the same as plain text.

use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant};

mod common;
use common::wick_in;

fn temp(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("wick-monitor-test-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn tmux(args: &[&str]) -> (bool, String) {
    let out = Command::new("tmux").args(args).output().expect("tmux runs");
    (out.status.success(), String::from_utf8_lossy(&out.stdout).into_owned())
}

/// Polls `what` every 50 ms for up to a minute.
fn eventually(what: &str, mut check: impl FnMut() -> Option<String>) -> String {
    let started = Instant::now();
    loop {
        if let Some(v) = check() {
            return v;
        }
        assert!(started.elapsed() < Duration::from_secs(60), "never: {what}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn the_live_view_shows_a_running_job_and_quits_on_q() {
    if Command::new("tmux").arg("-V").output().is_err() {
        eprintln!("SKIPPED: tmux is not installed; `wick monitor` was not driven");
        return;
    }
    let registry = temp("registry");
    let run = temp("run");
    let (ok, text) = wick_in(
        &registry,
        &["train", "--dir", run.to_str().unwrap(), "--steps", "1000000", "--save-every", "100000", "--detach"],
    );
    assert!(ok, "{text}");
    let id = text.split_whitespace().nth(2).unwrap().to_string();
    // Wait until the job has published memory figures.
    eventually("the job reports its heap", || {
        let (_, s) = wick_in(&registry, &["jobs", "status", &id]);
        s.contains("\"allocated\"").then_some(s)
    });
    let (_, once) = wick_in(&registry, &["monitor", "--once"]);
    assert!(once.contains(&id) && once.contains("running") && once.contains("allocated"), "{once}");
    // The run's engine, from the status file it keeps current: its pid, the `wick` program, cpu.
    let (_, status) = wick_in(&registry, &["jobs", "status", &id]);
    let pid = status.split("\"pid\": ").nth(1).and_then(|s| s.split(|c: char| !c.is_ascii_digit()).next());
    let pid = pid.unwrap_or_else(|| panic!("no pid in {status}"));
    let engine_row = format!("{pid}\twick\tcpu\t");
    assert!(once.contains(&engine_row), "no engine row `{engine_row}` in {once}");
    let (ok, json) = wick_in(&registry, &["monitor", "--once", "--json"]);
    assert!(ok && json.contains("\"engines\"") && json.contains(&format!("\"pid\": {pid}")), "{json}");

    let session = format!("wick-monitor-{}", std::process::id());
    let command = format!("{} monitor --interval 0.2; echo EXITED $?; sleep 60", env!("CARGO_BIN_EXE_wick"));
    let env = format!("WICK_OUTPUT_DIR={}", registry.display());
    let (ok, _) = tmux(&["new-session", "-d", "-s", &session, "-x", "160", "-y", "40", "-e", &env, &command]);
    assert!(ok, "tmux could not start a session");
    let capture = || tmux(&["capture-pane", "-p", "-t", &session]).1;
    let screen = eventually("the view shows the job", || {
        let s = capture();
        (s.contains("wick monitor") && s.contains(&id) && s.contains("last minute") && s.contains("wick engines "))
            .then_some(s)
    });
    assert!(screen.contains(&format!("wick cpu (pid {pid})")), "no engine sparkline: {screen}");
    assert!(screen.contains("host") && screen.contains("GPUs") && screen.contains("q quits"), "{screen}");
    tmux(&["send-keys", "-t", &session, "q"]);
    let after = eventually("q quits", || {
        let s = capture();
        s.contains("EXITED").then_some(s)
    });
    assert!(after.contains("EXITED 0"), "{after}");
    assert!(!after.contains("wick monitor"), "the alternate screen was left: {after}");
    tmux(&["kill-session", "-t", &session]);

    let (ok, text) = wick_in(&registry, &["jobs", "stop", &id]);
    assert!(ok, "{text}");
    eventually("the job stops", || {
        let (_, s) = wick_in(&registry, &["jobs", "status", &id]);
        s.contains("\"running\": false").then_some(s)
    });
    let _ = std::fs::remove_dir_all(&registry);
    let _ = std::fs::remove_dir_all(&run);
}

#[test]
fn bad_intervals_are_refused() {
    let registry = temp("bad");
    let (ok, text) = wick_in(&registry, &["monitor", "--interval", "0"]);
    assert!(!ok && text.contains("--interval"), "{text}");
    let (ok, text) = wick_in(&registry, &["monitor", "--json"]);
    assert!(!ok && text.contains("--once"), "{text}");
    let _ = std::fs::remove_dir_all(&registry);
}
