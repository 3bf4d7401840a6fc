//! `wick monitor`: a live view of memory — the host and its cgroup, every GPU the driver lists
//! (used/total, utilisation, its processes), every wick job (from the status files the jobs
//! publish: step, loss, allocated, peak, reserved and budget) and every live engine of any wick
//! process — a notebook kernel, a script, a job — from the status file each engine keeps current
//! (`wick::engine_status`), with a sparkline of the last minute per job and engine. A
//! terminal gets a full-screen view (ratatui; `q` or Esc quits, works inside tmux); anything else
//! (a pipe, a file, `--once`) gets plain text frames.

use std::collections::{HashMap, VecDeque};
use std::io::IsTerminal;
use std::time::{Duration, Instant};

use anyhow::{bail, Result};
use clap::Args;
use ratatui::crossterm::event::{self, Event, KeyCode, KeyEventKind, KeyModifiers};
use ratatui::layout::{Constraint, Layout};
use ratatui::style::{Color, Modifier, Style};
use ratatui::text::Line;
use ratatui::widgets::{Block, Borders, Paragraph, Row, Sparkline, Table, Wrap};
use wick::engine_status::{live_engines, EngineStatus};
use wick::gpu::{GpuReport, Gpus};
use wick::machine::HostInfo;
use wick_memory::format_bytes;
use wick_train::jobs::{Job, JobStatus};

/// `wick monitor` arguments.
#[derive(Debug, Args)]
pub struct MonitorArgs {
    /// Seconds between refreshes.
    #[arg(long, default_value_t = 1.0)]
    pub interval: f64,
    /// Print one plain-text frame and exit.
    #[arg(long)]
    pub once: bool,
    /// With --once: the frame as JSON.
    #[arg(long, requires = "once")]
    pub json: bool,
}

/// One look at the machine.
struct Frame {
    host: HostInfo,
    gpus: GpuReport,
    jobs: Vec<JobStatus>,
    engines: Vec<EngineStatus>,
}

impl Frame {
    fn take(gpus: &Gpus) -> Self {
        let jobs =
            Job::list().map(|jobs| jobs.into_iter().filter_map(|mut j| j.status().ok()).collect()).unwrap_or_default();
        let engines = live_engines().unwrap_or_default();
        Frame { host: HostInfo::probe(), gpus: gpus.report(), jobs, engines }
    }

    fn host_line(&self) -> String {
        let h = &self.host;
        let b = |n: Option<u64>| n.map_or_else(|| "?".to_string(), format_bytes);
        let used = h.total_bytes.zip(h.available_bytes).map(|(t, a)| t.saturating_sub(a));
        let cgroup = match (h.cgroup_usage_bytes, h.cgroup_limit_bytes) {
            (Some(u), Some(l)) => format!(" · cgroup {} of {}", b(Some(u)), b(Some(l))),
            (Some(u), None) => format!(" · cgroup {} (no limit)", b(Some(u))),
            _ => String::new(),
        };
        format!("host {} used of {} ({} available){cgroup}", b(used), b(h.total_bytes), b(h.available_bytes))
    }

    fn gpu_lines(&self) -> Vec<String> {
        if self.gpus.devices.is_empty() {
            return vec![format!("GPUs: {}", self.gpus.summary())];
        }
        self.gpus
            .devices
            .iter()
            .map(|g| {
                let procs: Vec<String> = g
                    .processes
                    .iter()
                    .map(|p| format!("{} {}", p.pid, p.used_bytes.map_or_else(|| "?".into(), format_bytes)))
                    .collect();
                format!(
                    "GPU {} {}: {} / {} used, {} busy; processes: {}",
                    g.index,
                    g.name,
                    format_bytes(g.used_bytes),
                    format_bytes(g.total_bytes),
                    g.utilization_percent.map_or_else(|| "?".into(), |u| format!("{u} %")),
                    if procs.is_empty() { "none visible".into() } else { procs.join(", ") }
                )
            })
            .collect()
    }
}

/// The columns of a job row.
fn job_cells(j: &JobStatus) -> [String; 9] {
    let p = &j.progress;
    let h = p.heap;
    let b = |n: Option<usize>| n.map_or_else(|| "-".to_string(), |n| format_bytes(n as u64));
    [
        j.id.clone(),
        j.pid.to_string(),
        p.state.clone(),
        format!("{}/{}", p.step, p.steps),
        p.loss.map_or_else(|| "-".into(), |l| format!("{l:.4}")),
        b(h.map(|h| h.allocated).or(p.rss_bytes)),
        b(h.map(|h| h.peak)),
        b(h.map(|h| h.reserved)),
        b(h.map(|h| h.budget)),
    ]
}

