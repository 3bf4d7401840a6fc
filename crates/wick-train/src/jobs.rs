//! Long runs outside the notebook: a [`Job`] is a process started in its own session (so it
//! survives the terminal, the notebook kernel and a kernel restart), logging to its run folder,
//! and registered under [`wick::files::output_dir`]`/jobs` so that `wick jobs` — or
//! [`Job::attach`] after a restart — finds it again.
//!
//! The contract with the program: it reports its progress with [`write_status`] (step, steps,
//! loss, memory, last checkpoint, state: into its run folder's `status.json` and, in a job, the
//! job's own status file) and handles SIGTERM by finishing its step, saving and exiting 0 —
//! `wick train` does both. [`Job::stop`] sends that SIGTERM.
//!
//! ```no_run
//! use wick_train::jobs::Job;
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let dir = std::path::Path::new("/tmp/run-1");
//! let mut job = Job::spawn("wick", &["train", "--dir", "/tmp/run-1", "--steps", "500"], dir)?;
//! println!("{}", job.status()?);      // in evcxr: job.status()?.evcxr_display()
//! // ... the kernel restarts ...
//! let mut job = Job::attach(job.id())?;
//! job.stop()?;                         // checkpoint and exit
//! job.wait(std::time::Duration::from_secs(60))?;
//! # Ok(())
//! # }
//! ```

use std::path::{Path, PathBuf};
use std::time::Duration;

use wick::host_memory::HeapFigures;
use wick::report::escape_html;

/// Why a job could not be started, found or signalled.
#[derive(Debug, thiserror::Error)]
pub enum JobError {
    /// A file or process operation failed.
    #[error("{what}: {source}")]
    Io {
        /// What was being done.
        what: String,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// No job has this id.
    #[error("no job `{0}` (see `wick jobs`)")]
    Unknown(String),
    /// The job did not end within the time given.
    #[error("job `{id}` still runs after {waited:?}")]
    Timeout {
        /// The job.
        id: String,
        /// How long was waited.
        waited: Duration,
    },
}

fn io(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> JobError {
    let what = what.into();
    move |source| JobError::Io { what, source }
}

/// What a job's program reports in its run folder's `status.json`.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Progress {
    /// Steps done.
    pub step: u64,
    /// Steps in all.
    pub steps: u64,
    /// The last loss.
    pub loss: Option<f64>,
    /// Resident memory of the process, bytes.
    pub rss_bytes: Option<usize>,
    /// The heap's allocated, peak, reserved and budget bytes, when the process's allocator
    /// counts them (the `wick` binary installs the caching heap).
    #[serde(default)]
    pub heap: Option<HeapFigures>,
    /// The newest checkpoint's manifest.
    pub last_checkpoint: Option<String>,
    /// `running`, `finished`, `stopped` (by SIGTERM, resumable) or `failed`.
    pub state: String,
    /// Why it ended (the error, or how it stopped).
    pub exit_reason: Option<String>,
    /// Each rank's figures when the run has several (rank 0 writes them all).
    #[serde(default)]
    pub ranks: Vec<RankFigures>,
}

/// One rank's figures in a multi-rank run.
#[derive(Debug, Clone, Copy, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct RankFigures {
    /// The rank.
    pub rank: usize,
    /// Resident memory of its process, bytes.
    pub rss_bytes: Option<usize>,
    /// Its heap's allocated bytes (the `wick` binary's caching heap).
    pub heap_allocated: Option<usize>,
    /// Its heap's peak.
    pub heap_peak: Option<usize>,
}

/// The environment variable through which [`Job::spawn`] tells the program where its own status
/// goes (a job's status must not be overwritten by a later run in the same folder).
pub const STATUS_ENV: &str = "WICK_JOB_STATUS";

