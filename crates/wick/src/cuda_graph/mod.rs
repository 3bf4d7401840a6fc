//! A step captured as a CUDA graph and replayed (feature `cuda`): the host launches a whole step —
//! forward, backward, the optimizer's update — as one graph instead of hundreds of kernels, which
//! is what a launch-bound step (a small model, a short sequence) waits on.
//!
//! How it sits on candle. candle allocates every buffer with `cuMemAllocAsync`; inside a capture
//! the driver turns each into an allocation node of the graph, and each free into a free node, so
//! the graph owns the memory of everything the step makes and frees: addresses fixed for the
//! graph's life and never handed to anyone else (the private pool PyTorch builds in its caching
//! allocator for `torch.cuda.graph`, here the driver's graph memory), given back when the graph is
//! dropped (`cuDeviceGraphMemTrim`). That memory is not in wick's pool: [`graph_memory`] reads it
//! and the memory report shows it on its own line.
//!
//! What a step must do to be captured (each is checked, and a step that breaks one is refused
//! with the reason — nothing of it has run, so the caller runs it eagerly instead):
//! - read nothing back from the device and upload nothing new while it runs: candle's upload
//!   cache is on for [`warm_up`] and the capture, so the small parameter arrays candle uploads
//!   for strided kernels are the warm-up's, and any other copy is an error inside the capture;
//!   wick's own kernels take their tensor lists in their parameters and their step's scalars from
//!   the device (`wick_kernels::step_scalars`);
//! - free everything it makes: its inputs and outputs are tensors made before the capture, which
//!   it reads and writes in place (the caller copies each new batch into the inputs before a
//!   replay). An allocation the graph would not free (a tensor kept past the step — state made
//!   lazily on the first step, say: warm up first) is found from the graph's nodes and is an
//!   error of its own ([`GraphError::Outlived`]): the tensor points into a graph never run, so
//!   what keeps it is unusable, and the step cannot simply run eagerly instead;
//! - update what outlives it in place (a model's buffers do on a CUDA device:
//!   `wick_nn::params::Buffer::set`; the fused update writes parameters, masters and state in
//!   place): a capture cannot free memory made before it, and a tensor put in place of another
//!   during a capture that then fails points into a graph never run — the step's host code must
//!   not do that, as no check can see it;
//! - run on one stream: the capture turns cudarc's per-buffer events off for its duration
//!   (cudarc's own graph tests do the same), so no other stream may use the step's tensors then.
//!
//! Replays are the captured step exactly: the same kernels on the same addresses, so a replayed
//! step gives the eager step's bits when the eager step is deterministic.
//!
//! A training step's capture is wick-train's (`amp::graph_step`); a function of tensors with
//! outputs — a model's forward pass in evaluation, inference — is [`GraphForward`] (`forward`).

use std::sync::Arc;

use candle_core::cuda_backend::cudarc::driver::{sys, CudaGraph, CudaStream};
use candle_core::{Device, Tensor};

mod forward;
pub mod shapes;
pub use forward::{Function, GraphForward, InputKey, InputsOutputs};

/// Why a step was not captured or a replay failed.
#[derive(Debug, thiserror::Error)]
pub enum GraphError {
    /// The step cannot be captured as it is; nothing of it ran (run it eagerly).
    #[error("the step cannot be captured as a CUDA graph: {0}")]
    Refused(String),
    /// Tensors the step made outlive it: they point into the memory of a graph that was never
    /// run (and is now dropped), so whatever keeps them (state made lazily by the step, say) must
    /// not be used again — rebuild it, warm the step up eagerly first, and capture again.
    #[error("the step cannot be captured, and what it kept is unusable: {0}")]
    Outlived(String),
    /// The device has not the memory the graph needs (at instantiation or its first upload).
    /// Nothing of the graph is kept. [`GraphError::into_memory_error`] makes it wick's typed
    /// out-of-memory.
    #[error("out of memory for the CUDA graph ({requested} bytes of graph allocations): {message}")]
    OutOfMemory {
        /// The driver's words.
        message: String,
        /// Bytes the graph's allocation nodes ask for (0 where not known yet).
        requested: usize,
    },
    /// The driver failed otherwise.
    #[error("CUDA graph: {0}")]
    Driver(String),
    /// The function itself failed while running eagerly (a warm-up, or a shape without a graph).
    #[error(transparent)]
    Failed(candle_core::Error),
}

impl GraphError {
    /// True for [`GraphError::OutOfMemory`].
    pub fn is_out_of_memory(&self) -> bool {
        matches!(self, GraphError::OutOfMemory { .. })
    }

