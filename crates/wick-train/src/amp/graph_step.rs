//! A training step run as a CUDA graph (feature `cuda`): the fused device step ([`DeviceAmp`]),
//! whose update reads nothing from the host while it runs, and a model's forward and backward,
//! captured once as one graph (`wick::cuda_graph`) and replayed at every later step — the host
//! launches one graph instead of every kernel of the step.
//!
//! A step is given its batch ([`GraphStep::step`]), or its micro-batches for gradient
//! accumulation ([`GraphStep::step_accumulated`]: one graph holds every micro-batch's forward
//! and backward and the one update). The first batch of a shape is copied into
//! inputs the step keeps for that shape, and every later batch of the shape into the same
//! inputs, which is where a replay reads them. The first `warmup` steps of a shape run eagerly
//! with candle's upload cache on (they make the optimizer's state, choose cuDNN's algorithms and
//! fill the cache the capture needs); the next is captured and replayed at once (a capture runs
//! nothing), and every later step of that shape replays it. Refused, not wrong: a capture the
//! driver or the step refuses is reported (its [`GraphStep::shapes`] say so) and that shape's
//! steps run eagerly; a batch of another shape (a smaller last batch, another sequence length)
//! runs eagerly with the reason, or gets a graph of its own with
//! [`GraphStep::recapture_per_shape`]. The loss is written into a tensor made before any capture
//! ([`GraphStep::last_loss`]). Dropping the step drops its graphs and gives their memory back to
//! the device.

use candle_core::backprop::GradStore;
use candle_core::{DType, Device, Tensor};
use wick::cuda_graph::shapes::{Place, Shapes};
use wick::cuda_graph::{self, copy_into, GraphError};

use super::device_step::{DeviceAmp, StepReport};
use crate::error::TrainError;

/// The memory report's line for the device's graph memory ([`GraphStep::account`]).
pub const GRAPH_MEMORY: &str = "CUDA graphs (the driver's graph pool)";

/// The forward pass of a step: the loss from the batch's tensors (the step's own inputs).
pub type Forward<'a> = &'a dyn Fn(&[Tensor]) -> candle_core::Result<Tensor>;

/// What a step over micro-batches runs for each ([`GraphStep::step_accumulated`]). A closure
/// `|k, inputs| loss` is one, with candle's backward.
pub trait StepBody {
    /// The loss of micro-batch `k` from its tensors (the step's own inputs of it).
    fn loss(&self, k: usize, inputs: &[Tensor]) -> candle_core::Result<Tensor>;

    /// The gradients of `loss` (a micro-batch's loss, divided by micro-batches × ranks and scaled):
    /// candle's backward unless the body says otherwise (activation checkpointing's).
    fn backward(&self, loss: &Tensor) -> candle_core::Result<GradStore> {
        loss.backward()
    }

    /// What the step does before its first micro-batch (a data-parallel step: rank 0's buffers
    /// into every rank's). Nothing by default.
    fn begin(&self) -> candle_core::Result<()> {
        Ok(())
    }

    /// The processes that each take as many micro-batches in the step (a data-parallel step's
    /// ranks): each micro-batch's loss counts `1/(micro-batches × ranks)`, as the trainer's.
    fn ranks(&self) -> usize {
        1
    }

    /// After the last backward, before the update: the summed gradients and the mean loss (one
    /// f32, this process's share) made what the update and the report should see (a data-parallel
    /// step: summed over the ranks, in place). Nothing by default.
    fn reduce(&self, grads: &mut GradStore, loss: &Tensor) -> candle_core::Result<()> {
        let _ = (grads, loss);
        Ok(())
    }
}

impl<F: Fn(usize, &[Tensor]) -> candle_core::Result<Tensor>> StepBody for F {
    fn loss(&self, k: usize, inputs: &[Tensor]) -> candle_core::Result<Tensor> {
        self(k, inputs)
    }
}

/// A step's shape: each micro-batch's tensors' dimensions and dtypes.
pub type Key = Vec<Vec<(Vec<usize>, DType)>>;

/// A training step that runs as a CUDA graph after its warm-up.
pub struct GraphStep {
    amp: DeviceAmp,
    device: Device,
    clip: Option<f64>,
    /// The last step's loss (one f32: the mean over its micro-batches), written by the step.
    loss: Tensor,
    /// Each batch shape's own inputs (every micro-batch's tensors) and graph.
    shapes: Shapes<Key, Vec<Vec<Tensor>>>,
    warmup: usize,
}

/// A graph's error as the step's: out-of-memory as wick's typed one (on `device`), the rest said.
fn graph_error(device: &Device) -> impl Fn(GraphError) -> TrainError + '_ {
    move |e| match e.into_memory_error(device) {
        Some(oom) => TrainError::from(oom),
        None => TrainError::Invalid { what: "CUDA graph step".into(), message: e.to_string() },
    }
}

