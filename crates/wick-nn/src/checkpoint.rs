//! Activation (gradient) checkpointing: a segment of layers keeps none of its intermediate
//! tensors after the forward pass and recomputes them during backward, trading compute for
//! activation memory.
//!
//! candle has no hook for this, so a segment is attached to the graph through a custom op: the
//! forward runs the segment on detached inputs (no graph is kept) and the op, applied to the
//! segment's input, hands that result over as its own output; the op's backward recomputes the segment with gradients
//! on, back-propagates the incoming gradient through it, returns the input's gradient, and sets
//! the parameters' gradients aside. [`Checkpointing::backward`] runs the whole backward pass and
//! merges those into the gradient store, so callers see the same gradients as without
//! checkpointing.
//!
//! The same segments are where parameters sharded over processes (ZeRO stage 3, in wick-train)
//! come whole: a context made with [`Checkpointing::sharded`] asks its [`ShardedBlocks`] for a
//! block's full parameters just before the block runs forward, drops them after it, asks again
//! in backward, and hands the block's parameter gradients over as soon as its backward is done.
//!
//! Where the blocks say so ([`ShardedBlocks::keeps_activations`]), a sharded block is not
//! recomputed: it runs forward with its graph on the gathered parameters, whose values are then
//! released (their pages go back; the graph keeps the tensors), and an identity node on its
//! output gathers them again into the same tensors when backward reaches it — before any op of
//! the block, which all lie between that node and the block's input. Each gathered tensor's
//! values are released again once its gradient is complete (every op that read it is done), and
//! the block's gradients are handed over when the last of them is; those of parameters that got
//! none are handed over at the end of backward. PyTorch's FSDP without checkpointing: one
//! forward pass per block fewer, every block's activations kept.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use candle_core::backprop::GradStore;
use candle_core::{CpuStorage, CustomOp1, Layout, Result, Shape, Tensor, TensorId, Var};

use crate::fused::Handoff;
use crate::params::Params;

/// A segment's computation: input and weights (in the order they were given) to output.
pub type SegmentFn = dyn Fn(&Tensor, &[Tensor]) -> Result<Tensor> + Send + Sync;

type Stash = Arc<Mutex<HashMap<TensorId, Tensor>>>;

/// Where a block's parameters come from when each process keeps only a shard of them: the
/// segments of a [`Checkpointing::sharded`] context call it with the model's own parameter
/// tensors (by identity) and never read those.
pub trait ShardedBlocks: Send + Sync {
    /// The full current values of `weights` (the model's parameters), one fresh variable each
    /// (`Var::from_vec`: tracked, with no copy made to track it), in their shapes and dtypes.
    /// Every process calls this for the same block at the same point.
    fn gather(&self, weights: &[Tensor]) -> Result<Vec<Tensor>>;
    /// The block's gradients of `weights` (`None` where it gave none), handed over as soon as
    /// the block's backward is done: the implementation reduces them to their owners.
    fn reduce(&self, weights: &[Tensor], grads: Vec<Option<Tensor>>) -> Result<()>;
    /// Whether the blocks keep their activations (no recomputation in backward): then
    /// [`ShardedBlocks::release`] and [`ShardedBlocks::regather`] are called. Default: no.
    fn keeps_activations(&self) -> bool {
        false
    }
    /// Gives back the memory of gathered values (tensors [`ShardedBlocks::gather`] returned)
    /// that nothing reads until they are gathered again: they read as zeros meanwhile. Default:
    /// their pages go back ([`crate::pages::release`]).
    fn release(&self, gathered: &[Tensor]) -> Result<()> {
        gathered.iter().try_for_each(crate::pages::release)
    }
    /// Writes the full current values of `weights` into `into`, the tensors an earlier
    /// [`ShardedBlocks::gather`] of the same weights returned (released since). Every process
    /// calls this for the same block at the same point.
    fn regather(&self, _weights: &[Tensor], _into: &[Tensor]) -> Result<()> {
        Err(candle_core::Error::Msg("these sharded blocks recompute; they do not gather again in place".into()))
    }
}

/// A block run with its graph kept on gathered parameters ([`ShardedBlocks::keeps_activations`]).
struct KeptBlock {
    /// The model's parameters (by identity, for the shards).
    weights: Vec<Tensor>,
    /// Their gradients, as they complete.
    grads: Vec<Option<Tensor>>,
    /// Gathered tensors whose gradient is not complete yet (0: handed over).
    waiting: usize,
}

