//! `wick train` killed with SIGKILL at arbitrary moments and resumed, again and again, ends with
//! the same losses and the same final weights (SHA-256 of every f32 master) as a run that was
//! never stopped; SIGTERM makes it finish its step, save and exit 0; a folder of an earlier run
//! is not overwritten without `--resume`, and `--resume` without a checkpoint is a clear error.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const STEPS: &str = "40";

fn temp_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("wick-cli-train-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

fn train(dir: &Path, resume: bool) -> Child {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_wick"));
    cmd.args(["train", "--steps", STEPS, "--save-every", "3", "--keep", "2"])
        .arg("--dir")
        .arg(dir)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    if resume {
        cmd.arg("--resume");
    }
    cmd.spawn().expect("wick runs")
}

fn finish(child: Child) -> (bool, String) {
    let out = child.wait_with_output().expect("wick finishes");
    (out.status.success(), format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr)))
}

/// Step → loss bits, from metrics.jsonl (every step exactly once).
fn losses(dir: &Path) -> Vec<(u64, u32)> {
    let text = std::fs::read_to_string(dir.join("metrics.jsonl")).unwrap();
    let rows: Vec<(u64, u32)> = text
        .lines()
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).unwrap();
            (v["step"].as_u64().unwrap(), (v["loss"].as_f64().unwrap() as f32).to_bits())
        })
        .collect();
    let steps: Vec<u64> = rows.iter().map(|r| r.0).collect();
    assert_eq!(steps, (1..=STEPS.parse().unwrap()).collect::<Vec<u64>>(), "each step once, in order");
    rows
}

fn summary(dir: &Path) -> serde_json::Value {
    serde_json::from_slice(&std::fs::read(dir.join("final.json")).unwrap()).unwrap()
}

fn has_checkpoint(dir: &Path) -> bool {
    std::fs::read_dir(dir).is_ok_and(|d| {
        d.filter_map(|e| e.ok()).any(|e| {
            e.file_name().to_string_lossy().ends_with(".json") && e.file_name().to_string_lossy().starts_with("step-")
        })
    })
}

#[test]
fn a_run_killed_at_random_moments_and_resumed_ends_exactly_as_an_uninterrupted_one() {
    let reference = temp_dir("reference");
    let (ok, text) = finish(train(&reference, false));
    assert!(ok, "{text}");

    let dir = temp_dir("killed");
    // Kill points from a fixed generator: some before the first checkpoint, most between.
    let mut state = 0x2545_F491_4F6C_DD1Du64;
    let (mut kills, mut resumes) = (0, 0);
    loop {
        let resume = has_checkpoint(&dir);
        resumes += usize::from(resume);
        let mut child = train(&dir, resume);
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        let delay = Duration::from_millis(30 + state % 400);
        let started = Instant::now();
        let exited = loop {
            if let Some(status) = child.try_wait().unwrap() {
                break Some(status);
            }
            if started.elapsed() >= delay || kills >= 8 && started.elapsed() >= Duration::from_secs(120) {
                break None;
            }
            std::thread::sleep(Duration::from_millis(5));
        };
        match exited {
            Some(_) => {
                let (ok, text) = finish(child);
                assert!(ok, "{text}");
                break;
            }
            None if kills < 8 => {
                child.kill().unwrap(); // SIGKILL: no chance to clean up
                let _ = child.wait();
                kills += 1;
            }
            None => {
                let (ok, text) = finish(child);
                assert!(ok, "{text}");
                break;
            }
        }
    }
    eprintln!("{kills} kills, {resumes} resumes");
    assert!(kills >= 3, "only {kills} kills landed; the run is too fast for this test");
    // Killed writers leave temporary files at most; no manifest without its tensors.
    let leftovers: Vec<String> = std::fs::read_dir(&dir)
        .unwrap()
        .filter_map(|e| e.ok())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with('.'))
        .collect();
    assert!(leftovers.is_empty(), "temporary files left behind after the last (clean) run: {leftovers:?}");
    assert!(resumes >= 2, "{resumes} resumes");
    assert_eq!(losses(&dir), losses(&reference), "the losses of the resumed run differ");
    assert_eq!(summary(&dir), summary(&reference), "the final weights differ");
    let _ = std::fs::remove_dir_all(&dir);
    let _ = std::fs::remove_dir_all(&reference);
}

#[test]
fn sigterm_finishes_the_step_saves_and_exits_zero_then_resume_completes_the_run() {
    let dir = temp_dir("sigterm");
    let child = train(&dir, false);
    // Wait for a few steps, then ask it to stop.
    let started = Instant::now();
    while std::fs::read_to_string(dir.join("metrics.jsonl")).map_or(0, |t| t.lines().count()) < 4 {
        assert!(started.elapsed() < Duration::from_secs(120), "no progress");
        std::thread::sleep(Duration::from_millis(10));
    }
    // SAFETY: sending a signal to our own child process.
    assert_eq!(unsafe { libc::kill(child.id() as i32, libc::SIGTERM) }, 0);
    let (ok, text) = finish(child);
    assert!(ok && text.contains("stopped by SIGTERM"), "{text}");
    let steps: Vec<u64> = std::fs::read_to_string(dir.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap()["step"].as_u64().unwrap())
        .collect();
    let last = *steps.last().unwrap();
    assert!(dir.join(format!("step-{last:010}.json")).is_file(), "no checkpoint at the last step {last}");
    assert!(!dir.join("final.json").exists());
    // Without --resume the folder is refused; with it the run completes.
    let (ok, text) = finish(train(&dir, false));
    assert!(!ok && text.contains("--resume"), "{text}");
    let (ok, text) = finish(train(&dir, true));
    assert!(ok && text.contains(&format!("step {last}")), "{text}");
    assert_eq!(summary(&dir)["steps"], 40);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn resume_without_a_checkpoint_is_a_clear_error() {
    let dir = temp_dir("nothing");
    let (ok, text) = finish(train(&dir, true));
    assert!(!ok && text.contains("no checkpoint in") && !text.contains("panicked"), "{text}");
    let _ = std::fs::remove_dir_all(&dir);
}