fn key_of<T: AsRef<[Tensor]>>(micro: &[T]) -> Key {
    micro.iter().map(|b| b.as_ref().iter().map(|t| (t.dims().to_vec(), t.dtype())).collect()).collect()
}

impl GraphStep {
    /// A step updating `amp`'s parameters on `device` (a CUDA device), clipped to `clip` when
    /// given, captured after `warmup` eager steps of a shape (at least one).
    pub fn new(amp: DeviceAmp, device: &Device, clip: Option<f64>, warmup: usize) -> Result<Self, TrainError> {
        if !device.is_cuda() {
            return Err(TrainError::Invalid {
                what: "CUDA graph step".into(),
                message: format!("CUDA graphs need a CUDA device, not {:?}", device.location()),
            });
        }
        if let Some(max_norm) = clip {
            crate::clip::check_max_norm(max_norm)?;
        }
        let loss = Tensor::zeros(1, DType::F32, device)?;
        Ok(GraphStep { amp, device: device.clone(), clip, loss, shapes: Shapes::default(), warmup: warmup.max(1) })
    }

    /// With `true`, a batch of a shape not seen before gets inputs and a graph of its own (after
    /// its own warm-up); each graph keeps its memory while the step lives. Without (the default),
    /// only the first shape is captured and other shapes run eagerly.
    pub fn recapture_per_shape(mut self, yes: bool) -> Self {
        self.shapes.recapture_per_shape(yes);
        self
    }

    /// One step on `batch` (tensors on the step's device; `forward` returns the loss from the
    /// tensors it is given, which are the step's own inputs of the batch's shape): backward and
    /// the update after it — eagerly during the shape's warm-up, after a refusal or for a shape
    /// without a graph; captured at the first step after the warm-up; replayed after that.
    /// Nothing is read back ([`GraphStep::last_loss`], [`GraphStep::last_step`] read what
    /// happened).
    pub fn step(&mut self, batch: &[Tensor], forward: Forward<'_>) -> Result<(), TrainError> {
        self.step_accumulated(&[batch], &|_: usize, inputs: &[Tensor]| forward(inputs))
    }

    /// One step over micro-batches (gradient accumulation, as the trainer's: each micro-batch's
    /// loss divided by their number times the body's ranks, the gradients summed in order, the
    /// body's reduction, then one update), as
    /// [`GraphStep::step`] does it for one: the shape is every micro-batch's, and the graph holds
    /// them all.
    pub fn step_accumulated<T: AsRef<[Tensor]>>(
        &mut self,
        micro_batches: &[T],
        body: &dyn StepBody,
    ) -> Result<(), TrainError> {
        if micro_batches.is_empty() {
            return Err(TrainError::Invalid { what: "CUDA graph step".into(), message: "no micro-batches".into() });
        }
        // Host code does not run in a replay: the learning rate of this step goes to the device
        // now (a copy only when it changed), before the graph reads it there.
        self.amp.write_hyper(self.clip)?;
        let key = key_of(micro_batches);
        // The shape's inputs, and whether the batch still has to be copied into them (not when
        // they were just made from it).
        let (index, copy) = match self.shapes.place(&key) {
            Place::Known(i) => (i, true),
            Place::New => {
                // Exactly each tensor's elements (`copy` of a view would keep the whole buffer
                // behind it for the graph's life).
                let own = |b: &T| b.as_ref().iter().map(|t| t.to_device(&self.device)?.force_contiguous()).collect();
                let inputs = micro_batches.iter().map(own).collect::<candle_core::Result<Vec<Vec<_>>>>()?;
                (self.shapes.push(key, inputs), false)
            }
            Place::Eager(reason) => {
                let given: Vec<&[Tensor]> = micro_batches.iter().map(AsRef::as_ref).collect();
                return self.run_eager(&given, body, reason);
            }
        };
        let Self { amp, device, clip, loss, shapes, warmup, .. } = self;
        let missing =
            || TrainError::Invalid { what: "CUDA graph step".into(), message: "a shape's entry is missing".into() };
        let (shaped, eager_reason) = shapes.entry_mut(index).ok_or_else(missing)?;
        if copy {
            for (dst, src) in shaped.own.iter().flatten().zip(micro_batches.iter().flat_map(AsRef::as_ref)) {
                copy_into(dst, src)?;
            }
        }
        if let Some(graph) = &shaped.graph {
            *eager_reason = None;
            return graph.replay().map_err(graph_error(device));
        }
        let inputs: Vec<&[Tensor]> = shaped.own.iter().map(Vec::as_slice).collect();
        if shaped.eager >= *warmup && shaped.refused.is_none() {
            match cuda_graph::capture(device, || {
                one_step(amp, loss, *clip, &inputs, body).map_err(candle_core::Error::wrap)
            }) {
                Ok(graph) => {
                    graph.replay().map_err(graph_error(device))?;
                    shaped.graph = Some(graph);
                    *eager_reason = None;
                    return Ok(());
                }
                Err(GraphError::Refused(why)) => shaped.refused = Some(why),
                Err(e) => return Err(graph_error(device)(e)),
            }
        }
        shaped.eager += 1;
        *eager_reason = shaped.refused.clone();
        cuda_graph::warm_up(device, || one_step(amp, loss, *clip, &inputs, body)).map_err(graph_error(device))?
    }

