//! One step's gradient reduction in flight: the buckets' collectives started in bucket order as
//! their gradients complete — from inside backward, through the patched candle's
//! `Tensor::backward_with_hook` (PyTorch DDP's reducer, which starts a bucket's all-reduce from
//! the post-accumulate-grad hook of its last gradient) — or all after backward.
//!
//! A [`Flight`] is made before the step's last backward pass. [`Flight::ready`] is the hook:
//! it takes a parameter's completed gradient out of the store (added to the earlier
//! micro-batches' sum, in the order the trainer adds them) and holds it in its bucket's slot;
//! when every slot of the next bucket is filled, the bucket is packed (its gradients freed) and
//! its collective started. [`Flight::close`], once backward is over (or failed), fills what no
//! hook took from the store, zeros where this rank has no gradient, and starts every bucket not
//! yet started, in order; [`Flight::finish`] waits for the last and returns each bucket's sum.
//!
//! Rationale for bucket order: every rank must start the same collectives in the same order
//! (MPI's rule for collectives, blocking and not). Buckets start strictly in order, whichever
//! completes first, and `close` starts all the rest before anything else collective happens
//! (the step's agreement on failures, the loss sum), so a rank whose backward took a different
//! path, or failed, still makes the same calls: its missing gradients count as zeros and the
//! presence of each gradient is agreed afterwards, as without overlap.
//!
//! Rationale for one bucket in flight at a time: a bucket in flight holds its packed values and
//! its receive buffer, as the reduction after backward does one bucket at a time, so the memory
//! the reduction adds stays one bucket's (now during backward, where the estimator counts it).
//! A later bucket that is complete waits, its gradients held, until the one in flight is done:
//! each hook call tests it (which also moves it on; with one thread per rank Open MPI moves a
//! collective only inside the rank's own MPI calls).
//!
//! Rationale for starting the last unit after backward: candle keeps every activation of the
//! graph until backward returns, so a collective started from a hook adds its buffers on top of
//! them. The last unit's last gradient is complete only at the end of backward, where there is
//! nothing left to overlap with; it starts once backward has returned and the graph is gone,
//! as without overlap. What overlap adds to a step's peak is one unit in flight beside the
//! activations (the estimator counts it: wick-zoo's `estimate::ranks`); `overlap: false` in
//! [`super::DataParallelOptions`] gives that back.
//!
//! Rationale for large gradients on their own: an f32 gradient of at least
//! `DIRECT_BYTES` (`buckets`) is its own unit, sent from its own storage (no copy into a
//! bucket: the copy cost a quarter of the all-reduce's time, BENCHMARKS.md "More than one
//! process").

use std::collections::HashMap;
use std::time::Instant;

use candle_core::backprop::GradStore;
use candle_core::{DType, Device, Tensor, TensorId, Var};

use super::comm::Comm;
use super::error::DistError;
use super::pending::{Collective, Outgoing, Pending};

/// What the last reduction did.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct ReduceStats {
    /// Buckets reduced.
    pub buckets: usize,
    /// Bytes each rank sent into the all-reduces.
    pub bytes: usize,
    /// Seconds in MPI calls.
    pub comm_s: f64,
    /// Seconds copying gradients into buckets and back.
    pub pack_s: f64,
    /// Buckets started from inside backward (the rest started after it).
    pub overlapped: usize,
    /// Seconds the buckets' collectives were in flight, start to completion, summed.
    pub flight_s: f64,
    /// Seconds waiting for a collective to complete (part of `comm_s`).
    pub wait_s: f64,
    /// Seconds the step spent on the reduction after backward: packing and starting what
    /// backward left, and waiting for the buckets to complete (the step's other collectives
    /// between those calls are not counted).
    pub exposed_s: f64,
    /// ZeRO stage 3: blocks whose gather was started ahead of them (prefetched) and used.
    pub prefetched: usize,
}

