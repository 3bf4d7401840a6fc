//! A safe reader for PyTorch's legacy (pre-1.6, non-zip) `.pth` files, such as torchvision's
//! `mobilenet_v2-b0353104.pth`, which candle's pickle loader cannot read. It interprets only the
//! pickle opcodes a state dict uses and calls nothing: the only constructors it accepts are
//! `collections.OrderedDict` and `torch._utils._rebuild_tensor_v2` over `torch.*Storage`, so a
//! file that asks for anything else is rejected rather than executed.
//!
//! Layout: pickle(magic number) pickle(protocol 1001) pickle(sys info) pickle(state dict with
//! persistent storage references) pickle(list of storage keys), then for each key an i64 element
//! count and the raw little-endian elements.

mod pickle;

use std::collections::{HashMap, HashSet};
use std::path::Path;

use candle_core::{DType, Device, Tensor};

use crate::error::ZooError;
use pickle::{unpickle, Reader, Value};

const MAGIC: &[u8] = &[0x6c, 0xfc, 0x9c, 0x46, 0xf9, 0x20, 0x6a, 0xa8, 0x50, 0x19]; // 0x1950a86a20f9469cfc6c LE

/// Reads every tensor of a legacy `.pth` state dict, in file order, onto `device`. Integer
/// tensors (`num_batches_tracked`) come back as I64. Every malformed, hostile or oversized input
/// is an error naming the file (see [`read_legacy_pth_bytes`]).
pub fn read_legacy_pth(path: &Path, device: &Device) -> Result<Vec<(String, Tensor)>, ZooError> {
    let data = std::fs::read(path).map_err(|e| ZooError::File { path: path.to_path_buf(), message: e.to_string() })?;
    read_legacy_pth_bytes(&data, path, device)
}

/// [`read_legacy_pth`] over the file's bytes (`path` names it in errors). The pickles may spend
/// work proportional to the input's length only and nest containers at most 64 deep; tensors must
/// be contiguous views inside their storage; a storage must have one dtype and size, and a name
/// may appear once.
pub fn read_legacy_pth_bytes(data: &[u8], path: &Path, device: &Device) -> Result<Vec<(String, Tensor)>, ZooError> {
    let fail = |message: String| ZooError::File { path: path.to_path_buf(), message };
    if data.starts_with(b"PK") {
        return Err(fail("this is a zip-format checkpoint (PyTorch >= 1.6); candle's own loader reads those".into()));
    }
    if data.first() != Some(&0x80) {
        return Err(fail("not a legacy PyTorch file (it does not start with a pickle)".into()));
    }
    let budget = data.len().saturating_mul(pickle::WORK_PER_BYTE).saturating_add(4096);
    let mut r = Reader { data, pos: 0 };
    match &*unpickle(&mut r, budget).map_err(|e| fail(format!("magic number: {e}")))? {
        Value::Long(bytes) if &**bytes == MAGIC => {}
        other => return Err(fail(format!("not a legacy PyTorch file (magic is a {})", other.summary()))),
    }
    match &*unpickle(&mut r, budget).map_err(|e| fail(format!("protocol version: {e}")))? {
        Value::Int(1001) => {}
        other => return Err(fail(format!("unsupported protocol version ({})", other.summary()))),
    }
    let sys_info = unpickle(&mut r, budget).map_err(|e| fail(format!("sys info: {e}")))?;
    let little_endian = match &*sys_info {
        Value::Dict(items, _) => items.iter().find_map(|(k, v)| match (&**k, &**v) {
            (Value::Str(k), Value::Bool(b)) if &**k == "little_endian" => Some(*b),
            _ => None,
        }),
        _ => None,
    };
    if little_endian != Some(true) {
        return Err(fail("the file was written big-endian or without byte-order information".into()));
    }
    let state = unpickle(&mut r, budget).map_err(|e| fail(format!("state dict: {e}")))?;
    let Value::Dict(entries, _) = &*state else {
        return Err(fail(format!("the checkpoint is not a state dict but a {}", state.summary())));
    };
    let keys = unpickle(&mut r, budget).map_err(|e| fail(format!("storage keys: {e}")))?;
    let Value::List(keys, _) = &*keys else { return Err(fail("storage keys are not a list".into())) };

    // Every entry a named tensor, named once; each storage with one dtype and one size.
    let mut tensors = Vec::with_capacity(entries.len());
    let mut names = HashSet::new();
    let mut storage_kind: HashMap<&str, (DType, usize)> = HashMap::new();
    for (name, v) in entries {
        let Value::Str(name) = &**name else {
            return Err(fail(format!("a state-dict key is a {}, not a string", name.summary())));
        };
        let Value::Tensor(t) = &**v else {
            return Err(fail(format!("entry `{name}` is a {}, not a tensor", v.summary())));
        };
        if !names.insert(&**name) {
            return Err(fail(format!("entry `{name}` appears twice")));
        }
        let kind = (t.dtype, t.storage_numel);
        if *storage_kind.entry(&t.storage_key).or_insert(kind) != kind {
            return Err(fail(format!(
                "storage {} is used as {:?} × {} by `{name}` and differently by another tensor",
                t.storage_key, t.dtype, t.storage_numel
            )));
        }
        tensors.push((name, t));
    }

    let mut storages: HashMap<&str, Tensor> = HashMap::new();
    for key in keys {
        let Value::Str(key) = &**key else { return Err(fail("a storage key is not a string".into())) };
        let numel = r.take(8).map_err(&fail)?;
        let numel =
            i64::from_le_bytes([numel[0], numel[1], numel[2], numel[3], numel[4], numel[5], numel[6], numel[7]]);
        let numel = usize::try_from(numel).map_err(|_| fail(format!("storage {key} has a negative size")))?;
        let (dtype, declared) =
            *storage_kind.get(&**key).ok_or_else(|| fail(format!("storage {key} is used by no tensor")))?;
        if declared != numel {
            return Err(fail(format!("storage {key}: {numel} elements on disk, {declared} declared")));
        }
        if storages.contains_key(&**key) {
            return Err(fail(format!("storage {key} is stored twice")));
        }
        let size =
            numel.checked_mul(dtype.size_in_bytes()).ok_or_else(|| fail(format!("storage {key} is too large")))?;
        let bytes = r.take(size).map_err(|e| fail(format!("storage {key}: {e}")))?;
        let t = match dtype {
            DType::F32 => Tensor::from_vec(le::<4, _>(bytes, f32::from_le_bytes), numel, device)?,
            DType::F64 => Tensor::from_vec(le::<8, _>(bytes, f64::from_le_bytes), numel, device)?,
            DType::I64 => Tensor::from_vec(le::<8, _>(bytes, i64::from_le_bytes), numel, device)?,
            DType::U8 => Tensor::from_vec(bytes.to_vec(), numel, device)?,
            other => return Err(fail(format!("storage {key}: dtype {other:?} is not supported yet"))),
        };
        storages.insert(key, t);
    }
    let mut out = Vec::with_capacity(tensors.len());
    for (name, t) in tensors {
        let storage = storages
            .get(&*t.storage_key)
            .ok_or_else(|| fail(format!("tensor `{name}`: storage {} is missing", t.storage_key)))?;
        let too_large = || fail(format!("tensor `{name}`: shape {:?} is too large", t.shape));
        let numel = t.shape.iter().try_fold(1usize, |a, &d| a.checked_mul(d)).ok_or_else(too_large)?;
        // Row-major strides of the shape (each divides numel, so none overflows).
        let mut contiguous = vec![1usize; t.shape.len()];
        for i in (0..t.shape.len().saturating_sub(1)).rev() {
            contiguous[i] = contiguous[i + 1] * t.shape[i + 1];
        }
        if numel > 1 && t.stride != contiguous {
            return Err(fail(format!("tensor `{name}` is not contiguous (stride {:?})", t.stride)));
        }
        if t.offset.checked_add(numel).is_none_or(|end| end > storage.elem_count()) {
            return Err(fail(format!("tensor `{name}` reaches past its storage")));
        }
        out.push((name.to_string(), storage.narrow(0, t.offset, numel)?.reshape(t.shape.as_slice())?));
    }
    Ok(out)
}

