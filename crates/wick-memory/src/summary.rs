//! `memory_summary()`: the statistics as a fixed-width table, laid out like PyTorch's.

use std::collections::BTreeMap;
use std::fmt::Write;

use crate::stats::MemoryStats;
use wick_alloc_check::format_bytes;

const WIDTH: usize = 82;

fn rule(out: &mut String, c: char) {
    let _ = writeln!(out, "|{}|", c.to_string().repeat(WIDTH - 2));
}

fn centered(out: &mut String, text: &str) {
    let _ = writeln!(out, "|{:^w$}|", text, w = WIDTH - 2);
}

/// One row: the statistic `key` (`allocated_bytes.all`, …) from `map`, `-` where a key is absent.
fn row(out: &mut String, map: &BTreeMap<String, i64>, label: &str, key: &str, bytes: bool) {
    let cell = |field: &str| match map.get(&format!("{key}.{field}")) {
        Some(&v) if bytes => format_bytes(v.max(0) as u64),
        Some(v) => v.to_string(),
        None => "-".to_string(),
    };
    let _ = writeln!(
        out,
        "| {:<23}| {:>11} | {:>11} | {:>11} | {:>11} |",
        label,
        cell("current"),
        cell("peak"),
        cell("allocated"),
        cell("freed")
    );
}

fn section(out: &mut String, map: &BTreeMap<String, i64>, label: &str, key: &str, bytes: bool) {
    row(out, map, label, &format!("{key}.all"), bytes);
    row(out, map, "      from large pool", &format!("{key}.large_pool"), bytes);
    row(out, map, "      from small pool", &format!("{key}.small_pool"), bytes);
    rule(out, '-');
}

/// Renders the statistics of `device` as a table.
pub fn memory_summary(device: &str, stats: &MemoryStats, limit: Option<usize>) -> String {
    memory_summary_of_map(device, &stats.to_map(), limit)
}

/// [`memory_summary`] of a statistics map with [`MemoryStats::to_map`]'s key names, from a
/// source that may know only some of them (an engine over the counting allocator or a CUDA
/// pool): what is absent shows as `-`, never as 0.
pub fn memory_summary_of_map(device: &str, map: &BTreeMap<String, i64>, limit: Option<usize>) -> String {
    let mut out = String::new();
    rule(&mut out, '=');
    centered(&mut out, &format!("wick memory summary, device {device}"));
    rule(&mut out, '-');
    let limit = limit.map_or_else(|| "none".to_string(), |l| format_bytes(l as u64));
    let count = |key: &str| map.get(key).map_or_else(|| "-".to_string(), |v| v.to_string());
    centered(
        &mut out,
        &format!(
            "OOMs: {:<6} alloc retries: {:<6} limit: {:<12} syncs: {}",
            count("num_ooms"),
            count("num_alloc_retries"),
            limit,
            count("num_sync_all_streams")
        ),
    );
    rule(&mut out, '=');
    let _ = writeln!(
        out,
        "| {:<23}| {:>11} | {:>11} | {:>11} | {:>11} |",
        "Metric", "Cur Usage", "Peak Usage", "Tot Alloc", "Tot Freed"
    );
    rule(&mut out, '-');
    section(&mut out, map, "Allocated memory", "allocated_bytes", true);
    section(&mut out, map, "Active memory", "active_bytes", true);
    section(&mut out, map, "Requested memory", "requested_bytes", true);
    section(&mut out, map, "Reserved memory", "reserved_bytes", true);
    section(&mut out, map, "Non-releasable memory", "inactive_split_bytes", true);
    section(&mut out, map, "Allocations", "allocation", false);
    section(&mut out, map, "Active allocs", "active", false);
    section(&mut out, map, "Reserved segments", "segment", false);
    section(&mut out, map, "Non-releasable allocs", "inactive_split", false);
    row(&mut out, map, "Oversize allocations", "oversize_allocations", false);
    row(&mut out, map, "Oversize segments", "oversize_segments", false);
    rule(&mut out, '=');
    let frag = match (map.get("reserved_bytes.all.peak"), map.get("allocated_bytes.all.peak")) {
        (Some(&reserved), Some(&allocated)) if allocated > 0 => format!("{:.3}", reserved as f64 / allocated as f64),
        (Some(_), Some(_)) => format!("{:.3}", 0.0),
        _ => "-".to_string(),
    };
    centered(&mut out, &format!("fragmentation (peak reserved / peak allocated): {frag}"));
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

    #[test]
    fn a_partial_map_shows_what_is_absent_as_a_dash() {
        let mut map = BTreeMap::new();
        map.insert("allocated_bytes.all.current".to_string(), 5 << 20);
        map.insert("allocated_bytes.all.peak".to_string(), 6 << 20);
        map.insert("num_ooms".to_string(), 2);
        let text = memory_summary_of_map("cpu", &map, None);
        for line in text.lines() {
            assert_eq!(line.chars().count(), WIDTH, "{line}");
        }
        let allocated = text.lines().find(|l| l.starts_with("| Allocated memory")).unwrap();
        assert!(
            allocated.contains("5.00 MiB") && allocated.contains("6.00 MiB") && allocated.contains(" - "),
            "{allocated}"
        );
        let reserved = text.lines().find(|l| l.starts_with("| Reserved memory")).unwrap();
        assert_eq!(reserved.matches(" - ").count(), 4, "{reserved}");
        assert!(text.contains("OOMs: 2") && text.contains("alloc retries: -"), "{text}");
        assert!(text.contains("peak allocated): -"), "{text}");
    }
}