impl ReduceStats {
    /// Of the time the collectives were in flight, the share no rank sat waiting for them
    /// (`1 − wait_s / flight_s`): 0 when every bucket was waited for from its start.
    pub fn hidden_fraction(&self) -> f64 {
        if self.flight_s > 0.0 {
            (1.0 - self.wait_s / self.flight_s).clamp(0.0, 1.0)
        } else {
            0.0
        }
    }
}

/// Appends `t`'s values, widened to f32, to `out`.
pub(crate) fn append_f32(t: &Tensor, out: &mut Vec<f32>) -> Result<(), DistError> {
    use candle_core::{CpuStorage, Storage};
    let t = t.detach().flatten_all()?;
    {
        // A contiguous CPU tensor is read where it lies: widening a bf16 one through `to_vec1`
        // held a copy of it beside the f32 values (the largest gradient's bytes again).
        let (storage, layout) = t.storage_and_layout();
        if let Some((a, b)) = layout.contiguous_offsets() {
            match &*storage {
                Storage::Cpu(CpuStorage::F32(v)) => {
                    out.extend_from_slice(&v[a..b]);
                    return Ok(());
                }
                Storage::Cpu(CpuStorage::BF16(v)) => {
                    out.extend(v[a..b].iter().map(|x| x.to_f32()));
                    return Ok(());
                }
                Storage::Cpu(CpuStorage::F16(v)) => {
                    out.extend(v[a..b].iter().map(|x| x.to_f32()));
                    return Ok(());
                }
                _ => {}
            }
        }
    }
    match t.dtype() {
        DType::F32 => out.extend(t.to_vec1::<f32>()?),
        DType::BF16 => out.extend(t.to_vec1::<half::bf16>()?.into_iter().map(f32::from)),
        DType::F16 => out.extend(t.to_vec1::<half::f16>()?.into_iter().map(f32::from)),
        d => return Err(DistError::unsupported("gradient reduction", format!("a {d:?} gradient"))),
    }
    Ok(())
}

/// What one collective reduces: parameters packed together (indices into the model's
/// parameters, in bucket order) into `len` values (their elements, then zeros to a multiple of
/// the world size for a reduce-scatter), or one large f32 gradient from its own storage.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Unit {
    pub(crate) members: Vec<usize>,
    pub(crate) len: usize,
    pub(crate) direct: bool,
}

/// What becomes of a unit's reduced values when its collective completes (the unit's index,
/// the unit, the values): the tensors the update reads, made at once so that a low-precision
/// model's f32 values do not wait beside its gradients.
pub(crate) type Finisher = Box<dyn FnMut(usize, &Unit, Vec<f32>) -> Result<Vec<Tensor>, DistError> + Send>;

/// A completed reduction: each unit with its tensors (what the [`Finisher`] made), whether this
/// rank had a gradient of each parameter, and what the reduction did.
pub(crate) type Reduced = (Vec<(Unit, Vec<Tensor>)>, Vec<bool>, ReduceStats);

/// A step's reduction, started unit by unit.
pub(crate) struct Flight {
    units: Vec<Unit>,
    finisher: Finisher,
    collective: Collective,
    vars: Vec<Var>,
    /// Parameter id → (unit, slot).
    place: HashMap<TensorId, (usize, usize)>,
    /// Each unit's gradients, held until it starts.
    held: Vec<Vec<Option<Tensor>>>,
    filled: Vec<Vec<bool>>,
    missing: Vec<usize>,
    /// The next unit to start.
    next: usize,
    in_flight: Option<(usize, Pending, Instant)>,
    results: Vec<Option<Vec<Tensor>>>,
    /// Whether this rank has a gradient of each parameter.
    present: Vec<bool>,
    /// The earlier micro-batches' summed gradients.
    previous: Option<GradStore>,
    stats: ReduceStats,
    /// When backward ended ([`Flight::close`]).
    closed: Option<Instant>,
}

