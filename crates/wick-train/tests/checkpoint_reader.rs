//! `CheckpointReader`: a checkpoint read by element range — pieces spread over shard files read
//! back equal to the tensors they were cut from, a damaged file is found when (and only when) it
//! is read from, bad layouts are refused when opened, and no file content makes it panic.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Tensor};
use proptest::prelude::*;
use wick_train::checkpoint::{CheckpointDir, Manifest};

fn manifest(step: u64) -> Manifest {
    Manifest {
        format: String::new(),
        version: 0,
        step,
        optimizer_steps: step,
        model: serde_json::json!({}),
        params: Vec::new(),
        buffers: Vec::new(),
        optimizer: String::new(),
        scaler: None,
        data: serde_json::json!({}),
        tensors: String::new(),
        bytes: 0,
        sha256: String::new(),
        shards: Vec::new(),
    }
}

fn dir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("wick-reader-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    d
}

/// `w` (0..n as f32) cut at `cuts` into pieces over two shard files, alternating; `bias` (bf16)
/// whole in file 0.
fn sharded(path: &Path, n: usize, cuts: &[usize]) -> (CheckpointDir, Vec<f32>) {
    let ckpt = CheckpointDir::new(path, 3).unwrap();
    let values: Vec<f32> = (0..n).map(|i| i as f32 * 0.5 - 3.0).collect();
    let mut files = [HashMap::new(), HashMap::new()];
    let mut bounds = vec![0];
    bounds.extend_from_slice(cuts);
    bounds.push(n);
    for (k, w) in bounds.windows(2).enumerate() {
        let piece = Tensor::new(&values[w[0]..w[1]], &Device::Cpu).unwrap();
        files[k % 2].insert(format!("state0/w#{}", w[0]), piece);
    }
    let bias = Tensor::new(&[1f32, -2., 3.], &Device::Cpu).unwrap().to_dtype(DType::BF16).unwrap();
    files[0].insert("buffer/bias".to_string(), bias);
    let shards = files.iter().enumerate().map(|(r, t)| ckpt.write_shard(1, r, 2, t).unwrap()).collect();
    ckpt.write_sharded(manifest(1), shards).unwrap();
    (ckpt, values)
}

#[test]
fn ranges_over_pieces_in_two_files_equal_the_tensor_they_were_cut_from() {
    let path = dir("ranges");
    let (ckpt, values) = sharded(&path, 37, &[5, 6, 20, 31]);
    let mut r = ckpt.open(1).unwrap();
    assert_eq!(r.elem_count("state0/w"), 37);
    for offset in 0..37 {
        for len in 0..=(37 - offset) {
            assert_eq!(r.read_f32("state0/w", offset, len).unwrap(), &values[offset..offset + len], "{offset}+{len}");
        }
    }
    assert_eq!(r.read("state0/w", &Device::Cpu).unwrap().to_vec1::<f32>().unwrap(), values);
    let bias = r.read("buffer/bias", &Device::Cpu).unwrap();
    assert_eq!(bias.dtype(), DType::BF16);
    assert_eq!(bias.to_dtype(DType::F32).unwrap().to_vec1::<f32>().unwrap(), vec![1., -2., 3.]);
    let past = r.read_f32("state0/w", 30, 8).unwrap_err().to_string();
    assert!(past.contains("`state0/w` has 37 elements, not 30 + 8"), "{past}");
    assert!(r.read_f32("state0/w", usize::MAX, 2).is_err(), "an overflowing range is refused");
    assert!(r.read_f32("buffer/bias", 0, 1).unwrap_err().to_string().contains("f32 was expected"));
    assert!(r.read_f32("state1/w", 0, 1).unwrap_err().to_string().contains("no tensor `state1/w`"));
    let _ = std::fs::remove_dir_all(&path);
}

