//! The HTML report of a recorded history: a self-contained page (inline SVG and script, no
//! network) with the active-memory timeline of stacked allocations — each allocation a band
//! from its birth to its free, stacked as memory_viz stacks them, coloured by label stack, with
//! hover (size, label stack, lifetime) and zoom (wheel; drag to pan; double-click resets) — and
//! the "held at the peak" table.

use std::fmt::Write;

use wick_memory::{format_bytes, HeapAction};

use super::MemoryHistory;
use crate::report::escape_html;

/// Allocations drawn one by one (the largest); the rest show as the gap below the grey line of
/// everything held, as memory_viz summarises small allocations.
pub const DRAWN_ALLOCATIONS: usize = 3000;

/// Points of the total-memory line at most (the largest value of each bucket is kept).
const TOTAL_POINTS: usize = 2000;

impl MemoryHistory {
    /// The report as a self-contained HTML page (see the module documentation).
    pub fn to_html(&self, title: &str) -> String {
        let lifetimes = self.heap.lifetimes();
        let n = self.heap.events.len();
        let ms = |i: usize| self.heap.events.get(i).map_or(0.0, |e| e.time_ns as f64 / 1e6);
        // The largest allocations, drawn in the order they were made.
        let mut order: Vec<usize> = (0..lifetimes.len()).collect();
        order.sort_by(|&a, &b| lifetimes[b].size.cmp(&lifetimes[a].size).then(a.cmp(&b)));
        order.truncate(DRAWN_ALLOCATIONS);
        order.sort_unstable();
        let mut label_ids: Vec<u32> = order.iter().map(|&k| lifetimes[k].label.0).collect();
        label_ids.sort_unstable();
        label_ids.dedup();
        let labels: Vec<String> = label_ids.iter().map(|&id| self.label_text(wick_memory::LabelId(id))).collect();
        // What was held before recording, as memory_viz shows it: a block from the start for
        // each free the history could not pair (freed at that event), and one for the rest.
        let before_label = labels.len();
        let mut allocs: Vec<serde_json::Value> = Vec::new();
        let mut before_freed = 0usize;
        let mut open = std::collections::HashSet::new();
        for (i, e) in self.heap.events.iter().enumerate() {
            match e.action {
                HeapAction::Alloc => {
                    open.insert(e.addr);
                }
                HeapAction::Free if !open.remove(&e.addr) => {
                    before_freed = before_freed.saturating_add(e.size);
                    allocs.push(serde_json::json!([0, i, e.size, before_label, 0.0, Some(ms(i))]));
                }
                HeapAction::Free => {}
            }
        }
        let still_held = self.heap.baseline.saturating_sub(before_freed);
        if still_held > 0 {
            allocs.push(serde_json::json!([0, -1, still_held, before_label, 0.0, None::<f64>]));
        }
        let before_blocks = allocs.len();
        let mut labels = labels;
        labels.push("held before recording started".to_string());
        allocs.extend(order.iter().map(|&k| {
            let l = &lifetimes[k];
            let label = label_ids.binary_search(&l.label.0).unwrap_or(0);
            let freed = l.freed.map_or(-1i64, |f| f as i64);
            serde_json::json!([l.born, freed, l.size, label, ms(l.born), l.freed.map(ms)])
        }));
        // Everything held (the stack's top, small allocations included), the largest of each bucket.
        let live = self.heap.live_bytes();
        let bucket = n.div_ceil(TOTAL_POINTS).max(1);
        let total: Vec<(usize, usize)> = (0..n)
            .step_by(bucket)
            .map(|start| (start, live[start..(start + bucket).min(n)].iter().copied().max().unwrap_or(0)))
            .collect();
        let held = self.held_at_peak();
        let data = serde_json::json!({
            "events": n,
            "before": before_blocks,
            "allocs": allocs,
            "labels": labels,
            "total": total,
            "peak": held.as_ref().map(|h| h.event),
        });
        // `<` escaped, so no label can close the script element.
        let data = data.to_string().replace('<', "\\u003c");
        let allocs_made = self.heap.events.iter().filter(|e| e.action == HeapAction::Alloc).count();
        let mut summary = format!(
            "<p>{} events on {} ({} allocations of ≥ {} recorded{}), {:.1} ms. {} drawn (the largest of {}); \
             wheel to zoom, drag to pan, double-click to reset, hover for an allocation.</p>",
            n,
            escape_html(&self.device),
            allocs_made,
            format_bytes(self.heap.min_size as u64),
            if self.heap.dropped > 0 {
                format!("; the oldest {} events were overwritten", self.heap.dropped)
            } else {
                String::new()
            },
            ms(n.saturating_sub(1)),
            order.len(),
            lifetimes.len(),
        );
        if let Some(h) = &held {
            let share = |b: usize| 100.0 * b as f64 / h.total.max(1) as f64;
            let _ = write!(
                summary,
                "<h2>Held at the peak: {} at {:.1} ms</h2><table id='held'><tr><th>label</th><th>bytes</th><th>share</th><th>blocks</th></tr>",
                format_bytes(h.total as u64),
                h.time_ms
            );
            for (label, bytes, blocks) in &h.rows {
                let _ = write!(
                    summary,
                    "<tr><td>{}</td><td>{}</td><td>{:.1} %</td><td>{blocks}</td></tr>",
                    escape_html(label),
                    format_bytes(*bytes as u64),
                    share(*bytes)
                );
            }
            let _ = write!(
                summary,
                "<tr><td><i>held before recording started</i></td><td>{}</td><td>{:.1} %</td><td></td></tr>\
                 <tr><td><i>the history's own ring</i></td><td>{}</td><td>{:.1} %</td><td></td></tr></table>",
                format_bytes(h.before_recording as u64),
                share(h.before_recording),
                format_bytes(h.history_ring as u64),
                share(h.history_ring)
            );
        }
        format!(
            "<!DOCTYPE html><html><head><meta charset='utf-8'><title>{t}</title><style>{STYLE}</style></head>\
             <body><h1>{t}</h1><h2>Active memory timeline</h2>\
             <div id='axis'></div><svg id='plot' viewBox='0 0 1 1' preserveAspectRatio='none'></svg>\
             <pre id='info'>hover over an allocation</pre><div id='legend'></div>{summary}\
             <script>const DATA = {data};\n{SCRIPT}</script></body></html>",
            t = escape_html(title)
        )
    }