impl Flight {
    /// A reduction of `vars`' gradients in `units` (every parameter in one unit at most), each
    /// unit's sum handed to `finisher` as it completes; its units start from inside backward
    /// ([`Flight::ready`]) or, closed at once, all after it ([`Flight::close`]).
    pub(crate) fn new(
        units: Vec<Unit>,
        collective: Collective,
        vars: &[Var],
        finisher: Finisher,
    ) -> Result<Self, DistError> {
        let mut place = HashMap::new();
        for (u, unit) in units.iter().enumerate() {
            for (k, &i) in unit.members.iter().enumerate() {
                let v = vars.get(i).ok_or_else(|| DistError::internal("a bucket names a parameter out of range"))?;
                if place.insert(v.id(), (u, k)).is_some() {
                    return Err(DistError::internal("a parameter in two buckets"));
                }
            }
        }
        let held = units.iter().map(|u| vec![None; u.members.len()]).collect();
        let filled = units.iter().map(|u| vec![false; u.members.len()]).collect();
        let missing = units.iter().map(|u| u.members.len()).collect();
        let results = vec![None; units.len()];
        Ok(Flight {
            units,
            finisher,
            collective,
            vars: vars.to_vec(),
            place,
            held,
            filled,
            missing,
            next: 0,
            in_flight: None,
            results,
            present: vec![false; vars.len()],
            previous: None,
            stats: ReduceStats::default(),
            closed: None,
        })
    }

    /// The earlier micro-batches' summed gradients, which each completed gradient is added to.
    pub(crate) fn set_previous(&mut self, previous: Option<GradStore>) {
        self.previous = previous;
    }

    /// The backward hook: `var`'s gradient is complete in `grads`.
    pub(crate) fn ready(&mut self, comm: &Comm, var: &Tensor, grads: &mut GradStore) -> Result<(), DistError> {
        let Some(&(u, k)) = self.place.get(&var.id()) else { return Ok(()) };
        if self.filled[u][k] || self.closed.is_some() {
            return Ok(());
        }
        self.fill(u, k, grads.remove(var))?;
        self.advance(comm)
    }

    /// Slot `k` of unit `u` from this micro-batch's gradient and the earlier ones' sum.
    fn fill(&mut self, u: usize, k: usize, g: Option<Tensor>) -> Result<(), DistError> {
        let i = self.units[u].members[k];
        let earlier = self.previous.as_mut().and_then(|p| p.remove(self.vars[i].as_tensor()));
        let total = match (earlier, g) {
            // The trainer's order: the earlier sum plus this micro-batch's.
            (Some(s), Some(g)) => Some((s + g)?),
            (s, g) => s.or(g),
        };
        self.present[i] = total.is_some();
        self.held[u][k] = total;
        self.filled[u][k] = true;
        self.missing[u] -= 1;
        Ok(())
    }

    /// Completes the unit in flight, if any (waiting when `wait`, testing otherwise): whether
    /// nothing is in flight now.
    fn complete(&mut self, comm: &Comm, wait: bool) -> Result<bool, DistError> {
        let Some((u, mut pending, since)) = self.in_flight.take() else { return Ok(true) };
        let t = Instant::now();
        if !(wait || pending.test(comm)?) {
            self.in_flight = Some((u, pending, since));
            self.stats.comm_s += t.elapsed().as_secs_f64();
            return Ok(false);
        }
        let values = pending.finish(comm)?;
        let now = Instant::now();
        self.stats.comm_s += (now - t).as_secs_f64();
        if wait {
            self.stats.wait_s += (now - t).as_secs_f64();
        }
        self.stats.flight_s += (now - since).as_secs_f64();
        self.results[u] = Some((self.finisher)(u, &self.units[u], values)?);
        self.stats.pack_s += now.elapsed().as_secs_f64();
        Ok(true)
    }

    /// Completes the unit in flight if it is done, and starts the next ones while they are
    /// complete and nothing is in flight — all but the last unit, which [`Flight::close`]
    /// starts (see the module's rationale).
    fn advance(&mut self, comm: &Comm) -> Result<(), DistError> {
        while self.complete(comm, false)? && self.next + 1 < self.units.len() && self.missing[self.next] == 0 {
            self.start(comm, self.next)?;
            self.next += 1;
        }
        Ok(())
    }

