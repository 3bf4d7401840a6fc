//! Scopes release deterministically; each adaptor does its one job.

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;

use wick_memory::{
    scoped, AllocateExt, CachingAllocator, FailureCallback, Limiting, MemoryError, MemoryResource, Scope,
    SimulatedBackend, Statistics, Tracking,
};

const MIB: usize = 1 << 20;

fn sim() -> CachingAllocator<SimulatedBackend> {
    CachingAllocator::new(SimulatedBackend::new(1 << 30))
}

#[test]
fn scope_frees_everything_on_every_path_and_reports_it() {
    let a = sim();
    let kept = {
        let scope = Scope::new(&a);
        let x = scope.allocate(3 * MIB).unwrap();
        scope.allocate(100).unwrap();
        let before = a.memory_stats().allocated_bytes.all.current;
        let kept = scope.keep(x).unwrap();
        assert_eq!(scope.live_blocks(), 1);
        let report = scope.end();
        assert_eq!(report.blocks, 1);
        assert_eq!(report.bytes, 512);
        assert_eq!(report.requested_bytes, 100);
        assert_eq!(report.kept, 1);
        assert_eq!(a.memory_stats().allocated_bytes.all.current, before - 512);
        kept
    };
    assert_eq!(a.memory_stats().allocated_bytes.all.current, 3 * MIB as i64, "the kept block lives on");
    drop(kept);
    // An error inside the scope (`?`) still frees what it allocated.
    let (result, report) = scoped(&a, |s| {
        s.allocate(5 * MIB)?;
        s.allocate(0)?; // ZeroSize error
        Ok(())
    });
    assert!(matches!(result, Err(MemoryError::ZeroSize)));
    assert_eq!(report.bytes, 5 * MIB);
    assert_eq!(a.memory_stats().allocated_bytes.all.current, 0);
}

#[test]
fn training_steps_in_scopes_return_to_baseline_exactly() {
    let a = sim();
    let weights = a.allocate(40 * MIB).unwrap();
    let baseline = a.memory_stats().allocated_bytes.all.current;
    for step in 0..20usize {
        let (result, report) = scoped(&a, |s| {
            for layer in 0..8 {
                s.allocate((layer + 1) * 300_000 + step)?;
            }
            Ok(())
        });
        result.unwrap();
        assert_eq!(report.blocks, 8);
        assert_eq!(a.memory_stats().allocated_bytes.all.current, baseline, "step {step}");
    }
    drop(weights);
}

#[test]
fn limiting_refuses_before_upstream_and_stays_usable() {
    let stack = Limiting::new(sim(), 10 * MIB);
    let x = stack.allocate(6 * MIB).unwrap();
    let err = stack.allocate(6 * MIB).unwrap_err();
    let oom = err.as_out_of_memory().unwrap();
    assert!(oom.limited_by_cap && oom.limit == Some(10 * MIB));
    assert_eq!(stack.inner().memory_stats().num_ooms, 0, "the allocator was never asked");
    assert_eq!(stack.memory_info().limit, Some(10 * MIB));
    drop(x);
    assert!(stack.allocate(9 * MIB).is_ok());
}

#[test]
fn failure_callback_frees_and_retries() {
    let calls = Arc::new(AtomicU32::new(0));
    let seen = calls.clone();
    let a = FailureCallback::new(Limiting::new(sim(), 8 * MIB), move |_, _, attempt| {
        seen.fetch_add(1, Ordering::SeqCst);
        attempt < 3
    });
    assert!(a.allocate(9 * MIB).unwrap_err().is_out_of_memory());
    assert_eq!(calls.load(Ordering::SeqCst), 3, "retried while the callback asked, then gave up");
}

#[test]
fn failure_callback_can_make_room() {
    // A cache the callback may drop: memory held outside the request's control.
    let stash: Arc<std::sync::Mutex<Vec<wick_memory::RawBlock>>> = Arc::default();
    let limited = Limiting::new(sim(), 8 * MIB);
    stash.lock().unwrap().push(limited.allocate_raw(wick_memory::AllocRequest::new(6 * MIB)).unwrap());
    let s2 = stash.clone();
    let a = FailureCallback::new(limited, move |up, _, _| match s2.lock().unwrap().pop() {
        Some(block) => up.deallocate_raw(block).is_ok(),
        None => false,
    });
    let x = a.allocate(6 * MIB).unwrap();
    assert_eq!(x.size(), 6 * MIB);
}

#[test]
fn tracking_lists_live_allocations_with_backtraces() {
    let t = Tracking::new(sim(), true);
    let x = t.allocate(1234).unwrap();
    let _y = t.allocate(99).unwrap();
    assert_eq!(t.live_bytes(), 1333);
    let report = t.report();
    assert!(report.starts_with("2 live allocation(s), 1333 bytes"), "{report}");
    assert!(t.live()[0].backtrace.is_some());
    drop(x);
    assert_eq!(t.live().len(), 1);
}

#[test]
fn keep_refuses_a_block_of_another_scope() {
    // Before: `keep` took whatever block sat at the same index of this scope, so the wrong block
    // left the scope and the right one was freed under its holder.
    let a = sim();
    let first = Scope::new(&a);
    let second = Scope::new(&a);
    let mine = first.allocate(100).unwrap();
    let theirs = second.allocate(200).unwrap();
    let theirs_addr = theirs.addr();
    assert!(matches!(first.keep(theirs), Err(MemoryError::ForeignBlock { addr }) if addr == theirs_addr));
    assert_eq!((first.live_blocks(), second.live_blocks()), (1, 1), "nothing moved");
    let kept = first.keep(mine).unwrap();
    assert_eq!(kept.size(), 100);
}

#[test]
fn adaptors_ignore_blocks_allocated_around_them() {
    // Freeing through an adaptor a block allocated through `.inner()` underflowed its counters.
    let stats = Statistics::new(sim());
    let counted = stats.allocate(4096).unwrap();
    let around = stats.inner().allocate_raw(wick_memory::AllocRequest::new(1024)).unwrap();
    stats.deallocate_raw(around).unwrap();
    let c = stats.counters();
    assert_eq!((c.count_current, c.bytes_current), (1, 4096));
    drop(counted);
    assert_eq!(stats.counters().count_current, 0);

    let limiting = Limiting::new(sim(), 8 * MIB);
    let counted = limiting.allocate(MIB).unwrap();
    let around = limiting.inner().allocate_raw(wick_memory::AllocRequest::new(2 * MIB)).unwrap();
    limiting.deallocate_raw(around).unwrap();
    assert_eq!(limiting.used(), MIB);
    drop(counted);
    assert_eq!(limiting.used(), 0);
}
