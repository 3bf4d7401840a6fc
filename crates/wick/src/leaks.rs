//! A leak finder for training loops: identical steps should end with the same memory allocated.
//! After a warm-up (the optimizer's state and the caches are made in the first steps), when the
//! memory allocated at the end of each of several steps in a row keeps growing, the finder says so
//! — and, when the engine records its history ([`Engine::record_memory_history`]), names the
//! label stacks of the allocations born in those steps and never freed.
//!
//! The case it was built for: a gradient or a loss kept across steps while it still carries its
//! graph (candle's leaf gradients do until detached) holds every activation of its step, step
//! after step; the finder names the layers whose activations pile up.

use std::collections::{BTreeMap, VecDeque};

use wick_memory::{format_bytes, heap_history_position, heap_history_recording};

use crate::Engine;

/// Watches the memory at the end of steps (see the module documentation).
#[derive(Debug, Clone)]
pub struct LeakFinder {
    warmup: usize,
    window: usize,
    steps: usize,
    /// (allocated bytes, history position) at the end of the last `window + 1` steps.
    ends: VecDeque<(usize, u64)>,
}

/// What the finder saw: steady growth, and what was born in it and never freed.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct LeakReport {
    /// Steps over which the memory grew at every step end.
    pub steps: usize,
    /// Bytes the memory grew over them.
    pub grown: usize,
    /// Allocations born in those steps and still live, by label stack, largest first: (label
    /// stack, bytes, blocks). Empty when the history was not recorded.
    pub rows: Vec<(String, usize, usize)>,
}

impl std::fmt::Display for LeakReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let per_step = self.grown / self.steps.max(1);
        write!(
            f,
            "possible leak: memory allocated at the end of each of the last {} steps grew (+{} in all, {} per step)",
            self.steps,
            format_bytes(self.grown as u64),
            format_bytes(per_step as u64)
        )?;
        if self.rows.is_empty() {
            return write!(f, "; record the engine's history (record_memory_history) to see what holds it");
        }
        write!(f, "; born in those steps and never freed:")?;
        for (label, bytes, blocks) in self.rows.iter().take(10) {
            write!(f, "\n  {:>12} in {blocks:>5} blocks  {label}", format_bytes(*bytes as u64))?;
        }
        Ok(())
    }
}

impl LeakFinder {
    /// Ignores the first `warmup` steps, then reports when the memory grows at each of
    /// `window` consecutive step ends (at least 2).
    pub fn new(warmup: usize, window: usize) -> Self {
        let window = window.max(2);
        LeakFinder { warmup, window, steps: 0, ends: VecDeque::with_capacity(window + 1) }
    }

    /// Call after each step, outside it. `Some` when the memory allocated at the end of each of
    /// the last `window` steps was higher than at the end of the step before. Needs an exact
    /// figure (the caching heap or the counting allocator on the CPU, or CUDA): `None` on the
    /// resident set, which moves for reasons of its own.
    pub fn end_step(&mut self, engine: &Engine) -> Option<LeakReport> {
        self.steps += 1;
        engine.peak_allocated()?;
        if self.steps <= self.warmup {
            return None;
        }
        let position = if heap_history_recording() { heap_history_position() } else { 0 };
        self.ends.push_back((engine.allocated().bytes, position));
        if self.ends.len() > self.window + 1 {
            self.ends.pop_front();
        }
        if self.ends.len() <= self.window {
            return None;
        }
        let grew = self.ends.iter().zip(self.ends.iter().skip(1)).all(|(a, b)| b.0 > a.0);
        if !grew {
            return None;
        }
        let (first, _) = self.ends[0];
        let (last, _) = self.ends[self.window];
        let rows = if heap_history_recording() { born_and_kept(engine, self.ends[0].1) } else { Vec::new() };
        Some(LeakReport { steps: self.window, grown: last - first, rows })
    }
}

/// Allocations recorded after history position `since` and still live, by label stack.
fn born_and_kept(engine: &Engine, since: u64) -> Vec<(String, usize, usize)> {
    let history = engine.memory_history();
    let start = history.heap.position_of(since).unwrap_or(0);
    let mut by_label: BTreeMap<String, (usize, usize)> = BTreeMap::new();
    for l in history.heap.lifetimes() {
        if l.born >= start && l.freed.is_none() {
            let row = by_label.entry(history.label_text(l.label)).or_default();
            row.0 += l.size;
            row.1 += 1;
        }
    }
    let mut rows: Vec<(String, usize, usize)> = by_label.into_iter().map(|(k, (b, n))| (k, b, n)).collect();
    rows.sort_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
    rows
}