    /// Packs unit `u` (its gradients freed) and starts its collective.
    fn start(&mut self, comm: &Comm, u: usize) -> Result<(), DistError> {
        let t0 = Instant::now();
        let unit = &self.units[u];
        let held = std::mem::take(&mut self.held[u]);
        let send = if unit.direct {
            let i = unit.members[0];
            let v = &self.vars[i];
            let g = match held.into_iter().next().flatten() {
                Some(g) => g.detach().contiguous()?,
                None => Tensor::zeros(v.dims(), DType::F32, &Device::Cpu)?,
            };
            Outgoing::Tensor(g)
        } else {
            let mut send = Vec::with_capacity(unit.len);
            for (&i, g) in unit.members.iter().zip(held) {
                match g {
                    Some(g) => append_f32(&g, &mut send)?,
                    None => send.resize(send.len() + self.vars[i].elem_count(), 0.0),
                }
            }
            if send.len() > unit.len {
                return Err(DistError::internal("a bucket's gradients are larger than the bucket"));
            }
            send.resize(unit.len, 0.0);
            Outgoing::Owned(send)
        };
        let t1 = Instant::now();
        // Non-blocking for every unit, started in backward or after it: MPI matches a blocking
        // collective only with a blocking one, and which units a rank starts in backward
        // depends on its timing. (Blocking ones after backward were no faster: 103 against 73 ms
        // a step for the 58 M decoder, within ±4 ms for ResNet-18; BENCHMARKS.md, "Overlap".)
        let pending = Pending::start(comm, send, self.collective)?;
        let t2 = Instant::now();
        self.stats.pack_s += (t1 - t0).as_secs_f64();
        self.stats.comm_s += (t2 - t1).as_secs_f64();
        self.stats.buckets += 1;
        self.stats.bytes += unit.len * 4;
        if self.closed.is_none() {
            self.stats.overlapped += 1;
        }
        self.in_flight = Some((u, pending, t1));
        Ok(())
    }

    /// Backward is over (`grads`: what it left in the store, `None` when it failed): every slot
    /// no hook filled is taken from `grads` and the earlier micro-batches' sum (zeros where this
    /// rank has none), and every unit not started yet is started, in order. Every rank calls it
    /// once per step before any other collective of the step.
    pub(crate) fn close(&mut self, comm: &Comm, mut grads: Option<&mut GradStore>) -> Result<(), DistError> {
        if self.closed.is_some() {
            return Ok(());
        }
        self.closed = Some(Instant::now());
        for u in self.next..self.units.len() {
            for k in 0..self.units[u].members.len() {
                if !self.filled[u][k] {
                    let v = self.vars[self.units[u].members[k]].as_tensor().clone();
                    let g = grads.as_deref_mut().and_then(|g| g.remove(&v));
                    self.fill(u, k, g)?;
                }
            }
        }
        self.previous = None;
        while self.next < self.units.len() {
            self.complete(comm, true)?;
            self.start(comm, self.next)?;
            self.next += 1;
        }
        self.stats.exposed_s += self.closed.map_or(0.0, |t| t.elapsed().as_secs_f64());
        Ok(())
    }

    /// Waits for the last unit: every unit with its reduced values (in unit order), whether this rank
    /// had a gradient of each parameter, and what the reduction did. Closes it first if needed.
    pub(crate) fn finish(mut self, comm: &Comm) -> Result<Reduced, DistError> {
        self.close(comm, None)?;
        let t = Instant::now();
        self.complete(comm, true)?;
        self.stats.exposed_s += t.elapsed().as_secs_f64();
        let results = self
            .units
            .into_iter()
            .zip(self.results)
            .map(|(unit, r)| {
                r.map(|t| (unit, t)).ok_or_else(|| DistError::internal("a bucket's reduction did not complete"))
            })
            .collect::<Result<Vec<_>, _>>()?;
        Ok((results, self.present, self.stats))
    }
}
