//! The engine: a candle device whose memory wick accounts for, caps, and reports.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Instant;

use candle_core::Device;
use wick_memory::{MemoryError, MemoryLimit, OutOfMemory};

use crate::engine_status::{Figures, Publisher};
use crate::figure::{Figure, FigureSource};
use crate::host_memory;
use crate::report::{Holding, Label, MemoryReport, Sample, Timeline};

mod history;
mod stats;

#[derive(Clone)]
enum Kind {
    Cpu,
    /// Without the `cuda` feature this is the stand-in, which cannot be constructed. Shared
    /// with the thread that publishes the engine's status.
    Cuda(Arc<crate::cuda::GovernedCuda>),
}

/// No user limit, in [`Engine`]'s shared limit cell (a limit of `usize::MAX` limits nothing).
const NO_LIMIT: usize = usize::MAX;

impl Kind {
    fn allocated(&self) -> Figure {
        match self {
            Kind::Cpu => match host_memory::exact_heap() {
                Some((bytes, source)) => Figure { bytes, source },
                None => Figure { bytes: host_memory::process_rss().unwrap_or(0), source: FigureSource::ProcessRss },
            },
            Kind::Cuda(g) => Figure { bytes: g.used(), source: FigureSource::CudaPool },
        }
    }

    fn reserved(&self) -> Figure {
        match self {
            Kind::Cpu => Figure { bytes: host_memory::process_rss().unwrap_or(0), source: FigureSource::ProcessRss },
            Kind::Cuda(g) => Figure { bytes: g.reserved(), source: FigureSource::CudaPool },
        }
    }

    fn peak_allocated(&self) -> Option<Figure> {
        match self {
            Kind::Cpu => host_memory::exact_peak().map(|(bytes, source)| Figure { bytes, source }),
            Kind::Cuda(g) => Some(Figure { bytes: g.used_peak(), source: FigureSource::CudaPool }),
        }
    }

    /// What the device could give without a user limit.
    fn device_budget(&self) -> (usize, FigureSource) {
        match self {
            Kind::Cpu => host_memory::host_budget(),
            Kind::Cuda(g) => (g.reserved().saturating_add(g.device_free()), FigureSource::CudaPool),
        }
    }

    fn budget(&self, limit: usize) -> Figure {
        limited(self.device_budget(), limit)
    }

    /// What this device's source knows of PyTorch's statistics, by their names (see
    /// [`Engine::memory_stats`]); the engine's own counters are added by the caller.
    fn stats_map(&self) -> BTreeMap<String, i64> {
        let i = |v: usize| i64::try_from(v).unwrap_or(i64::MAX);
        let mut map = BTreeMap::new();
        let mut put = |key: &str, v: usize| {
            map.insert(key.to_string(), i(v));
        };
        match self {
            Kind::Cpu => {
                if let (Some(current), Some(peak), Some((allocated, freed, allocs, frees))) =
                    (host_memory::counted_heap(), host_memory::counted_peak(), host_memory::counted_totals())
                {
                    // The counting allocator sees requested sizes; the system allocator's
                    // rounding is invisible to it, so allocated and requested are one figure.
                    for stat in ["allocated_bytes.all", "requested_bytes.all"] {
                        put(&format!("{stat}.current"), current);
                        put(&format!("{stat}.peak"), peak);
                        put(&format!("{stat}.allocated"), allocated);
                        put(&format!("{stat}.freed"), freed);
                    }
                    put("allocation.all.current", allocs.saturating_sub(frees));
                    put("allocation.all.allocated", allocs);
                    put("allocation.all.freed", frees);
                } else if let Some(heap) = wick_memory::CachingHeap::installed() {
                    // The caching allocator that serves candle's buffers: its own statistics.
                    map = heap.memory_stats().to_map();
                }
            }
            Kind::Cuda(g) => {
                put("allocated_bytes.all.current", g.used());
                put("allocated_bytes.all.peak", g.used_peak());
                put("reserved_bytes.all.current", g.reserved());
                put("reserved_bytes.all.peak", g.reserved_peak());
            }
        }
        map
    }
}