/// Replaces `path` by `bytes` so that a reader never sees half of it (a rename; not flushed to
/// disk: status is rewritten every few steps).
fn replace(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    // One temporary name per file, not per process: a status file has one writer at a time, and a
    // writer killed between write and rename leaves a temporary that the next write (a resumed
    // run's first) takes over, instead of one per killed process left for good.
    let name = path.file_name().map_or_else(Default::default, |n| n.to_string_lossy().into_owned());
    let tmp = path.with_file_name(format!(".{name}.tmp"));
    std::fs::write(&tmp, bytes)?;
    std::fs::rename(&tmp, path)
}

/// Writes `progress` as the run folder's `status.json` and, in a job, as the job's own status
/// (the file [`STATUS_ENV`] names).
pub fn write_status(dir: &Path, progress: &Progress) -> std::io::Result<()> {
    let bytes = serde_json::to_vec_pretty(progress).map_err(std::io::Error::other)?;
    replace(&dir.join("status.json"), &bytes)?;
    if let Some(own) = std::env::var_os(STATUS_ENV) {
        replace(Path::new(&own), &bytes)?;
    }
    Ok(())
}

/// A job's registration: what `wick jobs` lists.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Registration {
    /// The job's id.
    pub id: String,
    /// Its process.
    pub pid: u32,
    /// The process's start time (clock ticks after boot), so a reused pid is not taken for it.
    pub start_ticks: u64,
    /// Its run folder (status, log, checkpoints).
    pub dir: PathBuf,
    /// The command line.
    pub command: Vec<String>,
}

/// Where the registrations live.
pub fn registry() -> Result<PathBuf, JobError> {
    let dir = wick::files::output_dir().map_err(io("the output folder"))?.join("jobs");
    std::fs::create_dir_all(&dir).map_err(io(format!("creating {}", dir.display())))?;
    Ok(dir)
}

/// A job: its registration, and the child handle when this process started it.
pub struct Job {
    registration: Registration,
    child: Option<std::process::Child>,
}

