//! Training checkpoints on disk: everything a run needs to continue, as one safetensors file of
//! tensors and a small JSON manifest beside it (format and version, the step, what the model is,
//! every parameter's and buffer's name, shape and dtype, the optimizer, the loss scaler, the data position,
//! and the tensor file's size and SHA-256).
//!
//! Both files are written atomically ([`wick::files::write_atomic`]: a temporary file in the
//! same folder, flushed, renamed, the folder flushed), the tensors first and the manifest last,
//! so a manifest names only a complete tensor file: a run killed at any moment leaves the
//! previous checkpoints intact and at worst an orphaned tensor file that no manifest names.
//! Loading checks the manifest, the size and the checksum, and falls back to the previous
//! checkpoint when the newest is damaged, saying why.
//!
//! A sharded run (ZeRO, `crate::dist`) writes one tensor file per rank instead
//! (`step-N.shard-R-of-W.safetensors`, its pieces named `kind/param#offset`), and rank 0 writes
//! the manifest, which lists every shard with its size and SHA-256, once all are complete: the
//! manifest is still the commit point. [`join_pieces`] puts a tensor back together from its
//! pieces.
//!
//! | module | what it holds |
//! |---|---|
//! | this one | [`CheckpointDir`]: writing, pruning, loading whole ([`CheckpointDir::load`]) |
//! | [`reader`] | [`CheckpointReader`] ([`CheckpointDir::open`]): a checkpoint read by element range, each file checked on first use — how a sharded run resumes its own share |

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use candle_core::{Device, Tensor};
use sha2::{Digest, Sha256};

use crate::amp::ScalerState;
use crate::error::TrainError;

pub mod reader;
pub use reader::CheckpointReader;

/// The manifest's `format` field.
pub const FORMAT: &str = "wick-training-checkpoint";

/// The manifest version this build writes and reads.
pub const VERSION: u32 = 1;

/// One parameter as a manifest records it.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct ParamInfo {
    /// The parameter's name.
    pub name: String,
    /// Its shape.
    pub shape: Vec<usize>,
    /// Its dtype (`f32`, `bf16`, ...).
    pub dtype: String,
}

/// What a checkpoint holds and how to check it.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Manifest {
    /// [`FORMAT`].
    pub format: String,
    /// [`VERSION`].
    pub version: u32,
    /// Training steps taken when it was saved (the data position of the run's batches).
    pub step: u64,
    /// Optimizer updates applied (fewer than `step` when a loss scaler skipped some).
    pub optimizer_steps: u64,
    /// What the run says its model is (kind and configuration), compared on resume.
    pub model: serde_json::Value,
    /// Every parameter, in the model's order.
    pub params: Vec<ParamInfo>,
    /// Every buffer (state changed in training but not learned: batch norm's running
    /// statistics), in name order.
    #[serde(default)]
    pub buffers: Vec<ParamInfo>,
    /// The optimizer and its settings.
    pub optimizer: String,
    /// The loss scaler's state (f16 runs).
    pub scaler: Option<ScalerState>,
    /// The data position and anything else the run needs to continue (its own JSON).
    pub data: serde_json::Value,
    /// The tensor file, in the same folder.
    pub tensors: String,
    /// Its size in bytes.
    pub bytes: u64,
    /// Its SHA-256, hex.
    pub sha256: String,
    /// A sharded checkpoint's tensor files, one per rank in rank order (then `tensors` is empty):
    /// a data-parallel run whose optimizer state is sharded (ZeRO) writes each rank's share
    /// itself, and rank 0 writes this manifest once every shard is complete.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub shards: Vec<ShardFile>,
}

/// One rank's tensor file of a sharded checkpoint.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct ShardFile {
    /// The file, in the checkpoint's folder.
    pub file: String,
    /// Its size in bytes.
    pub bytes: u64,
    /// Its SHA-256, hex.
    pub sha256: String,
}

impl Manifest {
    /// Its tensor files: the one file, or a sharded checkpoint's shards in rank order.
    pub fn files(&self) -> Vec<ShardFile> {
        if self.shards.is_empty() {
            vec![ShardFile { file: self.tensors.clone(), bytes: self.bytes, sha256: self.sha256.clone() }]
        } else {
            self.shards.clone()
        }
    }
}

impl ShardFile {
    /// Its path in `dir`, when its name is a plain file name there (a manifest, at `manifest`,
    /// that names anything else is refused).
    fn path_in(&self, dir: &Path, manifest: &Path) -> Result<PathBuf, TrainError> {
        if self.file.is_empty() || self.file.contains(['/', '\\']) || self.file.starts_with('.') {
            return Err(file_error(manifest, format!("tensor file `{}` is not a file in this folder", self.file)));
        }
        Ok(dir.join(&self.file))
    }

