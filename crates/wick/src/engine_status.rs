//! Every live [`crate::engine::Engine`] publishes what it holds — allocated, reserved, peak and
//! budget, once a second — in a small status file under [`crate::files::output_dir`]`/engines`,
//! so that `wick monitor` shows every wick process on the machine (a notebook kernel, a script, a
//! job) the way `nvidia-smi` shows GPU processes, without the process having to do anything.
//!
//! Rationale: a file per engine, not a socket or shared memory: the monitor may start before or
//! after the engine, any number of monitors may read, and a process killed with SIGKILL leaves a
//! file that a reader recognises as stale (its pid is gone or belongs to a later process: the
//! start time in `/proc/PID/stat` differs) and removes. A thread rather than writes on engine
//! calls: an engine that sits idle in a notebook between cells is still shown with current
//! figures (its tensors are still held). The thread stops and the file goes when the engine is
//! dropped. `WICK_PUBLISH=0` turns publishing off.
//!
//! The thread allocates nothing once started (figures read into the stack, the status
//! serialised into a buffer it keeps, the paths made once): the heap figures it publishes are
//! the ones step reports and tests measure exactly, and a writer's transient allocations would
//! move them — a step's peak, `allocated` before and after — once a second.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// The environment variable that turns publishing off (`0`, `off`, `false` or `no`).
pub const PUBLISH_ENV: &str = "WICK_PUBLISH";

/// How often an engine rewrites its status.
pub const PUBLISH_INTERVAL: Duration = Duration::from_secs(1);

/// One engine's published figures.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct EngineStatus {
    /// Tells this engine from others of its process: `PID-TOKEN`, the file's name.
    pub id: String,
    /// The process holding the engine.
    pub pid: u32,
    /// The process's start time (clock ticks after boot), so a reused pid is not taken for it.
    pub start_ticks: u64,
    /// The process's name (`/proc/PID/comm`: `evcxr_jupyter`, `train_amp`, …).
    pub program: String,
    /// The engine's device (`cpu`, `cuda:0`).
    pub device: String,
    /// [`crate::engine::Engine::allocated`], bytes.
    pub allocated: usize,
    /// [`crate::engine::Engine::reserved`], bytes.
    pub reserved: usize,
    /// [`crate::engine::Engine::peak_allocated`], bytes, where the source is exact.
    pub peak: Option<usize>,
    /// [`crate::engine::Engine::budget`], bytes.
    pub budget: usize,
    /// When it was written, milliseconds after the Unix epoch.
    pub updated_unix_ms: u64,
}

/// The figures a publisher reads each time it writes.
pub(crate) struct Figures {
    pub allocated: usize,
    pub reserved: usize,
    pub peak: Option<usize>,
    pub budget: usize,
}

/// The folder the status files live in.
pub fn engines_dir() -> std::io::Result<PathBuf> {
    let dir = crate::files::output_dir()?.join("engines");
    std::fs::create_dir_all(&dir)?;
    Ok(dir)
}

fn publishing_enabled() -> bool {
    match std::env::var(PUBLISH_ENV) {
        Ok(v) => !matches!(v.trim().to_ascii_lowercase().as_str(), "0" | "off" | "false" | "no"),
        Err(_) => true,
    }
}

/// Whether process `pid` is alive and is the one that started at `start_ticks`.
fn alive(pid: u32, start_ticks: u64) -> bool {
    matches!(crate::machine::proc_stat(pid), Some((t, zombie)) if t == start_ticks && !zombie)
}

/// The engines whose processes run, oldest process first. Status files of processes that are
/// gone (killed, crashed) are removed on the way, and so are temporaries they left.
pub fn live_engines() -> std::io::Result<Vec<EngineStatus>> {
    let dir = engines_dir()?;
    let mut live = Vec::new();
    for entry in std::fs::read_dir(&dir)?.filter_map(|e| e.ok()) {
        let name = entry.file_name();
        let Some(name) = name.to_str() else { continue };
        if let Some(tmp) = name.strip_prefix('.').and_then(|n| n.strip_suffix(".json.tmp")) {
            // A temporary: its writer's pid starts the name; remove it once that process is gone.
            let pid = tmp.split('-').next().and_then(|p| p.parse::<u32>().ok());
            if pid.is_some_and(|pid| crate::machine::proc_stat(pid).is_none()) {
                let _ = std::fs::remove_file(entry.path());
            }
            continue;
        }
        if !name.ends_with(".json") {
            continue;
        }
        let status: Option<EngineStatus> =
            std::fs::read(entry.path()).ok().and_then(|bytes| serde_json::from_slice(&bytes).ok());
        match status {
            Some(s) if alive(s.pid, s.start_ticks) => live.push(s),
            // A file no engine could have written, or one whose process is gone.
            _ => {
                let _ = std::fs::remove_file(entry.path());
            }
        }
    }
    live.sort_by_key(|s| (s.start_ticks, s.pid, s.device.clone()));
    Ok(live)
}

