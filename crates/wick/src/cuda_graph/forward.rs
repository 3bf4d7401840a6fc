//! A function of tensors with outputs — a model's forward pass in evaluation, inference — run as
//! a CUDA graph ([`GraphForward`]): eagerly for its warm-up, then captured once per input shape
//! and replayed, each call's inputs copied into the graph's own and its outputs copied out of
//! the graph's own (a captured function keeps nothing it makes, so it writes its results into
//! tensors made before the capture: those of the last warm-up's shapes).
//!
//! Refused, not wrong: a capture the driver or the function refuses is reported
//! (its [`GraphForward::shapes`] say so) and that shape runs eagerly from then on; inputs of a
//! shape other than the captured one run eagerly with the reason, or get a graph of their own
//! with [`GraphForward::recapture_per_shape`]; outputs whose shapes change from
//! one call to the next (a function that is not a fixed computation of its inputs' shapes) are a
//! refused capture too. Dropping it drops its graphs and gives their memory back to the device.

use candle_core::{DType, Device, Tensor};

use super::shapes::{Place, Shapes};
use super::{capture, copy_into, cuda_of, warm_up, GraphError};

/// The function captured: its outputs from the inputs it is given (the graph's own inputs).
pub type Function<'a> = &'a dyn Fn(&[Tensor]) -> candle_core::Result<Vec<Tensor>>;

/// The inputs' dimensions and dtypes.
pub type InputKey = Vec<(Vec<usize>, DType)>;

/// What a shape keeps: the graph's own inputs, and the outputs it writes (made at the last
/// warm-up, empty before).
pub type InputsOutputs = (Vec<Tensor>, Vec<Tensor>);

/// A function of tensors run as a CUDA graph after its warm-up.
pub struct GraphForward {
    device: Device,
    warmup: usize,
    shapes: Shapes<InputKey, InputsOutputs>,
}

fn key_of(inputs: &[Tensor]) -> InputKey {
    inputs.iter().map(|t| (t.dims().to_vec(), t.dtype())).collect()
}

/// `outputs` copied (the caller keeps them across later replays).
fn copies(outputs: &[Tensor]) -> Result<Vec<Tensor>, GraphError> {
    outputs.iter().map(Tensor::copy).collect::<Result<_, _>>().map_err(GraphError::Failed)
}

impl GraphForward {
    /// A function run on `device` (a CUDA device), captured after `warmup` eager calls of an
    /// input shape (at least one: it makes what the function keeps, chooses cuDNN's algorithms
    /// and fills the upload cache the capture needs).
    pub fn new(device: &Device, warmup: usize) -> Result<Self, GraphError> {
        cuda_of(device)?;
        Ok(GraphForward { device: device.clone(), warmup: warmup.max(1), shapes: Shapes::default() })
    }

    /// With `true`, inputs of a shape not seen before get a graph of their own (after their own
    /// warm-up; each graph keeps its memory while this lives). Without (the default), only the
    /// first shape is captured and other shapes run eagerly.
    pub fn recapture_per_shape(mut self, yes: bool) -> Self {
        self.shapes.recapture_per_shape(yes);
        self
    }

    /// `f`'s outputs for `inputs` (tensors on any device: they are copied to this one): eagerly
    /// during the shape's warm-up, after a refusal or for a shape without a graph; captured at the
    /// first call after the warm-up; replayed after that. A replay's outputs are copies (one
    /// device copy each), so the caller may keep them across later calls. Nothing is read back.
    pub fn run(&mut self, inputs: &[Tensor], f: Function<'_>) -> Result<Vec<Tensor>, GraphError> {
        let key = key_of(inputs);
        let failed = GraphError::Failed;
        // The shape's entry, and whether the inputs still have to be copied into its own (not
        // when they were just made from them).
        let (index, copy) = match self.shapes.place(&key) {
            Place::Known(i) => (i, true),
            Place::New => {
                // Exactly each input's elements (`copy` of a view — a micro-batch narrowed out of
                // a larger batch — would keep the whole buffer behind it for the graph's life).
                let own =
                    inputs.iter().map(|t| t.to_device(&self.device)?.force_contiguous()).collect::<Result<Vec<_>, _>>();
                (self.shapes.push(key, (own.map_err(failed)?, Vec::new())), false)
            }
            Place::Eager(reason) => {
                self.shapes.set_eager_reason(Some(reason));
                return warm_up(&self.device, || f(inputs))?.map_err(failed);
            }
        };
        let (device, warmup) = (&self.device, self.warmup);
        let (shaped, eager_reason) =
            self.shapes.entry_mut(index).ok_or_else(|| GraphError::Driver("a shape's entry is missing".into()))?;
        let (given, outputs) = &mut shaped.own;
        if copy {
            for (dst, src) in given.iter().zip(inputs) {
                copy_into(dst, src).map_err(failed)?;
            }
        }
        if let Some(graph) = &shaped.graph {
            *eager_reason = None;
            graph.replay()?;
            return copies(outputs);
        }
        if shaped.eager >= warmup && shaped.refused.is_none() {
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
                    return copies(outputs);
                }
                Err(GraphError::Refused(why)) => shaped.refused = Some(why),
                Err(e) => return Err(e),
            }
        }
        shaped.eager += 1;
        *eager_reason = shaped.refused.clone();
        let made = warm_up(device, || f(given))?.map_err(failed)?;
        if shaped.refused.is_none() && shaped.eager >= warmup {
            // Where the capture (the next call) will write its outputs: made now, outside any
            // graph, in the shapes of this last warm-up's.
            *outputs = made.iter().map(Tensor::zeros_like).collect::<Result<_, _>>().map_err(failed)?;
        }
        Ok(made)
    }

    /// Its shapes: their graphs, why a capture was refused, why the last call ran eagerly.
    pub fn shapes(&self) -> &Shapes<InputKey, InputsOutputs> {
        &self.shapes
    }
}

/// The graphs go first, then their memory goes back to the device ([`super::trim`]): the
/// driver's graph pool returns to what other live graphs hold.
impl Drop for GraphForward {
    fn drop(&mut self) {
        self.shapes.clear();
        let _ = super::trim(&self.device);
    }
}
