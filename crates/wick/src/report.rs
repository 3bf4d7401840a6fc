//! Reports people would rather look at than read: the memory figures as a text table, and a
//! self-contained HTML page (inline SVG, no network) with the allocated/reserved timeline, the peak
//! marked, and the live blocks at the peak. Both implement evcxr's rich display.

use std::fmt::Write;

use wick_memory::format_bytes;
use wick_memory::{peak_live, HistoryEntry};

use crate::figure::Figure;

/// A short label stored inline, so recording a sample never allocates: the engine's own
/// bookkeeping must not move the heap figures it reports.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct Label {
    bytes: [u8; 48],
    len: u8,
}

impl Label {
    /// The label, cut to at most 48 bytes at a character boundary.
    pub fn new(text: &str) -> Self {
        let mut end = text.len().min(48);
        while !text.is_char_boundary(end) {
            end -= 1;
        }
        let mut bytes = [0u8; 48];
        bytes[..end].copy_from_slice(&text.as_bytes()[..end]);
        Label { bytes, len: end as u8 }
    }

    /// The text.
    pub fn as_str(&self) -> &str {
        std::str::from_utf8(&self.bytes[..self.len as usize]).unwrap_or("")
    }
}

impl std::fmt::Debug for Label {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{:?}", self.as_str())
    }
}

impl serde::Serialize for Label {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_str(self.as_str())
    }
}

/// One point of a memory timeline.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct Sample {
    /// Milliseconds since the engine started.
    pub t_ms: f64,
    /// Allocated bytes.
    pub allocated: usize,
    /// Reserved bytes.
    pub reserved: usize,
    /// What happened there (a step, a refusal, a user mark).
    pub label: Label,
}

/// Samples in time order: a ring of fixed capacity allocated once, keeping the latest.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct Timeline {
    /// The samples, oldest first.
    pub samples: std::collections::VecDeque<Sample>,
}

/// Samples a timeline keeps.
pub const TIMELINE_CAPACITY: usize = 4096;

impl Default for Timeline {
    fn default() -> Self {
        Timeline { samples: std::collections::VecDeque::with_capacity(TIMELINE_CAPACITY) }
    }
}

impl Timeline {
    /// Adds a sample, dropping the oldest when full (never reallocates).
    pub fn push(&mut self, sample: Sample) {
        if self.samples.len() == TIMELINE_CAPACITY {
            self.samples.pop_front();
        }
        self.samples.push_back(sample);
    }
}

/// The engine's figures at one moment, each with its source.
#[derive(Debug, Clone, serde::Serialize)]
pub struct MemoryReport {
    /// Device.
    pub device: String,
    /// Allocated bytes.
    pub allocated: Figure,
    /// Reserved bytes.
    pub reserved: Figure,
    /// Peak allocated, where an exact source exists.
    pub peak_allocated: Option<Figure>,
    /// The budget.
    pub budget: Figure,
    /// Bytes still available under the budget.
    pub available: usize,
    /// Timeline of marks.
    pub timeline: Timeline,
    /// What holds memory, as accounted by its owners ([`crate::Engine::account`]).
    pub holdings: Vec<Holding>,
}

/// Memory held by one named part of a job (parameters, master weights, optimizer state).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Holding {
    /// What holds it.
    pub what: String,
    /// Bytes.
    pub bytes: usize,
}

impl std::fmt::Display for MemoryReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(f, "wick memory on {}", self.device)?;
        writeln!(f, "  {:<10} {:>12}  source", "figure", "bytes")?;
        let mut line = |name: &str, fig: &Figure| {
            writeln!(f, "  {:<10} {:>12}  {}", name, format_bytes(fig.bytes as u64), fig.source)
        };
        line("allocated", &self.allocated)?;
        line("reserved", &self.reserved)?;
        if let Some(peak) = &self.peak_allocated {
            line("peak", peak)?;
        }
        line("budget", &self.budget)?;
        writeln!(f, "  {:<10} {:>12}  what can still be had now", "available", format_bytes(self.available as u64))?;
        if !self.holdings.is_empty() {
            writeln!(f, "  held by (as accounted by their owners)")?;
            for h in &self.holdings {
                writeln!(f, "    {:<36} {:>12}", h.what, format_bytes(h.bytes as u64))?;
            }
        }
        Ok(())
    }
}

