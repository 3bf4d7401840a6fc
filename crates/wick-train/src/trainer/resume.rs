//! [`Trainer::resume`]: the newest usable checkpoint read back — whole, or under a sharded
//! process group only this rank's share, by range ([`CheckpointReader`]) — checked against the
//! run before anything changes, and agreed between ranks.

use std::collections::HashMap;

use candle_core::{Tensor, Var};

use super::{dtype_name, invalid, Resumed, Trainer};
use crate::amp::MasterState;
use crate::checkpoint::{CheckpointDir, CheckpointReader, ParamInfo};
use crate::dist::parallel::Shard;
use crate::error::TrainError;
use wick_nn::model::Model;

/// What differs first between the `kind`s (parameters or buffers) a checkpoint records
/// (`theirs`) and this run's (`mine`), if anything.
fn first_difference(kind: &str, theirs: &[ParamInfo], mine: &[ParamInfo]) -> Option<String> {
    if theirs == mine {
        return None;
    }
    let by_name: HashMap<&str, &ParamInfo> = theirs.iter().map(|p| (p.name.as_str(), p)).collect();
    let differs = mine.iter().find_map(|p| match by_name.get(p.name.as_str()) {
        None => Some(format!("it has no {kind} `{}`", p.name)),
        Some(t) if *t != p => {
            Some(format!("`{}` is {:?} {} there, {:?} {} here", p.name, t.shape, t.dtype, p.shape, p.dtype))
        }
        _ => None,
    });
    Some(differs.unwrap_or_else(|| format!("{} {kind}s there, {} here", theirs.len(), mine.len())))
}

/// The optimizer's side of a checkpoint as read: the whole state, or this rank's shard.
enum State {
    Whole(MasterState),
    Shard(Shard),
}

/// A checkpoint read and checked, not yet applied.
struct Loaded {
    reader: CheckpointReader,
    state: State,
    buffers: Vec<Tensor>,
}

/// Whether `e` says that a checkpoint's files are damaged (pass over it) rather than that it
/// belongs to another run (stop).
fn damaged(e: &TrainError) -> bool {
    matches!(e, TrainError::File { .. })
}

fn flat(values: Vec<f32>, var: &Var) -> Result<Tensor, TrainError> {
    Ok(Tensor::from_vec(values, var.dims(), var.device())?)
}

impl<M: Model> Trainer<M> {
    /// Continues from the newest usable checkpoint in `dir`: the masters (and so the
    /// parameters), the optimizer state and step count, the loss scaler and the step. A damaged
    /// newest checkpoint is passed over (said in [`Resumed::skipped`]); none at all, or one made
    /// for another model, optimizer or precision, is an error saying what differs, and nothing
    /// changes.
    ///
    /// Any checkpoint resumes any run: one process or a process group, replicated or sharded,
    /// at any world size. Under a process group every rank calls it and all take the same
    /// checkpoint (a file one rank finds damaged is passed over by all). Sharded, each rank
    /// reads only its pieces of the masters and optimizer state (whichever rank's file holds
    /// them) and, one at a time, each parameter's value: the whole state is never in one
    /// process's memory.
    pub fn resume(&mut self, dir: &CheckpointDir) -> Result<Resumed, TrainError> {
        let steps = dir.steps()?;
        if let Some(p) = &self.parallel {
            p.group.check_same("checkpoints on disk", &serde_json::json!(steps))?;
        }
        let mut skipped = Vec::new();
        for step in steps.into_iter().rev() {
            let attempt = self.read(dir, step);
            let attempt = match &self.parallel {
                None => attempt,
                Some(p) => {
                    let refused = attempt.as_ref().err().is_some_and(|e| !damaged(e));
                    // Every rank has an error here when any rank had one; then all stop when
                    // one was refused the checkpoint, and all pass over it when it was damaged.
                    match p.agree(attempt) {
                        Err(e) if p.group.any(refused)? => return Err(e),
                        agreed => agreed,
                    }
                }
            };
            match attempt {
                Ok(loaded) => {
                    let applied = self.apply(loaded);
                    let applied = match &self.parallel {
                        Some(p) => p.agree(applied),
                        None => applied,
                    };
                    return applied.map(|mut r| {
                        r.skipped = skipped;
                        r
                    });
                }
                Err(e) if damaged(&e) || self.parallel.is_some() => skipped.push(format!("step {step}: {e}")),
                Err(e) => return Err(e),
            }
        }
        if skipped.is_empty() {
            return Err(invalid("resume", format!("no checkpoint in {}", dir.path().display())));
        }
        let message = format!("no usable checkpoint: {}", skipped.join("; "));
        Err(TrainError::File { path: dir.path().to_path_buf(), message })
    }

