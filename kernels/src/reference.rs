//! CPU references of the kernels: the same arithmetic, element by element in f32, on plain
//! slices. The GPU check runs each kernel and its reference on the same random data (NaN and inf
//! cases included) and compares; wick-zoo's tests tie the references to its `GradScaler` and
//! `MasterWeights`.

/// `amp_unscale.cu`: multiplies every element of every tensor by `inv_scale` in place and
/// returns whether any product is inf or NaN.
pub fn unscale_and_check(tensors: &mut [&mut [f32]], inv_scale: f32) -> bool {
    let mut found_inf = false;
    for t in tensors.iter_mut() {
        for x in t.iter_mut() {
            *x *= inv_scale;
            found_inf |= !x.is_finite();
        }
    }
    found_inf
}

/// The loss scaler's state on the device.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ScaleState {
    /// Current scale.
    pub scale: f32,
    /// Clean steps in a row.
    pub growth_tracker: i32,
}

/// `amp_update_scale.cu`: PyTorch's `_amp_update_scale_`.
pub fn update_scale(state: &mut ScaleState, found_inf: bool, growth_factor: f32, backoff_factor: f32, interval: i32) {
    if found_inf {
        state.scale *= backoff_factor;
        state.growth_tracker = 0;
    } else {
        let successful = state.growth_tracker + 1;
        if successful == interval {
            let grown = state.scale * growth_factor;
            if grown.is_finite() {
                state.scale = grown;
            }
            state.growth_tracker = 0;
        } else {
            state.growth_tracker = successful;
        }
    }
}

/// AdamW's settings for one step of [`adamw_master`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdamWStep {
    /// Learning rate.
    pub lr: f32,
    /// β1.
    pub beta1: f32,
    /// β2.
    pub beta2: f32,
    /// ε.
    pub eps: f32,
    /// Decoupled weight decay.
    pub weight_decay: f32,
    /// The step number, from 1 (for the bias corrections).
    pub step: i32,
}

impl AdamWStep {
    /// `(1 - β1^t, 1 - β2^t)`, computed on the host and passed to the kernel.
    pub fn bias_corrections(&self) -> (f32, f32) {
        (1.0 - self.beta1.powi(self.step), 1.0 - self.beta2.powi(self.step))
    }
}

/// `amp_adamw.cu`: one AdamW step on f32 masters and moments from the (scaled)
/// gradient; returns the new masters (the kernel also writes them, rounded, into the model's
/// compute copy). Nothing changes when `found_inf`.
pub fn adamw_master(
    master: &mut [f32],
    m: &mut [f32],
    v: &mut [f32],
    grad: &[f32],
    hyper: AdamWStep,
    inv_scale: f32,
    found_inf: bool,
) {
    if found_inf {
        return;
    }
    let (bc1, bc2) = hyper.bias_corrections();
    for i in 0..master.len() {
        let g = grad[i] * inv_scale;
        let mi = hyper.beta1 * m[i] + (1.0 - hyper.beta1) * g;
        let vi = hyper.beta2 * v[i] + (1.0 - hyper.beta2) * g * g;
        let (m_hat, v_hat) = (mi / bc1, vi / bc2);
        m[i] = mi;
        v[i] = vi;
        master[i] = master[i] * (1.0 - hyper.lr * hyper.weight_decay) - hyper.lr * m_hat / (v_hat.sqrt() + hyper.eps);
    }
}
