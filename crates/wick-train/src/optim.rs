//! The optimizers ([`Optimizer`]: SGD with momentum, AdamW) and the learning-rate schedule
//! ([`LrSchedule`]), and their updates on candle tensors: applied in place to an f32 tensor (a
//! parameter, or the f32 master of a low-precision one) from its gradient, reading the old
//! optimizer state and writing the new, in one pass (`wick_kernels::cpu::optim`'s loops, in
//! parallel over ranges). The composed form (one candle op per term: a dozen passes over every
//! parameter, each allocating) cost a tenth of some training steps; this is one read of
//! parameter, gradient and state and one write of parameter and state.

use std::sync::Mutex;

use candle_core::{CpuStorage, InplaceOp2, Layout, Result, Tensor};

use wick_kernels::cpu::{optim, par_ranges, SharedMut};
use wick_nn::native::elem::elems;
use wick_nn::native::{narrow_into, read, tensor, with};

pub use wick_kernels::cpu::optim::AdamW;

/// An optimizer's update rule and hyper-parameters.
#[derive(Clone, Copy, PartialEq)]
pub enum Optimizer {
    /// SGD with momentum (PyTorch's form: `b = μ·b + g`, `p -= lr·b`).
    SgdMomentum {
        /// Learning rate.
        lr: f64,
        /// Momentum μ.
        momentum: f64,
    },
    /// AdamW (decoupled weight decay, bias-corrected moments).
    AdamW(AdamW),
}

impl Optimizer {
    /// State vectors per parameter element (momentum buffer; first and second moments).
    pub fn states(&self) -> usize {
        match self {
            Optimizer::SgdMomentum { .. } => 1,
            Optimizer::AdamW(_) => 2,
        }
    }

    /// The learning rate.
    pub fn lr(&self) -> f64 {
        match self {
            Optimizer::SgdMomentum { lr, .. } | Optimizer::AdamW(AdamW { lr, .. }) => *lr,
        }
    }

    /// Sets the learning rate (a schedule's step).
    pub fn set_lr(&mut self, rate: f64) {
        match self {
            Optimizer::SgdMomentum { lr, .. } | Optimizer::AdamW(AdamW { lr, .. }) => *lr = rate,
        }
    }

    /// The hyper-parameters as the CUDA step's scalars take them (`wick_kernels::step_scalars`).
    pub fn hyper(&self) -> wick_kernels::step_scalars::Hyper {
        use wick_kernels::step_scalars::Hyper;
        match self {
            Optimizer::SgdMomentum { lr, momentum } => Hyper::sgd(*lr, *momentum),
            Optimizer::AdamW(a) => Hyper::adamw(a),
        }
    }
}

/// The form training checkpoints record (`SgdMomentum { lr: .., momentum: .. }`, `AdamW { lr:
/// .., beta1: .., .. }`) and compare on resume: written out rather than derived, so that
/// checkpoints saved before AdamW's settings became a struct of their own still resume.
impl std::fmt::Debug for Optimizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Optimizer::SgdMomentum { lr, momentum } => {
                f.debug_struct("SgdMomentum").field("lr", lr).field("momentum", momentum).finish()
            }
            Optimizer::AdamW(AdamW { lr, beta1, beta2, eps, weight_decay }) => f
                .debug_struct("AdamW")
                .field("lr", lr)
                .field("beta1", beta1)
                .field("beta2", beta2)
                .field("eps", eps)
                .field("weight_decay", weight_decay)
                .finish(),
        }
    }
}

struct Update<'a> {
    rule: Optimizer,
    /// The step number, from 1 (AdamW's bias correction).
    step: i32,
    /// Every gradient element is multiplied by it first (gradient clipping's coefficient).
    factor: f32,
    state: Vec<&'a [f32]>,
    next: Mutex<Vec<Vec<f32>>>,
}

