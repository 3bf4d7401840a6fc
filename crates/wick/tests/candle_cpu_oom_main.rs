//! Over-memory plain candle CPU tensors in a program with `wick::main!` (wick's caching heap as
//! the global allocator, `main` a kernel worker): candle's `Err` before any engine, after one, on
//! the main thread and on others; the heap's freed blocks count as room. A test with its own
//! `main` (`harness = false`): it fails by its exit status.

use candle_core::{DType, Device, Tensor};

type Res = Result<(), Box<dyn std::error::Error>>;

/// 1 TiB of f32.
const HUGE: usize = 1 << 38;

fn refused(what: &str, r: candle_core::Result<Tensor>) -> Res {
    match r {
        Err(e) if wick::is_out_of_memory(&e) => {
            println!("{what}: refused ({e})");
            Ok(())
        }
        Err(e) => Err(format!("{what}: another error: {e}").into()),
        Ok(_) => Err(format!("{what}: allocated").into()),
    }
}

fn run() -> Res {
    let earlier = Tensor::arange(0f32, 1000.0, &Device::Cpu)?;
    refused("before any engine", Tensor::zeros(HUGE, DType::F32, &Device::Cpu))?;
    let engine = wick::Engine::cpu();
    refused("after the engine", Tensor::zeros(HUGE, DType::F32, engine.device()))?;
    let col = Tensor::ones((1 << 19, 1), DType::F32, &Device::Cpu)?;
    refused("an op's output (broadcast_add)", col.broadcast_add(&col.t()?))?;
    let on_thread = std::thread::spawn(|| {
        refused("on another thread", Tensor::zeros(HUGE, DType::F32, &Device::Cpu)).map_err(|e| e.to_string())
    });
    on_thread.join().map_err(|_| "the thread panicked")??;

    // Under the caching heap a freed block stays with the process (reported as freed).
    let block = Tensor::zeros(64 << 20, DType::U8, &Device::Cpu)?;
    if wick::memory::CachingHeap::installed().is_none() {
        return Err("wick::main! installs the caching heap".into());
    }
    drop(block);
    let freed = wick_alloc_check::freed_heap();
    if freed < 64 << 20 {
        return Err(format!("the heap holds {freed} bytes freed after a 64 MiB tensor was dropped").into());
    }
    let again = Tensor::zeros(64 << 20, DType::U8, &Device::Cpu)?;
    if again.elem_count() != 64 << 20 || earlier.sum_all()?.to_scalar::<f32>()? != 499_500.0 {
        return Err("the tensors after the refusals are wrong".into());
    }
    address_space_limit()?;
    println!("ok: refused everywhere, {freed} freed bytes held by the heap, earlier tensors intact");
    Ok(())
}

/// Under `ulimit -v` (RLIMIT_AS) `malloc` returns null long before the machine is full, and Rust
/// aborts: a tensor beyond the limit is refused as such, though the machine has room for it;
/// the caching heap's freed blocks, mapped and so counted against the limit, are returned to the
/// system before a refusal and make room; and small tensors (below the size checked one by one)
/// are counted, so making them without end is refused too, never an abort. Last, since the limit
/// stays for the rest of the process.
fn address_space_limit() -> Res {
    // 768 MiB freed into the heap's cache: mapped, so inside the address space the limit counts.
    drop(Tensor::zeros(768usize << 20, DType::U8, &Device::Cpu)?);
    let statm = std::fs::read_to_string("/proc/self/statm")?;
    let pages: u64 = statm.split_whitespace().next().ok_or("statm")?.parse()?;
    let mapped = pages * 4096;
    let limit = libc::rlimit { rlim_cur: mapped + (512 << 20), rlim_max: libc::RLIM_INFINITY };
    // SAFETY: setrlimit reads one `rlimit` through a valid pointer.
    if unsafe { libc::setrlimit(libc::RLIMIT_AS, &limit) } != 0 {
        return Err("setrlimit(RLIMIT_AS) failed".into());
    }
    // A reading of the host's figures is reused for a moment to allow buffers (never to refuse
    // them): the new limit is seen from the next reading on.
    std::thread::sleep(wick_alloc_check::READING_REUSE);
    let machine_room = wick::host_memory::host_available();
    let err = match Tensor::zeros(2usize << 30, DType::U8, &Device::Cpu) {
        Err(e) => e.to_string(),
        Ok(_) => return Err("2 GiB allocated under a 1.25 GiB address-space allowance".into()),
    };
    if !err.contains("ulimit -v") || machine_room >= 2 << 30 {
        return Err(
            format!("refused for the wrong reason, or the room ({machine_room}) is not the limit's: {err}").into()
        );
    }
    println!("under ulimit -v: refused ({err})");
    // 1 GiB: more than the 512 MiB the limit leaves, less once the cached 768 MiB are returned.
    std::thread::sleep(wick_alloc_check::READING_REUSE);
    let big = Tensor::zeros(1usize << 30, DType::U8, &Device::Cpu)
        .map_err(|e| format!("1 GiB should fit once the heap returned its freed blocks: {e}"))?;
    drop(big);
    // 8 MiB tensors, each below the size checked one by one, kept until refused.
    std::thread::sleep(wick_alloc_check::READING_REUSE);
    let mut kept = Vec::new();
    let refusal = loop {
        match Tensor::zeros(8usize << 20, DType::U8, &Device::Cpu) {
            Ok(t) => kept.push(t),
            Err(e) => break e.to_string(),
        }
        if kept.len() > 1024 {
            return Err("8 GiB of small tensors under a 1.25 GiB address-space allowance".into());
        }
    };
    if !refusal.contains("below 16 MiB, counted together") || !refusal.contains("ulimit -v") {
        return Err(format!("small tensors refused for the wrong reason: {refusal}").into());
    }
    println!("small tensors: {} made, then refused ({refusal})", kept.len());
    drop(kept);
    let small = Tensor::zeros(32usize << 20, DType::U8, &Device::Cpu)?;
    (small.elem_count() == 32 << 20).then_some(()).ok_or_else(|| "a small tensor under the limit".into())
}

wick::main!(run);