/// The budget under a user limit ([`NO_LIMIT`] for none).
fn limited((device_budget, source): (usize, FigureSource), limit: usize) -> Figure {
    if limit < device_budget {
        Figure { bytes: limit, source: FigureSource::UserLimit }
    } else {
        Figure { bytes: device_budget, source }
    }
}

/// A candle device with governed memory. CPU by default; CUDA by ordinal with feature `cuda`.
/// All state lives in this value (no process-wide registries: notebooks keep statics per cell).
pub struct Engine {
    kind: Kind,
    device: Device,
    /// The user's limit, [`NO_LIMIT`] when none; shared with the publishing thread.
    limit: Arc<AtomicUsize>,
    timeline: std::sync::Mutex<Timeline>,
    holdings: std::sync::Mutex<Vec<Holding>>,
    /// Per step label: the batch of its last measured run and the bytes its peak rose above the
    /// memory before it (for [`Engine::try_step_batch`]'s prediction).
    pub(crate) step_growth: std::sync::Mutex<std::collections::HashMap<String, (usize, usize)>>,
    start: Instant,
    /// Out-of-memory errors this engine has seen (pre-flight refusals, candle's OOM in steps).
    pub(crate) ooms: AtomicU64,
    /// Retries after an out-of-memory error ([`Engine::retry_on_oom`]).
    pub(crate) retries: AtomicU64,
    /// Keeps this engine's status file current for `wick monitor` (`None` when publishing is off).
    publisher: Option<Publisher>,
}

impl Engine {
    /// The CPU device; its budget is what the container allows.
    pub fn cpu() -> Self {
        Engine::with(Kind::Cpu, Device::Cpu, None)
    }

    fn with(kind: Kind, device: Device, limit: Option<usize>) -> Self {
        let limit = Arc::new(AtomicUsize::new(limit.unwrap_or(NO_LIMIT)));
        let mut engine = Engine {
            kind,
            device,
            limit,
            timeline: std::sync::Mutex::new(Timeline::default()),
            holdings: std::sync::Mutex::new(Vec::new()),
            step_growth: std::sync::Mutex::new(std::collections::HashMap::new()),
            start: Instant::now(),
            ooms: AtomicU64::new(0),
            retries: AtomicU64::new(0),
            publisher: None,
        };
        let (kind, limit) = (engine.kind.clone(), engine.limit.clone());
        // The host's budget is read once (a cgroup walk allocates); the publisher must not move
        // the heap figures it publishes (see `engine_status`).
        let host_budget = matches!(kind, Kind::Cpu).then(host_memory::host_budget);
        engine.publisher = Publisher::start(engine.name(), move || {
            let device_budget = host_budget.unwrap_or_else(|| kind.device_budget());
            Figures {
                allocated: kind.allocated().bytes,
                reserved: kind.reserved().bytes,
                peak: kind.peak_allocated().map(|f| f.bytes),
                budget: limited(device_budget, limit.load(Ordering::Relaxed)).bytes,
            }
        });
        engine
    }

    /// CUDA device `ordinal` with candle's allocations drawn from a wick pool capped at `limit`.
    /// Built without the `cuda` feature, an `Unavailable` error that says so.
    pub fn cuda(ordinal: usize, limit: Option<usize>) -> Result<Self, MemoryError> {
        let governed = crate::cuda::GovernedCuda::new(ordinal, limit)?;
        let device = governed.device().clone();
        Ok(Engine::with(Kind::Cuda(Arc::new(governed)), device, limit))
    }

    /// The candle device, for creating tensors.
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// Short description (`cpu`, `cuda:0`).
    pub fn name(&self) -> String {
        match &self.kind {
            Kind::Cpu => "cpu".into(),
            Kind::Cuda(_) => match self.device.location() {
                candle_core::DeviceLocation::Cuda { gpu_id } => format!("cuda:{gpu_id}"),
                other => format!("{other:?}"),
            },
        }
    }

    /// Bytes held by live tensors (and, on the CPU, everything else on the heap): exact with the
    /// counting allocator or the caching heap installed, and on CUDA; the resident set otherwise.
    pub fn allocated(&self) -> Figure {
        self.kind.allocated()
    }