    /// Checks that the file at `path` has the recorded size.
    fn check_len(&self, path: &Path, len: u64) -> Result<(), TrainError> {
        if len != self.bytes {
            let message = format!("{len} bytes, the manifest says {} (truncated or replaced)", self.bytes);
            return Err(file_error(path, message));
        }
        Ok(())
    }

    /// Checks that the file at `path`, whose SHA-256 is `digest`, has the recorded one.
    fn check_sha256(&self, path: &Path, digest: &[u8]) -> Result<(), TrainError> {
        if hex(digest) != self.sha256 {
            return Err(file_error(path, "checksum mismatch: the file is damaged"));
        }
        Ok(())
    }
}

/// A checkpoint read back: its manifest and its tensors by name.
#[derive(Debug)]
pub struct Saved {
    /// The manifest.
    pub manifest: Manifest,
    /// The tensors.
    pub tensors: HashMap<String, Tensor>,
}

/// The newest loadable checkpoint of a folder, and why newer ones were passed over.
#[derive(Debug)]
pub struct Latest {
    /// The checkpoint.
    pub saved: Saved,
    /// One line per newer checkpoint that could not be used (damaged, truncated, unreadable).
    pub skipped: Vec<String>,
}

/// The checkpoints of one run: `step-NNNNNNNNNN.safetensors` and `step-NNNNNNNNNN.json` in one
/// folder, of which the newest `keep` are kept.
#[derive(Debug, Clone)]
pub struct CheckpointDir {
    dir: PathBuf,
    keep: usize,
}

