//! `memory_summary()`: the statistics as a fixed-width table, laid out like PyTorch's.

use std::fmt::Write;

use crate::format::format_bytes;
use crate::stats::{MemoryStats, Stat, StatArray};

const WIDTH: usize = 82;

fn rule(out: &mut String, c: char) {
    let _ = writeln!(out, "|{}|", c.to_string().repeat(WIDTH - 2));
}

fn centered(out: &mut String, text: &str) {
    let _ = writeln!(out, "|{:^w$}|", text, w = WIDTH - 2);
}

fn row(out: &mut String, label: &str, stat: &Stat, bytes: bool) {
    let cell = |v: i64| {
        if bytes {
            format_bytes(v.max(0) as u64)
        } else {
            v.to_string()
        }
    };
    let _ = writeln!(
        out,
        "| {:<23}| {:>11} | {:>11} | {:>11} | {:>11} |",
        label,
        cell(stat.current),
        cell(stat.peak),
        cell(stat.allocated),
        cell(stat.freed)
    );
}

fn section(out: &mut String, label: &str, array: &StatArray, bytes: bool) {
    row(out, label, &array.all, bytes);
    row(out, "      from large pool", &array.large_pool, bytes);
    row(out, "      from small pool", &array.small_pool, bytes);
    rule(out, '-');
}

/// Renders the statistics of `device` as a table.
pub fn memory_summary(device: &str, stats: &MemoryStats, limit: Option<usize>) -> String {
    let mut out = String::new();
    rule(&mut out, '=');
    centered(&mut out, &format!("wick memory summary, device {device}"));
    rule(&mut out, '-');
    let limit = limit.map_or_else(|| "none".to_string(), |l| format_bytes(l as u64));
    centered(
        &mut out,
        &format!(
            "OOMs: {:<6} alloc retries: {:<6} limit: {:<12} syncs: {}",
            stats.num_ooms, stats.num_alloc_retries, limit, stats.num_sync_all_streams
        ),
    );
    rule(&mut out, '=');
    let _ = writeln!(
        out,
        "| {:<23}| {:>11} | {:>11} | {:>11} | {:>11} |",
        "Metric", "Cur Usage", "Peak Usage", "Tot Alloc", "Tot Freed"
    );
    rule(&mut out, '-');
    section(&mut out, "Allocated memory", &stats.allocated_bytes, true);
    section(&mut out, "Active memory", &stats.active_bytes, true);
    section(&mut out, "Requested memory", &stats.requested_bytes, true);
    section(&mut out, "Reserved memory", &stats.reserved_bytes, true);
    section(&mut out, "Non-releasable memory", &stats.inactive_split_bytes, true);
    section(&mut out, "Allocations", &stats.allocation, false);
    section(&mut out, "Active allocs", &stats.active, false);
    section(&mut out, "Reserved segments", &stats.segment, false);
    section(&mut out, "Non-releasable allocs", &stats.inactive_split, false);
    row(&mut out, "Oversize allocations", &stats.oversize_allocations, false);
    row(&mut out, "Oversize segments", &stats.oversize_segments, false);
    rule(&mut out, '=');
    let frag = if stats.allocated_bytes.all.peak > 0 {
        stats.reserved_bytes.all.peak as f64 / stats.allocated_bytes.all.peak as f64
    } else {
        0.0
    };
    centered(&mut out, &format!("fragmentation (peak reserved / peak allocated): {frag:.3}"));
    rule(&mut out, '=');
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::stats::PoolKind;

    #[test]
    fn table_has_fixed_width_and_values() {
        let mut stats = MemoryStats::default();
        stats.allocated_bytes.update(PoolKind::Large, 3 << 20);
        stats.reserved_bytes.update(PoolKind::Large, 4 << 20);
        let text = memory_summary("sim:0", &stats, Some(1 << 30));
        for line in text.lines() {
            assert_eq!(line.chars().count(), WIDTH, "{line}");
        }
        assert!(text.contains("3.00 MiB"));
        assert!(text.contains("1.00 GiB"));
        assert!(text.contains("1.333"));
    }
}