    /// The checkpoint at `step`, read and checked against this run; nothing changes.
    fn read(&self, dir: &CheckpointDir, step: u64) -> Result<Loaded, TrainError> {
        let mut reader = dir.open(step)?;
        let manifest = reader.manifest_path().to_path_buf();
        let m = reader.manifest().clone();
        let refuse =
            |what: String| invalid("resume", format!("{} was made for another run: {what}", manifest.display()));
        let mine = self.param_infos();
        if let Some(differs) = first_difference("parameter", &m.params, &mine) {
            return Err(refuse(differs));
        }
        let my_buffers = self.buffer_infos();
        if let Some(differs) = first_difference("buffer", &m.buffers, &my_buffers) {
            return Err(refuse(differs));
        }
        if m.model != self.description {
            return Err(refuse(format!("its model is {}, this run's {}", m.model, self.description)));
        }
        let optimizer = format!("{:?}", self.options.optimizer);
        if m.optimizer != optimizer {
            return Err(refuse(format!("its optimizer is {}, this run's {optimizer}", m.optimizer)));
        }
        if m.scaler.is_some() != self.scales() {
            return Err(refuse("one scales its loss (f16) and the other does not".into()));
        }
        if let Some(s) = m.scaler.filter(|s| !(s.scale.is_finite() && s.scale > 0.0)) {
            return Err(refuse(format!("its loss scale {} is not a positive number", s.scale)));
        }
        // Every tensor the state needs, whole or in pieces, with the parameter's size.
        let states = self.options.optimizer.states();
        let names: Vec<String> = mine.iter().map(|p| p.name.clone()).collect();
        for (name, v) in names.iter().zip(&self.vars) {
            for key in std::iter::once(format!("master/{name}")).chain((0..states).map(|k| format!("state{k}/{name}")))
            {
                if !reader.contains(&key) {
                    return Err(refuse(format!("it lacks the tensor `{key}`")));
                }
                if reader.elem_count(&key) != v.elem_count() {
                    let n = reader.elem_count(&key);
                    return Err(refuse(format!("`{key}` has {n} elements there, {} here", v.elem_count())));
                }
            }
        }
        let mut buffers = Vec::with_capacity(my_buffers.len());
        for b in &my_buffers {
            let key = format!("buffer/{}", b.name);
            if !reader.contains(&key) {
                return Err(refuse(format!("it lacks the tensor `{key}`")));
            }
            let t = reader.read(&key, &self.device())?;
            if t.dims() != b.shape.as_slice() || dtype_name(t.dtype()) != b.dtype {
                let found = format!("{:?} {}", t.dims(), dtype_name(t.dtype()));
                return Err(refuse(format!("its buffer `{}` is {found}, expected {:?} {}", b.name, b.shape, b.dtype)));
            }
            buffers.push(t);
        }
        let shard = match &self.parallel {
            Some(p) => p.read_shard(&self.vars, &names, &mut reader)?,
            None => None,
        };
        let state = match shard {
            Some(z) => {
                // Each parameter's value is read when applied: its files are checked now.
                names.iter().try_for_each(|name| reader.verify(&format!("master/{name}")))?;
                State::Shard(z)
            }
            None => {
                let mut whole = MasterState { step: m.optimizer_steps, masters: Vec::new(), states: Vec::new() };
                for (name, v) in names.iter().zip(&self.vars) {
                    let mut read = |key: String| flat(reader.read_f32(&key, 0, v.elem_count())?, v);
                    whole.masters.push(read(format!("master/{name}"))?);
                    whole.states.push((0..states).map(|k| read(format!("state{k}/{name}"))).collect::<Result<_, _>>()?);
                }
                State::Whole(whole)
            }
        };
        Ok(Loaded { reader, state, buffers })
    }

    /// Makes `loaded` the run's state.
    fn apply(&mut self, loaded: Loaded) -> Result<Resumed, TrainError> {
        let Loaded { mut reader, state, buffers } = loaded;
        match state {
            // The masters check their own state before taking any of it.
            State::Whole(whole) => match self.graph.as_mut() {
                Some(g) => g.load_state(&whole)?,
                None => self.masters.load_state(&whole)?,
            },
            State::Shard(z) => {
                // Every parameter from its f32 value (files checked when read), one at a time —
                // but for the blocks' parameters of a ZeRO-3 run, whose model copies are handed
                // back (the shard holds them).
                let names: Vec<String> = self.model.params().iter().map(|(n, _)| n.clone()).collect();
                let released = |i: usize| match &z {
                    Shard::Params(p) => p.released(i),
                    Shard::Zero(_) => false,
                };
                for (i, (name, v)) in names.iter().zip(&self.vars).enumerate() {
                    if released(i) {
                        continue;
                    }
                    let value = flat(reader.read_f32(&format!("master/{name}"), 0, v.elem_count())?, v)?;
                    v.set(&value.to_dtype(v.dtype())?)?;
                }
                if let Some(p) = self.parallel.as_mut() {
                    p.set_shard(z);
                }
            }
        }
        for ((_, buffer), t) in self.model.params().buffers().zip(&buffers) {
            buffer.set(t)?;
        }
        let m = reader.manifest();
        match (self.scaler.as_mut(), self.graph.as_mut(), m.scaler) {
            (Some(s), _, Some(saved)) => s.load_state(saved)?,
            (None, Some(g), Some(saved)) => g.load_scaler_state(saved)?,
            _ => {}
        }
        self.step = m.step;
        let manifest = reader.manifest_path().to_path_buf();
        Ok(Resumed { step: m.step, data: m.data.clone(), manifest, skipped: Vec::new() })
    }

    fn device(&self) -> candle_core::Device {
        self.vars.first().map_or(candle_core::Device::Cpu, |v| v.device().clone())
    }
}