/// Little-endian elements of `N` bytes each.
fn le<const N: usize, T>(bytes: &[u8], from: fn([u8; N]) -> T) -> Vec<T> {
    bytes
        .chunks_exact(N)
        .map(|c| {
            let mut a = [0u8; N];
            a.copy_from_slice(c);
            from(a)
        })
        .collect()
}

/// Converts a legacy `.pth` state dict to a safetensors file with the same names and values.
/// Returns the number of tensors written.
pub fn convert_to_safetensors(pth: &Path, out: &Path) -> Result<usize, ZooError> {
    let tensors = read_legacy_pth(pth, &Device::Cpu)?;
    let count = tensors.len();
    let map: HashMap<String, Tensor> = tensors.into_iter().collect();
    // Atomically: a failed or interrupted conversion never leaves a truncated file at `out`.
    wick::tensor_files::write_safetensors(out, &map)
        .map_err(|e| ZooError::File { path: out.to_path_buf(), message: e.to_string() })?;
    Ok(count)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(bytes: &[u8]) -> Result<pickle::Obj, String> {
        unpickle(&mut Reader { data: bytes, pos: 0 }, 1 << 20)
    }

    #[test]
    fn refuses_to_call_anything_else() {
        // pickle.dumps(os.system, protocol=2) style: GLOBAL 'os system' + args + REDUCE.
        let evil = b"\x80\x02cos\nsystem\nq\x00X\x02\x00\x00\x00lsq\x01\x85q\x02Rq\x03.";
        let err = run(evil).unwrap_err();
        assert!(err.contains("refusing to call os.system"), "{err}");
    }

    #[test]
    fn truncated_and_unknown_input_are_errors() {
        assert!(run(b"\x80\x02X\xff\x00\x00\x00ab").unwrap_err().contains("end of file"));
        assert!(run(b"\x80\x02\xfe").unwrap_err().contains("unsupported pickle opcode"));
        assert!(run(b"\x80\x02t.").unwrap_err().contains("MARK"));
        let dir = std::env::temp_dir().join(format!("wick-pth-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join("x.pth");
        std::fs::write(&p, b"PK\x03\x04rest").unwrap();
        assert!(read_legacy_pth(&p, &Device::Cpu).unwrap_err().to_string().contains("zip-format"));
        std::fs::write(&p, b"\x80\x02K\x05.").unwrap();
        assert!(read_legacy_pth(&p, &Device::Cpu).unwrap_err().to_string().contains("not a legacy PyTorch file"));
        std::fs::remove_dir_all(&dir).ok();
    }
}
