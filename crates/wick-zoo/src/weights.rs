//! Loading named tensors from safetensors files with errors that name the file and the tensor,
//! and checking every tensor's shape and dtype against what the model expects.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Tensor};

use crate::error::ZooError;

/// The tensors of one safetensors file.
pub struct WeightFile {
    path: PathBuf,
    tensors: HashMap<String, Tensor>,
}

impl WeightFile {
    /// Reads every tensor of `path` onto `device`.
    pub fn open(path: &Path, device: &Device) -> Result<Self, ZooError> {
        if !path.is_file() {
            return Err(ZooError::File { path: path.to_path_buf(), message: "no such file".into() });
        }
        let tensors = candle_core::safetensors::load(path, device).map_err(|e| ZooError::File {
            path: path.to_path_buf(),
            message: format!("not a readable safetensors file: {e}"),
        })?;
        Ok(WeightFile { path: path.to_path_buf(), tensors })
    }

    /// The tensor `name`, which must have `shape`; converted to `dtype`.
    pub fn get(&self, name: &str, shape: &[usize], dtype: DType) -> Result<Tensor, ZooError> {
        let bad = |message: String| ZooError::Tensor { path: self.path.clone(), tensor: name.to_string(), message };
        let t = self.tensors.get(name).ok_or_else(|| bad("missing".into()))?;
        if t.dims() != shape {
            return Err(bad(format!("shape {:?}, expected {:?}", t.dims(), shape)));
        }
        if !t.dtype().is_float() {
            return Err(bad(format!("dtype {:?} is not a floating-point type", t.dtype())));
        }
        t.to_dtype(dtype).map_err(|e| bad(e.to_string()))
    }

    /// The file's path.
    pub fn path(&self) -> &Path {
        &self.path
    }
}
