//! The conformance suite against the CPU backends and a stack of adaptors.

mod conformance;

use conformance::{run_sequence, run_suite, Harness, MIB};
use wick_memory::SimulatedStreams;
use wick_memory::{
    AllocatorConfig, Backend, CachingAllocator, EventLog, HostBackend, Limiting, MemoryLimit, SimulatedBackend,
    Statistics, StreamId, TraceOp, Tracking,
};

/// What the suite reads from the two CPU backends.
trait CpuBackend: Backend {
    fn sim_streams(&self) -> &SimulatedStreams;
    fn segment_bytes(&self) -> usize;
}

impl CpuBackend for HostBackend {
    fn sim_streams(&self) -> &SimulatedStreams {
        self.streams()
    }
    fn segment_bytes(&self) -> usize {
        self.bytes_in_segments()
    }
}

impl CpuBackend for SimulatedBackend {
    fn sim_streams(&self) -> &SimulatedStreams {
        self.streams()
    }
    fn segment_bytes(&self) -> usize {
        self.bytes_in_segments()
    }
}

/// A harness over a caching allocator on a CPU backend, with `streams` extra streams.
fn harness<B: CpuBackend>(
    a: &CachingAllocator<B>,
    streams: Vec<StreamId>,
    limit: Option<usize>,
) -> Harness<'_, CachingAllocator<B>> {
    Harness {
        resource: a,
        backend_bytes: Box::new(|| a.backend().segment_bytes()),
        streams,
        launch: Box::new(|s| a.backend().sim_streams().launch(s).unwrap_or(())),
        finish_all: Box::new(|| a.backend().sim_streams().finish_all()),
        limit,
    }
}

#[test]
fn host_backend_conforms() {
    run_suite("host", 2, |ops| {
        let backend = HostBackend::with_capacity(160 * MIB);
        let s1 = backend.streams().create_stream();
        let a = CachingAllocator::new(backend);
        let h = harness(&a, vec![StreamId::DEFAULT, s1], None);
        run_sequence(&h, ops)
    });
}

#[test]
fn simulated_backend_with_cap_and_policy_options_conforms() {
    run_suite("simulated+cap", 3, |ops| {
        let backend = SimulatedBackend::new(512 * MIB);
        let s1 = backend.streams().create_stream();
        let s2 = backend.streams().create_stream();
        let config = AllocatorConfig {
            limit: Some(MemoryLimit::Bytes(96 * MIB)),
            ..AllocatorConfig::parse("max_split_size_mb:24,roundup_power2_divisions:4,garbage_collection_threshold:0.7")
                .map_err(|e| e.to_string())?
        };
        let a = CachingAllocator::with_config(backend, config).map_err(|e| e.to_string())?;
        let h = harness(&a, vec![StreamId::DEFAULT, s1, s2], Some(96 * MIB));
        run_sequence(&h, ops)
    });
}

#[test]
fn adaptor_stack_conforms() {
    run_suite("statistics(limiting(tracking(event_log(caching(sim)))))", 2, |ops| {
        let backend = SimulatedBackend::new(256 * MIB);
        let s1 = backend.streams().create_stream();
        let stack = Statistics::new(Limiting::new(
            Tracking::new(EventLog::new(CachingAllocator::new(backend)), false),
            120 * MIB,
        ));
        let caching = stack.inner().inner().inner().inner();
        let h = Harness {
            resource: &stack,
            backend_bytes: Box::new(|| caching.backend().bytes_in_segments()),
            streams: vec![StreamId::DEFAULT, s1],
            launch: Box::new(|s| caching.backend().streams().launch(s).unwrap_or(())),
            finish_all: Box::new(|| caching.backend().streams().finish_all()),
            limit: None,
        };
        run_sequence(&h, ops)?;
        // The adaptors agree with the allocator: nothing live, everything logged is balanced.
        let counters = stack.counters();
        if counters.bytes_current != 0 || counters.count_current != 0 {
            return Err(format!("statistics adaptor left {counters:?}"));
        }
        if stack.inner().used() != 0 || !stack.inner().inner().live().is_empty() {
            return Err("limiting/tracking adaptors still count live bytes".into());
        }
        // Every logged free names a live allocation, and nothing logged is left live.
        let mut live = std::collections::HashSet::new();
        for op in stack.inner().inner().inner().ops() {
            let balanced = match op {
                TraceOp::Alloc { id, .. } => live.insert(id),
                TraceOp::Free { id } => live.remove(&id),
            };
            if !balanced {
                return Err(format!("event log out of balance at {op:?}"));
            }
        }
        if live.is_empty() {
            Ok(())
        } else {
            Err(format!("event log leaves {} allocations live", live.len()))
        }
    });
}

#[test]
fn expandable_segments_conform_on_both_cpu_backends() {
    run_suite("simulated+expandable+cap", 2, |ops| {
        let backend = SimulatedBackend::new(512 * MIB);
        let s1 = backend.streams().create_stream();
        let config = AllocatorConfig {
            limit: Some(MemoryLimit::Bytes(100 * MIB)),
            ..AllocatorConfig::parse("expandable_segments:True").map_err(|e| e.to_string())?
        };
        let a = CachingAllocator::with_config(backend, config).map_err(|e| e.to_string())?;
        let h = harness(&a, vec![StreamId::DEFAULT, s1], Some(100 * MIB));
        run_sequence(&h, ops)
    });
    run_suite("host+expandable", 2, |ops| {
        let backend = HostBackend::with_capacity(160 * MIB);
        let s1 = backend.streams().create_stream();
        let config = AllocatorConfig::parse("expandable_segments:True").map_err(|e| e.to_string())?;
        let a = CachingAllocator::with_config(backend, config).map_err(|e| e.to_string())?;
        let h = harness(&a, vec![StreamId::DEFAULT, s1], None);
        run_sequence(&h, ops)
    });
}