    /// Writes [`MemoryHistory::to_html`] to `path` (atomically).
    pub fn write_html(&self, path: &std::path::Path, title: &str) -> std::io::Result<()> {
        crate::files::write_atomic(path, self.to_html(title).as_bytes())
    }
}

const STYLE: &str = "body{font-family:sans-serif;margin:1.5em}table{border-collapse:collapse}\
td,th{border:1px solid #ccc;padding:2px 8px}#plot{width:100%;height:420px;border:1px solid #aaa;cursor:crosshair}\
#legend span{display:inline-block;margin-right:1em}#legend i{display:inline-block;width:10px;height:10px;margin-right:4px}\
polygon:hover{stroke:#000;stroke-width:1px}";

/// Lays the allocations out as memory_viz does (each new one on top of those live; a free drops
/// those above it), draws them and wires hover and zoom. Sets `data-ready` on the body when
/// drawn (and `data-error` on a script error), which the browser test reads; with `#selftest`
/// in the address it also hovers the largest allocation and zooms once, recording the results.
const SCRIPT: &str = r#"
window.onerror = (m) => { document.body.dataset.error = m; };
(() => {
const NS = 'http://www.w3.org/2000/svg';
const svg = document.getElementById('plot');
const info = document.getElementById('info');
// A colour per label stack (hues a golden angle apart); what was held before recording is grey.
const colour = (i) => i === DATA.labels.length - 1 ? '#c8c8c8' : `hsl(${(i * 137.508) % 360}, 62%, ${i % 2 ? 58 : 46}%)`;
const fmt = (b) => { const u = ['B','KiB','MiB','GiB','TiB']; let i = 0; while (b >= 1024 && i < 4) { b /= 1024; i++; } return b.toFixed(i ? 2 : 0) + ' ' + u[i]; };
const n = Math.max(DATA.events, 1);
// Births and frees of the drawn allocations, in event order (a free after a birth at the same event).
const actions = [];
DATA.allocs.forEach((a, k) => { actions.push([a[0], 0, k]); if (a[1] >= 0) actions.push([a[1], 1, k]); });
actions.sort((x, y) => x[0] - y[0] || x[1] - y[1]);
const points = DATA.allocs.map(() => []);
const offset = DATA.allocs.map(() => 0);
let current = [], top = 0, highest = 1;
for (const [t, free, k] of actions) {
  const size = DATA.allocs[k][2];
  if (!free) { offset[k] = top; points[k].push([t, top]); current.push(k); top += size; }
  else {
    const i = current.indexOf(k);
    points[k].push([t, offset[k]]);
    current.splice(i, 1);
    for (let j = i; j < current.length; j++) { const e = current[j]; points[e].push([t, offset[e]]); offset[e] -= size; points[e].push([t, offset[e]]); }
    top -= size;
  }
  highest = Math.max(highest, top);
}
for (const k of current) points[k].push([n, offset[k]]);
for (const [, v] of DATA.total) highest = Math.max(highest, v);
const H = 1000, y = (b) => H - b * H / highest;
svg.setAttribute('viewBox', `0 0 ${n} ${H}`);
const total = document.createElementNS(NS, 'polyline');
total.setAttribute('points', DATA.total.map(([t, v]) => `${t},${y(v)}`).join(' '));
total.setAttribute('fill', 'none'); total.setAttribute('stroke', '#999'); total.setAttribute('vector-effect', 'non-scaling-stroke');
svg.appendChild(total);
DATA.allocs.forEach((a, k) => {
  const p = points[k], size = a[2];
  const bottom = p.map(([t, o]) => `${t},${y(o)}`), upper = p.map(([t, o]) => `${t},${y(o + size)}`).reverse();
  const poly = document.createElementNS(NS, 'polygon');
  poly.setAttribute('points', bottom.concat(upper).join(' '));
  poly.setAttribute('fill', colour(a[3]));
  poly.setAttribute('vector-effect', 'non-scaling-stroke');
  poly.dataset.k = k;
  poly.addEventListener('mouseover', () => {
    const freed = a[1] >= 0 ? `freed at event ${a[1]} (${a[5].toFixed(2)} ms), lived ${(a[5] - a[4]).toFixed(2)} ms` : 'still live at the end';
    info.textContent = `${fmt(size)} (${size} bytes)\nlabel: ${DATA.labels[a[3]]}\nallocated at event ${a[0]} (${a[4].toFixed(2)} ms), ${freed}`;
  });
  svg.appendChild(poly);
});
if (DATA.peak !== null) {
  const m = document.createElementNS(NS, 'line');
  m.setAttribute('x1', DATA.peak); m.setAttribute('x2', DATA.peak); m.setAttribute('y1', 0); m.setAttribute('y2', H);
  m.setAttribute('stroke', '#c00'); m.setAttribute('stroke-dasharray', '4 3'); m.setAttribute('vector-effect', 'non-scaling-stroke');
  svg.appendChild(m);
}
const legend = document.getElementById('legend');
DATA.labels.slice(0, 40).forEach((l, i) => { const s = document.createElement('span'); const sw = document.createElement('i'); sw.style.background = colour(i); s.appendChild(sw); s.appendChild(document.createTextNode(l)); legend.appendChild(s); });
let view = [0, n];
const axis = document.getElementById('axis');
const show = () => { svg.setAttribute('viewBox', `${view[0]} 0 ${view[1] - view[0]} ${H}`); axis.textContent = `events ${Math.round(view[0])}–${Math.round(view[1])} of ${DATA.events}; top of the plot ${fmt(highest)}`; };
const zoom = (factor, at) => { const w = view[1] - view[0], c = view[0] + at * w, nw = Math.min(n, Math.max(w * factor, 2)); view = [Math.max(0, c - at * nw), 0]; view[1] = Math.min(n, view[0] + nw); show(); };
svg.addEventListener('wheel', (e) => { e.preventDefault(); const r = svg.getBoundingClientRect(); zoom(e.deltaY > 0 ? 1.25 : 0.8, (e.clientX - r.left) / r.width); });
let drag = null;
svg.addEventListener('mousedown', (e) => { drag = [e.clientX, view.slice()]; });
window.addEventListener('mouseup', () => { drag = null; });
svg.addEventListener('mousemove', (e) => { if (!drag) return; const r = svg.getBoundingClientRect(); const w = drag[1][1] - drag[1][0]; const dx = (drag[0] - e.clientX) / r.width * w; const x0 = Math.min(Math.max(0, drag[1][0] + dx), n - w); view = [x0, x0 + w]; show(); });
svg.addEventListener('dblclick', () => { view = [0, n]; show(); });
show();
document.body.dataset.ready = String(DATA.allocs.length - DATA.before);
if (location.hash === '#selftest') {
  let largest = DATA.before; DATA.allocs.forEach((a, k) => { if (k >= DATA.before && a[2] > DATA.allocs[largest][2]) largest = k; });
  const poly = svg.querySelector(`polygon[data-k="${largest}"]`);
  if (poly) poly.dispatchEvent(new MouseEvent('mouseover'));
  document.body.dataset.hover = info.textContent;
  zoom(0.5, 0.5);
  document.body.dataset.zoomed = svg.getAttribute('viewBox');
}
})();
"#;