    /// Out-of-memory as wick's typed [`wick_memory::MemoryError::OutOfMemory`] (the device named
    /// `device`, the request the graph's allocations), anything else as `None`.
    pub fn into_memory_error(&self, device: &Device) -> Option<wick_memory::MemoryError> {
        let GraphError::OutOfMemory { message, requested } = self else { return None };
        let name = format!("{:?} (a CUDA graph's memory: {message})", device.location());
        Some(wick_memory::MemoryError::OutOfMemory(Box::new(wick_memory::OutOfMemory::refused(name, *requested))))
    }
}

/// Copies `src` (same shape; converted to `dst`'s device and dtype) into `dst`'s own memory: what
/// a captured step reads, or writes for its caller, stays where the graph has it.
pub fn copy_into(dst: &Tensor, src: &Tensor) -> candle_core::Result<()> {
    let src = src.to_device(dst.device())?.to_dtype(dst.dtype())?.contiguous()?;
    dst.flatten_all()?.slice_set(&src.flatten_all()?, 0, 0)
}

/// What a captured graph holds: its nodes by kind and the memory its allocation nodes ask for.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct GraphShape {
    /// Kernel launches.
    pub kernels: usize,
    /// Copies and fills.
    pub copies: usize,
    /// Allocation nodes (tensors the step makes).
    pub allocations: usize,
    /// Free nodes (tensors the step frees).
    pub frees: usize,
    /// Bytes the allocation nodes ask for, summed (the driver reuses freed ranges within the
    /// graph, so what it reserves — [`graph_memory`] — is at most this).
    pub allocated_bytes: usize,
    /// Every node.
    pub nodes: usize,
}

/// The device's graph memory (`cuDeviceGetGraphMemAttribute`): bytes in use by graphs' allocations
/// now, and reserved for graphs (in use or cached), now and at their highest.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct GraphMemory {
    /// In use now.
    pub used: u64,
    /// Reserved now.
    pub reserved: u64,
    /// Reserved at the highest since the process began (or the driver's last reset).
    pub reserved_high: u64,
}

/// A captured step, ready to replay on the stream it was captured on.
pub struct StepGraph {
    graph: CudaGraph,
    stream: Arc<CudaStream>,
    shape: GraphShape,
}

fn driver(e: impl std::fmt::Display) -> GraphError {
    let text = e.to_string();
    if text.contains("OUT_OF_MEMORY") || text.to_lowercase().contains("out of memory") {
        GraphError::OutOfMemory { message: text, requested: 0 }
    } else {
        GraphError::Driver(text)
    }
}

fn cuda_of(device: &Device) -> Result<&candle_core::CudaDevice, GraphError> {
    match device {
        Device::Cuda(cuda) => Ok(cuda),
        other => Err(GraphError::Refused(format!("CUDA graphs need a CUDA device, not {:?}", other.location()))),
    }
}

/// Runs `step` eagerly with candle's upload cache on, so the small arrays candle uploads for its
/// strided kernels are cached by content and a capture of the same step finds them (a step not
/// warmed up this way is refused at its first such upload). Run the step this way at least once,
/// with the shapes the capture will have, before [`capture`]. The cache holds each distinct array
/// for the process's life (a few bytes each).
pub fn warm_up<T>(device: &Device, step: impl FnOnce() -> T) -> Result<T, GraphError> {
    let cuda = cuda_of(device)?;
    let _cache = cuda.enable_cuda_graph_htod_cache();
    Ok(step())
}

/// Ends a capture still open when dropped (the step panicked or returned early), and turns the
/// context's event tracking back on if the capture turned it off.
struct Capturing {
    stream: Arc<CudaStream>,
    tracking: bool,
    open: bool,
}

/// How a capture ended: an error cudarc recorded while it ran (a free or an event it could not
/// report then), and the graph or the driver's error.
struct Ended {
    recorded: Option<candle_core::cuda_backend::cudarc::driver::DriverError>,
    graph: Result<Option<CudaGraph>, candle_core::cuda_backend::cudarc::driver::DriverError>,
}

