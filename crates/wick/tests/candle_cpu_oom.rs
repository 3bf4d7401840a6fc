//! A CPU tensor that candle itself allocates beyond the host's memory is candle's `Err` (wick's
//! patched candle-core asks `wick_alloc_check` first), never an aborted process: made directly,
//! as an op's output, or by a copy; with an engine or without one; on any thread; every earlier
//! tensor survives. `candle_cpu_oom_main.rs` does the same under `wick::main!`.

use candle_core::{DType, Device, Tensor};

/// Far beyond any machine this runs on (1 TiB of f32), yet its element count fits easily.
const HUGE: usize = 1 << 38;

#[test]
fn over_memory_candle_cpu_tensors_are_errors_and_earlier_tensors_survive() {
    let engine = wick::Engine::cpu();
    assert!(wick::host_memory::candle_checks_cpu_allocations(), "the workspace builds wick's patched candle-core");
    let earlier = Tensor::arange(0f32, 1000.0, engine.device()).unwrap();
    let expect_oom = |what: &str, r: candle_core::Result<Tensor>| {
        let err = r.err().unwrap_or_else(|| panic!("{what}: allocated"));
        assert!(wick::is_out_of_memory(&err), "{what}: {err}");
        let text = err.to_string();
        assert!(text.contains("a candle CPU tensor") && text.contains("TiB"), "{what}: {text}");
    };
    // Made directly.
    expect_oom("zeros", Tensor::zeros(HUGE, DType::F32, &Device::Cpu));
    expect_oom("ones", Tensor::ones((1 << 19, 1 << 19), DType::F32, &Device::Cpu));
    expect_oom("randn", Tensor::randn(0f32, 1.0, HUGE, &Device::Cpu));
    // An op's output: an outer product, a broadcast made contiguous, a cast, a gather of rows.
    let col = Tensor::ones((1 << 19, 1), DType::F32, &Device::Cpu).unwrap();
    let row = Tensor::ones((1, 1 << 19), DType::F32, &Device::Cpu).unwrap();
    expect_oom("matmul", col.matmul(&row));
    expect_oom("broadcast + contiguous", col.broadcast_as((1 << 19, 1 << 19)).and_then(|t| t.contiguous()));
    expect_oom("broadcast_add", col.broadcast_add(&row));
    let ids = Tensor::zeros(1 << 20, DType::U32, &Device::Cpu).unwrap();
    expect_oom("index_select", row.index_select(&ids, 0));
    // Everything before is intact, and ordinary work goes on.
    assert_eq!(earlier.sum_all().unwrap().to_scalar::<f32>().unwrap(), 499_500.0);
    let small = Tensor::zeros((256, 256), DType::F32, &Device::Cpu).unwrap();
    assert_eq!(small.matmul(&small).unwrap().dims(), &[256, 256]);
}

#[test]
fn the_check_lets_every_ordinary_size_through() {
    let _engine = wick::Engine::cpu();
    // Below the checked size nothing is asked; above it, what the host has is allowed.
    for n in [0usize, 1, 4099, (wick::host_memory::CHECKED_FROM / 4) + 1, 64 << 20] {
        let t = Tensor::zeros(n, DType::U8, &Device::Cpu).unwrap();
        assert_eq!(t.elem_count(), n);
    }
}

#[test]
fn without_an_engine_and_on_other_threads_too() {
    // No engine in this test: nothing is installed, the patched candle-core asks by itself.
    let earlier = Tensor::arange(0u32, 100, &Device::Cpu).unwrap();
    let refused = |r: candle_core::Result<Tensor>| matches!(r, Err(ref e) if wick::is_out_of_memory(e));
    assert!(refused(Tensor::zeros(HUGE, DType::F32, &Device::Cpu)));
    let threads: Vec<_> = (0..4)
        .map(|i| std::thread::spawn(move || refused(Tensor::ones((1 << 20, 1 << (18 + i)), DType::F32, &Device::Cpu))))
        .collect();
    for t in threads {
        assert!(t.join().expect("no panic on the thread"), "refused on its thread");
    }
    // The text names the machine's figures as the machine's, not as wick's.
    let err = Tensor::zeros(HUGE, DType::F32, &Device::Cpu).unwrap_err().to_string();
    assert!(err.contains("tried to allocate 1.00 TiB") && err.contains("this process holds"), "{err}");
    assert!(!err.contains("allocated by wick"), "{err}");
    assert_eq!(earlier.sum_all().unwrap().to_scalar::<u32>().unwrap(), 4950);
}