impl InplaceOp2 for Update<'_> {
    fn name(&self) -> &'static str {
        "optimizer_step"
    }

    fn cpu_fwd(&self, dst: &mut CpuStorage, dl: &Layout, src: &CpuStorage, sl: &Layout) -> Result<()> {
        let CpuStorage::F32(p) = dst else {
            return Err(candle_core::Error::Msg("optimizer step: the updated tensor is not f32".into()));
        };
        let Some((start, end)) = dl.contiguous_offsets() else {
            return Err(candle_core::Error::Msg("optimizer step: the updated tensor is not contiguous".into()));
        };
        let p = p.get_mut(start..end).ok_or_else(|| candle_core::Error::Msg("optimizer step: out of range".into()))?;
        // A low-precision gradient (an AMP model's) is read as it is, each element widened where
        // the update uses it: a widened copy of every gradient was a pass and an allocation of
        // its own.
        match src {
            CpuStorage::BF16(_) => self.apply(p, elems::<f32, half::bf16>(src, sl)?),
            CpuStorage::F16(_) => self.apply(p, elems::<f32, half::f16>(src, sl)?),
            _ => self.apply(p, &read::<f32>(src, sl)?),
        }
    }
}

impl Update<'_> {
    /// The update of `p` from `g`, each gradient element widened where it is used.
    fn apply<G: Copy + Into<f32> + Sync>(&self, p: &mut [f32], g: &[G]) -> Result<()> {
        let n = p.len();
        if g.len() != n || self.state.len() != self.rule.states() || self.state.iter().any(|s| s.len() != n) {
            return Err(candle_core::Error::Msg(format!("optimizer step: {n} values, {} gradients", g.len())));
        }
        let mut next: Vec<Vec<f32>> = (0..self.rule.states()).map(|_| vec![0f32; n]).collect();
        {
            let pp = SharedMut::new(p);
            let outs: Vec<SharedMut<f32>> = next.iter_mut().map(|v| SharedMut::new(v)).collect();
            let (rule, step, factor) = (self.rule, self.step, self.factor);
            par_ranges(n, 1 << 14, |r| {
                // SAFETY: `par_ranges` hands out disjoint ranges.
                let p = unsafe { pp.range(r.start, r.len()) };
                // SAFETY: as above.
                let out: Vec<&mut [f32]> = outs.iter().map(|o| unsafe { o.range(r.start, r.len()) }).collect();
                let g = &g[r.clone()];
                let mut out = out.into_iter();
                match rule {
                    Optimizer::SgdMomentum { lr, momentum } => {
                        let Some(new) = out.next() else { return };
                        optim::sgd_momentum(p, g, &self.state[0][r.clone()], new, (lr, momentum), factor);
                    }
                    Optimizer::AdamW(hyper) => {
                        let (Some(m_new), Some(v_new)) = (out.next(), out.next()) else { return };
                        let old = (&self.state[0][r.clone()], &self.state[1][r.clone()]);
                        optim::adamw(p, g, old, (m_new, v_new), &hyper, step, factor);
                    }
                }
            });
        }
        *self.next.lock().unwrap_or_else(|e| e.into_inner()) = next;
        Ok(())
    }
}

/// Applies step number `step` (from 1) of `rule` in place to `target` (an f32 CPU tensor) from
/// `grad` (any float dtype, same element count) multiplied by `factor` (gradient clipping's
/// coefficient, [`crate::clip`]; 1 for none) and the old `state` tensors (f32, `rule.states()`
/// of them); returns the new state tensors.
pub fn step(
    target: &Tensor,
    grad: &Tensor,
    state: &[Tensor],
    (rule, step): (Optimizer, i32),
    factor: f32,
) -> Result<Vec<Tensor>> {
    // The new state is made beside the old one, outside candle's allocations: asked for as
    // candle asks for its CPU buffers, so an update the host cannot hold is an error.
    let bytes = target.elem_count().checked_mul(4).and_then(|b| b.checked_mul(state.len()));
    wick_alloc_check::check(bytes).map_err(candle_core::Error::Msg)?;
    let grad = grad.contiguous()?;
    let next = match state {
        [s] => with::<f32, _>(s, |s| run(target, &grad, vec![s], (rule, step), factor))?,
        [m, v] => with::<f32, _>(m, |m| with::<f32, _>(v, |v| run(target, &grad, vec![m, v], (rule, step), factor)))?,
        _ => return Err(candle_core::Error::Msg(format!("optimizer step: {} state tensors", state.len()))),
    };
    next.into_iter().map(|v| tensor(v, target.shape(), candle_core::DType::F32)).collect()
}

