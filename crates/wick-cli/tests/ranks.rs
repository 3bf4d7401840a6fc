//! `wick train` on two ranks under a real `mpirun` (2 × 1 thread): the same final weights, to
//! the bit, as one process accumulating both ranks' micro-batches; a rank killed with SIGKILL
//! at a random moment (in a step or in a save) ends the job non-zero within seconds, naming the
//! rank, and `--resume` — on two ranks or on one, after one kill or several — finishes with the
//! uninterrupted run's weights, replicated, ZeRO-2 and ZeRO-3 (a checkpoint shard per rank). Needs a wick
//! built with `--features mpi`, which this file needs too (`[[test]] required-features`):
//! `scripts/long-tests.sh` builds both in the one `cargo test`. Skipped, loudly, without `mpirun`.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

fn which(cmd: &str) -> bool {
    Command::new("sh").arg("-c").arg(format!("command -v {cmd}")).output().is_ok_and(|o| o.status.success())
}

/// This test's wick: built with `--features mpi` by the same `cargo test` that built this file (the
/// file needs that feature: `scripts/long-tests.sh` runs it). `None`, and a SKIPPED line, where
/// `mpirun` is missing.
fn wick_mpi() -> Option<PathBuf> {
    if !which("mpirun") {
        assert!(std::env::var_os("WICK_REQUIRE_MPI").is_none(), "WICK_REQUIRE_MPI is set and mpirun is missing");
        eprintln!("SKIPPED: multi-rank `wick train` needs mpirun: apt-get install openmpi-bin");
        return None;
    }
    Some(PathBuf::from(env!("CARGO_BIN_EXE_wick")))
}

fn train(wick: &Path, dir: &Path, extra: &[&str]) -> Command {
    let mut c = Command::new(wick);
    c.args(["train", "--dir"]).arg(dir);
    c.args(["--steps", "12", "--hidden", "128", "--layers", "4", "--seq", "64"]);
    if !extra.contains(&"--save-every") {
        c.args(["--save-every", "2"]);
    }
    c.args(extra);
    c.env("OMPI_ALLOW_RUN_AS_ROOT", "1").env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1").env("RAYON_NUM_THREADS", "1");
    c
}

fn finish(mut c: Command) -> String {
    let out = c.output().expect("wick runs");
    assert!(out.status.success(), "{}\n{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    let dir = c.get_args().skip_while(|a| *a != "--dir").nth(1).expect("--dir").to_owned();
    let summary: serde_json::Value =
        serde_json::from_slice(&std::fs::read(Path::new(&dir).join("final.json")).expect("final.json")).unwrap();
    summary["params_sha256"].as_str().expect("digest").to_string()
}

/// The ranks' pids: `wick train` processes of this test's wick on `dir` (the launcher, which has
/// `--ranks`, and mpirun excepted).
fn rank_pids(dir: &Path) -> Vec<u32> {
    let needle = dir.display().to_string();
    let program = format!("{} train", env!("CARGO_BIN_EXE_wick"));
    let mut pids = Vec::new();
    for entry in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<u32>() else { continue };
        let cmd = std::fs::read(entry.path().join("cmdline")).unwrap_or_default();
        let cmd = String::from_utf8_lossy(&cmd).replace('\0', " ");
        if cmd.contains(&program) && cmd.contains(&needle) && !cmd.contains("mpirun") && !cmd.contains("--ranks") {
            pids.push(pid);
        }
    }
    pids
}

fn steps_done(dir: &Path) -> usize {
    std::fs::read_to_string(dir.join("metrics.jsonl")).map_or(0, |m| m.lines().count())
}

