//! Loading named tensors from safetensors files with errors that name the file and the tensor,
//! and checking every tensor's shape and dtype against what the model expects: whole files for
//! the zoo's models ([`WeightFile`]), and a governed `VarBuilder` for any candle-nn or
//! candle-transformers model ([`SafetensorsWeights`], in `var_builder.rs`).

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Tensor};

use crate::error::ZooError;

mod var_builder;

pub use var_builder::SafetensorsWeights;

/// The tensors of one safetensors file.
pub struct WeightFile {
    path: PathBuf,
    tensors: HashMap<String, Tensor>,
}

impl WeightFile {
    /// Reads every tensor of `path` onto `device`, after a pre-flight of its payload (read from
    /// the header) against the memory the host can give (`OutOfMemory` with advice).
    pub fn open(path: &Path, device: &Device) -> Result<Self, ZooError> {
        if !path.is_file() {
            return Err(ZooError::File { path: path.to_path_buf(), message: "no such file".into() });
        }
        // Pre-flight from the header alone: the payload is copied into tensors, and a CPU copy
        // larger than the host can give would abort the process.
        let payload = wick::tensor_files::safetensors_payload_bytes(path).map_err(|e| {
            let why = match e {
                wick::memory::MemoryError::InvalidFile { message, .. } => message,
                other => other.to_string(),
            };
            ZooError::File { path: path.to_path_buf(), message: format!("not a readable safetensors file: {why}") }
        })?;
        wick_nn::params::preflight_bytes(Some(payload), device, &format!("weights {}", path.display()))?;
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

    /// Number of tensors in the file.
    pub fn len(&self) -> usize {
        self.tensors.len()
    }

    /// True when the file holds no tensor.
    pub fn is_empty(&self) -> bool {
        self.tensors.is_empty()
    }

    /// The file's path.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

/// The Hugging Face hub cache: `root` when given, else `HF_HUB_CACHE`, then `HF_HOME/hub`, then
/// `~/.cache/huggingface/hub` (where Python's `huggingface_hub` and hf-hub look).
pub fn hub_cache_root(root: Option<&Path>) -> Result<PathBuf, ZooError> {
    match root {
        Some(r) => Ok(r.to_path_buf()),
        None => std::env::var_os("HF_HUB_CACHE")
            .map(PathBuf::from)
            .or_else(|| std::env::var_os("HF_HOME").map(|h| PathBuf::from(h).join("hub")))
            .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache/huggingface/hub")))
            .ok_or_else(|| ZooError::File {
                path: PathBuf::from("~/.cache/huggingface/hub"),
                message: "no HOME, HF_HOME or HF_HUB_CACHE".into(),
            }),
    }
}

/// The snapshot directory of `repo_id` in a Hugging Face hub cache (`hub/models--org--name/
/// snapshots/<commit of refs/main>`), read offline through hf-hub's cache API: nothing is
/// downloaded here ([`crate::hub::fetch`] downloads). `root` is the hub cache (`$HF_HOME/hub`, `~/.cache/huggingface/hub`); `None`
/// uses `HF_HUB_CACHE`, then `HF_HOME/hub`, then the default under `HOME`. Every file in
/// `required` must be present.
pub fn hf_cache_snapshot(root: Option<&Path>, repo_id: &str, required: &[&str]) -> Result<PathBuf, ZooError> {
    let root = hub_cache_root(root)?;
    let repo = hf_hub::Cache::new(root.clone()).model(repo_id.to_string());
    let mut dir = None;
    for file in required {
        let path = repo.get(file).ok_or_else(|| ZooError::File {
            path: root.join(format!("models--{}", repo_id.replace('/', "--"))).join(file),
            message: format!(
                "`{file}` of {repo_id} is not in the hub cache (this reads it offline; `wick fetch {repo_id}` downloads it)"
            ),
        })?;
        dir = path.parent().map(Path::to_path_buf);
    }
    dir.ok_or_else(|| ZooError::File { path: root, message: "no files requested".into() })
}