impl Job {
    /// Starts `program args…` in its own session (`setsid`: it survives this process, its
    /// terminal and its notebook kernel), stdin closed, stdout and stderr to `dir/log.txt`, and
    /// registers it.
    pub fn spawn(program: impl AsRef<Path>, args: &[&str], dir: &Path) -> Result<Job, JobError> {
        use std::os::unix::process::CommandExt;
        std::fs::create_dir_all(dir).map_err(io(format!("creating {}", dir.display())))?;
        let log_path = dir.join("log.txt");
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&log_path)
            .map_err(io(format!("opening {}", log_path.display())))?;
        let err_log = log.try_clone().map_err(io("duplicating the log"))?;
        let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos());
        let id = format!("{:08x}", (nanos as u64 ^ u64::from(std::process::id()).rotate_left(32)) as u32);
        let registry = registry()?;
        let mut cmd = std::process::Command::new(program.as_ref());
        cmd.args(args)
            .env(STATUS_ENV, registry.join(format!("{id}.status.json")))
            .stdin(std::process::Stdio::null())
            .stdout(log)
            .stderr(err_log);
        // SAFETY: `setsid` is async-signal-safe and touches no memory of this process.
        unsafe {
            cmd.pre_exec(|| {
                if libc::setsid() < 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        let child = cmd.spawn().map_err(io(format!("starting {}", program.as_ref().display())))?;
        let pid = child.id();
        let start_ticks = wick::machine::proc_stat(pid).map_or(0, |(t, _)| t);
        let mut command = vec![program.as_ref().display().to_string()];
        command.extend(args.iter().map(|a| a.to_string()));
        let dir = std::fs::canonicalize(dir).unwrap_or_else(|_| dir.to_path_buf());
        let registration = Registration { id, pid, start_ticks, dir, command };
        let path = registry.join(format!("{}.json", registration.id));
        let json = serde_json::to_vec_pretty(&registration).map_err(|e| io("registering")(std::io::Error::other(e)))?;
        wick::files::write_atomic(&path, &json).map_err(io(format!("writing {}", path.display())))?;
        Ok(Job { registration, child: Some(child) })
    }

    /// The job registered as `id` (after a notebook restart, or from another process).
    pub fn attach(id: &str) -> Result<Job, JobError> {
        if id.is_empty() || !id.chars().all(|c| c.is_ascii_alphanumeric()) {
            return Err(JobError::Unknown(id.to_string()));
        }
        let path = registry()?.join(format!("{id}.json"));
        let text = std::fs::read(&path).map_err(|_| JobError::Unknown(id.to_string()))?;
        let registration: Registration = serde_json::from_slice(&text)
            .map_err(|e| io(format!("reading {}", path.display()))(std::io::Error::other(e)))?;
        Ok(Job { registration, child: None })
    }

    /// Every registered job, oldest first.
    pub fn list() -> Result<Vec<Job>, JobError> {
        let mut jobs: Vec<Job> = std::fs::read_dir(registry()?)
            .map_err(io("listing jobs"))?
            .filter_map(|e| e.ok())
            .filter_map(|e| {
                e.file_name().to_str()?.strip_suffix(".json").filter(|s| !s.contains('.')).map(String::from)
            })
            .filter_map(|id| Job::attach(&id).ok())
            .collect();
        jobs.sort_by_key(|j| j.registration.start_ticks);
        Ok(jobs)
    }

    /// The id.
    pub fn id(&self) -> &str {
        &self.registration.id
    }

    /// The registration.
    pub fn registration(&self) -> &Registration {
        &self.registration
    }

    /// True while the job's process runs (the same process: its start time matches).
    pub fn is_running(&mut self) -> bool {
        if let Some(child) = self.child.as_mut() {
            return matches!(child.try_wait(), Ok(None));
        }
        matches!(wick::machine::proc_stat(self.registration.pid), Some((t, zombie)) if t == self.registration.start_ticks && !zombie)
    }

    /// Its progress and whether it runs. A job whose process is gone while its status still
    /// says `running` was killed or crashed: its state reads `died`.
    pub fn status(&mut self) -> Result<JobStatus, JobError> {
        let running = self.is_running();
        let path = registry()?.join(format!("{}.status.json", self.registration.id));
        let mut progress: Progress = match std::fs::read(&path) {
            Ok(bytes) => serde_json::from_slice(&bytes).unwrap_or_default(),
            Err(_) => Progress { state: "starting".into(), ..Progress::default() },
        };
        if !running && (progress.state == "running" || progress.state == "starting") {
            progress.state = "died".into();
            progress
                .exit_reason
                .get_or_insert_with(|| "the process ended without reporting (killed or crashed)".into());
        }
        Ok(JobStatus { id: self.registration.id.clone(), pid: self.registration.pid, running, progress })
    }

    /// Asks the job to checkpoint and exit (SIGTERM); a job that is not running is left alone.
    pub fn stop(&mut self) -> Result<(), JobError> {
        if !self.is_running() {
            return Ok(());
        }
        let pid =
            libc::pid_t::try_from(self.registration.pid).map_err(|e| io("signalling")(std::io::Error::other(e)))?;
        // SAFETY: a signal to a process this job started (its start time was checked above).
        if unsafe { libc::kill(pid, libc::SIGTERM) } != 0 {
            return Err(io("sending SIGTERM")(std::io::Error::last_os_error()));
        }
        Ok(())
    }

    /// Waits up to `timeout` for the job to end; its final status.
    pub fn wait(&mut self, timeout: Duration) -> Result<JobStatus, JobError> {
        let start = std::time::Instant::now();
        while self.is_running() {
            if start.elapsed() >= timeout {
                return Err(JobError::Timeout { id: self.registration.id.clone(), waited: timeout });
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        self.status()
    }

    /// Removes the registration and the job's status (not the run folder).
    pub fn forget(self) -> Result<(), JobError> {
        let registry = registry()?;
        let _ = std::fs::remove_file(registry.join(format!("{}.status.json", self.registration.id)));
        let path = registry.join(format!("{}.json", self.registration.id));
        std::fs::remove_file(&path).map_err(io(format!("removing {}", path.display())))
    }
}

/// A job's state at one moment.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct JobStatus {
    /// The job.
    pub id: String,
    /// Its process.
    pub pid: u32,
    /// Whether the process runs.
    pub running: bool,
    /// What it reported.
    pub progress: Progress,
}

impl std::fmt::Display for JobStatus {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let p = &self.progress;
        write!(f, "{} pid {} {:<8} step {}/{}", self.id, self.pid, p.state, p.step, p.steps)?;
        if let Some(loss) = p.loss {
            write!(f, " loss {loss:.4}")?;
        }
        if let Some(h) = &p.heap {
            write!(f, " {h}")?;
        }
        if let Some(rss) = p.rss_bytes {
            write!(f, " rss {}", wick::memory::format_bytes(rss as u64))?;
        }
        if let Some(c) = &p.last_checkpoint {
            write!(f, " checkpoint {c}")?;
        }
        if let Some(why) = &p.exit_reason {
            write!(f, " ({why})")?;
        }
        let b = |n: Option<usize>| n.map_or_else(|| "-".to_string(), |n| wick::memory::format_bytes(n as u64));
        for r in p.ranks.iter().filter(|_| p.ranks.len() > 1) {
            write!(
                f,
                "\n    rank {}: allocated {} peak {} rss {}",
                r.rank,
                b(r.heap_allocated),
                b(r.heap_peak),
                b(r.rss_bytes)
            )?;
        }
        Ok(())
    }
}

impl JobStatus {
    /// The status as an HTML card: a progress bar, the loss, memory, the last checkpoint.
    pub fn to_html(&self) -> String {
        let p = &self.progress;
        let percent = if p.steps > 0 { (p.step as f64 / p.steps as f64 * 100.0).min(100.0) } else { 0.0 };
        let mut rows = format!("<tr><td>state</td><td>{}</td></tr>", escape_html(&p.state));
        if let Some(loss) = p.loss {
            rows.push_str(&format!("<tr><td>loss</td><td>{loss:.4}</td></tr>"));
        }
        if let Some(h) = &p.heap {
            rows.push_str(&format!("<tr><td>heap</td><td>{}</td></tr>", escape_html(&h.to_string())));
        }
        if let Some(rss) = p.rss_bytes {
            rows.push_str(&format!(
                "<tr><td>memory (RSS)</td><td>{}</td></tr>",
                wick::memory::format_bytes(rss as u64)
            ));
        }
        if let Some(c) = &p.last_checkpoint {
            rows.push_str(&format!("<tr><td>last checkpoint</td><td><code>{}</code></td></tr>", escape_html(c)));
        }
        if let Some(why) = &p.exit_reason {
            rows.push_str(&format!("<tr><td>exit</td><td>{}</td></tr>", escape_html(why)));
        }
        format!(
            "<div class=\"wick-job\"><b>job {}</b> (pid {}): step {}/{}\
             <div style=\"background:#eee;width:320px;height:10px\"><div style=\"background:#4a7;width:{percent:.1}%;height:10px\"></div></div>\
             <table>{rows}</table></div>",
            escape_html(&self.id),
            self.pid,
            p.step,
            p.steps
        )
    }

    /// evcxr rich display: the HTML card with the text as fallback.
    pub fn evcxr_display(&self) {
        wick::report::display(&self.to_string(), &self.to_html());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_status_write_takes_over_the_temporary_a_killed_writer_left() {
        let dir = std::env::temp_dir().join(format!("wick-jobs-status-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        // What a writer killed between write and rename leaves.
        std::fs::write(dir.join(".status.json.tmp"), b"{half").unwrap();
        let progress = Progress { step: 7, steps: 9, state: "running".into(), ..Progress::default() };
        write_status(&dir, &progress).unwrap();
        let names: Vec<String> =
            std::fs::read_dir(&dir).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
        assert_eq!(names, vec!["status.json".to_string()]);
        let back: Progress = serde_json::from_slice(&std::fs::read(dir.join("status.json")).unwrap()).unwrap();
        assert_eq!(back, progress);
        let _ = std::fs::remove_dir_all(&dir);
    }
}