    /// Bytes taken from the device: the resident set on the CPU, the pool's reservation on CUDA.
    pub fn reserved(&self) -> Figure {
        self.kind.reserved()
    }

    /// Peak of `allocated` since creation or `reset_peak_stats` (exact sources only).
    pub fn peak_allocated(&self) -> Option<Figure> {
        self.kind.peak_allocated()
    }

    /// Resets the peaks to the current values (PyTorch's `reset_peak_memory_stats`).
    pub fn reset_peak_memory_stats(&self) {
        match &self.kind {
            Kind::Cpu => host_memory::reset_exact_peak(),
            Kind::Cuda(g) => g.reset_peak_stats(),
        }
    }

    /// Returns cached memory to the system: `malloc_trim` on the CPU, `cuMemPoolTrimTo` on CUDA.
    /// Returns the bytes released as measured by the reserved figure.
    pub fn empty_cache(&self) -> Result<usize, MemoryError> {
        let before = self.reserved().bytes;
        match &self.kind {
            Kind::Cpu => {
                host_memory::trim_heap();
            }
            Kind::Cuda(g) => {
                g.empty_cache()?;
            }
        }
        Ok(before.saturating_sub(self.reserved().bytes))
    }

    /// The most this engine may use and where that number comes from: the user's limit if set and
    /// lower, else the container's budget (CPU) or the device capacity (CUDA).
    pub fn budget(&self) -> Figure {
        self.kind.budget(self.limit.load(Ordering::Relaxed))
    }

    /// The user's limit, if one is set.
    fn user_limit(&self) -> Option<usize> {
        Some(self.limit.load(Ordering::Relaxed)).filter(|&l| l != NO_LIMIT)
    }

    /// The status file this engine keeps current for `wick monitor` (see
    /// [`crate::engine_status`]); `None` when publishing is off or could not start.
    pub fn status_file(&self) -> Option<&std::path::Path> {
        self.publisher.as_ref().map(|p| p.path())
    }

    /// Sets the cap (bytes or a fraction of the budget the device would otherwise have). On the
    /// CPU it is enforced by pre-flight checks; on CUDA the pool also refuses beyond it, but its
    /// own cap is fixed when the pool is created.
    pub fn set_memory_limit(&mut self, limit: Option<MemoryLimit>) -> Result<(), MemoryError> {
        let previous = self.limit.swap(NO_LIMIT, Ordering::Relaxed);
        let base = self.budget().bytes;
        match limit.map(|l| l.resolve(base)).transpose() {
            Ok(resolved) => {
                self.limit.store(resolved.unwrap_or(NO_LIMIT), Ordering::Relaxed);
                Ok(())
            }
            Err(e) => {
                self.limit.store(previous, Ordering::Relaxed);
                Err(e)
            }
        }
    }

    /// Bytes that can still be allocated under the budget. Under a user limit the engine's own
    /// allocated figure counts; on the CPU otherwise what the host can give now
    /// ([`host_memory::host_available`]: the machine, the cgroup, `ulimit -v`, the commit
    /// limit); on CUDA the budget less the pool's reserved bytes.
    pub fn available(&self) -> usize {
        let used = match &self.kind {
            Kind::Cpu if self.user_limit().is_some() => self.allocated().bytes,
            Kind::Cpu => return host_memory::host_available().min(self.budget().bytes),
            Kind::Cuda(g) => g.reserved(),
        };
        self.budget().bytes.saturating_sub(used)
    }

    /// Pre-flight: refuses with `OutOfMemory` (and advice) a request of `bytes` for `what` that
    /// would not fit under the budget, *before* anything is allocated.
    pub fn preflight(&self, bytes: usize, what: &str) -> Result<(), MemoryError> {
        let available = self.available();
        if bytes <= available {
            return Ok(());
        }
        let budget = self.budget();
        self.ooms.fetch_add(1, Ordering::Relaxed);
        self.mark("refused by pre-flight");
        Err(self
            .with_usage(OutOfMemory::refused(format!("{} ({what})", self.name()), bytes))
            .with_device(budget.bytes, available)
            .with_limit(self.user_limit(), budget.source == FigureSource::UserLimit)
            // Host memory has no cache to fragment: all that is available can be had at once.
            .with_largest_free_block(available)
            .into_error())
    }

