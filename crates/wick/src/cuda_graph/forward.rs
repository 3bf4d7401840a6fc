//! A function of tensors with outputs — a model's forward pass in evaluation, inference — run as
//! a CUDA graph ([`GraphForward`]): eagerly for its warm-up, then captured once per input shape
//! and replayed, each call's inputs copied into the graph's own and its outputs copied out of
//! the graph's own (a captured function keeps nothing it makes, so it writes its results into
//! tensors made before the capture: those of the last warm-up's shapes).
//!
//! Refused, not wrong: a capture the driver or the function refuses is reported
//! ([`GraphForward::refused`]) and that shape runs eagerly from then on; inputs of a shape other
//! than the captured one run eagerly with the reason ([`GraphForward::eager_reason`]), or get a
//! graph of their own with [`GraphForward::recapture_per_shape`]; outputs whose shapes change from
//! one call to the next (a function that is not a fixed computation of its inputs' shapes) are a
//! refused capture too. Dropping it drops its graphs and gives their memory back to the device.

use candle_core::{DType, Device, Tensor};

use super::{capture, copy_into, cuda_of, warm_up, GraphError, StepGraph};

/// The function captured: its outputs from the inputs it is given (the graph's own inputs).
pub type Function<'a> = &'a dyn Fn(&[Tensor]) -> candle_core::Result<Vec<Tensor>>;

/// The inputs' dimensions and dtypes.
type Key = Vec<(Vec<usize>, DType)>;

/// One input shape: the graph's inputs and outputs for it, its eager calls so far, and its graph
/// once captured (or why the capture was refused).
struct Shaped {
    key: Key,
    inputs: Vec<Tensor>,
    outputs: Vec<Tensor>,
    eager: usize,
    graph: Option<StepGraph>,
    refused: Option<String>,
}

/// A function of tensors run as a CUDA graph after its warm-up.
pub struct GraphForward {
    device: Device,
    warmup: usize,
    recapture: bool,
    shapes: Vec<Shaped>,
    eager_reason: Option<String>,
}

fn key_of(inputs: &[Tensor]) -> Key {
    inputs.iter().map(|t| (t.dims().to_vec(), t.dtype())).collect()
}

impl GraphForward {
    /// A function run on `device` (a CUDA device), captured after `warmup` eager calls of an
    /// input shape (at least one: it makes what the function keeps, chooses cuDNN's algorithms
    /// and fills the upload cache the capture needs).
    pub fn new(device: &Device, warmup: usize) -> Result<Self, GraphError> {
        cuda_of(device)?;
        Ok(GraphForward {
            device: device.clone(),
            warmup: warmup.max(1),
            recapture: false,
            shapes: Vec::new(),
            eager_reason: None,
        })
    }

    /// With `true`, inputs of a shape not seen before get a graph of their own (after their own
    /// warm-up; each graph keeps its memory while this lives). Without (the default), only the
    /// first shape is captured and other shapes run eagerly.
    pub fn recapture_per_shape(mut self, yes: bool) -> Self {
        self.recapture = yes;
        self
    }

    /// `f`'s outputs for `inputs` (tensors on any device: they are copied to this one): eagerly
    /// during the shape's warm-up, after a refusal or for a shape without a graph; captured at the
    /// first call after the warm-up; replayed after that. A replay's outputs are copies (one
    /// device copy each), so the caller may keep them across later calls. Nothing is read back.
    pub fn run(&mut self, inputs: &[Tensor], f: Function<'_>) -> Result<Vec<Tensor>, GraphError> {
        let key = key_of(inputs);
        let failed = GraphError::Failed;
        let index = match self.shapes.iter().position(|s| s.key == key) {
            Some(i) => {
                for (dst, src) in self.shapes[i].inputs.iter().zip(inputs) {
                    copy_into(dst, src).map_err(failed)?;
                }
                i
            }
            None if self.shapes.is_empty() || self.recapture => {
                let own = inputs.iter().map(|t| t.to_device(&self.device)?.copy()).collect::<Result<Vec<_>, _>>();
                let inputs = own.map_err(failed)?;
                self.shapes.push(Shaped { key, inputs, outputs: Vec::new(), eager: 0, graph: None, refused: None });
                self.shapes.len() - 1
            }
            None => {
                self.eager_reason = Some(format!(
                    "the inputs' shapes {:?} are not the captured ones {:?} (recapture_per_shape gives each shape a \
                     graph)",
                    key, self.shapes[0].key
                ));
                return warm_up(&self.device, || f(inputs))?.map_err(failed);
            }
        };
        let Self { device, warmup, shapes, eager_reason, .. } = self;
        let shaped = &mut shapes[index];
        if let Some(graph) = &shaped.graph {
            *eager_reason = None;
            graph.replay()?;
            return shaped.outputs.iter().map(Tensor::copy).collect::<Result<_, _>>().map_err(failed);
        }
        if shaped.eager >= *warmup && shaped.refused.is_none() {
            let (given, outputs) = (&shaped.inputs, &shaped.outputs);
            let captured = capture(device, || {
                let made = f(given)?;
                if made.len() != outputs.len() {
                    candle_core::bail!("{} outputs, {} at the warm-up", made.len(), outputs.len());
                }
                for (dst, out) in outputs.iter().zip(&made) {
                    if (out.dims(), out.dtype()) != (dst.dims(), dst.dtype()) {
                        candle_core::bail!(
                            "an output of {:?} {:?}, {:?} {:?} at the warm-up",
                            out.dims(),
                            out.dtype(),
                            dst.dims(),
                            dst.dtype()
                        );
                    }
                    copy_into(dst, out)?;
                }
                Ok(())
            });
            match captured {
                Ok(graph) => {
                    graph.replay()?;
                    shaped.graph = Some(graph);
                    *eager_reason = None;
                    return shaped.outputs.iter().map(Tensor::copy).collect::<Result<_, _>>().map_err(failed);
                }
                Err(GraphError::Refused(why)) => shaped.refused = Some(why),
                Err(e) => return Err(e),
            }
        }
        shaped.eager += 1;
        *eager_reason = shaped.refused.clone();
        let made = warm_up(device, || f(&shaped.inputs))?.map_err(failed)?;
        if shaped.refused.is_none() && shaped.eager >= *warmup {
            // Where the capture (the next call) will write its outputs: made now, outside any
            // graph, in the shapes of this last warm-up's.
            shaped.outputs = made.iter().map(Tensor::zeros_like).collect::<Result<_, _>>().map_err(failed)?;
        }
        Ok(made)
    }

    /// The first shape's graph, once there is one.
    pub fn graph(&self) -> Option<&StepGraph> {
        self.shapes.first().and_then(|s| s.graph.as_ref())
    }

    /// Every graph captured (one a shape).
    pub fn graphs(&self) -> impl Iterator<Item = &StepGraph> {
        self.shapes.iter().filter_map(|s| s.graph.as_ref())
    }

    /// Why the first shape's capture was refused, when it was.
    pub fn refused(&self) -> Option<&str> {
        self.shapes.first().and_then(|s| s.refused.as_deref())
    }

    /// Why the last call ran eagerly after its shape's warm-up (a refused capture, or a shape
    /// without a graph); `None` after a replay or a warm-up call.
    pub fn eager_reason(&self) -> Option<&str> {
        self.eager_reason.as_deref()
    }
}

/// The graphs go first, then their memory goes back to the device ([`super::trim`]): the
/// driver's graph pool returns to what other live graphs hold.
impl Drop for GraphForward {
    fn drop(&mut self) {
        drop(std::mem::take(&mut self.shapes));
        let _ = super::trim(&self.device);
    }
}
