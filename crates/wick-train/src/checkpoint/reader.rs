//! A checkpoint opened for reading by element range ([`CheckpointReader`]): a rank of a sharded
//! run reads only its own share of the masters and optimizer state, at any world size, without
//! the whole state ever being in one process's memory.
//!
//! Opening reads the manifest and each tensor file's safetensors header (small), checks that
//! each file has the size the manifest records and that its header describes exactly its bytes,
//! and indexes every tensor by its key: whole (`state0/w`) or as pieces (`state0/w#OFFSET`, a
//! sharded checkpoint's), which must cover it from offset 0 without gaps or overlaps. A file's
//! SHA-256 is checked, streaming, the first time anything is read from it, so a file no read
//! touches is not read at all, and what is returned always comes from a file whose checksum
//! matched.
//!
//! The header is read and checked by `wick::tensor_files::read_safetensors_header` (the
//! `safetensors` crate's own `Metadata`).

use std::collections::HashMap;
use std::fs::File;
use std::io::{Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};

use candle_core::{Device, Tensor};
use safetensors::Dtype;
use sha2::{Digest, Sha256};

use super::{file_error, Manifest, ShardFile};
use crate::error::TrainError;

/// How many bytes a read or a checksum pass holds at a time.
const CHUNK: usize = 1 << 20;

struct TensorFile {
    path: PathBuf,
    file: File,
    record: ShardFile,
    verified: bool,
}

/// One stored part of a tensor: the whole tensor, or a piece from `offset` (in elements).
#[derive(Debug, Clone)]
struct Part {
    file: usize,
    offset: usize,
    elems: usize,
    dtype: Dtype,
    shape: Vec<usize>,
    /// Where its bytes start in the file.
    start: u64,
}

/// A checkpoint's manifest and an index of its tensors, read by range on demand (see the
/// module's documentation).
pub struct CheckpointReader {
    manifest_path: PathBuf,
    manifest: Manifest,
    files: Vec<TensorFile>,
    index: HashMap<String, Vec<Part>>,
}

/// `key` and the piece offset of a stored tensor's name (`key#OFFSET`; 0 for a whole tensor).
fn split_name(name: &str) -> Result<(&str, usize), String> {
    match name.rsplit_once('#') {
        Some((key, offset)) => {
            Ok((key, offset.parse().map_err(|_| format!("the piece `{name}` has no element offset"))?))
        }
        None => Ok((name, 0)),
    }
}

impl TensorFile {
    /// Opens `record` in `dir` (named by the manifest at `manifest`) and indexes its tensors
    /// into `index` (as file number `n`).
    fn open(
        dir: &Path,
        manifest: &Path,
        record: &ShardFile,
        n: usize,
        index: &mut HashMap<String, Vec<Part>>,
    ) -> Result<TensorFile, TrainError> {
        let path = record.path_in(dir, manifest)?;
        let mut file = File::open(&path).map_err(|e| file_error(&path, e))?;
        let len = file.metadata().map_err(|e| file_error(&path, e))?.len();
        record.check_len(&path, len)?;
        let damaged = |why: String| file_error(&path, format!("not a safetensors file: {why}"));
        let header = wick::tensor_files::read_safetensors_header(&mut file, len).map_err(damaged)?;
        let (metadata, data_start) = (header.metadata, header.data_start);
        for (name, info) in metadata.tensors() {
            let (key, offset) = split_name(&name).map_err(damaged)?;
            let elems = info.shape.iter().product();
            let start = data_start + info.data_offsets.0 as u64;
            let part = Part { file: n, offset, elems, dtype: info.dtype, shape: info.shape.clone(), start };
            index.entry(key.to_string()).or_default().push(part);
        }
        Ok(TensorFile { path, file, record: record.clone(), verified: false })
    }

    /// Checks the file's SHA-256 against the manifest's, once, reading it in chunks.
    fn verify(&mut self) -> Result<(), TrainError> {
        if self.verified {
            return Ok(());
        }
        let path = &self.path;
        self.file.seek(SeekFrom::Start(0)).map_err(|e| file_error(path, e))?;
        let mut hasher = Sha256::new();
        let mut buf = vec![0u8; CHUNK];
        loop {
            let n = self.file.read(&mut buf).map_err(|e| file_error(path, e))?;
            if n == 0 {
                break;
            }
            hasher.update(&buf[..n]);
        }
        self.record.check_sha256(path, &hasher.finalize())?;
        self.verified = true;
        Ok(())
    }

    /// `len` bytes from `at`, appended to `out` (after the checksum check).
    fn read_into(&mut self, at: u64, len: usize, out: &mut Vec<u8>) -> Result<(), TrainError> {
        self.verify()?;
        let path = &self.path;
        self.file.seek(SeekFrom::Start(at)).map_err(|e| file_error(path, e))?;
        let from = out.len();
        out.resize(from + len, 0);
        self.file.read_exact(&mut out[from..]).map_err(|e| file_error(path, e))
    }
}