    /// `oom` with this engine's usage figures and whose memory they are: the CUDA pool's (wick's
    /// allocator), this process's heap where a wick global allocator counts it, else this
    /// process's resident set (never called wick's).
    pub(crate) fn with_usage(&self, oom: OutOfMemory) -> OutOfMemory {
        use wick_memory::UsageOwner;
        let allocated = self.allocated();
        match allocated.source {
            // The heap's figure alone (the engine's CPU "reserved" is the resident set, not the
            // heap's), with the resident set beside it.
            FigureSource::CountingAllocator | FigureSource::CachingHeap => oom
                .with_usage(allocated.bytes, allocated.bytes)
                .with_owner(UsageOwner::ProcessHeap)
                .with_process_resident(host_memory::process_rss()),
            FigureSource::ProcessRss => {
                oom.with_usage(allocated.bytes, self.reserved().bytes).with_owner(UsageOwner::ProcessResident)
            }
            _ => oom.with_usage(allocated.bytes, self.reserved().bytes),
        }
    }

    /// Records a point of the memory timeline (shown in the HTML report).
    pub fn mark(&self, label: &str) {
        let sample = Sample {
            t_ms: self.start.elapsed().as_secs_f64() * 1e3,
            allocated: self.allocated().bytes,
            reserved: self.reserved().bytes,
            label: Label::new(label),
        };
        self.timeline.lock().unwrap_or_else(|p| p.into_inner()).push(sample);
    }

    /// Records that `what` (model parameters, f32 master weights, optimizer state, …) holds
    /// `bytes` of this engine's memory, replacing an earlier figure for the same `what`; the
    /// memory summary lists these beside the allocator's totals, so what the totals are made of
    /// is visible. 0 removes the entry.
    pub fn account(&self, what: &str, bytes: usize) {
        let mut holdings = self.holdings.lock().unwrap_or_else(|p| p.into_inner());
        holdings.retain(|h| h.what != what);
        if bytes > 0 {
            holdings.push(Holding { what: what.to_string(), bytes });
        }
    }

    /// The figures now, with their sources, and the timeline so far.
    pub fn memory_report(&self) -> MemoryReport {
        MemoryReport {
            device: self.name(),
            allocated: self.allocated(),
            reserved: self.reserved(),
            peak_allocated: self.peak_allocated(),
            budget: self.budget(),
            available: self.available(),
            timeline: self.timeline.lock().unwrap_or_else(|p| p.into_inner()).clone(),
            holdings: self.holdings.lock().unwrap_or_else(|p| p.into_inner()).clone(),
        }
    }

    /// The memory report as JSON (figures, sources, holdings and timeline); not a [`wick_memory::Snapshot`],
    /// which lists an allocator's segments and blocks.
    pub fn memory_report_json(&self) -> String {
        serde_json::to_string_pretty(&self.memory_report()).unwrap_or_else(|e| format!("{{\"error\":\"{e}\"}}"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn holdings_are_listed_replaced_and_removed() {
        let engine = Engine::cpu();
        engine.account("master weights (f32)", 4 << 20);
        engine.account("optimizer state (f32)", 8 << 20);
        engine.account("master weights (f32)", 2 << 20);
        let report = engine.memory_report();
        assert_eq!(
            report.holdings,
            vec![
                Holding { what: "optimizer state (f32)".into(), bytes: 8 << 20 },
                Holding { what: "master weights (f32)".into(), bytes: 2 << 20 },
            ]
        );
        let text = engine.memory_summary();
        assert!(
            text.contains("held by") && text.contains("master weights (f32)") && text.contains("2.00 MiB"),
            "{text}"
        );
        assert!(engine.memory_report_json().contains("\"optimizer state (f32)\""));
        engine.account("optimizer state (f32)", 0);
        engine.account("master weights (f32)", 0);
        assert!(!engine.memory_summary().contains("held by"));
    }
}
