//! `wick monitor`: a live view of memory — the host and its cgroup, every GPU the driver lists
//! (used/total, utilisation, its processes), and every wick job (from the status files the jobs
//! publish: allocated, peak, reserved and budget, with a sparkline of the last minute). A
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
use wick::gpu::{GpuReport, Gpus};
use wick::jobs::{Job, JobStatus};
use wick::machine::HostInfo;
use wick_memory::format_bytes;

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
}

impl Frame {
    fn take(gpus: &Gpus) -> Self {
        let jobs =
            Job::list().map(|jobs| jobs.into_iter().filter_map(|mut j| j.status().ok()).collect()).unwrap_or_default();
        Frame { host: HostInfo::probe(), gpus: gpus.report(), jobs }
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

const JOB_HEADER: [&str; 9] = ["job", "pid", "state", "step", "loss", "allocated", "peak", "reserved", "budget"];

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
        for j in &f.jobs {
            out.push_str(&job_cells(j).join("\t"));
            out.push('\n');
        }
    }
    out
}

/// The last minute of a job's allocated bytes (or RSS), one sample per refresh.
struct History {
    samples: HashMap<String, VecDeque<u64>>,
    keep: usize,
}

impl History {
    fn record(&mut self, f: &Frame) {
        for j in &f.jobs {
            let v = j.progress.heap.map(|h| h.allocated).or(j.progress.rss_bytes).unwrap_or(0) as u64;
            let q = self.samples.entry(j.id.clone()).or_default();
            q.push_back(v);
            while q.len() > self.keep {
                q.pop_front();
            }
        }
    }
}

fn draw(frame: &mut ratatui::Frame, f: &Frame, history: &History) {
    let running: Vec<&JobStatus> = f.jobs.iter().filter(|j| j.running).collect();
    let gpu_lines = f.gpu_lines();
    let areas = Layout::vertical([
        Constraint::Length(3),
        // A reason line (no driver) may wrap once.
        Constraint::Length(gpu_lines.len() as u16 + 2 + u16::from(f.gpus.devices.is_empty())),
        Constraint::Min(4),
        Constraint::Length(if running.is_empty() { 0 } else { 3 * running.len().min(4) as u16 }),
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
    let rows: Vec<Row> = f.jobs.iter().map(|j| Row::new(job_cells(j))).collect();
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
    let spark_areas =
        Layout::vertical(running.iter().take(4).map(|_| Constraint::Length(3)).collect::<Vec<_>>()).split(areas[3]);
    for (j, area) in running.iter().zip(spark_areas.iter()) {
        let data: Vec<u64> = history.samples.get(&j.id).map(|q| q.iter().copied().collect()).unwrap_or_default();
        frame.render_widget(
            Sparkline::default()
                .data(&data)
                .style(Style::default().fg(Color::Green))
                .block(Block::default().borders(Borders::ALL).title(format!(" {} allocated, last minute ", j.id))),
            *area,
        );
    }
    frame.render_widget(Paragraph::new("q quits"), areas[4]);
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
            let json = serde_json::json!({"host": f.host, "gpus": f.gpus, "jobs": f.jobs});
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
