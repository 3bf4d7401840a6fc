//! The engine's statistics under PyTorch's names and layout (`torch.cuda.memory_stats`,
//! `max_memory_allocated`, `memory_summary`), from whatever source the device has: the counting
//! allocator's counters, the caching heap's own allocator statistics, or the CUDA pool's
//! attributes. A key the source cannot know is absent, never 0: an absent peak says "not
//! measured", a zero would say "nothing was used".

use std::collections::BTreeMap;
use std::sync::atomic::Ordering;

use super::Engine;

impl Engine {
    /// The statistics by the allocator's key names (`allocated_bytes.all.current`,
    /// `reserved_bytes.all.peak`, `num_ooms`, … — the map [`wick_memory::MemoryStats::to_map`]
    /// returns), with the keys this device's source knows:
    /// - CPU with the [`crate::CountingAllocator`]: `allocated_bytes.all.*` and
    ///   `requested_bytes.all.*` (current, peak, cumulative allocated and freed; one figure, as
    ///   it sees requested sizes) and `allocation.all.{current,allocated,freed}`;
    /// - CPU with the caching heap ([`wick_memory::CachingHeap`]): every key of the caching
    ///   allocator that serves candle's buffers (requests of [`wick_memory::LARGE_REQUEST`]
    ///   or more; smaller ones go to the system allocator and are counted only in
    ///   [`Engine::allocated`]);
    /// - CUDA: `allocated_bytes.all.{current,peak}` and `reserved_bytes.all.{current,peak}` of
    ///   the wick pool candle draws from;
    /// - CPU with neither: none of the byte keys (the resident set is not an allocator figure).
    ///
    /// `num_ooms` (pre-flight refusals, out-of-memory errors in steps) and `num_alloc_retries`
    /// ([`Engine::retry_on_oom`]) are always there: the engine counts them itself (added to the
    /// caching heap's own).
    pub fn memory_stats(&self) -> BTreeMap<String, i64> {
        let mut map = self.kind.stats_map();
        let i = |v: u64| i64::try_from(v).unwrap_or(i64::MAX);
        for (key, own) in [("num_ooms", &self.ooms), ("num_alloc_retries", &self.retries)] {
            let total = map.get(key).copied().unwrap_or(0).saturating_add(i(own.load(Ordering::Relaxed)));
            map.insert(key.to_string(), total);
        }
        map
    }

    /// `allocated_bytes.all.peak` of [`Engine::memory_stats`] (PyTorch's `max_memory_allocated`);
    /// `None` where the source does not measure it.
    pub fn max_memory_allocated(&self) -> Option<usize> {
        self.stat("allocated_bytes.all.peak")
    }

    /// `reserved_bytes.all.peak` of [`Engine::memory_stats`] (PyTorch's `max_memory_reserved`);
    /// `None` where the source has no reservation (the counting allocator) or does not say.
    pub fn max_memory_reserved(&self) -> Option<usize> {
        self.stat("reserved_bytes.all.peak")
    }

    fn stat(&self, key: &str) -> Option<usize> {
        self.kind.stats_map().get(key).and_then(|&v| usize::try_from(v).ok())
    }

    /// The statistics as the allocator's PyTorch-layout table ([`wick_memory::memory_summary`]:
    /// `-` where the source cannot know a figure), followed by the engine's figures with their
    /// sources and what holds them ([`Engine::account`]).
    pub fn memory_summary(&self) -> String {
        let limit = self.user_limit();
        let table = wick_memory::memory_summary_of_map(&self.name(), &self.memory_stats(), limit);
        format!("{table}{}", self.memory_report())
    }
}