fn file_error(path: &Path, message: impl std::fmt::Display) -> TrainError {
    TrainError::File { path: path.to_path_buf(), message: message.to_string() }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

impl CheckpointDir {
    /// The checkpoints in `dir` (created when missing), keeping the newest `keep` (at least 1).
    ///
    /// Opening touches no file: under a process group every rank opens the folder while others
    /// may already be writing their shards into it. Temporary files a killed writer left behind
    /// are removed when a checkpoint at their step or later is committed
    /// ([`CheckpointDir::write`], [`CheckpointDir::write_sharded`]); by then no writer of that
    /// step is still at work.
    pub fn new(dir: &Path, keep: usize) -> Result<Self, TrainError> {
        std::fs::create_dir_all(dir).map_err(|e| file_error(dir, e))?;
        Ok(CheckpointDir { dir: dir.to_path_buf(), keep: keep.max(1) })
    }

    /// The folder.
    pub fn path(&self) -> &Path {
        &self.dir
    }

    fn stem(step: u64) -> String {
        format!("step-{step:010}")
    }

    /// The manifest path of the checkpoint at `step`.
    pub fn manifest_path(&self, step: u64) -> PathBuf {
        self.dir.join(format!("{}.json", Self::stem(step)))
    }

    /// The steps that have a manifest, oldest first (complete or not: [`CheckpointDir::load`]
    /// checks).
    pub fn steps(&self) -> Result<Vec<u64>, TrainError> {
        let entries = std::fs::read_dir(&self.dir).map_err(|e| file_error(&self.dir, e))?;
        let mut steps: Vec<u64> = entries
            .filter_map(|e| e.ok())
            .filter_map(|e| {
                let name = e.file_name().into_string().ok()?;
                name.strip_prefix("step-")?.strip_suffix(".json")?.parse().ok()
            })
            .collect();
        steps.sort_unstable();
        Ok(steps)
    }

    /// Writes a checkpoint: `tensors` to its safetensors file, then `manifest` (whose `step`
    /// names it; its file fields are filled in here) — each atomically — and removes all but the
    /// newest `keep` checkpoints. Returns the manifest's path.
    pub fn write(&self, mut manifest: Manifest, tensors: &HashMap<String, Tensor>) -> Result<PathBuf, TrainError> {
        let stem = Self::stem(manifest.step);
        let file = self.write_tensors(&format!("{stem}.safetensors"), tensors)?;
        manifest.tensors = file.file;
        manifest.bytes = file.bytes;
        manifest.sha256 = file.sha256;
        manifest.shards.clear();
        self.commit(manifest)
    }

    /// Writes rank `rank`'s share of the sharded checkpoint at `step` (of `world` ranks),
    /// atomically; the manifest comes later ([`CheckpointDir::write_sharded`]), once every rank's
    /// is written.
    pub fn write_shard(
        &self,
        step: u64,
        rank: usize,
        world: usize,
        tensors: &HashMap<String, Tensor>,
    ) -> Result<ShardFile, TrainError> {
        self.write_tensors(&format!("{}.shard-{rank}-of-{world}.safetensors", Self::stem(step)), tensors)
    }

    /// Writes the manifest of a sharded checkpoint whose `shards` are all written: the commit
    /// point (a checkpoint without it is never read), then removes all but the newest `keep`.
    pub fn write_sharded(&self, mut manifest: Manifest, shards: Vec<ShardFile>) -> Result<PathBuf, TrainError> {
        if shards.is_empty() {
            return Err(file_error(&self.dir, "a sharded checkpoint needs its shards"));
        }
        manifest.tensors = String::new();
        manifest.bytes = 0;
        manifest.sha256 = String::new();
        manifest.shards = shards;
        self.commit(manifest)
    }

    fn write_tensors(&self, name: &str, tensors: &HashMap<String, Tensor>) -> Result<ShardFile, TrainError> {
        let tensor_path = self.dir.join(name);
        let written =
            wick::tensor_files::write_safetensors(&tensor_path, tensors).map_err(|e| file_error(&tensor_path, e))?;
        Ok(ShardFile { file: name.to_string(), bytes: written.len() as u64, sha256: hex(&Sha256::digest(&written)) })
    }

    /// Writes `manifest` (format and version filled in) atomically and prunes.
    fn commit(&self, mut manifest: Manifest) -> Result<PathBuf, TrainError> {
        manifest.format = FORMAT.into();
        manifest.version = VERSION;
        let path = self.manifest_path(manifest.step);
        let json = serde_json::to_vec_pretty(&manifest).map_err(|e| file_error(&path, e))?;
        wick::files::write_atomic(&path, &json).map_err(|e| file_error(&path, e))?;
        self.prune()?;
        self.remove_orphans(manifest.step);
        Ok(path)
    }

    /// Removes the temporary files of checkpoints at `step` or earlier: those a killed writer
    /// left behind. Called at a commit, when every writer of those steps has finished (a sharded
    /// save commits once all ranks have written and wait for it; a single process writes one
    /// checkpoint at a time). A later step's temporary file may belong to a writer still at work
    /// and is left alone. Best effort: a file that cannot be removed is left.
    fn remove_orphans(&self, step: u64) {
        let Ok(entries) = std::fs::read_dir(&self.dir) else { return };
        for entry in entries.filter_map(|e| e.ok()) {
            let name = entry.file_name();
            let name = name.to_string_lossy();
            let Some(rest) = name.strip_prefix(".step-") else { continue };
            let of_step = rest.get(..10).and_then(|digits| digits.parse::<u64>().ok());
            if of_step.is_some_and(|s| s <= step) && rest.contains(".tmp-") {
                let _ = std::fs::remove_file(entry.path());
            }
        }
    }

    /// Removes all but the newest `keep` checkpoints (the manifest first: a crash in between
    /// leaves an orphaned tensor file, never a manifest without its tensors), and tensor files
    /// no manifest names that are older than the oldest kept checkpoint.
    fn prune(&self) -> Result<(), TrainError> {
        let steps = self.steps()?;
        let cut = steps.len().saturating_sub(self.keep);
        for &step in &steps[..cut] {
            let stem = Self::stem(step);
            let manifest = self.manifest_path(step);
            std::fs::remove_file(&manifest).map_err(|e| file_error(&manifest, e))?;
            let _ = std::fs::remove_file(self.dir.join(format!("{stem}.safetensors")));
            let shards = format!("{stem}.shard-");
            for entry in std::fs::read_dir(&self.dir).map_err(|e| file_error(&self.dir, e))?.filter_map(|e| e.ok()) {
                if entry.file_name().to_string_lossy().starts_with(&shards) {
                    let _ = std::fs::remove_file(entry.path());
                }
            }
        }
        Ok(())
    }

    /// Reads and checks the checkpoint at `step`: the manifest parses and is this format and
    /// version, and the tensor file has the recorded size and SHA-256.
    pub fn load(&self, step: u64, device: &Device) -> Result<Saved, TrainError> {
        let (path, manifest) = self.read_manifest(step)?;
        // A sharded checkpoint's files are read one after another into one set of tensors
        // (its pieces are named `kind/param#offset`; [`join_pieces`] joins them).
        let mut tensors = HashMap::new();
        for file in &manifest.files() {
            tensors.extend(self.read_checked(&path, file, device)?);
        }
        Ok(Saved { manifest, tensors })
    }

    /// Opens the checkpoint at `step` for reading by range ([`CheckpointReader`]): its manifest
    /// and its files' headers are read and checked now, each file's checksum when it is first
    /// read from.
    pub fn open(&self, step: u64) -> Result<CheckpointReader, TrainError> {
        let (path, manifest) = self.read_manifest(step)?;
        CheckpointReader::open(&self.dir, path, manifest)
    }

    /// The manifest at `step`, checked to be this format and version, and its path.
    fn read_manifest(&self, step: u64) -> Result<(PathBuf, Manifest), TrainError> {
        let path = self.manifest_path(step);
        let text = std::fs::read(&path).map_err(|e| file_error(&path, e))?;
        let manifest: Manifest =
            serde_json::from_slice(&text).map_err(|e| file_error(&path, format!("not a checkpoint manifest: {e}")))?;
        if manifest.format != FORMAT || manifest.version != VERSION {
            return Err(file_error(
                &path,
                format!(
                    "format {} version {}; this build reads {FORMAT} version {VERSION}",
                    manifest.format, manifest.version
                ),
            ));
        }
        Ok((path, manifest))
    }

    /// The tensors of `file` (named by the manifest at `manifest`) once its size and checksum
    /// are the recorded ones.
    fn read_checked(
        &self,
        manifest: &Path,
        file: &ShardFile,
        device: &Device,
    ) -> Result<HashMap<String, Tensor>, TrainError> {
        let tensor_path = file.path_in(&self.dir, manifest)?;
        let bytes = std::fs::read(&tensor_path).map_err(|e| file_error(&tensor_path, e))?;
        file.check_len(&tensor_path, bytes.len() as u64)?;
        file.check_sha256(&tensor_path, &Sha256::digest(&bytes))?;
        Ok(candle_core::safetensors::load_buffer(&bytes, device)?)
    }

    /// The newest checkpoint that loads, with a line for each newer one that did not; `None`
    /// when the folder has no checkpoint at all. When every checkpoint is damaged, the error
    /// lists why each was refused.
    pub fn load_latest(&self, device: &Device) -> Result<Option<Latest>, TrainError> {
        let mut skipped = Vec::new();
        for step in self.steps()?.into_iter().rev() {
            match self.load(step, device) {
                Ok(saved) => return Ok(Some(Latest { saved, skipped })),
                Err(e) => skipped.push(format!("step {step}: {e}")),
            }
        }
        if skipped.is_empty() {
            Ok(None)
        } else {
            Err(file_error(&self.dir, format!("no usable checkpoint: {}", skipped.join("; "))))
        }
    }
}

/// The tensor `key` of a sharded checkpoint, joined from its pieces `key#OFFSET` (flat, in
/// order; they must cover it from 0 without gaps or overlaps); `None` when it has no pieces.
pub fn join_pieces(tensors: &HashMap<String, Tensor>, key: &str) -> Result<Option<Tensor>, TrainError> {
    let prefix = format!("{key}#");
    let mut pieces: Vec<(usize, &Tensor)> = Vec::new();
    for (name, t) in tensors {
        if let Some(offset) = name.strip_prefix(&prefix) {
            let offset = offset.parse().map_err(|_| TrainError::Invalid {
                what: "resume".into(),
                message: format!("the checkpoint's piece `{name}` has no offset"),
            })?;
            pieces.push((offset, t));
        }
    }
    if pieces.is_empty() {
        return Ok(None);
    }
    pieces.sort_by_key(|(offset, _)| *offset);
    let mut at = 0usize;
    let mut flat = Vec::with_capacity(pieces.len());
    for (offset, t) in pieces {
        if offset != at {
            return Err(TrainError::Invalid {
                what: "resume".into(),
                message: format!("`{key}`: a piece starts at {offset}, the pieces before end at {at}"),
            });
        }
        at += t.elem_count();
        flat.push(t.flatten_all()?);
    }
    Ok(Some(Tensor::cat(&flat, 0)?))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A sharded checkpoint's pieces join in offset order; a gap, an overlap or a piece without
    /// an offset is refused naming the tensor.
    #[test]
    fn pieces_join_in_order_and_gaps_are_refused() {
        let t = |v: &[f32]| Tensor::new(v, &Device::Cpu).unwrap();
        let mut m = HashMap::new();
        m.insert("state0/w#3".to_string(), t(&[4., 5.]));
        m.insert("state0/w#0".to_string(), t(&[1., 2., 3.]));
        let joined = join_pieces(&m, "state0/w").unwrap().unwrap();
        assert_eq!(joined.to_vec1::<f32>().unwrap(), vec![1., 2., 3., 4., 5.]);
        assert!(join_pieces(&m, "state1/w").unwrap().is_none());
        m.insert("state0/w#6".to_string(), t(&[7.]));
        let gap = join_pieces(&m, "state0/w").unwrap_err().to_string();
        assert!(gap.contains("`state0/w`: a piece starts at 6, the pieces before end at 5"), "{gap}");
        m.insert("state0/v#x".to_string(), t(&[1.]));
        assert!(join_pieces(&m, "state0/v").unwrap_err().to_string().contains("no offset"));
    }
}