/// The kept blocks of a context: in forward order, and which block and slot each gathered
/// tensor whose gradient is not complete yet is.
#[derive(Default)]
struct Kept {
    blocks: Vec<KeptBlock>,
    slots: HashMap<TensorId, (usize, usize)>,
}

impl Kept {
    /// Takes a gathered tensor's complete gradient out of `store`, releases its values, and
    /// hands its block's gradients over once they are all complete. `false` when `var` is not
    /// a gathered tensor of this context.
    fn ready(&mut self, var: &Tensor, store: &mut GradStore, blocks: &dyn ShardedBlocks) -> Result<bool> {
        let Some((b, slot)) = self.slots.remove(&var.id()) else { return Ok(false) };
        let block = &mut self.blocks[b];
        block.grads[slot] = store.remove(var).map(|g| g.detach());
        blocks.release(std::slice::from_ref(var))?;
        block.waiting -= 1;
        if block.waiting == 0 {
            blocks.reduce(&block.weights, std::mem::take(&mut block.grads))?;
        }
        Ok(true)
    }

    /// Hands over the blocks whose gradients did not all complete (parameters without one), the
    /// last block first.
    fn finish(self, blocks: &dyn ShardedBlocks) -> Result<()> {
        for block in self.blocks.into_iter().rev().filter(|b| b.waiting > 0) {
            blocks.reduce(&block.weights, block.grads)?;
        }
        Ok(())
    }
}

/// The identity on a kept block's output: its backward gathers the block's parameters again
/// before any op of the block runs backward.
struct Regather {
    blocks: Arc<dyn ShardedBlocks>,
    weights: Vec<Tensor>,
    gathered: Vec<Tensor>,
}

impl CustomOp1 for Regather {
    fn name(&self) -> &'static str {
        "wick-regather"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        Ok((crate::fused::materialize_cpu(s, l)?, l.shape().clone()))
    }

    fn cuda_fwd(&self, s: &candle_core::CudaStorage, l: &Layout) -> Result<(candle_core::CudaStorage, Shape)> {
        Ok((crate::fused::materialize_cuda(s, l)?, l.shape().clone()))
    }

    fn bwd(&self, _arg: &Tensor, _res: &Tensor, grad_res: &Tensor) -> Result<Option<Tensor>> {
        self.blocks.regather(&self.weights, &self.gathered)?;
        Ok(Some(grad_res.clone()))
    }
}

struct SegmentOp {
    f: Arc<SegmentFn>,
    weights: Vec<Tensor>,
    result: Handoff,
    stash: Stash,
    sharded: Option<Arc<dyn ShardedBlocks>>,
}

impl CustomOp1 for SegmentOp {
    fn name(&self) -> &'static str {
        "wick-checkpoint"
    }

    fn cpu_fwd(&self, _: &CpuStorage, _: &Layout) -> Result<(CpuStorage, Shape)> {
        self.result.cpu()
    }

    fn cuda_fwd(&self, _: &candle_core::CudaStorage, _: &Layout) -> Result<(candle_core::CudaStorage, Shape)> {
        self.result.cuda()
    }

    fn bwd(&self, arg: &Tensor, _res: &Tensor, grad_res: &Tensor) -> Result<Option<Tensor>> {
        let input = Var::from_tensor(&arg.detach())?;
        if let Some(sharded) = &self.sharded {
            // The block's parameters whole again, for this backward only.
            let gathered = sharded
                .gather(&self.weights)?
                .into_iter()
                .map(|t| Var::from_tensor(&t).map(|v| v.as_tensor().clone()))
                .collect::<Result<Vec<_>>>()?;
            let output = (self.f)(input.as_tensor(), &gathered)?;
            let mut grads = (output * grad_res.detach())?.sum_all()?.backward()?;
            let weight_grads = gathered.iter().map(|w| grads.remove(w)).collect();
            drop(gathered);
            sharded.reduce(&self.weights, weight_grads)?;
            return Ok(grads.get(input.as_tensor()).map(|g| g.detach()));
        }
        let output = (self.f)(input.as_tensor(), &self.weights)?;
        let grads = (output * grad_res.detach())?.sum_all()?.backward()?;
        let mut stash = self.stash.lock().unwrap_or_else(|p| p.into_inner());
        for w in &self.weights {
            // Detached, so the stash does not keep the recomputed segment's graph alive.
            if let Some(g) = grads.get(w).map(|g| g.detach()) {
                let total = match stash.remove(&w.id()) {
                    Some(previous) => (previous + g)?,
                    None => g.clone(),
                };
                stash.insert(w.id(), total);
            }
        }
        Ok(grads.get(input.as_tensor()).map(|g| g.detach()))
    }
}