impl Capturing {
    fn end(&mut self) -> Ended {
        self.open = false;
        // cudarc keeps an error it could not return (a `Drop`'s) and hands it to the next call
        // that binds the context — `end_capture` among them, which would then return before
        // ending the capture. Taken here, it is the capture's.
        let recorded = self.stream.context().check_err().err();
        let mut graph = self.stream.end_capture(sys::CUgraphInstantiate_flags(0));
        if graph.is_err() && still_capturing(&self.stream) {
            // The stream must not stay in capture mode whatever happened: end it directly and
            // drop what it captured.
            let mut raw: sys::CUgraph = std::ptr::null_mut();
            // SAFETY: the stream is live and capturing; the graph it returns is ours to destroy.
            let ended = unsafe { sys::cuStreamEndCapture(self.stream.cu_stream(), &mut raw) }.result();
            if !raw.is_null() {
                // SAFETY: the graph just returned, not owned by anything else.
                let _ = unsafe { sys::cuGraphDestroy(raw) };
            }
            if let Err(e) = ended {
                graph = Err(e);
            }
        }
        if self.tracking {
            // SAFETY: restores the setting the capture found; the capture's buffers are freed.
            unsafe { self.stream.context().enable_event_tracking() };
        }
        Ended { recorded, graph }
    }
}

/// True while `stream` is capturing (asked of the driver directly, past any error cudarc holds).
fn still_capturing(stream: &CudaStream) -> bool {
    let mut status = sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
    // SAFETY: a live stream, and a place for its status.
    let asked = unsafe { sys::cuStreamIsCapturing(stream.cu_stream(), &mut status) }.result();
    asked.is_ok() && status != sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE
}

impl Drop for Capturing {
    fn drop(&mut self) {
        if self.open {
            // The graph of an abandoned capture is dropped (destroyed) at once, and any error the
            // abandoned step left with cudarc is the capture's, not the next call's.
            let _ = self.end();
            let _ = self.stream.context().check_err();
        }
    }
}

/// Captures `step` on `device`'s stream (candle's, where wick's kernels launch too) as a graph:
/// `step` runs on the host, its kernels are recorded, none runs. Returns the graph and what it
/// holds; [`StepGraph::replay`] runs it. Refused, with the reason and with nothing run, when the
/// step errs while capturing (a read from the device, an upload the warm-up did not cache, an op
/// the driver cannot capture) or leaves allocations the graph would not free. Run the step once
/// through [`warm_up`] first.
pub fn capture(device: &Device, step: impl FnOnce() -> candle_core::Result<()>) -> Result<StepGraph, GraphError> {
    let cuda = cuda_of(device)?;
    let stream = cuda.cuda_stream();
    stream.synchronize().map_err(driver)?;
    let _cache = cuda.enable_cuda_graph_htod_cache();
    let ctx = stream.context();
    // An error cudarc holds from before is not the capture's: report it as it is.
    ctx.check_err().map_err(driver)?;
    let tracking = ctx.is_event_tracking();
    if tracking {
        // SAFETY: everything the step does is on this one stream (the module's rule); the
        // setting is restored when the capture ends, on every path (`Capturing`).
        unsafe { ctx.disable_event_tracking() };
    }
    let mut capturing = Capturing { stream: stream.clone(), tracking, open: false };
    stream
        .begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
        .map_err(|e| GraphError::Refused(format!("the stream would not start a capture: {e}")))?;
    capturing.open = true;
    let ran = step();
    let Ended { recorded, graph } = capturing.end();
    // Whatever the step's host code left with cudarc while capturing (its locals' frees) is the
    // capture's too: taken, so the next eager call does not report it as its own.
    let left = ctx.check_err().err();
    let graph = match (ran, recorded.or(left), graph) {
        (Err(e), _, _) => return Err(GraphError::Refused(format!("the step failed while capturing ({e})"))),
        (Ok(()), Some(e), _) => {
            return Err(GraphError::Refused(format!("an operation of the step failed while capturing: {e}")))
        }
        (Ok(()), None, Err(e)) => return Err(GraphError::Refused(format!("the driver ended the capture: {e}"))),
        (Ok(()), None, Ok(None)) => return Err(GraphError::Refused("the step launched nothing".into())),
        (Ok(()), None, Ok(Some(graph))) => graph,
    };
    let shape = shape_of(&graph)?;
    if shape.allocations > shape.frees {
        return Err(GraphError::Outlived(format!(
            "{} of the step's {} allocations outlive it: a captured step keeps nothing it makes (warm it up eagerly \
             so its state exists first, and write its results into tensors made before the capture)",
            shape.allocations - shape.frees,
            shape.allocations
        )));
    }
    // The graph's memory is mapped now rather than at the first replay, so running out of it is
    // an error here, before the caller counts on the graph.
    graph.upload().map_err(|e| match driver(e) {
        GraphError::OutOfMemory { message, .. } => {
            GraphError::OutOfMemory { message, requested: shape.allocated_bytes }
        }
        other => other,
    })?;
    Ok(StepGraph { graph, stream: stream.clone(), shape })
}