/// The thread that keeps one engine's status file current; stopping it (drop) removes the file.
pub(crate) struct Publisher {
    signal: Arc<Signal>,
    thread: Option<std::thread::JoinHandle<()>>,
    path: PathBuf,
}

/// The publisher's handshake with its engine: `ready` once the thread has started (its own
/// start-up allocations and frees are done), `stop` when the engine goes. A mutex and a condition
/// variable, not a channel: waiting on a channel allocates its waiter's entry the first time.
#[derive(Default)]
struct Signal {
    state: Mutex<(bool, bool)>,
    changed: Condvar,
}

impl Signal {
    fn lock(&self) -> MutexGuard<'_, (bool, bool)> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// 64 bits that differ between engines of one process and between processes (no counter: a
/// notebook re-creates statics per cell, so two cells' counters would both start at 0).
fn token() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    let local = 0u8;
    h.write_usize(std::ptr::addr_of!(local) as usize);
    h.write_u128(SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_nanos()));
    h.finish()
}

fn program_name() -> String {
    std::fs::read_to_string("/proc/self/comm").map_or_else(|_| "?".into(), |s| s.trim().to_string())
}

impl Publisher {
    /// Starts publishing `figures()` for `device`, now and every [`PUBLISH_INTERVAL`]; `None`
    /// when publishing is off or cannot start (no output folder, no thread): an engine works
    /// the same without it.
    pub(crate) fn start(device: String, mut figures: impl FnMut() -> Figures + Send + 'static) -> Option<Publisher> {
        if !publishing_enabled() {
            return None;
        }
        let dir = engines_dir().ok()?;
        let pid = std::process::id();
        let start_ticks = crate::machine::proc_stat(pid).map_or(0, |(t, _)| t);
        let id = format!("{pid}-{:016x}", token());
        let path = dir.join(format!("{id}.json"));
        let signal = Arc::new(Signal::default());
        let (file, tmp) = (path.clone(), dir.join(format!(".{id}.json.tmp")));
        let mut status = EngineStatus {
            id,
            pid,
            start_ticks,
            program: program_name(),
            device,
            allocated: 0,
            reserved: 0,
            peak: None,
            budget: 0,
            updated_unix_ms: 0,
        };
        // Far more than a status takes (about 250 bytes), so serialising never grows it.
        let mut buf: Vec<u8> = Vec::with_capacity(4096);
        let mut write = move || {
            let f = figures();
            status.allocated = f.allocated;
            status.reserved = f.reserved;
            status.peak = f.peak;
            status.budget = f.budget;
            status.updated_unix_ms = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64);
            buf.clear();
            if serde_json::to_writer(&mut buf, &status).is_ok() {
                // A full disk or a removed folder costs the monitor a row, never the engine.
                let _ = std::fs::write(&tmp, &buf).and_then(|()| std::fs::rename(&tmp, &file));
            }
        };
        // The first status is there when the engine is returned.
        write();
        let theirs = signal.clone();
        let thread = std::thread::Builder::new().name("wick-publish".into()).spawn(move || {
            let mut state = theirs.lock();
            state.0 = true;
            theirs.changed.notify_all();
            // `stop` is checked before each wait too: set during a write, its notice was missed.
            while !state.1 {
                // Spurious wake-ups only write early.
                state = theirs.changed.wait_timeout(state, PUBLISH_INTERVAL).unwrap_or_else(|p| p.into_inner()).0;
                if state.1 {
                    break;
                }
                drop(state);
                write();
                state = theirs.lock();
            }
        });
        let Ok(thread) = thread else {
            let _ = std::fs::remove_file(&path);
            return None;
        };
        // Returned once the thread runs: its start-up (the closure's box freed, thread-locals
        // registered) then lies before anything the caller measures.
        let mut state = signal.lock();
        while !state.0 {
            state = signal.changed.wait(state).unwrap_or_else(|p| p.into_inner());
        }
        drop(state);
        Some(Publisher { signal, thread: Some(thread), path })
    }

    /// The status file.
    pub(crate) fn path(&self) -> &Path {
        &self.path
    }
}

impl Drop for Publisher {
    fn drop(&mut self) {
        self.signal.lock().1 = true;
        self.signal.changed.notify_all();
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
        let _ = std::fs::remove_file(&self.path);
    }
}
