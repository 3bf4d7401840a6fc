//! `wick report FILE`: a saved allocator snapshot (`Snapshot::to_json`), allocator history (a
//! JSON array of `HistoryEntry`, as `CachingAllocator::history()` serialises) or recorded run
//! (`MemoryHistory::write_json`, e.g. `zoo-speed --record-history`) rendered as wick's
//! self-contained HTML report, or as text.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use clap::Args;
use wick::report::escape_html;
use wick::{HistoryReport, MemoryHistory};
use wick_memory::{format_bytes, memory_summary, HistoryEntry, Snapshot};

/// The largest file `wick report` reads (a history of millions of events is well under it).
const MAX_FILE: u64 = 1 << 30;

/// `wick report` arguments.
#[derive(Debug, Args)]
pub struct ReportArgs {
    /// A snapshot or history JSON file.
    pub file: PathBuf,
    /// Where to write the HTML page (default: FILE with `.html`).
    #[arg(long, conflicts_with = "text")]
    pub out: Option<PathBuf>,
    /// Print the report as text instead of writing HTML.
    #[arg(long)]
    pub text: bool,
}

/// What a file holds.
enum Saved {
    Snapshot(Box<Snapshot>),
    History(Vec<HistoryEntry>),
    Run(Box<MemoryHistory>),
}

fn read(path: &Path) -> Result<Saved> {
    let size = std::fs::metadata(path).with_context(|| format!("reading {}", path.display()))?.len();
    if size > MAX_FILE {
        bail!(
            "{}: {} is larger than the {} a report reads",
            path.display(),
            format_bytes(size),
            format_bytes(MAX_FILE)
        );
    }
    let text = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let value: serde_json::Value =
        serde_json::from_str(&text).with_context(|| format!("{}: not JSON", path.display()))?;
    if value.is_array() {
        let entries: Vec<HistoryEntry> = serde_json::from_value(value)
            .with_context(|| format!("{}: a JSON array, but not an allocator history", path.display()))?;
        return Ok(Saved::History(entries));
    }
    if MemoryHistory::is_recorded_run(&value) {
        let run: MemoryHistory = serde_json::from_value(value)
            .with_context(|| format!("{}: an object with `heap`, but not a recorded run", path.display()))?;
        return Ok(Saved::Run(Box::new(run)));
    }
    if value.get("segments").is_some() {
        let snapshot = Snapshot::from_json(&text).with_context(|| format!("{}: not a snapshot", path.display()))?;
        return Ok(Saved::Snapshot(Box::new(snapshot)));
    }
    bail!(
        "{}: neither a snapshot (an object with `segments`), an allocator history (an array of events) nor a \
         recorded run (an object with `heap` and `labels`)",
        path.display()
    )
}

/// The snapshot as text: PyTorch's `memory_summary` table, then one line per segment.
fn snapshot_text(s: &Snapshot) -> String {
    let mut out = memory_summary(&s.device, &s.stats, s.limit);
    let sum = |f: fn(&wick_memory::SegmentSnapshot) -> usize| {
        s.segments.iter().map(f).fold(0usize, usize::saturating_add) as u64
    };
    out.push_str(&format!(
        "\n{} segments, {} reserved, {} allocated\n",
        s.segments.len(),
        format_bytes(sum(|g| g.total_size)),
        format_bytes(sum(|g| g.allocated_size))
    ));
    for g in &s.segments {
        out.push_str(&format!(
            "  {:#014x} {:>12} {} stream {}: {} allocated in {} blocks\n",
            g.address,
            format_bytes(g.total_size as u64),
            g.segment_type,
            g.stream,
            format_bytes(g.allocated_size as u64),
            g.blocks.len()
        ));
    }
    out
}

/// The snapshot as a self-contained page: the summary and a bar per segment (its blocks to
/// scale: allocated dark, inactive light).
fn snapshot_html(s: &Snapshot) -> String {
    let mut bars = String::new();
    for g in &s.segments {
        let total = g.total_size.max(1) as f64;
        let mut cells = String::new();
        for b in &g.blocks {
            let percent = b.size as f64 / total * 100.0;
            let colour = if format!("{:?}", b.state).contains("Allocated") { "#3a6" } else { "#dde" };
            cells.push_str(&format!(
                "<div title='{} {:?}' style='display:inline-block;height:14px;width:{percent:.3}%;background:{colour}'></div>",
                escape_html(&format_bytes(b.size as u64)),
                b.state
            ));
        }
        bars.push_str(&format!(
            "<div style='margin:2px 0'><code>{:#x}</code> {}<div style='width:800px;border:1px solid #999'>{cells}</div></div>",
            g.address,
            escape_html(&format_bytes(g.total_size as u64))
        ));
    }
    format!(
        "<!DOCTYPE html><html><head><meta charset='utf-8'><title>wick snapshot — {}</title></head><body>\
         <h1>wick snapshot — {}</h1><pre>{}</pre><h2>segments</h2>{bars}</body></html>",
        escape_html(&s.device),
        escape_html(&s.device),
        escape_html(&snapshot_text(s))
    )
}

/// Runs `wick report`.
pub fn run(args: &ReportArgs) -> Result<()> {
    let saved = read(&args.file)?;
    let title = format!("wick history — {}", args.file.display());
    let (text, html) = match &saved {
        Saved::Snapshot(s) => (snapshot_text(s), snapshot_html(s)),
        Saved::History(h) => {
            let r = HistoryReport::from_history(&title, h);
            (r.to_text(), r.to_html())
        }
        Saved::Run(run) => {
            let title = format!("wick recorded run — {}", args.file.display());
            let heap = &run.heap;
            let first = format!(
                "{}: {} events on {} (allocations of ≥ {}), {} overwritten",
                args.file.display(),
                heap.events.len(),
                run.device,
                format_bytes(heap.min_size as u64),
                heap.dropped
            );
            let held = run.held_at_peak().map(|h| h.to_string()).unwrap_or_else(|| "no events".into());
            (format!("{first}\n{held}"), run.to_html(&title))
        }
    };
    if args.text {
        println!("{text}");
        return Ok(());
    }
    let out = args.out.clone().unwrap_or_else(|| args.file.with_extension("html"));
    wick::files::write_atomic(&out, html.as_bytes()).with_context(|| format!("writing {}", out.display()))?;
    println!("{}", text.lines().next().unwrap_or_default());
    println!("wrote {}", out.display());
    Ok(())
}