fn wait(child: &mut Child, limit: Duration) -> Option<std::process::ExitStatus> {
    let start = Instant::now();
    while start.elapsed() < limit {
        if let Some(status) = child.try_wait().expect("wait") {
            return Some(status);
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    None
}

#[test]
fn two_ranks_train_as_one_process_and_survive_a_killed_rank() {
    let tmp = std::env::temp_dir().join(format!("wick-ranks-cli-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&tmp);
    std::fs::create_dir_all(&tmp).unwrap();
    let Some(wick) = wick_mpi() else { return };
    let reference = finish(train(&wick, &tmp.join("alone"), &["--accumulate", "2"]));
    let two = finish(train(&wick, &tmp.join("two"), &["--ranks", "2"]));
    assert_eq!(two, reference, "2 ranks × 1 micro-batch = 1 process × 2, bit for bit");
    let status: serde_json::Value =
        serde_json::from_slice(&std::fs::read(tmp.join("two/status.json")).unwrap()).unwrap();
    assert_eq!(status["ranks"].as_array().map(Vec::len), Some(2), "per-rank figures: {status}");
    // Each step's line names its reduction; buckets start inside backward by default (this
    // model's first bucket, 1 MiB, of 2).
    let metrics = std::fs::read_to_string(tmp.join("two/metrics.jsonl")).unwrap();
    for line in metrics.lines() {
        let v: serde_json::Value = serde_json::from_str(line).unwrap();
        let (buckets, started) = (v["reduce"]["buckets"].as_u64(), v["reduce"]["in_backward"].as_u64());
        assert!(buckets.is_some_and(|b| b >= 2) && started.is_some_and(|s| s >= 1), "the reduction in {line}");
    }
    // Without overlap: the same parameters, and nothing started inside backward.
    let late = finish(train(&wick, &tmp.join("late"), &["--ranks", "2", "--no-overlap"]));
    assert_eq!(late, reference, "2 ranks reducing after backward");
    let metrics = std::fs::read_to_string(tmp.join("late/metrics.jsonl")).unwrap();
    assert!(metrics.lines().all(|l| l.contains("\"in_backward\":0")), "{metrics}");
    // ZeRO-3 prefetching the next block's gather: the same parameters; from the second step on
    // (the first learns the blocks' order) the blocks' gathers were started ahead.
    let ahead = finish(train(&wick, &tmp.join("prefetch"), &["--ranks", "2", "--zero", "3", "--prefetch"]));
    assert_eq!(ahead, reference, "2 ranks at ZeRO-3, prefetching");
    let metrics = std::fs::read_to_string(tmp.join("prefetch/metrics.jsonl")).unwrap();
    let prefetched: Vec<u64> = metrics
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap()["reduce"]["prefetched"].as_u64().unwrap())
        .collect();
    assert!(prefetched.len() > 1 && prefetched[0] == 0 && prefetched[1..].iter().all(|&n| n > 0), "{metrics}");

    // ZeRO-3 keeping the blocks' activations (gathered again in backward, not recomputed).
    let kept = finish(train(&wick, &tmp.join("kept"), &["--ranks", "2", "--zero", "3", "--no-recompute"]));
    assert_eq!(kept, reference, "2 ranks at ZeRO-3 without recomputation");

    // Kill a rank at random moments, replicated (once) and ZeRO-2/3 (three times in a row, saving
    // every step, so kills land in saves too: a shard per rank in each checkpoint).
    let mut rng = Moments::new();
    kill_and_resume(&wick, &tmp, "killed", &[], 1, &mut rng, &reference);
    kill_and_resume(&wick, &tmp, "killed-zero2", &["--zero", "2", "--save-every", "1"], 3, &mut rng, &reference);
    // ZeRO-3: most of a step is inside the blocks' gathers, recomputations and reduce-scatters,
    // so the kills land in collectives; its checkpoints resume at stage 3 and on one process.
    kill_and_resume(&wick, &tmp, "killed-zero3", &["--zero", "3", "--save-every", "1"], 3, &mut rng, &reference);
    // The same without recomputation: kills land in the gathers for backward too.
    let kept = ["--zero", "3", "--no-recompute", "--save-every", "1"];
    kill_and_resume(&wick, &tmp, "killed-zero3-kept", &kept, 1, &mut rng, &reference);
    let _ = std::fs::remove_dir_all(&tmp);
}

/// Random kill moments (xorshift), seeded from the clock or `WICK_TEST_SEED`; the seed is
/// printed so that a failing run can be repeated.
struct Moments(u64);

impl Moments {
    fn new() -> Self {
        let seed = std::env::var("WICK_TEST_SEED").ok().and_then(|s| s.parse().ok()).unwrap_or_else(|| {
            std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(1, |d| d.as_nanos() as u64)
        });
        eprintln!("kill moments: WICK_TEST_SEED={seed}");
        Moments(seed | 1)
    }

    /// A number in `0..n`.
    fn below(&mut self, n: u64) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0 % n
    }
}

/// Runs 2 ranks with `extra` flags and kills one of them (chosen at random) with SIGKILL at a
/// random moment — once a checkpoint exists, 1 to 3 steps on (at most step 8 of 12), then up to 300 ms into the next step or save — `kills`
/// times, each run resuming the one before; checks that each job ends non-zero within 30 s
/// naming the rank. Then resumes on 2 ranks and (from a copy) on 1 accumulating 2: both must
/// end with `reference`'s parameters.
fn kill_and_resume(
    wick: &Path,
    tmp: &Path,
    name: &str,
    extra: &[&str],
    kills: usize,
    rng: &mut Moments,
    reference: &str,
) {
    let dir = tmp.join(name);
    let mut args = vec!["--ranks", "2"];
    args.extend_from_slice(extra);
    for k in 0..kills {
        let mut this = args.clone();
        if k > 0 {
            this.push("--resume");
        }
        let mut run = train(wick, &dir, &this).stdout(Stdio::null()).stderr(Stdio::piped()).spawn().unwrap();
        let start = Instant::now();
        // Once the first checkpoint is complete (before it there is nothing to resume).
        let saved = || {
            std::fs::read_dir(&dir).into_iter().flatten().flatten().any(|e| {
                let n = e.file_name().to_string_lossy().into_owned();
                n.starts_with("step-") && n.ends_with(".json")
            })
        };
        while !saved() && start.elapsed() < Duration::from_secs(120) {
            std::thread::sleep(Duration::from_millis(10));
        }
        let target = (steps_done(&dir) + 1 + rng.below(3) as usize).min(8);
        while (steps_done(&dir) < target || rank_pids(&dir).len() < 2) && start.elapsed() < Duration::from_secs(120) {
            std::thread::sleep(Duration::from_millis(10));
        }
        std::thread::sleep(Duration::from_millis(rng.below(300)));
        let pids = rank_pids(&dir);
        assert_eq!(pids.len(), 2, "{name}: two ranks run: {pids:?}");
        let victim = pids[rng.below(2) as usize];
        let (at, killed_at) = (steps_done(&dir), Instant::now());
        // SAFETY: kill has no memory-safety preconditions.
        assert_eq!(unsafe { libc::kill(victim as i32, libc::SIGKILL) }, 0);
        let status = wait(&mut run, Duration::from_secs(30)).expect("the job ends within 30 s of a rank's death");
        let ended_in = killed_at.elapsed();
        let mut stderr = String::new();
        std::io::Read::read_to_string(run.stderr.as_mut().unwrap(), &mut stderr).unwrap();
        assert!(!status.success(), "{name}: a killed rank fails the job");
        assert!(stderr.contains("rank"), "{name}: the message names the rank: {stderr}");
        eprintln!("{name}: a rank (pid {victim}) killed after step {at} ended the job in {ended_in:?}");
    }
    let one = tmp.join(format!("{name}-one"));
    std::fs::create_dir_all(&one).unwrap();
    for entry in std::fs::read_dir(&dir).unwrap().flatten() {
        if entry.file_name().to_string_lossy().starts_with("step-") {
            std::fs::copy(entry.path(), one.join(entry.file_name())).unwrap();
        }
    }
    args.push("--resume");
    assert_eq!(finish(train(wick, &dir, &args)), reference, "{name}: resumed on 2 ranks");
    assert_eq!(finish(train(wick, &one, &["--accumulate", "2", "--resume"])), reference, "{name}: resumed on 1 rank");
}

/// `wick` with the job registry in `registry`; success and stdout + stderr.
fn wick_at(wick: &Path, registry: &Path, args: &[&str]) -> (bool, String) {
    let out = Command::new(wick)
        .args(args)
        .env("WICK_OUTPUT_DIR", registry)
        .env("OMPI_ALLOW_RUN_AS_ROOT", "1")
        .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
        .env("RAYON_NUM_THREADS", "1")
        .output()
        .expect("wick runs");
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    (out.status.success(), text)
}

/// A detached 2-rank run is one job (mpirun's) whose status carries both ranks' memory; `wick
/// jobs stop` reaches every rank through mpirun, they agree on the step to stop after, rank 0
/// saves, the job ends "stopped", and `--resume` continues from that step.
#[test]
fn a_detached_two_rank_job_is_listed_with_its_ranks_and_stops_cleanly() {
    let tmp = std::env::temp_dir().join(format!("wick-ranks-job-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&tmp);
    std::fs::create_dir_all(&tmp).unwrap();
    let Some(wick) = wick_mpi() else { return };
    let (registry, dir) = (tmp.join("registry"), tmp.join("run"));
    let d = dir.to_str().unwrap();
    let (ok, text) = wick_at(
        &wick,
        &registry,
        &["train", "--dir", d, "--steps", "400", "--save-every", "50", "--ranks", "2", "--detach"],
    );
    assert!(ok, "{text}");
    let id = text.split_whitespace().nth(2).unwrap().to_string();
    let status = |id: &str| -> serde_json::Value {
        let (ok, text) = wick_at(&wick, &registry, &["jobs", "status", id]);
        assert!(ok, "{text}");
        serde_json::from_str(&text).unwrap()
    };
    let start = Instant::now();
    let running = loop {
        let s = status(&id);
        if s["progress"]["step"].as_u64().unwrap_or(0) >= 3
            && s["progress"]["ranks"].as_array().is_some_and(|r| r.len() == 2)
        {
            break s;
        }
        assert!(start.elapsed() < Duration::from_secs(120), "the job never got going: {s}");
        std::thread::sleep(Duration::from_millis(50));
    };
    assert_eq!(running["progress"]["state"], "running");
    let (ok, list) = wick_at(&wick, &registry, &["jobs"]);
    assert!(ok && list.contains(&id) && list.contains("rank 1:"), "{list}");
    let (ok, text) = wick_at(&wick, &registry, &["jobs", "stop", &id]);
    assert!(ok, "{text}");
    let start = Instant::now();
    let stopped = loop {
        let s = status(&id);
        if s["running"] == false {
            break s;
        }
        assert!(start.elapsed() < Duration::from_secs(60), "the job did not stop: {s}");
        std::thread::sleep(Duration::from_millis(50));
    };
    assert_eq!(stopped["progress"]["state"], "stopped", "{stopped}");
    let step = stopped["progress"]["step"].as_u64().unwrap();
    assert!(dir.join(format!("step-{step:010}.json")).is_file(), "rank 0 saved at the agreed step {step}");
    assert!(step < 400, "stopped before the end: {stopped}");
    let resume = ["train", "--dir", d, "--steps", "400", "--save-every", "50", "--ranks", "2", "--resume"];
    let (ok, text) = wick_at(&wick, &registry, &resume);
    assert!(ok && text.contains(&format!("step {step}")) && text.contains("trained 400 steps"), "{text}");
    assert!(wick_at(&wick, &registry, &["jobs", "forget", &id]).0);
    let _ = std::fs::remove_dir_all(&tmp);
}
