//! The `gemm` crate keeps a scratch buffer per thread for the thread's life, made on the
//! thread's first product; `allocate_thread_scratch` makes it on every thread of rayon's pool
//! and on the caller, so that products measured afterwards keep nothing. This binary counts its
//! own live heap bytes (one test: nothing else allocates meanwhile).

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicIsize, Ordering};

use wick_kernels::cpu::gemm::{allocate_thread_scratch, gemm, Mat};

struct Counting;

static LIVE: AtomicIsize = AtomicIsize::new(0);

// SAFETY: every call is forwarded to the system allocator unchanged; only a counter is kept.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        LIVE.fetch_add(layout.size() as isize, Ordering::SeqCst);
        // SAFETY: the caller's contract, passed on.
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        LIVE.fetch_sub(layout.size() as isize, Ordering::SeqCst);
        // SAFETY: the caller's contract, passed on.
        unsafe { System.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static HEAP: Counting = Counting;

fn live() -> isize {
    LIVE.load(Ordering::SeqCst)
}

const M: usize = 512;
const K: usize = 256;
const N: usize = 256;

/// One single-threaded product of all-ones by all-halves, checked (every element is K/2), its
/// operands and result made and dropped inside.
fn one_product() {
    let (a, b) = (vec![1.0f64; M * K], vec![0.5f64; K * N]);
    let mut dst = vec![0.0f64; M * N];
    gemm(&mut dst, Mat::rows(&a, M, K), Mat::rows(&b, K, N), 1.0, false, false).unwrap();
    assert!(dst.iter().all(|&x| x == K as f64 / 2.0));
}

#[test]
fn products_after_the_thread_scratch_is_allocated_keep_nothing() {
    // A thread of its own, never given the scratch: its first product keeps the crate's buffer
    // (the control: what the call below prevents can be seen here).
    let kept = std::thread::spawn(|| {
        let before = live();
        one_product();
        live() - before
    })
    .join()
    .unwrap();
    assert!(kept >= 64 << 10, "a thread's first product keeps the crate's scratch: {kept} bytes");

    allocate_thread_scratch();
    let before = live();
    rayon::broadcast(|_| one_product());
    one_product();
    assert_eq!(live() - before, 0, "products on rayon's threads and the caller's kept bytes");
}
