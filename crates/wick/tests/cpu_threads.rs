//! `cpu_threads::kernels_on_main_thread` (its own test binary: it sets up the process's global
//! rayon pool, once).

use rayon::prelude::*;

#[test]
fn the_calling_thread_becomes_the_first_worker_and_runs_its_share() {
    let caller = std::thread::current().id();
    wick::cpu_threads::kernels_on_main_thread().expect("no global pool yet");
    assert_eq!(rayon::current_thread_index(), Some(0), "the caller is worker 0");
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
    assert_eq!(rayon::current_num_threads(), cpus);
    // A parallel op issued here runs partly on this thread (no hand-off to the pool), with the
    // same result as a serial one.
    let ran_here = std::sync::atomic::AtomicUsize::new(0);
    let sum: usize = (0..100_000usize)
        .into_par_iter()
        .with_max_len(1_000)
        .map(|i| {
            if std::thread::current().id() == caller {
                ran_here.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            }
            i
        })
        .sum();
    assert_eq!(sum, 100_000 * 99_999 / 2);
    assert!(ran_here.into_inner() > 0, "the calling thread ran none of the op");
    // The pool exists now: a second call is an error, not a panic.
    assert!(wick::cpu_threads::kernels_on_main_thread().is_err());
}
