//! Statistics with PyTorch's names and meanings (`torch.cuda.memory_stats`).

use std::collections::BTreeMap;

/// One statistic: current value, peak, and cumulative increments/decrements.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Stat {
    /// Value now.
    pub current: i64,
    /// Highest value since creation or the last `reset_peak_stats`.
    pub peak: i64,
    /// Sum of all increases.
    pub allocated: i64,
    /// Sum of all decreases.
    pub freed: i64,
}

impl Stat {
    /// Adds `amount` (may be negative). Saturates rather than wrapping or panicking: a counter
    /// pinned at `i64::MAX` is visibly wrong, a wrapped one is silently wrong.
    pub fn update(&mut self, amount: i64) {
        self.current = self.current.saturating_add(amount);
        self.peak = self.peak.max(self.current);
        if amount > 0 {
            self.allocated = self.allocated.saturating_add(amount);
        } else {
            self.freed = self.freed.saturating_sub(amount);
        }
    }

    /// `current` as a byte or block count (0 if it were ever negative).
    pub fn unsigned_current(&self) -> usize {
        usize::try_from(self.current).unwrap_or(0)
    }

    fn reset_peak(&mut self) {
        self.peak = self.current;
    }

    fn reset_accumulated(&mut self) {
        self.allocated = 0;
        self.freed = 0;
    }
}

/// A byte or block count as a statistic's signed amount (`i64::MAX` beyond it; no size a
/// backend can hold gets there, but the conversion must not wrap to a negative figure).
pub(crate) fn signed(amount: usize) -> i64 {
    i64::try_from(amount).unwrap_or(i64::MAX)
}

/// Which pool a statistic covers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PoolKind {
    /// Requests up to 1 MiB, served from 2 MiB segments.
    Small,
    /// Everything else.
    Large,
}

impl PoolKind {
    /// The statistic-key name of the pool (`small_pool`, `large_pool`).
    pub fn key(self) -> &'static str {
        match self {
            PoolKind::Small => "small_pool",
            PoolKind::Large => "large_pool",
        }
    }
}

/// A statistic kept for all blocks and per pool.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct StatArray {
    /// Both pools.
    pub all: Stat,
    /// The small pool.
    pub small_pool: Stat,
    /// The large pool.
    pub large_pool: Stat,
}

impl StatArray {
    /// Adds `amount` to the aggregate and to `pool`.
    pub fn update(&mut self, pool: PoolKind, amount: i64) {
        self.all.update(amount);
        match pool {
            PoolKind::Small => self.small_pool.update(amount),
            PoolKind::Large => self.large_pool.update(amount),
        }
    }

    fn each(&mut self) -> [&mut Stat; 3] {
        [&mut self.all, &mut self.small_pool, &mut self.large_pool]
    }
}

/// All statistics of a caching allocator.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct MemoryStats {
    /// Live user allocations (count).
    pub allocation: StatArray,
    /// Segments reserved from the backend (count).
    pub segment: StatArray,
    /// Active blocks: allocated or awaiting stream events before reuse (count).
    pub active: StatArray,
    /// Free blocks inside split segments, which `empty_cache` cannot release (count).
    pub inactive_split: StatArray,
    /// Bytes of live allocations, in block sizes (after rounding).
    pub allocated_bytes: StatArray,
    /// Bytes reserved from the backend.
    pub reserved_bytes: StatArray,
    /// Bytes of active blocks.
    pub active_bytes: StatArray,
    /// Bytes of free blocks inside split segments.
    pub inactive_split_bytes: StatArray,
    /// Bytes the callers asked for (before rounding).
    pub requested_bytes: StatArray,
    /// Allocations at least `max_split_size` (count).
    pub oversize_allocations: Stat,
    /// Segments at least `max_split_size` (count).
    pub oversize_segments: Stat,
    /// Times a request failed, the cache was flushed and the request retried.
    pub num_alloc_retries: u64,
    /// Requests that ended in out-of-memory.
    pub num_ooms: u64,
    /// Times all streams were synchronised.
    pub num_sync_all_streams: u64,
    /// Segments allocated from the backend.
    pub num_device_alloc: u64,
    /// Segments returned to the backend.
    pub num_device_free: u64,
    /// The configured `max_split_size` in bytes; `i64::MAX` when unlimited.
    pub max_split_size: i64,
}

