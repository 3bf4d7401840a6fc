//! A trace recorded by the event-log adaptor replays to the same figures.

use wick_memory::{AllocateExt, CachingAllocator, EventLog, MemoryResource, SimulatedBackend, Statistics};
use wick_trace::{replay, Trace};

const MIB: usize = 1 << 20;

fn sim() -> CachingAllocator<SimulatedBackend> {
    CachingAllocator::new(SimulatedBackend::new(1 << 30))
}

#[test]
fn event_log_trace_replays_to_the_same_peaks() {
    let logged = Statistics::new(EventLog::new(sim()));
    {
        let a = logged.allocate(5 * MIB).unwrap();
        let b = logged.allocate(700).unwrap();
        drop(a);
        let _c = logged.allocate(2 * MIB).unwrap();
        drop(b);
    }
    let trace = Trace::from_ops("session", logged.inner().ops());
    assert_eq!(trace.ops.len(), 6);
    let original = logged.memory_stats();
    let report = replay(&trace, &sim()).unwrap();
    assert_eq!(report.peak_allocated as i64, original.allocated_bytes.all.peak);
    assert_eq!(report.peak_reserved as i64, original.reserved_bytes.all.peak);
    assert_eq!(logged.counters().bytes_peak, 5 * MIB + 700);
}