impl MemoryReport {
    /// The report as a self-contained HTML page.
    pub fn to_html(&self) -> String {
        let summary = format!("<pre>{}</pre>", escape_html(&self.to_string()));
        let samples: Vec<Sample> = self.timeline.samples.iter().cloned().collect();
        render_page(&format!("wick memory — {}", self.device), &summary, &samples, &[], "highest mark")
    }

    /// evcxr rich display: HTML with a text fallback.
    pub fn evcxr_display(&self) {
        display(&self.to_string(), &self.to_html());
    }
}

/// An HTML report built from a caching allocator's recorded history (`record_history`).
#[derive(Debug, Clone)]
pub struct HistoryReport {
    /// Title.
    pub title: String,
    /// Timeline samples, one per event.
    pub samples: Vec<Sample>,
    /// Live blocks (address, size) at the allocated peak.
    pub live_at_peak: Vec<(u64, usize)>,
}

impl HistoryReport {
    /// Builds the timeline and the live set at the peak
    /// ([`wick_memory::peak_live`]) from history entries.
    pub fn from_history(title: &str, history: &[HistoryEntry]) -> Self {
        let samples = history
            .iter()
            .map(|e| Sample {
                t_ms: e.time_ns as f64 / 1e6,
                allocated: e.allocated.max(0) as usize,
                reserved: e.reserved.max(0) as usize,
                label: Label::new(&format!("{:?}", e.action)),
            })
            .collect();
        HistoryReport { title: title.to_string(), samples, live_at_peak: peak_live(history).blocks }
    }

    /// The report as a self-contained HTML page.
    pub fn to_html(&self) -> String {
        render_page(&self.title, "", &self.samples, &self.live_at_peak, "peak")
    }

    /// A one-paragraph text version.
    pub fn to_text(&self) -> String {
        let peak = self.samples.iter().map(|s| s.allocated).max().unwrap_or(0);
        let reserved = self.samples.iter().map(|s| s.reserved).max().unwrap_or(0);
        format!(
            "{}: {} events, peak allocated {}, peak reserved {}, {} blocks live at the peak",
            self.title,
            self.samples.len(),
            format_bytes(peak as u64),
            format_bytes(reserved as u64),
            self.live_at_peak.len()
        )
    }

    /// evcxr rich display.
    pub fn evcxr_display(&self) {
        display(&self.to_text(), &self.to_html());
    }

    /// Writes the HTML page to `path` (atomically: [`crate::files::write_atomic`]).
    pub fn write(&self, path: &std::path::Path) -> std::io::Result<()> {
        crate::files::write_atomic(path, self.to_html().as_bytes())
    }
}

/// Shows `text` and `html` as an evcxr notebook cell's rich output (both forms: the notebook
/// picks HTML, a terminal the text).
pub fn display(text: &str, html: &str) {
    use std::io::Write as _;
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "EVCXR_BEGIN_CONTENT text/plain\n{text}\nEVCXR_END_CONTENT");
    let _ = writeln!(out, "EVCXR_BEGIN_CONTENT text/html\n{html}\nEVCXR_END_CONTENT");
}

/// `text` made safe inside HTML elements (`&`, `<`, `>` escaped), for wick's self-contained
/// reports and cards.
pub fn escape_html(text: &str) -> String {
    text.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;")
}

