//! Saving a run: [`Trainer::save`] and [`Trainer::save_in_background`] write a checkpoint of
//! everything the run changes (the whole state, or under ZeRO each rank's share of it, every
//! rank's file complete before rank 0 writes the manifest that names them).

use std::collections::HashMap;
use std::path::PathBuf;
use std::time::Instant;

use candle_core::Tensor;

use super::{invalid, Trainer};
use crate::amp::ScalerState;
use crate::checkpoint::{CheckpointDir, Manifest};
use crate::dist::parallel::Parallel;
use crate::error::TrainError;
use wick_nn::model::Model;

/// A checkpoint being written by a background thread ([`Trainer::save_in_background`]).
pub struct PendingSave {
    thread: std::thread::JoinHandle<Result<PathBuf, TrainError>>,
    /// How long the training thread was held (copying the state), in seconds.
    pub stall_s: f64,
}

impl PendingSave {
    /// Waits for the write; the manifest's path.
    pub fn wait(self) -> Result<PathBuf, TrainError> {
        self.thread.join().unwrap_or_else(|_| {
            Err(TrainError::Invalid { what: "checkpoint".into(), message: "the writer thread panicked".into() })
        })
    }
}

impl<M: Model> Trainer<M> {
    /// The checkpoint's manifest (file fields empty) and tensors: every master and optimizer
    /// state, copied (later steps do not change them).
    fn snapshot(&self, data: serde_json::Value) -> Result<(Manifest, HashMap<String, Tensor>), TrainError> {
        let state = self.master_state()?;
        let manifest = self.manifest(data, state.step, self.scaler_state()?);
        let mut tensors = HashMap::new();
        for (((name, _), master), states) in self.model.params().iter().zip(state.masters).zip(state.states) {
            tensors.insert(format!("master/{name}"), master);
            for (k, t) in states.into_iter().enumerate() {
                tensors.insert(format!("state{k}/{name}"), t);
            }
        }
        // A copy: on a CUDA device a buffer is updated in place (`wick_nn::params::Buffer::set`),
        // and a background write reads it while later steps run.
        for (name, buffer) in self.model.params().buffers() {
            tensors.insert(format!("buffer/{name}"), buffer.get().copy()?);
        }
        Ok((manifest, tensors))
    }

    /// The manifest of a checkpoint at this step (file fields empty).
    fn manifest(&self, data: serde_json::Value, optimizer_steps: u64, scaler: Option<ScalerState>) -> Manifest {
        Manifest {
            format: String::new(),
            version: 0,
            step: self.step,
            optimizer_steps,
            model: self.description.clone(),
            params: self.param_infos(),
            buffers: self.buffer_infos(),
            optimizer: format!("{:?}", self.options.optimizer),
            scaler,
            data,
            tensors: String::new(),
            bytes: 0,
            sha256: String::new(),
            shards: Vec::new(),
        }
    }

    /// A sharded run's checkpoint: each rank writes its share of masters and optimizer state
    /// (rank 0 also the f32 parameters whole and the buffers — every rank holds those), every
    /// rank's file is complete before rank 0 writes the manifest that names them all, and every
    /// rank learns whether that worked. Nothing gathers the sharded state on one rank.
    fn save_sharded(&self, p: &Parallel, dir: &CheckpointDir, data: serde_json::Value) -> Result<PathBuf, TrainError> {
        let names: Vec<String> = self.model.params().iter().map(|(n, _)| n.clone()).collect();
        let (rank, world) = (p.group.rank(), p.group.world_size());
        let written = (|| {
            let mut tensors = p.shard_tensors(&self.vars, &names)?.unwrap_or_default();
            if p.group.is_root() {
                for (name, buffer) in self.model.params().buffers() {
                    tensors.insert(format!("buffer/{name}"), buffer.get());
                }
            }
            dir.write_shard(self.step, rank, world, &tensors)
        })();
        let shard = p.agree(written)?;
        let text = serde_json::to_vec(&shard).map_err(|e| invalid("checkpoint", e.to_string()))?;
        let shards = p
            .group
            .all_gather_bytes(&text)?
            .iter()
            .map(|b| serde_json::from_slice(b).map_err(|e| invalid("checkpoint", e.to_string())))
            .collect::<Result<Vec<_>, _>>()?;
        let committed = if p.group.is_root() {
            let steps = p.sharded_steps().unwrap_or(0);
            dir.write_sharded(self.manifest(data, steps, self.scaler_state()?), shards)
        } else {
            Ok(dir.manifest_path(self.step))
        };
        p.agree(committed)
    }

    /// Saves a checkpoint of the run now, with `data` (the run's own position: its data
    /// loader's, its random generators'); returns the manifest's path.
    ///
    /// Data-parallel, rank 0 writes (every rank holds the same state) and every rank returns
    /// once the checkpoint is complete, or fails with rank 0's error; sharded (ZeRO), each rank
    /// writes its shard and rank 0 the manifest once all are written. Either resumes at any
    /// world size ([`Trainer::resume`], before [`Trainer::data_parallel`]).
    pub fn save(&self, dir: &CheckpointDir, data: serde_json::Value) -> Result<PathBuf, TrainError> {
        let Some(p) = &self.parallel else {
            let (manifest, tensors) = self.snapshot(data)?;
            return dir.write(manifest, &tensors);
        };
        if p.sharded() {
            return self.save_sharded(p, dir, data);
        }
        let written = if p.group.is_root() {
            self.snapshot(data).and_then(|(manifest, tensors)| dir.write(manifest, &tensors))
        } else {
            Ok(dir.manifest_path(self.step))
        };
        p.agree(written)
    }

    /// As [`Trainer::save`], with the write in a background thread: training is held only while
    /// the state is copied ([`PendingSave::stall_s`]). Wait for one save before starting the
    /// next.
    ///
    /// Under a process group the save is [`Trainer::save`]'s, done before this returns (the
    /// ranks must agree that it completed).
    pub fn save_in_background(&self, dir: &CheckpointDir, data: serde_json::Value) -> Result<PendingSave, TrainError> {
        let start = Instant::now();
        if self.parallel.is_some() {
            let written = self.save(dir, data);
            let stall_s = start.elapsed().as_secs_f64();
            let thread = std::thread::Builder::new()
                .name("wick-checkpoint".into())
                .spawn(move || written)
                .map_err(|e| invalid("checkpoint", format!("cannot start the writer thread: {e}")))?;
            return Ok(PendingSave { thread, stall_s });
        }
        let (manifest, tensors) = self.snapshot(data)?;
        let stall_s = start.elapsed().as_secs_f64();
        let dir = dir.clone();
        let thread = std::thread::Builder::new()
            .name("wick-checkpoint".into())
            .spawn(move || dir.write(manifest, &tensors))
            .map_err(|e| invalid("checkpoint", format!("cannot start the writer thread: {e}")))?;
        Ok(PendingSave { thread, stall_s })
    }
}
