//! Tensor files (safetensors: weights, checkpoints, datasets): what they will cost before
//! loading them, from the header alone; their header read and checked without the payload
//! ([`read_safetensors_header`], for readers that read tensor by tensor); writing them whole
//! and atomically.

use std::collections::HashMap;
use std::io::Read;
use std::path::Path;

use candle_core::Tensor;

use wick_memory::MemoryError;

/// Bytes of tensor data in a safetensors file, from its header alone (the format starts with a
/// little-endian u64 header length and a JSON header of `data_offsets`; reading it directly avoids
/// mapping the whole file just to size it). Errors name the file.
pub fn safetensors_payload_bytes(path: &std::path::Path) -> Result<usize, MemoryError> {
    let bad = |message: String| MemoryError::InvalidFile { path: path.to_path_buf(), message };
    let mut file = std::fs::File::open(path).map_err(|e| bad(e.to_string()))?;
    let mut len = [0u8; 8];
    file.read_exact(&mut len).map_err(|e| bad(format!("cannot read header length: {e}")))?;
    let len = u64::from_le_bytes(len);
    // The format caps headers at 100 MB.
    if len > 100_000_000 {
        return Err(bad(format!("header length {len} is implausible; not a safetensors file")));
    }
    let mut header = vec![0u8; len as usize];
    file.read_exact(&mut header).map_err(|e| bad(format!("truncated header: {e}")))?;
    let json: serde_json::Value =
        serde_json::from_slice(&header).map_err(|e| bad(format!("header is not JSON: {e}")))?;
    let map = json.as_object().ok_or_else(|| bad("header is not a JSON object".into()))?;
    let mut end = 0usize;
    for (name, entry) in map.iter().filter(|(k, _)| k.as_str() != "__metadata__") {
        let offsets = entry
            .get("data_offsets")
            .and_then(|o| o.as_array())
            .filter(|o| o.len() == 2)
            .ok_or_else(|| bad(format!("tensor `{name}` has no data_offsets")))?;
        let stop = offsets[1].as_u64().ok_or_else(|| bad(format!("tensor `{name}`: bad data_offsets")))?;
        end = end.max(usize::try_from(stop).map_err(|_| bad(format!("tensor `{name}` is too large")))?);
    }
    Ok(end)
}

/// The most header bytes a safetensors file may have (the format's own cap).
pub const MAX_SAFETENSORS_HEADER: u64 = 100_000_000;

/// A safetensors file's header, read and checked by [`read_safetensors_header`].
#[derive(Debug)]
pub struct SafetensorsHeader {
    /// The tensors, parsed by the `safetensors` crate's own `Metadata` (which checks that the
    /// offsets are contiguous and match each tensor's dtype and shape; its `read_metadata` is not
    /// used because it wants the whole file in memory).
    pub metadata: safetensors::tensor::Metadata,
    /// Where the payload starts in the file (a tensor's offsets count from here).
    pub data_start: u64,
}

/// Reads the header of the safetensors file `file` (`len` bytes long) from its start, and checks
/// that it describes exactly the file's payload. `Err` says why it is not a safetensors file.
pub fn read_safetensors_header(file: &mut std::fs::File, len: u64) -> Result<SafetensorsHeader, String> {
    let mut n = [0u8; 8];
    file.read_exact(&mut n).map_err(|e| format!("no header length ({e})"))?;
    let header = u64::from_le_bytes(n);
    if header > MAX_SAFETENSORS_HEADER || header > len.saturating_sub(8) {
        return Err(format!("a header of {header} bytes in a file of {len}"));
    }
    let mut text = Vec::new();
    file.take(header).read_to_end(&mut text).map_err(|e| e.to_string())?;
    let metadata: safetensors::tensor::Metadata = serde_json::from_slice(&text).map_err(|e| e.to_string())?;
    let data_start = 8 + header;
    if data_start.checked_add(metadata.data_len() as u64) != Some(len) {
        return Err(format!("its header describes {} data bytes, it holds {}", metadata.data_len(), len - data_start));
    }
    Ok(SafetensorsHeader { metadata, data_start })
}