impl CheckpointReader {
    pub(super) fn open(dir: &Path, manifest_path: PathBuf, manifest: Manifest) -> Result<Self, TrainError> {
        let records = manifest.files();
        let mut index = HashMap::new();
        let mut files = Vec::with_capacity(records.len());
        for (n, record) in records.iter().enumerate() {
            files.push(TensorFile::open(dir, &manifest_path, record, n, &mut index)?);
        }
        for (key, parts) in index.iter_mut() {
            parts.sort_by_key(|p| p.offset);
            let mut at = 0usize;
            for p in parts.iter() {
                if p.offset != at {
                    let message = format!("`{key}`: a piece starts at {}, the pieces before end at {at}", p.offset);
                    return Err(file_error(&files[p.file].path, message));
                }
                at += p.elems;
            }
        }
        Ok(CheckpointReader { manifest_path, manifest, files, index })
    }

    /// The manifest.
    pub fn manifest(&self) -> &Manifest {
        &self.manifest
    }

    /// The manifest's path.
    pub fn manifest_path(&self) -> &Path {
        &self.manifest_path
    }

    /// Whether the checkpoint holds the tensor `key` (whole or in pieces).
    pub fn contains(&self, key: &str) -> bool {
        self.index.contains_key(key)
    }

    /// Elements in the tensor `key` (0 when it has none).
    pub fn elem_count(&self, key: &str) -> usize {
        self.index.get(key).and_then(|p| p.last()).map_or(0, |p| p.offset + p.elems)
    }

    fn parts(&self, key: &str) -> Result<&[Part], TrainError> {
        self.index
            .get(key)
            .map(Vec::as_slice)
            .ok_or_else(|| file_error(&self.manifest_path, format!("it holds no tensor `{key}`")))
    }

    /// Elements `offset .. offset + len` of the f32 tensor `key`, flat, from whichever files
    /// hold them (each checked once against its checksum).
    pub fn read_f32(&mut self, key: &str, offset: usize, len: usize) -> Result<Vec<f32>, TrainError> {
        let parts = self.parts(key)?.to_vec();
        let total = self.elem_count(key);
        let end = offset.checked_add(len).filter(|&e| e <= total).ok_or_else(|| {
            file_error(&self.manifest_path, format!("`{key}` has {total} elements, not {offset} + {len}"))
        })?;
        let mut out = Vec::with_capacity(len);
        let mut bytes = Vec::with_capacity(CHUNK.min(4 * len));
        for p in parts.iter().filter(|p| p.offset < end && p.offset + p.elems > offset) {
            if p.dtype != Dtype::F32 {
                let message = format!("`{key}` is stored as {:?}; f32 was expected", p.dtype);
                return Err(file_error(&self.files[p.file].path, message));
            }
            let (a, b) = (offset.max(p.offset) - p.offset, end.min(p.offset + p.elems) - p.offset);
            // In chunks: the bytes are never held beside all of the values.
            let mut at = a;
            while at < b {
                let n = (b - at).min(CHUNK / 4);
                bytes.clear();
                self.files[p.file].read_into(p.start + 4 * at as u64, 4 * n, &mut bytes)?;
                out.extend(bytes.chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])));
                at += n;
            }
        }
        Ok(out)
    }

    /// The whole tensor `key` on `device`, in its stored dtype and shape (pieces are joined
    /// flat).
    pub fn read(&mut self, key: &str, device: &Device) -> Result<Tensor, TrainError> {
        let parts = self.parts(key)?.to_vec();
        let first = &parts[0];
        if parts.iter().any(|p| p.dtype != first.dtype) {
            return Err(file_error(&self.manifest_path, format!("the pieces of `{key}` differ in dtype")));
        }
        let dtype = wick::tensor_files::candle_dtype(first.dtype).ok_or_else(|| {
            file_error(
                &self.files[first.file].path,
                format!("`{key}` is {:?}, a dtype wick does not train in", first.dtype),
            )
        })?;
        let shape = if parts.len() == 1 { first.shape.clone() } else { vec![self.elem_count(key)] };
        let mut bytes = Vec::new();
        for p in &parts {
            self.files[p.file].read_into(p.start, p.elems * dtype.size_in_bytes(), &mut bytes)?;
        }
        Ok(Tensor::from_raw_buffer(&bytes, dtype, &shape, device)?)
    }

    /// Checks the checksum of every file that holds part of `key` (reading them through).
    pub fn verify(&mut self, key: &str) -> Result<(), TrainError> {
        let files: Vec<usize> = self.parts(key)?.iter().map(|p| p.file).collect();
        files.into_iter().try_for_each(|f| self.files[f].verify())
    }
}