/// A job's rows: its own, then one per rank of a multi-rank run (each rank's heap).
fn job_rows(j: &JobStatus) -> Vec<[String; 9]> {
    let b = |n: Option<usize>| n.map_or_else(|| "-".to_string(), |n| format_bytes(n as u64));
    let mut rows = vec![job_cells(j)];
    for r in j.progress.ranks.iter().filter(|_| j.progress.ranks.len() > 1) {
        let dash = || "-".to_string();
        rows.push([
            format!("  rank {}", r.rank),
            dash(),
            dash(),
            dash(),
            dash(),
            b(r.heap_allocated.or(r.rss_bytes)),
            b(r.heap_peak),
            dash(),
            dash(),
        ]);
    }
    rows
}

const JOB_HEADER: [&str; 9] = ["job", "pid", "state", "step", "loss", "allocated", "peak", "reserved", "budget"];

/// The columns of an engine row.
fn engine_cells(e: &EngineStatus) -> [String; 7] {
    let b = |n: usize| format_bytes(n as u64);
    [
        e.pid.to_string(),
        e.program.clone(),
        e.device.clone(),
        b(e.allocated),
        e.peak.map_or_else(|| "-".to_string(), b),
        b(e.reserved),
        b(e.budget),
    ]
}

const ENGINE_HEADER: [&str; 7] = ["pid", "program", "device", "allocated", "peak", "reserved", "budget"];

fn text_frame(f: &Frame) -> String {
    let mut out = format!("wick monitor — {}\n", f.host_line());
    for line in f.gpu_lines() {
        out.push_str(&line);
        out.push('\n');
    }
    if f.jobs.is_empty() {
        out.push_str("no wick jobs\n");
    } else {
        out.push_str(&JOB_HEADER.join("\t"));
        out.push('\n');
        for row in f.jobs.iter().flat_map(job_rows) {
            out.push_str(&row.join("\t"));
            out.push('\n');
        }
    }
    if f.engines.is_empty() {
        out.push_str("no wick engines\n");
    } else {
        out.push_str(&ENGINE_HEADER.join("\t"));
        out.push('\n');
        for e in &f.engines {
            out.push_str(&engine_cells(e).join("\t"));
            out.push('\n');
        }
    }
    out
}

/// The last minute of each job's and engine's allocated bytes (a job's RSS when its heap is not
/// counted), one sample per refresh; keyed by the sparkline's title.
struct History {
    samples: HashMap<String, VecDeque<u64>>,
    keep: usize,
}

impl History {
    fn record(&mut self, f: &Frame) {
        let jobs =
            f.jobs.iter().filter(|j| j.running).map(|j| {
                (job_key(j), j.progress.heap.map(|h| h.allocated).or(j.progress.rss_bytes).unwrap_or(0) as u64)
            });
        let engines = f.engines.iter().map(|e| (engine_key(e), e.allocated as u64));
        let seen: Vec<(String, u64)> = jobs.chain(engines).collect();
        // Forget what is no longer running, so the map does not grow with every process seen.
        self.samples.retain(|k, _| seen.iter().any(|(s, _)| s == k));
        for (key, v) in seen {
            let q = self.samples.entry(key).or_default();
            q.push_back(v);
            while q.len() > self.keep {
                q.pop_front();
            }
        }
    }

    /// The series, oldest first, in the order they were seen.
    fn series(&self, f: &Frame) -> Vec<(String, Vec<u64>)> {
        let keys = f.jobs.iter().filter(|j| j.running).map(job_key).chain(f.engines.iter().map(engine_key));
        keys.filter_map(|k| self.samples.get(&k).map(|q| (k.clone(), q.iter().copied().collect()))).collect()
    }
}

fn job_key(j: &JobStatus) -> String {
    format!("job {}", j.id)
}

fn engine_key(e: &EngineStatus) -> String {
    format!("{} {} (pid {})", e.program, e.device, e.pid)
}

/// Sparklines shown at most (each takes three lines).
const MAX_SPARKLINES: usize = 4;