fn run(
    target: &Tensor,
    grad: &Tensor,
    state: Vec<&[f32]>,
    (rule, step): (Optimizer, i32),
    factor: f32,
) -> Result<Vec<Vec<f32>>> {
    let op = Update { rule, step, factor, state, next: Mutex::new(Vec::new()) };
    target.inplace_op2(grad, &op)?;
    Ok(op.next.into_inner().unwrap_or_else(|e| e.into_inner()))
}

/// Writes `source` (f32) into `target` (same element count, any float dtype) in place, rounded
/// to `target`'s dtype: the compute copy of a master weight.
pub fn copy_into(target: &Tensor, source: &Tensor) -> Result<()> {
    struct Cast;
    impl InplaceOp2 for Cast {
        fn name(&self) -> &'static str {
            "copy_rounded"
        }
        fn cpu_fwd(&self, dst: &mut CpuStorage, dl: &Layout, src: &CpuStorage, sl: &Layout) -> Result<()> {
            let s = read::<f32>(src, sl)?;
            let Some((start, end)) = dl.contiguous_offsets().filter(|(a, b)| b - a == s.len()) else {
                return Err(candle_core::Error::Msg("copy_rounded: layouts do not match".into()));
            };
            match dst {
                CpuStorage::F32(d) => d[start..end].copy_from_slice(&s),
                CpuStorage::BF16(d) => narrow_into(&s, &mut d[start..end]),
                CpuStorage::F16(d) => narrow_into(&s, &mut d[start..end]),
                CpuStorage::F64(d) => d[start..end].iter_mut().zip(s.iter()).for_each(|(d, v)| *d = *v as f64),
                _ => return Err(candle_core::Error::Msg("copy_rounded: not a float tensor".into())),
            }
            Ok(())
        }
    }
    target.inplace_op2(&source.contiguous()?, &Cast)
}

/// How the learning rate moves with the step (a factor of the optimizer's rate).
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
pub enum LrSchedule {
    /// The optimizer's rate throughout.
    Constant,
    /// Linear warm-up over `warmup` steps to the optimizer's rate, then cosine decay to
    /// `min_factor` of it at step `total` (and `min_factor` after): PyTorch's `LinearLR`
    /// followed by `CosineAnnealingLR`.
    WarmupCosine {
        /// Warm-up steps.
        warmup: u64,
        /// The step the decay ends at.
        total: u64,
        /// The final factor.
        min_factor: f64,
    },
}

impl LrSchedule {
    /// The factor for the update that follows `step` updates.
    pub fn factor(&self, step: u64) -> f64 {
        match *self {
            LrSchedule::Constant => 1.0,
            LrSchedule::WarmupCosine { warmup, total, min_factor } => {
                if step < warmup {
                    return (step + 1) as f64 / warmup as f64;
                }
                let span = total.saturating_sub(warmup).max(1) as f64;
                let progress = ((step - warmup) as f64 / span).min(1.0);
                min_factor + (1.0 - min_factor) * 0.5 * (1.0 + (std::f64::consts::PI * progress).cos())
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The form checkpoints saved before AdamW's settings became a struct recorded (the derived
    /// `Debug` of the struct variants): resume compares it as text.
    #[test]
    fn the_recorded_form_is_the_one_earlier_checkpoints_hold() {
        let adamw = Optimizer::AdamW(AdamW { lr: 1e-3, beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.0 });
        assert_eq!(format!("{adamw:?}"), "AdamW { lr: 0.001, beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.0 }");
        let sgd = Optimizer::SgdMomentum { lr: 0.1, momentum: 0.9 };
        assert_eq!(format!("{sgd:?}"), "SgdMomentum { lr: 0.1, momentum: 0.9 }");
        let mut scheduled = adamw;
        scheduled.set_lr(0.5);
        assert_eq!((adamw.lr(), scheduled.lr(), scheduled.states()), (1e-3, 0.5, 2));
    }
}