impl MemoryStats {
    /// Resets every peak to the current value (`torch.cuda.reset_peak_memory_stats`).
    pub fn reset_peak_stats(&mut self) {
        for array in self.arrays_mut() {
            for stat in array.each() {
                stat.reset_peak();
            }
        }
        self.oversize_allocations.reset_peak();
        self.oversize_segments.reset_peak();
    }

    /// Resets cumulative counters (`torch.cuda.reset_accumulated_memory_stats`).
    pub fn reset_accumulated(&mut self) {
        for array in self.arrays_mut() {
            for stat in array.each() {
                stat.reset_accumulated();
            }
        }
        self.oversize_allocations.reset_accumulated();
        self.oversize_segments.reset_accumulated();
        self.num_alloc_retries = 0;
        self.num_ooms = 0;
        self.num_sync_all_streams = 0;
        self.num_device_alloc = 0;
        self.num_device_free = 0;
    }

    fn arrays_mut(&mut self) -> [&mut StatArray; 9] {
        [
            &mut self.allocation,
            &mut self.segment,
            &mut self.active,
            &mut self.inactive_split,
            &mut self.allocated_bytes,
            &mut self.reserved_bytes,
            &mut self.active_bytes,
            &mut self.inactive_split_bytes,
            &mut self.requested_bytes,
        ]
    }

    fn arrays(&self) -> [(&'static str, &StatArray); 9] {
        [
            ("allocation", &self.allocation),
            ("segment", &self.segment),
            ("active", &self.active),
            ("inactive_split", &self.inactive_split),
            ("allocated_bytes", &self.allocated_bytes),
            ("reserved_bytes", &self.reserved_bytes),
            ("active_bytes", &self.active_bytes),
            ("inactive_split_bytes", &self.inactive_split_bytes),
            ("requested_bytes", &self.requested_bytes),
        ]
    }

    /// The flat dictionary `torch.cuda.memory_stats()` returns, with the same key names,
    /// e.g. `allocated_bytes.all.current`, `reserved_bytes.large_pool.peak`, `num_ooms`.
    pub fn to_map(&self) -> BTreeMap<String, i64> {
        let mut map = BTreeMap::new();
        let mut put_stat = |prefix: &str, stat: &Stat| {
            for (name, value) in
                [("current", stat.current), ("peak", stat.peak), ("allocated", stat.allocated), ("freed", stat.freed)]
            {
                map.insert(format!("{prefix}.{name}"), value);
            }
        };
        for (name, array) in self.arrays() {
            put_stat(&format!("{name}.all"), &array.all);
            put_stat(&format!("{name}.small_pool"), &array.small_pool);
            put_stat(&format!("{name}.large_pool"), &array.large_pool);
        }
        put_stat("oversize_allocations", &self.oversize_allocations);
        put_stat("oversize_segments", &self.oversize_segments);
        let clamp = |v: u64| i64::try_from(v).unwrap_or(i64::MAX);
        map.insert("num_alloc_retries".into(), clamp(self.num_alloc_retries));
        map.insert("num_ooms".into(), clamp(self.num_ooms));
        map.insert("num_sync_all_streams".into(), clamp(self.num_sync_all_streams));
        map.insert("num_device_alloc".into(), clamp(self.num_device_alloc));
        map.insert("num_device_free".into(), clamp(self.num_device_free));
        map.insert("max_split_size".into(), self.max_split_size);
        map
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stat_tracks_peak_and_totals() {
        let mut s = Stat::default();
        s.update(10);
        s.update(-4);
        s.update(3);
        assert_eq!(s, Stat { current: 9, peak: 10, allocated: 13, freed: 4 });
        s.reset_peak();
        assert_eq!(s.peak, 9);
    }

    #[test]
    fn map_uses_pytorch_keys() {
        let mut m = MemoryStats::default();
        m.allocated_bytes.update(PoolKind::Large, 2048);
        let map = m.to_map();
        assert_eq!(map["allocated_bytes.all.current"], 2048);
        assert_eq!(map["allocated_bytes.large_pool.peak"], 2048);
        assert_eq!(map["allocated_bytes.small_pool.current"], 0);
        for key in ["reserved_bytes.all.peak", "inactive_split_bytes.all.current", "num_alloc_retries", "num_ooms"] {
            assert!(map.contains_key(key), "{key}");
        }
    }
}