/// Renders the page: the summary, an SVG timeline (allocated solid, reserved dashed, peak marked)
/// and the live blocks at the peak.
/// `peak_label` names the marked maximum: "peak" when the samples are every allocator event, "highest
/// mark" when they are only the marks (the true peak may fall between two marks).
fn render_page(title: &str, summary: &str, samples: &[Sample], live: &[(u64, usize)], peak_label: &str) -> String {
    let (w, h, pad) = (900.0, 320.0, 50.0);
    let t_max = samples.iter().map(|s| s.t_ms).fold(0.0, f64::max).max(1e-9);
    let y_max = samples.iter().map(|s| s.allocated.max(s.reserved)).max().unwrap_or(0).max(1) as f64;
    let x = |t: f64| pad + (w - 2.0 * pad) * t / t_max;
    let y = |b: usize| h - pad - (h - 2.0 * pad) * b as f64 / y_max;
    let line = |pick: fn(&Sample) -> usize| {
        samples.iter().map(|s| format!("{:.1},{:.1}", x(s.t_ms), y(pick(s)))).collect::<Vec<_>>().join(" ")
    };
    let mut svg = format!(
        "<svg xmlns='http://www.w3.org/2000/svg' width='{w}' height='{h}' role='img' aria-label='memory timeline'>\
         <rect width='100%' height='100%' fill='#fff'/>\
         <line x1='{pad}' y1='{b}' x2='{r}' y2='{b}' stroke='#888'/><line x1='{pad}' y1='{pad}' x2='{pad}' y2='{b}' stroke='#888'/>\
         <text x='{pad}' y='{t}' font-size='12'>{}</text><text x='{r}' y='{l}' font-size='12' text-anchor='end'>{:.1} ms</text>",
        format_bytes(y_max as u64),
        t_max,
        b = h - pad,
        r = w - pad,
        t = pad - 8.0,
        l = h - pad + 16.0,
    );
    if !samples.is_empty() {
        let _ = write!(
            svg,
            "<polyline fill='none' stroke='#c33' stroke-dasharray='6 3' points='{}'/>",
            line(|s| s.reserved)
        );
        let _ =
            write!(svg, "<polyline fill='none' stroke='#36c' stroke-width='2' points='{}'/>", line(|s| s.allocated));
        if let Some(peak) = samples.iter().max_by_key(|s| s.allocated) {
            let (px, py) = (x(peak.t_ms), y(peak.allocated));
            // Keep the label inside the picture when the peak is near the right edge.
            let (lx, anchor) = if px > 0.7 * w { (px - 8.0, "end") } else { (px + 8.0, "start") };
            let _ = write!(
                svg,
                "<circle cx='{px:.1}' cy='{py:.1}' r='5' fill='#36c'/><text x='{lx:.1}' y='{:.1}' font-size='12' text-anchor='{anchor}'>{peak_label} {}</text>",
                py - 8.0,
                format_bytes(peak.allocated as u64)
            );
        }
    }
    svg.push_str("<text x='60' y='20' font-size='12' fill='#36c'>allocated</text><text x='140' y='20' font-size='12' fill='#c33'>reserved</text></svg>");
    let mut blocks = String::new();
    if !live.is_empty() {
        blocks.push_str("<h2>Live blocks at the peak</h2><table><tr><th>address</th><th>size</th></tr>");
        for (addr, size) in live {
            let _ = write!(blocks, "<tr><td><code>{addr:#x}</code></td><td>{}</td></tr>", format_bytes(*size as u64));
        }
        blocks.push_str("</table>");
    }
    let marks: String = samples
        .iter()
        .filter(|s| {
            !matches!(s.label.as_str(), "Alloc" | "FreeRequested" | "FreeCompleted" | "SegmentAlloc" | "SegmentFree")
        })
        .map(|s| {
            format!(
                "<li>{:.1} ms — {}: allocated {}, reserved {}</li>",
                s.t_ms,
                escape_html(s.label.as_str()),
                format_bytes(s.allocated as u64),
                format_bytes(s.reserved as u64)
            )
        })
        .collect();
    format!(
        "<!DOCTYPE html><html><head><meta charset='utf-8'><title>{t}</title>\
         <style>body{{font-family:sans-serif;margin:1.5em}}table{{border-collapse:collapse}}td,th{{border:1px solid #ccc;padding:2px 8px}}</style>\
         </head><body><h1>{t}</h1>{summary}{svg}<ul>{marks}</ul>{blocks}</body></html>",
        t = escape_html(title)
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use wick_memory::{AllocateExt, CachingAllocator, SimulatedBackend};

    #[test]
    fn history_report_marks_the_real_peak_and_its_live_blocks() {
        let a = CachingAllocator::new(SimulatedBackend::new(1 << 30));
        a.record_history(1000);
        let x = a.allocate(3 << 20).unwrap();
        let y = a.allocate(5 << 20).unwrap();
        let (xa, ya) = (x.addr(), y.addr());
        drop(x);
        drop(y);
        let _z = a.allocate(1 << 20).unwrap();
        let report = HistoryReport::from_history("test", &a.history());
        let mut expected = vec![(xa, 3 << 20), (ya, 5 << 20)];
        expected.sort();
        assert_eq!(report.live_at_peak, expected);
        let html = report.to_html();
        assert!(html.starts_with("<!DOCTYPE html>") && html.contains("<svg") && html.contains("peak 8.00 MiB"));
        assert!(!html.contains("<script") && !html.contains("src=") && !html.contains("href="), "self-contained");
        assert!(report.to_text().contains("peak allocated 8.00 MiB"));
    }
}
