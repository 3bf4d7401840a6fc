//! A `VarBuilder` for any candle-nn or candle-transformers model, governed by wick: the files are
//! pre-flighted from their headers before a byte of payload is read, and every tensor is read
//! under its own label (`weights/<name>`), so the memory history and the held-at-peak table say
//! which weights hold what.
//!
//! Why not candle's `VarBuilder::from_mmaped_safetensors`: mapping a file is `unsafe` (a file
//! changed or cut short under the map is undefined behaviour, or a `SIGBUS` that kills the
//! process), and the pages a map touches are charged to no allocation wick can see or label.
//! Here each tensor is read with plain reads straight into its own buffer, reserved fallibly: no
//! second copy, and a file damaged after opening is an `Err` naming it.

use std::collections::HashMap;
use std::fs::File;
use std::io::{Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use candle_core::{DType, Device, Shape, Tensor};
use candle_nn::var_builder::SimpleBackend;
use candle_nn::VarBuilder;
use safetensors::Dtype;

use crate::error::ZooError;

/// Where one tensor's bytes are, and what they are.
#[derive(Debug, Clone)]
struct Entry {
    file: usize,
    /// `None`: a dtype candle has no type for (refused when the tensor is asked for).
    dtype: Option<DType>,
    stored: Dtype,
    shape: Vec<usize>,
    start: u64,
    bytes: usize,
}

/// The tensors of one or more safetensors files (a model's shards), indexed from their headers
/// alone; read one tensor at a time through [`SafetensorsWeights::var_builder`].
#[derive(Debug)]
pub struct SafetensorsWeights {
    paths: Vec<PathBuf>,
    files: Vec<Mutex<File>>,
    index: HashMap<String, Entry>,
}

fn file_error(path: &Path, message: impl std::fmt::Display) -> ZooError {
    ZooError::File { path: path.to_path_buf(), message: message.to_string() }
}

impl SafetensorsWeights {
    /// Opens `paths` and reads their headers (checked: offsets contiguous and matching each
    /// tensor's dtype and shape, the file exactly as long as its header says). A tensor name in
    /// two files is an error.
    pub fn open<P: AsRef<Path>>(paths: &[P]) -> Result<Self, ZooError> {
        let mut weights = SafetensorsWeights { paths: Vec::new(), files: Vec::new(), index: HashMap::new() };
        for path in paths {
            weights.add(path.as_ref())?;
        }
        Ok(weights)
    }

    /// The weights of a model folder as the hub lays it out: the shards that
    /// `model.safetensors.index.json` names, else `model.safetensors`.
    pub fn open_dir(dir: &Path) -> Result<Self, ZooError> {
        let index = dir.join("model.safetensors.index.json");
        if !index.is_file() {
            return Self::open(&[dir.join("model.safetensors")]);
        }
        let text = std::fs::read_to_string(&index).map_err(|e| file_error(&index, e))?;
        let json: serde_json::Value = serde_json::from_str(&text).map_err(|e| file_error(&index, e))?;
        let map = json
            .get("weight_map")
            .and_then(|m| m.as_object())
            .ok_or_else(|| file_error(&index, "no `weight_map` object"))?;
        let mut shards = Vec::new();
        for (tensor, file) in map {
            let file = file.as_str().ok_or_else(|| file_error(&index, format!("`{tensor}` names no file")))?;
            // Shards sit beside the index: a name that climbs out of the folder is refused.
            let relative = Path::new(file);
            if relative.components().count() != 1 || relative.is_absolute() || file == ".." || file == "." {
                return Err(file_error(&index, format!("`{tensor}`: `{file}` is not a file in this folder")));
            }
            if !shards.iter().any(|s: &String| s == file) {
                shards.push(file.to_string());
            }
        }
        shards.sort();
        let paths: Vec<PathBuf> = shards.iter().map(|s| dir.join(s)).collect();
        Self::open(&paths)
    }

    fn add(&mut self, path: &Path) -> Result<(), ZooError> {
        let mut file = File::open(path).map_err(|e| file_error(path, e))?;
        let len = file.metadata().map_err(|e| file_error(path, e))?.len();
        let header = wick::tensor_files::read_safetensors_header(&mut file, len)
            .map_err(|why| file_error(path, format!("not a safetensors file: {why}")))?;
        let (metadata, data_start) = (header.metadata, header.data_start);
        let n_file = self.files.len();
        for (name, info) in metadata.tensors() {
            let (begin, end) = info.data_offsets;
            let entry = Entry {
                file: n_file,
                dtype: wick::tensor_files::candle_dtype(info.dtype),
                stored: info.dtype,
                shape: info.shape.clone(),
                start: data_start + begin as u64,
                bytes: end - begin,
            };
            if let Some(other) = self.index.insert(name.clone(), entry) {
                return Err(file_error(
                    path,
                    format!("tensor `{name}` is also in {}", self.paths[other.file].display()),
                ));
            }
        }
        self.paths.push(path.to_path_buf());
        self.files.push(Mutex::new(file));
        Ok(())
    }

    /// The files, in the order they were opened.
    pub fn paths(&self) -> &[PathBuf] {
        &self.paths
    }

    /// The tensor names, in no particular order.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.index.keys().map(String::as_str)
    }

    /// Bytes of the tensors as stored.
    pub fn stored_bytes(&self) -> usize {
        self.index.values().map(|e| e.bytes).sum()
    }

    /// What loading every tensor as `dtype` holds at its peak on the engine's device: the tensors
    /// in `dtype`, and while the largest tensor stored in another dtype is converted, its copy as
    /// stored. A tensor is read straight into its own buffer: on the CPU that buffer is the
    /// tensor; for a GPU it is host memory, copied to the device once and freed, so it is not
    /// part of the device's figure. A tensor already in `dtype` is not converted (no second
    /// copy). `None` when the figure overflows.
    pub fn load_bytes(&self, dtype: DType) -> Option<usize> {
        let mut total = 0usize;
        let mut converted = 0usize;
        for e in self.index.values() {
            let elems = e.shape.iter().try_fold(1usize, |n, &d| n.checked_mul(d))?;
            total = total.checked_add(elems.checked_mul(dtype.size_in_bytes())?)?;
            if e.dtype != Some(dtype) {
                converted = converted.max(e.bytes);
            }
        }
        total.checked_add(converted)
    }

    /// A `VarBuilder` over these weights for `engine`'s device, in `dtype`: pre-flighted first
    /// against what the engine can still give ([`SafetensorsWeights::load_bytes`]; `OutOfMemory`
    /// with advice, nothing read). candle-nn and candle-transformers models load from it as from
    /// candle's own; each tensor is read when the model asks for it, under the label
    /// `weights/<name>`, and converted to the dtype asked for.
    pub fn var_builder(self, engine: &wick::Engine, dtype: DType) -> Result<VarBuilder<'static>, ZooError> {
        let what = match self.paths.as_slice() {
            [one] => format!("weights {}", one.display()),
            many => format!("weights in {} files", many.len()),
        };
        let bytes = self.load_bytes(dtype).ok_or_else(|| wick::memory::MemoryError::TooLarge {
            requested: usize::MAX,
            capacity: 0,
            device: what.clone(),
        })?;
        engine.preflight(bytes, &what)?;
        Ok(VarBuilder::from_backend(Box::new(self), dtype, engine.device().clone()))
    }

    fn read(&self, e: &Entry, device: &Device) -> Result<Tensor, String> {
        let dtype = e.dtype.ok_or_else(|| format!("its dtype {:?} has no candle type", e.stored))?;
        let mut file = self.files[e.file].lock().unwrap_or_else(|p| p.into_inner());
        file.seek(SeekFrom::Start(e.start)).map_err(|err| err.to_string())?;
        let shape = e.shape.as_slice();
        match dtype {
            DType::F32 => read_typed::<f32>(&mut file, e.bytes, shape, device),
            DType::F16 => read_typed::<half::f16>(&mut file, e.bytes, shape, device),
            DType::BF16 => read_typed::<half::bf16>(&mut file, e.bytes, shape, device),
            DType::F64 => read_typed::<f64>(&mut file, e.bytes, shape, device),
            DType::I64 => read_typed::<i64>(&mut file, e.bytes, shape, device),
            DType::U32 => read_typed::<u32>(&mut file, e.bytes, shape, device),
            DType::U8 => read_typed::<u8>(&mut file, e.bytes, shape, device),
            other => Err(format!("its dtype {other:?} is not read")),
        }
    }

    fn get_checked(
        &self,
        name: &str,
        shape: Option<&Shape>,
        dtype: DType,
        device: &Device,
    ) -> candle_core::Result<Tensor> {
        let e = self.index.get(name).ok_or_else(|| candle_core::Error::CannotFindTensor { path: name.to_string() })?;
        let path = &self.paths[e.file];
        if let Some(shape) = shape {
            if shape.dims() != e.shape.as_slice() {
                return Err(candle_core::Error::Msg(format!(
                    "{}: tensor `{name}` has shape {:?}, the model expects {:?}",
                    path.display(),
                    e.shape,
                    shape.dims()
                )));
            }
        }
        // The read and the conversion are allocated under `weights/<name>`.
        let _weights = wick::memory::push_label("weights");
        let _name = wick::memory::push_label(name);
        let tensor = self
            .read(e, device)
            .map_err(|why| candle_core::Error::Msg(format!("{}: tensor `{name}`: {why}", path.display())))?;
        tensor.to_dtype(dtype)
    }
}