    /// One step run eagerly on `micro_batches` as given (no inputs of the step's own), for
    /// `reason` (its [`GraphStep::shapes`] say it afterwards): a batch the caller cannot give
    /// as tensors of a fixed shape, or one of a shape without a graph.
    pub fn run_eager(
        &mut self,
        micro_batches: &[&[Tensor]],
        body: &dyn StepBody,
        reason: String,
    ) -> Result<(), TrainError> {
        self.amp.write_hyper(self.clip)?;
        self.shapes.set_eager_reason(Some(reason));
        let (amp, loss, clip) = (&mut self.amp, &self.loss, self.clip);
        cuda_graph::warm_up(&self.device, || one_step(amp, loss, clip, micro_batches, body))
            .map_err(graph_error(&self.device))?
    }
    /// Sets the learning rate of the next steps (a schedule's step; replays read it from the
    /// device).
    pub fn set_learning_rate(&mut self, rate: f64) {
        self.amp.set_learning_rate(rate);
    }

    /// The last step's loss (a host read: waits for the step).
    pub fn last_loss(&self) -> Result<f32, TrainError> {
        Ok(self.loss.to_vec1::<f32>()?.first().copied().unwrap_or(f32::NAN))
    }

    /// What the last step's update did (a host read).
    pub fn last_step(&self) -> Result<StepReport, TrainError> {
        self.amp.last_step()
    }

    /// Its batch shapes: their graphs, why a capture was refused, why the last step ran
    /// eagerly.
    pub fn shapes(&self) -> &Shapes<Key, Vec<Vec<Tensor>>> {
        &self.shapes
    }

    /// The fused step it drives.
    pub fn amp(&self) -> &DeviceAmp {
        &self.amp
    }

    /// The fused step, to continue from a checkpoint ([`DeviceAmp::load_state`] and
    /// [`DeviceAmp::load_scaler_state`] write into the memory a captured step reads).
    pub fn amp_mut(&mut self) -> &mut DeviceAmp {
        &mut self.amp
    }

    /// Puts the device's graph memory (the driver's graph pool, which holds the captured steps'
    /// tensors outside wick's pool) in `engine`'s memory report as a line of its own, with the
    /// fused step's masters and state ([`DeviceAmp::account`]).
    pub fn account(&self, engine: &wick::Engine) -> Result<(), TrainError> {
        self.amp.account(engine);
        let memory = cuda_graph::graph_memory(&self.device).map_err(graph_error(&self.device))?;
        engine.account(GRAPH_MEMORY, usize::try_from(memory.reserved).unwrap_or(usize::MAX));
        Ok(())
    }
}

/// The step's graphs go first, then their memory goes back to the device (`cuda_graph::trim`):
/// the driver's graph pool returns to what other live graphs hold.
impl Drop for GraphStep {
    fn drop(&mut self) {
        self.shapes.clear();
        let _ = cuda_graph::trim(&self.device);
    }
}

/// The body's start, forward and backward over each micro-batch (its loss divided by their
/// number times the body's ranks, the gradients summed in order), the mean loss copied into
/// `loss`, the body's reduction, and the fused update: what is captured.
fn one_step(
    amp: &mut DeviceAmp,
    loss: &Tensor,
    clip: Option<f64>,
    micro_batches: &[&[Tensor]],
    body: &dyn StepBody,
) -> Result<(), TrainError> {
    body.begin()?;
    // What each micro-batch's loss counts: 1/(micro-batches × ranks).
    let n = micro_batches.len().saturating_mul(body.ranks().max(1));
    let (mut total, mut loss_sum) = (None::<GradStore>, None::<Tensor>);
    for (k, inputs) in micro_batches.iter().enumerate() {
        let value = body.loss(k, inputs)?;
        let value32 = value.to_dtype(DType::F32)?.reshape(1)?;
        loss_sum = Some(match loss_sum {
            None => value32,
            Some(sum) => (sum + value32)?,
        });
        let scaled = if n > 1 { (value / n as f64)? } else { value };
        let grads = body.backward(&amp.scale_loss(&scaled)?)?;
        drop(scaled);
        total = Some(super::add_grads(total, grads, amp.vars())?);
    }
    if let Some(sum) = loss_sum {
        let mean = if n > 1 { (sum / n as f64)? } else { sum };
        loss.slice_set(&mean, 0, 0)?;
    }
    let mut grads =
        total.ok_or_else(|| TrainError::Invalid { what: "CUDA graph step".into(), message: "no gradients".into() })?;
    body.reduce(&mut grads, loss)?;
    let unscaled = amp.unscale(&grads)?;
    drop(grads);
    amp.apply(unscaled, clip)
}
