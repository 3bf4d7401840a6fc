//! The caching heap as this test binary's global allocator: large buffers come from the cache
//! and go back to it, reused blocks are handed out zeroed when asked, contents survive growth
//! across the small/large boundary, over-aligned requests are served, threads never see each
//! other's blocks, and `empty_cache` gives the unused segments back.

use std::alloc::{GlobalAlloc, Layout};
use std::sync::Mutex;

use wick_memory::{CachingHeap, LARGE_REQUEST};

#[global_allocator]
static HEAP: CachingHeap = CachingHeap::new();

/// The tests share one heap; run them one at a time so the figures they read are their own.
static SERIAL: Mutex<()> = Mutex::new(());

fn allocated() -> i64 {
    HEAP.memory_stats().allocated_bytes.all.current
}

#[test]
fn large_buffers_come_from_the_cache_and_are_reused() {
    let _s = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let before = allocated();
    let v = vec![1u8; 5 << 20];
    assert!(allocated() >= before + (5 << 20), "a 5 MiB buffer is a cache block");
    assert_eq!(CachingHeap::installed().map(|h| h as *const CachingHeap), Some(&HEAP as *const CachingHeap));
    let reserved = HEAP.memory_stats().reserved_bytes.all.current;
    let segments = HEAP.memory_stats().num_device_alloc;
    drop(v);
    assert_eq!(allocated(), before, "freed back to the cache");
    assert_eq!(HEAP.memory_stats().reserved_bytes.all.current, reserved, "still reserved: cached, not unmapped");
    // The same size again: served from the cached segment, no new one.
    let v = vec![2u8; 5 << 20];
    assert_eq!(HEAP.memory_stats().num_device_alloc, segments, "reused, not a new segment");
    assert!(v.iter().all(|b| *b == 2));
}

#[test]
fn reused_blocks_are_zeroed_when_asked() {
    let _s = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let n = 3 << 20;
    let dirty = vec![0xAAu8; n];
    drop(dirty);
    // `vec![0; n]` asks for zeroed memory; the block it gets held 0xAA.
    let clean = vec![0u8; n];
    assert!(clean.iter().all(|b| *b == 0));
}

#[test]
fn contents_survive_growth_across_the_boundary() {
    let _s = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let mut v: Vec<u32> = Vec::new();
    for i in 0..(3 * LARGE_REQUEST / 4) as u32 {
        v.push(i);
    }
    assert!(v.capacity() * 4 >= LARGE_REQUEST);
    assert!(v.iter().enumerate().all(|(i, x)| *x == i as u32));
    v.truncate(10);
    v.shrink_to_fit();
    assert_eq!(v, (0..10).collect::<Vec<u32>>());
}

#[test]
fn over_aligned_and_small_requests_are_served() {
    let _s = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    for align in [8, 64, 512, 4096, 1 << 16] {
        let layout = Layout::from_size_align(LARGE_REQUEST + 123, align).unwrap();
        // SAFETY: non-zero size; freed with the same layout below.
        let p = unsafe { HEAP.alloc(layout) };
        assert!(!p.is_null());
        assert_eq!(p as usize % align, 0, "aligned to {align}");
        // SAFETY: `p` holds `layout.size()` bytes.
        unsafe {
            std::ptr::write_bytes(p, 7, layout.size());
            assert_eq!(*p.add(layout.size() - 1), 7);
            HEAP.dealloc(p, layout);
        }
    }
    // A small request goes to the system allocator and back.
    let small: Vec<u8> = std::hint::black_box(vec![3u8; 100]);
    assert_eq!(small.iter().map(|b| *b as usize).sum::<usize>(), 300);
}

#[test]
fn threads_never_share_blocks() {
    let _s = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let threads: Vec<_> = (0..4u8)
        .map(|t| {
            std::thread::spawn(move || {
                let mut live: Vec<Vec<u8>> = Vec::new();
                for round in 0..200usize {
                    let size = LARGE_REQUEST + ((round * 7919 + t as usize * 104_729) % (4 << 20));
                    live.push(vec![t.wrapping_mul(31).wrapping_add(round as u8); size]);
                    if live.len() > 6 {
                        let v = live.remove(round % live.len());
                        let expected = v[0];
                        assert!(v.iter().all(|b| *b == expected), "another thread wrote into this block");
                    }
                }
                live.iter().all(|v| v.iter().all(|b| *b == v[0]))
            })
        })
        .collect();
    for t in threads {
        assert!(t.join().unwrap(), "blocks kept their contents");
    }
}

#[test]
fn live_figures_and_empty_cache() {
    let _s = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    // The harness's own threads allocate and free beside the test: only bounds are certain.
    HEAP.reset_peak_stats();
    let v = vec![9u8; 8 << 20];
    assert!(HEAP.live_bytes() >= 8 << 20, "the buffer is live");
    assert!(HEAP.peak_bytes() >= HEAP.live_bytes(), "the peak is at least the current figure");
    drop(v);
    let released = HEAP.empty_cache().unwrap();
    assert!(released.bytes >= 8 << 20, "the unused segments went back: {released:?}");
    // Every segment still reserved holds a live block (the test harness's own buffers).
    assert!(HEAP.snapshot().segments.iter().all(|s| s.allocated_size > 0));
    assert!(HEAP.memory_summary().contains("Allocated memory"));
}
