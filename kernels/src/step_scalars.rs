//! The scalars one multi-tensor optimizer step reads on a CUDA device (`cuda/optim_step.cu`): a
//! block of [`SLOTS`] f32 values in [`Slot`]'s order — AdamW's constants of the step, SGD's
//! learning rate and momentum, gradient clipping's coefficient, and the flags that skip the step.
//! The device computes the block itself (`wick_step_scalars`, from [`Hyper`]'s f64 values, a step
//! counter and clipping's partial sums, all on the device), so a step reads nothing from the host
//! that changes while it runs — what a step captured as a CUDA graph needs; [`host`] computes the
//! same block on the host for the callers that know the step's values there. Both follow
//! [`crate::cpu::optim::AdamW::step_constants`] (f64, each value rounded to f32 once) with the
//! bias corrections' powers by [`crate::cpu::optim::powi`], so the two blocks are the same bits.

use crate::cpu::optim::AdamW;

/// The values of the block, in `optim_step.cu`'s `WickStepSlot` order (a test reads that list).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(usize)]
pub enum Slot {
    /// β1.
    B1,
    /// β2.
    B2,
    /// 1 − β1.
    C1,
    /// 1 − β2.
    C2,
    /// ε.
    Eps,
    /// 1 − lr·weight decay.
    Decay,
    /// lr / (1 − β1^t).
    StepSize,
    /// 1 / √(1 − β2^t).
    InvBc2Sqrt,
    /// The learning rate (SGD).
    Lr,
    /// The momentum (SGD).
    Momentum,
    /// Clipping's coefficient (1 without clipping).
    Factor,
    /// Non-zero: the step changes nothing.
    Skip,
    /// Non-zero: clipping's norm was not finite without a loss scaler's flag to explain it (the
    /// step is skipped and the caller reports the error).
    BadNorm,
}

/// The number of f32 values in the block.
pub const SLOTS: usize = Slot::BadNorm as usize + 1;

/// The f64 hyper-parameters `wick_step_scalars` reads, in `optim_step.cu`'s `WickHyper` order
/// ([`Hyper::to_array`]). SGD leaves the betas at 0 (its block's AdamW values are then unused).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Hyper {
    /// Learning rate.
    pub lr: f64,
    /// AdamW's β1.
    pub beta1: f64,
    /// AdamW's β2.
    pub beta2: f64,
    /// AdamW's ε.
    pub eps: f64,
    /// AdamW's decoupled weight decay.
    pub weight_decay: f64,
    /// SGD's momentum.
    pub momentum: f64,
    /// Clipping's bound (read only when clipping's partial sums are given).
    pub max_norm: f64,
}

/// The number of f64 values of [`Hyper::to_array`].
pub const HYPERS: usize = 7;

impl Hyper {
    /// AdamW's settings.
    pub fn adamw(a: &AdamW) -> Self {
        Hyper {
            lr: a.lr,
            beta1: a.beta1,
            beta2: a.beta2,
            eps: a.eps,
            weight_decay: a.weight_decay,
            momentum: 0.0,
            max_norm: 0.0,
        }
    }

    /// SGD with momentum's settings.
    pub fn sgd(lr: f64, momentum: f64) -> Self {
        Hyper { lr, beta1: 0.0, beta2: 0.0, eps: 0.0, weight_decay: 0.0, momentum, max_norm: 0.0 }
    }

    /// The values in the device's order.
    pub fn to_array(&self) -> [f64; HYPERS] {
        [self.lr, self.beta1, self.beta2, self.eps, self.weight_decay, self.momentum, self.max_norm]
    }

    fn as_adamw(&self) -> AdamW {
        AdamW { lr: self.lr, beta1: self.beta1, beta2: self.beta2, eps: self.eps, weight_decay: self.weight_decay }
    }
}