/// candle's dtype for a safetensors dtype; `None` for those candle has no type for.
pub fn candle_dtype(dtype: safetensors::Dtype) -> Option<candle_core::DType> {
    use candle_core::DType;
    use safetensors::Dtype;
    Some(match dtype {
        Dtype::F32 => DType::F32,
        Dtype::F16 => DType::F16,
        Dtype::BF16 => DType::BF16,
        Dtype::F64 => DType::F64,
        Dtype::I64 => DType::I64,
        Dtype::U32 => DType::U32,
        Dtype::U8 => DType::U8,
        _ => return None,
    })
}

/// Writes `tensors` as a safetensors file at `path` atomically ([`crate::files::write_atomic`])
/// and returns the file's bytes (for a checksum without reading it back).
///
/// Why not candle's `safetensors::save`: it writes through a `.tmpXXXXXX` file of its own next
/// to the destination, which a process killed mid-write leaves behind under a name no sweep of
/// wick's own temporary files knows. Serialising in memory costs one copy of the payload, as
/// much as reading the file back for its checksum did.
pub fn write_safetensors<K>(path: &Path, tensors: &HashMap<K, Tensor>) -> std::io::Result<Vec<u8>>
where
    K: AsRef<str> + Ord + std::fmt::Display,
{
    let bytes = safetensors::serialize(tensors, None).map_err(std::io::Error::other)?;
    crate::files::write_atomic(path, &bytes)?;
    Ok(bytes)
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Tensor};

    #[test]
    fn sizes_a_real_safetensors_file_and_rejects_garbage() {
        let dir = std::env::temp_dir().join(format!("wick-weights-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("w.safetensors");
        let a = Tensor::zeros((64, 32), candle_core::DType::F32, &Device::Cpu).unwrap();
        let b = Tensor::zeros(10, candle_core::DType::F16, &Device::Cpu).unwrap();
        candle_core::safetensors::save(&std::collections::HashMap::from([("a", a), ("b", b)]), &path).unwrap();
        assert_eq!(safetensors_payload_bytes(&path).unwrap(), 64 * 32 * 4 + 10 * 2);
        let garbage = dir.join("bad.safetensors");
        std::fs::write(&garbage, b"definitely not safetensors").unwrap();
        let err = safetensors_payload_bytes(&garbage).unwrap_err().to_string();
        assert!(err.contains("bad.safetensors"), "{err}");
        assert!(safetensors_payload_bytes(&dir.join("missing.safetensors")).is_err());
        std::fs::remove_dir_all(&dir).ok();
    }

    #[test]
    fn written_tensor_files_read_back_as_candle_reads_them_and_leave_nothing_else() {
        let dir = std::env::temp_dir().join(format!("wick-weights-write-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let a = Tensor::arange(0f32, 12.0, &Device::Cpu).unwrap().reshape((3, 4)).unwrap();
        let b = Tensor::new(&[7i64, -1], &Device::Cpu).unwrap();
        let path = dir.join("t.safetensors");
        let bytes = write_safetensors(&path, &HashMap::from([("a", a.clone()), ("b", b.clone())])).unwrap();
        assert_eq!(std::fs::read(&path).unwrap(), bytes);
        let back = candle_core::safetensors::load(&path, &Device::Cpu).unwrap();
        assert_eq!(back["a"].to_vec2::<f32>().unwrap(), a.to_vec2::<f32>().unwrap());
        assert_eq!(back["b"].to_vec1::<i64>().unwrap(), vec![7, -1]);
        let names: Vec<_> = std::fs::read_dir(&dir).unwrap().map(|e| e.unwrap().file_name()).collect();
        assert_eq!(names, vec![std::ffi::OsString::from("t.safetensors")]);
        // A folder that does not exist: an error, not a panic.
        assert!(write_safetensors(&dir.join("no/such/t.safetensors"), &HashMap::from([("a", a)])).is_err());
        std::fs::remove_dir_all(&dir).ok();
    }
}
