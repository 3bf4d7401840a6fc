//! `wick train` killed with SIGKILL at arbitrary moments and resumed, again and again, ends with
//! the same losses and the same final weights (SHA-256 of every f32 master) as a run that was
//! never stopped — started every time with the same `--resume-if-any`, as a preemptible job's
//! scheduler starts it; SIGTERM makes it finish its step, save and exit 0; a folder of an earlier
//! run is not overwritten without `--resume`, and `--resume` without a checkpoint is a clear
//! error while `--resume-if-any` starts fresh.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

mod common;
use common::wick_in;

const STEPS: &str = "200";

fn temp_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("wick-cli-train-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

/// `wick train` in `dir`, with `how` ("", "--resume" or "--resume-if-any").
fn train(dir: &Path, how: &str) -> Child {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_wick"));
    cmd.args(["train", "--steps", STEPS, "--save-every", "3", "--keep", "2"])
        .arg("--dir")
        .arg(dir)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    if !how.is_empty() {
        cmd.arg(how);
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

/// Waits until the run in `dir` has logged `steps` steps, sends it SIGTERM, and checks that it
/// saved and exited cleanly, saying so; returns what it printed.
///
/// A resumed run starts from a metrics file an earlier run left (perhaps already `steps` lines
/// long) and installs its SIGTERM handler only after truncating it to its checkpoint, so it
/// counts as started only once the file holds a line more than it did here: truncation never
/// lengthens it, and the run appends only after its handler is in place.
fn stop_after(child: Child, dir: &Path, steps: usize) -> String {
    let started = Instant::now();
    let lines = || std::fs::read_to_string(dir.join("metrics.jsonl")).map_or(0, |t| t.lines().count());
    let wanted = steps.max(lines() + 1);
    while lines() < wanted {
        assert!(started.elapsed() < Duration::from_secs(120), "no progress");
        std::thread::sleep(Duration::from_millis(5));
    }
    // SAFETY: sending a signal to our own child process.
    assert_eq!(unsafe { libc::kill(child.id() as i32, libc::SIGTERM) }, 0);
    let (ok, text) = finish(child);
    assert!(ok && text.contains("stopped by SIGTERM"), "{text}");
    text
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
    let started = Instant::now();
    let (ok, text) = finish(train(&reference, ""));
    assert!(ok, "{text}");
    // Kill points are drawn within the first 15 % of the uninterrupted run's own duration, so
    // they land on any machine and build: each resumed run has most of its work left when its
    // kill point comes (at 30 % a resumed run of the faster kernels could finish first, and only
    // two kills landed).
    let span = (started.elapsed().as_millis() as u64 * 15 / 100).max(60);

    let dir = temp_dir("killed");
    // Kill points from a fixed generator: some before the first checkpoint, most between.
    let mut state = 0x2545_F491_4F6C_DD1Du64;
    let (mut kills, mut resumes) = (0, 0);
    loop {
        // The same command line every time: it resumes when there is a checkpoint.
        resumes += usize::from(has_checkpoint(&dir));
        let mut child = train(&dir, "--resume-if-any");
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        let delay = Duration::from_millis(20 + state % span);
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
    // Wait for a few steps, then ask it to stop.
    stop_after(train(&dir, ""), &dir, 4);
    let steps: Vec<u64> = std::fs::read_to_string(dir.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap()["step"].as_u64().unwrap())
        .collect();
    let last = *steps.last().unwrap();
    assert!(dir.join(format!("step-{last:010}.json")).is_file(), "no checkpoint at the last step {last}");
    assert!(!dir.join("final.json").exists());
    // Without --resume the folder is refused; with it the run completes.
    let (ok, text) = finish(train(&dir, ""));
    assert!(!ok && text.contains("--resume"), "{text}");
    let (ok, text) = finish(train(&dir, "--resume"));
    assert!(ok && text.contains(&format!("step {last}")), "{text}");
    assert_eq!(summary(&dir)["steps"].as_u64(), STEPS.parse().ok());
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn resume_without_a_checkpoint_is_a_clear_error_and_resume_if_any_starts_fresh() {
    let dir = temp_dir("nothing");
    let (ok, text) = finish(train(&dir, "--resume"));
    assert!(!ok && text.contains("no checkpoint in") && !text.contains("panicked"), "{text}");
    let text = stop_after(train(&dir, "--resume-if-any"), &dir, 2);
    assert!(text.contains("starting fresh") && !text.contains("resumed from"), "{text}");
    let text = stop_after(train(&dir, "--resume-if-any"), &dir, 4);
    assert!(text.contains("resumed from"), "{text}");
    let _ = std::fs::remove_dir_all(&dir);
}

fn job_state(registry: &Path, id: &str) -> serde_json::Value {
    let (ok, text) = wick_in(registry, &["jobs", "status", id]);
    assert!(ok, "{text}");
    serde_json::from_str(&text).unwrap()
}

fn wait_for(registry: &Path, id: &str, what: impl Fn(&serde_json::Value) -> bool) -> serde_json::Value {
    let started = Instant::now();
    loop {
        let status = job_state(registry, id);
        if what(&status) {
            return status;
        }
        assert!(started.elapsed() < Duration::from_secs(180), "job {id} never reached the state: {status}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn a_detached_run_outlives_its_launcher_is_listed_stopped_and_resumed() {
    let registry = temp_dir("registry");
    let dir = temp_dir("detached");
    let d = dir.to_str().unwrap();
    let (ok, text) = wick_in(&registry, &["train", "--dir", d, "--steps", "120", "--save-every", "10", "--detach"]);
    assert!(ok, "{text}");
    // The launcher has exited; the job runs on, in a session of its own.
    let id = text.split_whitespace().nth(2).unwrap().to_string();
    let status = wait_for(&registry, &id, |s| s["progress"]["step"].as_u64().unwrap_or(0) >= 3);
    assert_eq!((status["running"].as_bool(), status["progress"]["state"].as_str()), (Some(true), Some("running")));
    let pid = status["pid"].as_u64().unwrap();
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    let session: i64 = stat[stat.rfind(')').unwrap() + 2..].split_whitespace().nth(3).unwrap().parse().unwrap();
    assert_eq!(session, pid as i64, "the job leads its own session");
    let (ok, list) = wick_in(&registry, &["jobs"]);
    assert!(ok && list.contains(&id) && list.contains("running"), "{list}");
    // Its live memory, from the caching heap the binary installs: allocated ≤ peak, allocated ≤
    // reserved (the cache's segments hold every live large block), peak well under the budget.
    let heap = &status["progress"]["heap"];
    let figure = |k: &str| heap[k].as_u64().unwrap_or_else(|| panic!("no heap.{k} in {status}"));
    let (allocated, peak, reserved, budget) =
        (figure("allocated"), figure("peak"), figure("reserved"), figure("budget"));
    assert!(0 < allocated && allocated <= peak && allocated <= reserved && peak < budget, "{heap}");
    assert!(list.contains("allocated") && list.contains("of budget"), "{list}");

    // Stop: it finishes its step, saves and exits 0; the status says how to continue.
    let (ok, text) = wick_in(&registry, &["jobs", "stop", &id]);
    assert!(ok, "{text}");
    let stopped = wait_for(&registry, &id, |s| s["running"] == false);
    assert_eq!(stopped["progress"]["state"], "stopped", "{stopped}");
    let step = stopped["progress"]["step"].as_u64().unwrap();
    assert!(dir.join(format!("step-{step:010}.json")).is_file());
    assert!(stopped["progress"]["exit_reason"].as_str().unwrap().contains("--resume"));

    // Resumed as a new job, it completes the run.
    let (ok, text) =
        wick_in(&registry, &["train", "--dir", d, "--steps", "120", "--save-every", "10", "--resume", "--detach"]);
    assert!(ok, "{text}");
    let again = text.split_whitespace().nth(2).unwrap().to_string();
    let done = wait_for(&registry, &again, |s| s["running"] == false);
    assert_eq!(
        (done["progress"]["state"].as_str(), done["progress"]["step"].as_u64()),
        (Some("finished"), Some(120)),
        "{done}"
    );
    assert!(std::fs::read_to_string(dir.join("log.txt")).unwrap().contains("resumed from"));
    let (ok, list) = wick_in(&registry, &["jobs"]);
    assert!(ok && list.contains("stopped") && list.contains("finished"), "{list}");
    for job in [&id, &again] {
        assert!(wick_in(&registry, &["jobs", "forget", job]).0);
    }
    assert!(!wick_in(&registry, &["jobs", "status", &id]).0, "a forgotten job is still listed");
    let _ = std::fs::remove_dir_all(&dir);
    let _ = std::fs::remove_dir_all(&registry);
}

#[test]
fn a_run_on_a_token_file_resumes_its_data_loader_exactly_and_reports_eval_loss() {
    let data = temp_dir("tokens");
    std::fs::create_dir_all(&data).unwrap();
    let file = data.join("tokens.bin");
    // A learnable stream: a few motifs over a 32-token vocabulary.
    let tokens: Vec<u16> = (0..6000u32).map(|i| ((i % 7) * 3 + (i / 700) % 5) as u16 % 32).collect();
    std::fs::write(&file, tokens.iter().flat_map(|t| t.to_le_bytes()).collect::<Vec<u8>>()).unwrap();
    let f = file.to_str().unwrap();
    let args = |dir: &Path, resume: bool| {
        let mut a = vec!["train", "--data", f, "--steps", "60", "--save-every", "4", "--eval-every", "20"];
        a.extend(["--dir", dir.to_str().unwrap()]);
        if resume {
            a.push("--resume");
        }
        a.iter().map(|s| s.to_string()).collect::<Vec<_>>()
    };
    let run = |dir: &Path, resume: bool| {
        Command::new(env!("CARGO_BIN_EXE_wick"))
            .args(args(dir, resume))
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap()
    };
    let reference = data.join("reference");
    let (ok, text) = finish(run(&reference, false));
    assert!(ok, "{text}");
    let metrics = std::fs::read_to_string(reference.join("metrics.jsonl")).unwrap();
    let evals: Vec<u64> = metrics
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
        .filter(|v| v["eval_loss"].is_number())
        .map(|v| v["step"].as_u64().unwrap())
        .collect();
    assert_eq!(evals, vec![20, 40, 60]);
    // 6000 tokens make 187 windows of 32: 23 batches of 8 an epoch, so 60 steps cross two epoch
    // ends; stop after a few steps (mid-epoch), resume, and end where the reference ended.
    let dir = data.join("stopped");
    stop_after(run(&dir, false), &dir, 6);
    let (ok, text) = finish(run(&dir, true));
    assert!(ok, "{text}");
    assert_eq!(summary(&dir), summary(&reference), "the resumed run's weights differ");
    // A token outside the vocabulary is refused, naming it.
    std::fs::write(&file, [1u8, 0, 40, 0]).unwrap();
    let (ok, text) = finish(run(&data.join("bad"), false));
    assert!(!ok && text.contains("token 1 is 40"), "{text}");
    let _ = std::fs::remove_dir_all(&data);
}

/// Bad multi-process settings are refused before anything starts: `--ranks` in a build without
/// MPI (this test binary's `wick` has no `mpi` feature) or under a launcher that started ranks
/// already, a ZeRO stage that does not exist, an option the stage would ignore, a torchrun-style
/// world without MPI.
/// The device options refused before anything starts: a CUDA graph without the CUDA device, the
/// CUDA device in a build without CUDA (this test binary's), no warm-up, an unknown device.
#[test]
fn bad_device_settings_say_what_to_do() {
    let dir = temp_dir("device-refused");
    let run = |args: &[&str]| {
        let out = Command::new(env!("CARGO_BIN_EXE_wick"))
            .args(["train", "--steps", "2", "--dir"])
            .arg(&dir)
            .args(args)
            .output()
            .unwrap();
        (out.status.success(), String::from_utf8_lossy(&out.stderr).into_owned())
    };
    let (ok, err) = run(&["--cuda-graph"]);
    assert!(!ok && err.contains("--cuda-graph needs --device cuda"), "{err}");
    let (ok, err) = run(&["--device", "cuda", "--cuda-graph"]);
    assert!(!ok && err.contains("--device cuda") && err.contains("built without CUDA"), "{err}");
    let (ok, err) = run(&["--device", "cuda", "--cuda-graph", "--graph-warmup", "0"]);
    assert!(!ok && err.contains("--graph-warmup"), "{err}");
    // Stage 3 trains on GPUs (over NCCL); this build has no CUDA, and says so.
    let (ok, err) = run(&["--device", "cuda", "--zero", "3"]);
    assert!(!ok && err.contains("built without CUDA"), "{err}");
    let (ok, err) = run(&["--device", "cuda", "--zero", "3", "--prefetch"]);
    assert!(!ok && err.contains("--prefetch") && err.contains("GPU"), "{err}");
    let (ok, err) = run(&["--device", "cuda", "--cuda-graph", "--zero", "2"]);
    assert!(!ok && err.contains("--cuda-graph") && err.contains("--zero 0"), "{err}");
    let (ok, err) = run(&["--device", "tpu"]);
    assert!(!ok && err.contains("--device"), "{err}");
    // Nothing was trained or written.
    assert!(!dir.join("metrics.jsonl").exists());
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn bad_multi_process_settings_say_what_to_do() {
    let dir = temp_dir("ranks-refused");
    let d = dir.to_str().unwrap();
    let run = |args: &[&str], env: &[(&str, &str)]| {
        let mut c = Command::new(env!("CARGO_BIN_EXE_wick"));
        c.args(["train", "--dir", d, "--steps", "2"]).args(args);
        for (k, v) in env {
            c.env(k, v);
        }
        let out = c.output().unwrap();
        (out.status.success(), String::from_utf8_lossy(&out.stderr).into_owned())
    };
    let (ok, err) = run(&["--ranks", "2"], &[]);
    assert!(!ok && err.contains("--features mpi"), "{err}");
    let (ok, err) = run(&["--ranks", "2"], &[("OMPI_COMM_WORLD_RANK", "0"), ("OMPI_COMM_WORLD_SIZE", "2")]);
    assert!(!ok && err.contains("give one or the other"), "{err}");
    let (ok, err) = run(&["--zero", "4"], &[]);
    assert!(!ok && err.contains("--zero"), "{err}");
    // Options the stage would ignore.
    let (ok, err) = run(&["--zero", "2", "--prefetch"], &[]);
    assert!(!ok && err.contains("--prefetch") && err.contains("--zero 3"), "{err}");
    let (ok, err) = run(&["--no-recompute"], &[]);
    assert!(!ok && err.contains("--no-recompute") && err.contains("stage 0"), "{err}");
    let (ok, err) = run(&["--zero", "3", "--no-overlap"], &[]);
    assert!(!ok && err.contains("--no-overlap is for ZeRO stages 0-2"), "{err}");
    let (ok, err) = run(&[], &[("RANK", "0"), ("WORLD_SIZE", "2")]);
    assert!(!ok && err.contains("mpirun -n 2"), "{err}");
    let (ok, err) = run(&[], &[("OMPI_COMM_WORLD_RANK", "1"), ("OMPI_COMM_WORLD_SIZE", "2")]);
    assert!(!ok && err.contains("without the `mpi` feature"), "{err}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn clipping_reports_each_steps_norm_and_a_bad_bound_is_refused() {
    let run = |dir: &Path, extra: &[&str]| {
        let out = Command::new(env!("CARGO_BIN_EXE_wick"))
            .args(["train", "--steps", "3", "--save-every", "3", "--dir", dir.to_str().unwrap()])
            .args(extra)
            .output()
            .expect("wick runs");
        (
            out.status.success(),
            format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr)),
        )
    };
    let metrics = |dir: &Path| -> Vec<serde_json::Value> {
        let text = std::fs::read_to_string(dir.join("metrics.jsonl")).unwrap();
        text.lines().map(|l| serde_json::from_str(l).unwrap()).collect()
    };
    let (clipped, plain) = (temp_dir("clipped"), temp_dir("unclipped"));
    let (ok, text) = run(&clipped, &["--clip-grad-norm", "0.05"]);
    assert!(ok, "{text}");
    let (ok, text) = run(&plain, &[]);
    assert!(ok, "{text}");
    let (c, p) = (metrics(&clipped), metrics(&plain));
    assert_eq!((c.len(), p.len()), (3, 3));
    // Every step's norm, before clipping, above the bound: each update was clipped.
    for line in &c {
        let norm = line["grad_norm"].as_f64().unwrap_or(f64::NAN);
        assert!(norm.is_finite() && norm > 0.05, "{line}");
    }
    assert!(p.iter().all(|l| l.get("grad_norm").is_none()), "{p:?}");
    // The first loss comes before any update; the later ones follow the clipped updates.
    assert_eq!(c[0]["loss"], p[0]["loss"]);
    assert_ne!(c[2]["loss"], p[2]["loss"]);
    for bad in ["0", "-1", "nan", "inf", "x"] {
        let dir = temp_dir("bad-bound");
        let (ok, text) = run(&dir, &[&format!("--clip-grad-norm={bad}")]);
        assert!(!ok && text.contains("positive number") && !text.contains("panicked"), "{bad}: {text}");
        assert!(!dir.join("metrics.jsonl").exists());
    }
    for dir in [clipped, plain] {
        let _ = std::fs::remove_dir_all(&dir);
    }
}