/// The block for step `step` (from 1) with clipping's coefficient `factor` (1 for none) and the
/// step applied (no skip flag): what `wick_step_scalars` writes for the same values.
pub fn host(hyper: &Hyper, step: i32, factor: f32) -> [f32; SLOTS] {
    let k = hyper.as_adamw().step_constants(step);
    let mut block = [0.0f32; SLOTS];
    for (slot, value) in [
        (Slot::B1, k.b1),
        (Slot::B2, k.b2),
        (Slot::C1, k.c1),
        (Slot::C2, k.c2),
        (Slot::Eps, k.eps),
        (Slot::Decay, k.decay),
        (Slot::StepSize, k.step_size),
        (Slot::InvBc2Sqrt, k.inv_bc2_sqrt),
        (Slot::Lr, hyper.lr as f32),
        (Slot::Momentum, hyper.momentum as f32),
        (Slot::Factor, factor),
    ] {
        block[slot as usize] = value;
    }
    block
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The names of a C enum's members in `source`, in order (between `enum NAME {` and `}`).
    fn members(source: &str, name: &str) -> Vec<String> {
        let start = source.find(&format!("enum {name} {{")).expect("the enum is in the kernel's source");
        let body = &source[start..];
        let body = &body[body.find('{').unwrap_or(0) + 1..body.find('}').unwrap_or(0)];
        body.split(',').map(|m| m.trim().to_string()).filter(|m| !m.is_empty()).collect()
    }

    /// The Rust order is the kernel's: every slot and hyper-parameter at the same place.
    #[test]
    fn orders_match_the_kernel_source() {
        let source = include_str!("cuda/optim_step.cu");
        let slots = members(source, "WickStepSlot");
        let rust = [
            "B1",
            "B2",
            "C1",
            "C2",
            "EPS",
            "DECAY",
            "STEP_SIZE",
            "INV_BC2_SQRT",
            "LR",
            "MOMENTUM",
            "FACTOR",
            "SKIP",
            "BAD_NORM",
        ];
        let want: Vec<String> = rust.iter().map(|n| format!("WICK_SLOT_{n}")).chain(["WICK_SLOTS".into()]).collect();
        assert_eq!(slots, want);
        assert_eq!(rust.len(), SLOTS);
        assert_eq!((Slot::Factor as usize, Slot::Skip as usize), (10, 11));
        let hypers = members(source, "WickHyper");
        let names = ["LR", "BETA1", "BETA2", "EPS", "WEIGHT_DECAY", "MOMENTUM", "MAX_NORM"];
        let want: Vec<String> = names.iter().map(|n| format!("WICK_HYPER_{n}")).chain(["WICK_HYPERS".into()]).collect();
        assert_eq!(hypers, want);
        let h = Hyper { lr: 1.0, beta1: 2.0, beta2: 3.0, eps: 4.0, weight_decay: 5.0, momentum: 6.0, max_norm: 7.0 };
        assert_eq!(h.to_array(), [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0]);
    }

    /// The host's block holds AdamW's constants of the step, SGD's values rounded once, the
    /// factor, and no flag.
    #[test]
    fn host_block_is_the_steps_constants() {
        let a = AdamW { lr: 3e-4, beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.01 };
        for step in [1, 2, 10, 1000] {
            let block = host(&Hyper::adamw(&a), step, 0.25);
            let k = a.step_constants(step);
            assert_eq!(block[Slot::StepSize as usize], k.step_size);
            assert_eq!(block[Slot::InvBc2Sqrt as usize], k.inv_bc2_sqrt);
            assert_eq!(block[Slot::Decay as usize], k.decay);
            assert_eq!(block[Slot::C2 as usize], (1.0f64 - 0.999) as f32);
            assert_eq!(block[Slot::Factor as usize], 0.25);
            assert_eq!((block[Slot::Skip as usize], block[Slot::BadNorm as usize]), (0.0, 0.0));
        }
        let s = host(&Hyper::sgd(0.1, 0.9), 7, 1.0);
        assert_eq!((s[Slot::Lr as usize], s[Slot::Momentum as usize]), (0.1f64 as f32, 0.9f64 as f32));
        assert!(s.iter().all(|v| v.is_finite()), "SGD's unused AdamW values stay finite: {s:?}");
    }
}