/// `bytes` of the file from where it stands, as a tensor of `T`: read straight into the tensor's
/// own buffer (reserved fallibly), so a tensor costs one copy from the page cache.
fn read_typed<T: candle_core::WithDType>(
    file: &mut File,
    bytes: usize,
    shape: &[usize],
    device: &Device,
) -> Result<Tensor, String> {
    let size = std::mem::size_of::<T>();
    if !bytes.is_multiple_of(size) {
        return Err(format!("{bytes} bytes are not a whole number of {size}-byte elements"));
    }
    let n = bytes / size;
    let mut values: Vec<T> = Vec::new();
    values.try_reserve_exact(n).map_err(|_| format!("cannot allocate {bytes} bytes to read it"))?;
    values.resize(n, T::zero());
    // The file's bytes are little-endian; on a big-endian machine they are converted by candle.
    if cfg!(target_endian = "little") {
        // SAFETY: `values` holds `n` initialised elements of `T`, `n * size` bytes; the types
        // read here (floats, integers) are plain data for which every bit pattern is a value,
        // so viewing them as bytes and overwriting those bytes is sound.
        let view = unsafe { std::slice::from_raw_parts_mut(values.as_mut_ptr().cast::<u8>(), bytes) };
        read_all(file, view)?;
        return Tensor::from_vec(values, shape, device).map_err(|err| err.to_string());
    }
    drop(values);
    let mut raw = vec![0u8; bytes];
    read_all(file, &mut raw)?;
    Tensor::from_raw_buffer(&raw, T::DTYPE, shape, device).map_err(|err| err.to_string())
}

fn read_all(file: &mut File, into: &mut [u8]) -> Result<(), String> {
    let mut done = 0;
    while done < into.len() {
        match file.read(&mut into[done..]) {
            Ok(0) => return Err(format!("cut short: {done} of its {} bytes are in the file", into.len())),
            Ok(n) => done += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e.to_string()),
        }
    }
    Ok(())
}

impl SimpleBackend for SafetensorsWeights {
    fn get(
        &self,
        s: Shape,
        name: &str,
        _h: candle_nn::Init,
        dtype: DType,
        dev: &Device,
    ) -> candle_core::Result<Tensor> {
        self.get_checked(name, Some(&s), dtype, dev)
    }

    fn get_unchecked(&self, name: &str, dtype: DType, dev: &Device) -> candle_core::Result<Tensor> {
        self.get_checked(name, None, dtype, dev)
    }

    fn contains_tensor(&self, name: &str) -> bool {
        self.index.contains_key(name)
    }
}