/// Counts `graph`'s nodes by kind and its allocation nodes' bytes.
fn shape_of(graph: &CudaGraph) -> Result<GraphShape, GraphError> {
    use sys::CUgraphNodeType as Kind;
    let cu_graph = graph.cu_graph();
    let mut count = 0usize;
    // SAFETY: a live graph (owned by `graph`); a null array asks for the count only.
    unsafe { sys::cuGraphGetNodes(cu_graph, std::ptr::null_mut(), &mut count) }.result().map_err(driver)?;
    let mut nodes = vec![std::ptr::null_mut(); count];
    // SAFETY: `nodes` holds `count` entries, the count the driver just gave.
    unsafe { sys::cuGraphGetNodes(cu_graph, nodes.as_mut_ptr(), &mut count) }.result().map_err(driver)?;
    let mut shape = GraphShape { nodes: count, ..GraphShape::default() };
    for &node in nodes.iter().take(count) {
        let mut kind = Kind::CU_GRAPH_NODE_TYPE_EMPTY;
        // SAFETY: `node` is one of the live graph's nodes.
        unsafe { sys::cuGraphNodeGetType(node, &mut kind) }.result().map_err(driver)?;
        match kind {
            Kind::CU_GRAPH_NODE_TYPE_KERNEL => shape.kernels += 1,
            Kind::CU_GRAPH_NODE_TYPE_MEMCPY | Kind::CU_GRAPH_NODE_TYPE_MEMSET => shape.copies += 1,
            Kind::CU_GRAPH_NODE_TYPE_MEM_ALLOC => {
                shape.allocations += 1;
                // SAFETY: the parameters are plain data (integers and pointers), valid when zero.
                let mut params: sys::CUDA_MEM_ALLOC_NODE_PARAMS = unsafe { std::mem::zeroed() };
                // SAFETY: an allocation node of the live graph, and a place for its parameters.
                unsafe { sys::cuGraphMemAllocNodeGetParams(node, &mut params) }.result().map_err(driver)?;
                shape.allocated_bytes = shape.allocated_bytes.saturating_add(params.bytesize);
            }
            Kind::CU_GRAPH_NODE_TYPE_MEM_FREE => shape.frees += 1,
            _ => {}
        }
    }
    Ok(shape)
}

impl StepGraph {
    /// Runs the captured step once more on its stream (asynchronously, like any launch): the same
    /// kernels on the same addresses. Copy the next inputs into the step's input tensors first.
    pub fn replay(&self) -> Result<(), GraphError> {
        self.graph.launch().map_err(driver)
    }

    /// What the graph holds.
    pub fn shape(&self) -> GraphShape {
        self.shape
    }

    /// The stream it replays on.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }
}

impl Drop for StepGraph {
    fn drop(&mut self) {
        // Replays finish first; then the graph (dropped with `self`) gives its memory back to the
        // driver's graph pool, and the trim below gives the pool's unused memory to the device.
        let _ = self.stream.synchronize();
    }
}

/// Gives the device's cached graph memory back (`cuDeviceGraphMemTrim`): what no live graph uses.
/// Dropping a [`StepGraph`] and then calling this brings [`graph_memory`]'s `reserved` back to
/// what the other live graphs hold (none: zero).
pub fn trim(device: &Device) -> Result<(), GraphError> {
    let cuda = cuda_of(device)?;
    let ordinal = cuda.cuda_stream().context().cu_device();
    cuda.cuda_stream().synchronize().map_err(driver)?;
    // SAFETY: a device of a live context.
    unsafe { sys::cuDeviceGraphMemTrim(ordinal) }.result().map_err(driver)
}

/// The device's graph memory now.
pub fn graph_memory(device: &Device) -> Result<GraphMemory, GraphError> {
    use sys::CUgraphMem_attribute as A;
    let cuda = cuda_of(device)?;
    let ordinal = cuda.cuda_stream().context().cu_device();
    let read = |attr: A| -> Result<u64, GraphError> {
        let mut value = 0u64;
        // SAFETY: a device of a live context; the attribute is a 64-bit count.
        unsafe { sys::cuDeviceGetGraphMemAttribute(ordinal, attr, (&mut value as *mut u64).cast()) }
            .result()
            .map_err(driver)?;
        Ok(value)
    };
    Ok(GraphMemory {
        used: read(A::CU_GRAPH_MEM_ATTR_USED_MEM_CURRENT)?,
        reserved: read(A::CU_GRAPH_MEM_ATTR_RESERVED_MEM_CURRENT)?,
        reserved_high: read(A::CU_GRAPH_MEM_ATTR_RESERVED_MEM_HIGH)?,
    })
}