fn draw(frame: &mut ratatui::Frame, f: &Frame, history: &History) {
    let series = history.series(f);
    let shown = series.len().min(MAX_SPARKLINES);
    let gpu_lines = f.gpu_lines();
    let areas = Layout::vertical([
        Constraint::Length(3),
        // A reason line (no driver) may wrap once.
        Constraint::Length(gpu_lines.len() as u16 + 2 + u16::from(f.gpus.devices.is_empty())),
        Constraint::Min(4),
        Constraint::Min(4),
        Constraint::Length(3 * shown as u16),
        Constraint::Length(1),
    ])
    .split(frame.area());
    let title = Style::default().add_modifier(Modifier::BOLD);
    frame.render_widget(
        Paragraph::new(f.host_line())
            .block(Block::default().borders(Borders::ALL).title(Line::styled(" wick monitor ", title))),
        areas[0],
    );
    let gpus: Vec<Line> = gpu_lines.into_iter().map(Line::from).collect();
    let gpus = Paragraph::new(gpus).wrap(Wrap { trim: true });
    frame.render_widget(gpus.block(Block::default().borders(Borders::ALL).title(" GPUs ")), areas[1]);
    let rows: Vec<Row> = f.jobs.iter().flat_map(job_rows).map(Row::new).collect();
    let widths = [
        Constraint::Length(16),
        Constraint::Length(8),
        Constraint::Length(9),
        Constraint::Length(11),
        Constraint::Length(8),
        Constraint::Length(11),
        Constraint::Length(11),
        Constraint::Length(11),
        Constraint::Length(11),
    ];
    let jobs_title = if f.jobs.is_empty() { " wick jobs: none " } else { " wick jobs " };
    frame.render_widget(
        Table::new(rows, widths)
            .header(Row::new(JOB_HEADER).style(title))
            .block(Block::default().borders(Borders::ALL).title(jobs_title)),
        areas[2],
    );
    let rows: Vec<Row> = f.engines.iter().map(|e| Row::new(engine_cells(e))).collect();
    let widths = [
        Constraint::Length(8),
        Constraint::Length(16),
        Constraint::Length(8),
        Constraint::Length(11),
        Constraint::Length(11),
        Constraint::Length(11),
        Constraint::Length(11),
    ];
    let engines_title = if f.engines.is_empty() { " wick engines: none " } else { " wick engines " };
    frame.render_widget(
        Table::new(rows, widths)
            .header(Row::new(ENGINE_HEADER).style(title))
            .block(Block::default().borders(Borders::ALL).title(engines_title)),
        areas[3],
    );
    let spark_areas = Layout::vertical(vec![Constraint::Length(3); shown]).split(areas[4]);
    for ((name, data), area) in series.iter().zip(spark_areas.iter()) {
        frame.render_widget(
            Sparkline::default()
                .data(data)
                .style(Style::default().fg(Color::Green))
                .block(Block::default().borders(Borders::ALL).title(format!(" {name}: allocated, last minute "))),
            *area,
        );
    }
    frame.render_widget(Paragraph::new("q quits"), areas[5]);
}

/// Runs `wick monitor`.
pub fn run(args: &MonitorArgs) -> Result<()> {
    if !(args.interval.is_finite() && (0.05..=3600.0).contains(&args.interval)) {
        bail!("--interval must be between 0.05 and 3600 seconds (got {})", args.interval);
    }
    let interval = Duration::from_secs_f64(args.interval);
    let gpus = Gpus::open();
    if args.once {
        let f = Frame::take(&gpus);
        if args.json {
            let json = serde_json::json!({"host": f.host, "gpus": f.gpus, "jobs": f.jobs, "engines": f.engines});
            println!("{}", serde_json::to_string_pretty(&json)?);
        } else {
            print!("{}", text_frame(&f));
        }
        return Ok(());
    }
    if !std::io::stdout().is_terminal() {
        // Plain frames for a pipe or a log, until the process is stopped.
        loop {
            println!("{}", text_frame(&Frame::take(&gpus)));
            std::thread::sleep(interval);
        }
    }
    let keep = (60.0 / args.interval).ceil().max(2.0) as usize;
    let mut history = History { samples: HashMap::new(), keep };
    let mut terminal = ratatui::try_init()?;
    let result = (|| -> Result<()> {
        loop {
            let f = Frame::take(&gpus);
            history.record(&f);
            terminal.draw(|frame| draw(frame, &f, &history))?;
            let until = Instant::now() + interval;
            while let Some(left) = until.checked_duration_since(Instant::now()) {
                if !event::poll(left)? {
                    break;
                }
                if let Event::Key(k) = event::read()? {
                    let ctrl_c = k.code == KeyCode::Char('c') && k.modifiers.contains(KeyModifiers::CONTROL);
                    if k.kind == KeyEventKind::Press && (matches!(k.code, KeyCode::Char('q') | KeyCode::Esc) || ctrl_c)
                    {
                        return Ok(());
                    }
                }
            }
        }
    })();
    ratatui::try_restore()?;
    result
}

#[cfg(test)]
mod tests {
    use super::*;
    use wick_train::jobs::{Progress, RankFigures};

    /// A multi-rank job gets a row per rank under its own, each with that rank's heap; a
    /// one-process job stays one row.
    #[test]
    fn a_multi_rank_job_shows_a_row_per_rank() {
        let rank = |r: usize, allocated: usize| RankFigures {
            rank: r,
            rss_bytes: Some(1 << 30),
            heap_allocated: Some(allocated),
            heap_peak: Some(allocated * 2),
        };
        let progress = Progress {
            step: 3,
            steps: 10,
            state: "running".into(),
            ranks: vec![rank(0, 3 << 20), rank(1, 5 << 20)],
            ..Progress::default()
        };
        let job = JobStatus { id: "j1".into(), pid: 7, running: true, progress };
        let rows = job_rows(&job);
        assert_eq!(rows.len(), 3);
        assert_eq!(rows[0][0], "j1");
        assert_eq!((rows[2][0].as_str(), rows[2][5].as_str()), ("  rank 1", format_bytes(5 << 20).as_str()));
        assert_eq!(rows[1][6], format_bytes(6 << 20));
        let alone = JobStatus { progress: Progress { ranks: vec![rank(0, 1)], ..job.progress.clone() }, ..job };
        assert_eq!(job_rows(&alone).len(), 1);
    }
}