/// Runs a block whose forward updates state (batch-norm statistics), checkpointed or not.
/// `apply(spec, x, weights, update)` is told to update the state on the forward run only, never
/// when the block is recomputed during backward.
pub fn run_stateful<S: Clone + Send + Sync + 'static>(
    checkpoint: Option<&Checkpointing>,
    x: &Tensor,
    weights: &[Tensor],
    spec: &S,
    apply: impl Fn(&S, &Tensor, &[Tensor], bool) -> Result<Tensor> + Send + Sync + 'static,
) -> Result<Tensor> {
    match checkpoint {
        Some(ckpt) => {
            let spec = spec.clone();
            let first = AtomicBool::new(true);
            ckpt.segment(x, weights.to_vec(), move |x, w| apply(&spec, x, w, first.swap(false, Ordering::SeqCst)))
        }
        None => apply(spec, x, weights, true),
    }
}

/// A checkpointing context for one training step (or many: its stash empties at each backward).
#[derive(Default, Clone)]
pub struct Checkpointing {
    stash: Stash,
    sharded: Option<Arc<dyn ShardedBlocks>>,
    /// The weights the segments of this context take (by identity).
    segment_weights: Arc<Mutex<HashSet<TensorId>>>,
    /// Sharded blocks run with their graphs kept ([`ShardedBlocks::keeps_activations`]).
    kept: Arc<Mutex<Kept>>,
}

impl Checkpointing {
    /// A new context.
    pub fn new() -> Self {
        Self::default()
    }

    /// A context whose segments take their parameters from `blocks` (each process holding a
    /// shard of them): gathered before a block's forward and dropped after it, gathered again
    /// for its backward, its gradients handed to `blocks` when its backward is done (they are
    /// not in the gradient store [`Checkpointing::backward`] returns).
    pub fn sharded(blocks: Arc<dyn ShardedBlocks>) -> Self {
        Checkpointing { sharded: Some(blocks), ..Self::default() }
    }

    /// Runs `f(x, weights)` without keeping its intermediates; they are recomputed in backward.
    /// `weights` are the (trainable) tensors `f` uses; anything else it captures is a constant.
    pub fn segment(
        &self,
        x: &Tensor,
        weights: Vec<Tensor>,
        f: impl Fn(&Tensor, &[Tensor]) -> Result<Tensor> + Send + Sync + 'static,
    ) -> Result<Tensor> {
        if let Some(sharded) = self.sharded.as_ref().filter(|s| s.keeps_activations()) {
            return self.kept_segment(sharded, x, weights, f);
        }
        let detached: Vec<Tensor> = match &self.sharded {
            Some(sharded) => sharded.gather(&weights)?.iter().map(Tensor::detach).collect(),
            None => weights.iter().map(|w| w.detach()).collect(),
        };
        let y = f(&x.detach(), &detached)?;
        drop(detached);
        self.segment_weights.lock().unwrap_or_else(|p| p.into_inner()).extend(weights.iter().map(Tensor::id));
        // The op must be on the graph even when the input itself is not tracked (raw images).
        let input = if x.track_op() { x.clone() } else { Var::from_tensor(x)?.as_tensor().clone() };
        input.apply_op1(SegmentOp {
            f: Arc::new(f),
            weights,
            result: Handoff::new("wick-checkpoint", y),
            stash: self.stash.clone(),
            sharded: self.sharded.clone(),
        })
    }

    /// A sharded segment that keeps its graph (see the module's documentation).
    fn kept_segment(
        &self,
        sharded: &Arc<dyn ShardedBlocks>,
        x: &Tensor,
        weights: Vec<Tensor>,
        f: impl Fn(&Tensor, &[Tensor]) -> Result<Tensor>,
    ) -> Result<Tensor> {
        let gathered = sharded.gather(&weights)?;
        let y = f(x, &gathered)?;
        sharded.release(&gathered)?;
        if !y.track_op() {
            // Nothing of the block is back-propagated: nothing to gather again or reduce.
            return Ok(y);
        }
        let mut kept = self.kept.lock().unwrap_or_else(|p| p.into_inner());
        let b = kept.blocks.len();
        for (slot, g) in gathered.iter().enumerate() {
            kept.slots.insert(g.id(), (b, slot));
        }
        let block = KeptBlock { weights: weights.clone(), grads: vec![None; gathered.len()], waiting: gathered.len() };
        kept.blocks.push(block);
        drop(kept);
        y.apply_op1(Regather { blocks: sharded.clone(), weights, gathered })
    }