#[test]
fn a_damaged_file_is_found_when_read_from_and_only_then() {
    let path = dir("damaged");
    // Pieces [0, 10) in file 0, [10, 20) in file 1.
    let (ckpt, values) = sharded(&path, 20, &[10]);
    let shard = path.join("step-0000000001.shard-1-of-2.safetensors");
    let mut bytes = std::fs::read(&shard).unwrap();
    let last = bytes.len() - 1;
    bytes[last] ^= 1;
    std::fs::write(&shard, bytes).unwrap();
    let mut r = ckpt.open(1).unwrap();
    assert_eq!(r.read_f32("state0/w", 2, 6).unwrap(), &values[2..8], "file 0 is intact");
    let e = r.read_f32("state0/w", 8, 4).unwrap_err().to_string();
    assert!(e.contains("shard-1-of-2") && e.contains("checksum mismatch"), "{e}");
    // Truncated: refused when opened, naming the sizes.
    std::fs::write(&shard, b"short").unwrap();
    let e = ckpt.open(1).err().expect("a truncated shard is refused").to_string();
    assert!(e.contains("5 bytes, the manifest says"), "{e}");
    std::fs::remove_file(&shard).unwrap();
    assert!(ckpt.open(1).is_err(), "a missing shard is refused");
    let _ = std::fs::remove_dir_all(&path);
}

#[test]
fn pieces_that_leave_a_gap_or_overlap_are_refused_when_opened() {
    for (name, pieces) in [("gap", vec![(0, 3), (4, 2)]), ("overlap", vec![(0, 3), (2, 2)]), ("late", vec![(1, 3)])] {
        let path = dir(name);
        let ckpt = CheckpointDir::new(&path, 3).unwrap();
        let mut t = HashMap::new();
        for (offset, len) in pieces {
            t.insert(format!("state0/w#{offset}"), Tensor::zeros(len, DType::F32, &Device::Cpu).unwrap());
        }
        let shard = ckpt.write_shard(1, 0, 1, &t).unwrap();
        ckpt.write_sharded(manifest(1), vec![shard]).unwrap();
        let e = ckpt.open(1).err().expect("refused").to_string();
        assert!(e.contains("`state0/w`: a piece starts at"), "{name}: {e}");
        let _ = std::fs::remove_dir_all(&path);
    }
}

/// A manifest over `bytes` as its one tensor file (size and checksum right, so the content
/// reaches the header parser).
fn open_bytes(path: &Path, bytes: &[u8]) -> Result<(), String> {
    use sha2::Digest;
    let ckpt = CheckpointDir::new(path, 3).unwrap();
    std::fs::write(path.join("t.safetensors"), bytes).unwrap();
    let mut m = manifest(1);
    m.tensors = "t.safetensors".into();
    m.bytes = bytes.len() as u64;
    m.sha256 = sha2::Sha256::digest(bytes).iter().map(|b| format!("{b:02x}")).collect();
    m.format = wick_train::checkpoint::FORMAT.into();
    m.version = wick_train::checkpoint::VERSION;
    std::fs::write(ckpt.manifest_path(1), serde_json::to_vec(&m).unwrap()).unwrap();
    let mut r = ckpt.open(1).map_err(|e| e.to_string())?;
    r.read("w", &Device::Cpu).map(|_| ()).map_err(|e| e.to_string())
}

fn valid_file() -> Vec<u8> {
    // A file of its own per call: two tests call this at the same time, and one removing the
    // shared file while the other read it failed a full run ("No such file or directory").
    static CALLS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let call = CALLS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let t = Tensor::new(&[1f32, 2., 3., 4.], &Device::Cpu).unwrap();
    let path = dir(&format!("valid-{call}")).with_extension("safetensors");
    candle_core::safetensors::save(&HashMap::from([("w", t)]), &path).unwrap();
    let bytes = std::fs::read(&path).unwrap();
    let _ = std::fs::remove_file(&path);
    bytes
}

#[test]
fn the_valid_file_reads_and_a_bad_header_is_an_error() {
    let path = dir("header");
    assert_eq!(open_bytes(&path, &valid_file()), Ok(()));
    let mut huge = valid_file();
    huge[..8].copy_from_slice(&u64::MAX.to_le_bytes());
    assert!(open_bytes(&path, &huge).unwrap_err().contains("not a safetensors file"));
    let _ = std::fs::remove_dir_all(&path);
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(200))]

    /// Any bytes, and any mutation of a valid file, give `Ok` or an error — never a panic, an
    /// abort or a huge allocation.
    #[test]
    fn no_file_content_makes_the_reader_panic(
        random in proptest::collection::vec(any::<u8>(), 0..200),
        flips in proptest::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..6),
    ) {
        let path = dir("fuzz");
        let _ = open_bytes(&path, &random);
        let mut bytes = valid_file();
        for (at, x) in flips {
            let i = at.index(bytes.len());
            bytes[i] ^= x;
        }
        let _ = open_bytes(&path, &bytes);
        let _ = std::fs::remove_dir_all(&path);
    }
}