    /// Back-propagates `loss` and adds the checkpointed segments' parameter gradients.
    pub fn backward(&self, loss: &Tensor, params: &Params) -> Result<GradStore> {
        self.backward_with_hook(loss, params, &mut |_, _| Ok(()))
    }

    /// [`Checkpointing::backward`], calling `ready` as candle's `Tensor::backward_with_hook`
    /// does for each variable of the outer graph once its gradient there is complete — except
    /// a segment's weight: its gradient comes from the segments' own backward passes, which
    /// may run after the outer graph's part of it (a weight read inside a segment and outside
    /// one), and is in the store this returns, whole.
    pub fn backward_with_hook(
        &self,
        loss: &Tensor,
        params: &Params,
        ready: &mut dyn FnMut(&Tensor, &mut GradStore) -> Result<()>,
    ) -> Result<GradStore> {
        let mut grads = {
            // A copy: a segment recomputed in backward may record its weights again.
            let inside = self.segment_weights.lock().unwrap_or_else(|p| p.into_inner()).clone();
            let mut kept = self.kept.lock().unwrap_or_else(|p| p.into_inner());
            let sharded = self.sharded.as_deref();
            let mut outer = |var: &Tensor, store: &mut GradStore| {
                if inside.contains(&var.id()) {
                    return Ok(());
                }
                if let Some(blocks) = sharded {
                    if kept.ready(var, store, blocks)? {
                        return Ok(());
                    }
                }
                ready(var, store)
            };
            let grads = loss.backward_with_hook(&mut outer);
            // The blocks are not kept for the next backward; a failed one hands nothing over
            // (the caller stops the step on every process).
            let blocks = std::mem::take(&mut *kept);
            let grads = grads?;
            if let Some(sharded) = sharded {
                blocks.finish(sharded)?;
            }
            grads
        };
        let mut stash = self.stash.lock().unwrap_or_else(|p| p.into_inner());
        for (_, var) in params.iter() {
            if let Some(g) = stash.remove(&var.id()) {
                let total = match grads.remove(var.as_tensor()) {
                    Some(existing) => (existing + g)?,
                    None => g,
                };
                grads.insert(var.as_tensor(), total);
            }
        }
        stash.clear();
        self.segment_weights.lock().unwrap_or_else(|p| p.into_inner()).clear();
        Ok(grads)
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::AtomicBool;

    use candle_core::{DType, Device};

    use super::*;

    /// Stands in for the shards of one process: gathers copies of the weights, writes them back
    /// into released tensors, and records every call and the gradients handed over.
    struct Fake {
        keep: bool,
        log: Mutex<Vec<&'static str>>,
        reduced: Mutex<HashMap<TensorId, Tensor>>,
        fail_regather: AtomicBool,
    }

    impl Fake {
        fn new(keep: bool) -> Arc<Self> {
            Arc::new(Fake {
                keep,
                log: Mutex::default(),
                reduced: Mutex::default(),
                fail_regather: AtomicBool::new(false),
            })
        }

        fn log(&self, what: &'static str) {
            self.log.lock().unwrap().push(what);
        }
    }

    impl ShardedBlocks for Fake {
        fn gather(&self, weights: &[Tensor]) -> Result<Vec<Tensor>> {
            self.log("gather");
            weights.iter().map(|w| Ok(Var::from_tensor(&w.detach())?.as_tensor().clone())).collect()
        }

        fn reduce(&self, weights: &[Tensor], grads: Vec<Option<Tensor>>) -> Result<()> {
            self.log("reduce");
            for (w, g) in weights.iter().zip(grads) {
                if let Some(g) = g {
                    self.reduced.lock().unwrap().insert(w.id(), g);
                }
            }
            Ok(())
        }

        fn keeps_activations(&self) -> bool {
            self.keep
        }

        fn release(&self, gathered: &[Tensor]) -> Result<()> {
            self.log("release");
            gathered.iter().try_for_each(crate::pages::release)
        }

        fn regather(&self, weights: &[Tensor], into: &[Tensor]) -> Result<()> {
            if self.fail_regather.load(Ordering::SeqCst) {
                return Err(candle_core::Error::Msg("the gather failed".into()));
            }
            self.log("regather");
            for (w, t) in weights.iter().zip(into) {
                crate::pages::reclaim(t)?;
                t.slice_set(&w.detach(), 0, 0)?;
            }
            Ok(())
        }
    }

    fn block(x: &Tensor, w: &[Tensor]) -> Result<Tensor> {
        x.matmul(&w[0])?.tanh()
    }

    /// Two 64 × 64 weights (16 KiB each: whole pages to release) and an input.
    fn setup() -> (Var, Var, Var) {
        let dev = Device::Cpu;
        let w = |seed: f64| Var::from_tensor(&(Tensor::rand(-0.2f32, 0.2, (64, 64), &dev).unwrap() * seed).unwrap());
        (Var::from_tensor(&Tensor::rand(-1f32, 1., (4, 64), &dev).unwrap()).unwrap(), w(1.0).unwrap(), w(0.5).unwrap())
    }

    fn bits(t: &Tensor) -> Vec<u32> {
        t.flatten_all()
            .unwrap()
            .to_dtype(DType::F32)
            .unwrap()
            .to_vec1::<f32>()
            .unwrap()
            .iter()
            .map(|v| v.to_bits())
            .collect()
    }

    /// Kept sharded blocks give the plain graph's gradients to the bit (a block's weights read
    /// as zeros between its forward pass and its regather: a missing regather changes them —
    /// checked by hand), each block gathered once for forward and once again for backward, the
    /// later block first, each gathered tensor released after forward and after its gradient,
    /// and each block's gradients handed over once; recomputing blocks give the same gradients.
    #[test]
    fn kept_blocks_gather_again_release_and_hand_over_as_the_plain_graph() {
        let (x, w1, w2) = setup();
        let loss = block(&block(x.as_tensor(), &[w1.as_tensor().clone()]).unwrap(), &[w2.as_tensor().clone()])
            .unwrap()
            .sum_all()
            .unwrap();
        let plain = loss.backward().unwrap();
        for keep in [true, false] {
            let fake = Fake::new(keep);
            let ckpt = Checkpointing::sharded(fake.clone());
            let h = ckpt.segment(x.as_tensor(), vec![w1.as_tensor().clone()], block).unwrap();
            let y = ckpt.segment(&h, vec![w2.as_tensor().clone()], block).unwrap();
            let grads = ckpt.backward(&y.sum_all().unwrap(), &Params::default()).unwrap();
            assert_eq!(bits(grads.get(x.as_tensor()).unwrap()), bits(plain.get(x.as_tensor()).unwrap()), "keep {keep}");
            let reduced = fake.reduced.lock().unwrap();
            for w in [&w1, &w2] {
                let want = bits(plain.get(w.as_tensor()).unwrap());
                assert_eq!(bits(&reduced[&w.as_tensor().id()]), want, "keep {keep}");
                assert!(grads.get(w.as_tensor()).is_none(), "handed over, not in the store");
            }
            let log = fake.log.lock().unwrap().clone();
            let want: &[&str] = if keep {
                // Forward: gather and release each block; backward: the second block gathered
                // again, released at its gradient and reduced, then the first.
                &[
                    "gather", "release", "gather", "release", "regather", "release", "reduce", "regather", "release",
                    "reduce",
                ]
            } else {
                // Recomputed: gathered for forward, and again inside each segment's backward.
                &["gather", "gather", "gather", "reduce", "gather", "reduce"]
            };
            assert_eq!(log, want, "keep {keep}");
        }
    }

    /// A failed gather in backward is an error, not gradients from released (zero) values, and
    /// the context is usable again: the next step's gradients are right.
    #[test]
    fn a_failed_regather_is_an_error_and_the_next_step_is_right() {
        let (x, w1, w2) = setup();
        let fake = Fake::new(true);
        let ckpt = Checkpointing::sharded(fake.clone());
        let run = || -> Result<GradStore> {
            let h = ckpt.segment(x.as_tensor(), vec![w1.as_tensor().clone()], block)?;
            let y = ckpt.segment(&h, vec![w2.as_tensor().clone()], block)?;
            ckpt.backward(&y.sum_all()?, &Params::default())
        };
        fake.fail_regather.store(true, Ordering::SeqCst);
        let err = run().err().map(|e| e.to_string()).unwrap_or_default();
        assert!(err.contains("the gather failed"), "{err}");
        assert!(fake.reduced.lock().unwrap().is_empty(), "nothing handed over from a failed backward");
        fake.fail_regather.store(false, Ordering::SeqCst);
        let grads = run().unwrap();
        let loss = block(&block(x.as_tensor(), &[w1.as_tensor().clone()]).unwrap(), &[w2.as_tensor().clone()])
            .unwrap()
            .sum_all()
            .unwrap();
        let plain = loss.backward().unwrap();
        assert_eq!(bits(grads.get(x.as_tensor()).unwrap()), bits(plain.get(x.as_tensor()).unwrap()));
        let reduced = fake.reduced.lock().unwrap();
        assert_eq!(bits(&reduced[&w1.as_tensor().id()]), bits(plain.get(w1.as_tensor()).unwrap()));
    }
}
