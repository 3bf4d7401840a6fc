//! CPU references of the kernels: the same arithmetic, element by element in f32, on plain
//! slices. The GPU check runs each kernel and its reference on the same random data (NaN and inf
//! cases included) and compares; wick-train's tests tie the references to its `GradScaler` and
//! `MasterWeights`.

use crate::cpu::optim::AdamW;

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

/// `amp_adamw.cu`: AdamW step `step` (from 1) on f32 masters and moments from the (scaled)
/// gradient, with `hyper` in f32 and its bias corrections computed in f64 as the launcher passes
/// them ([`AdamW::bias_corrections`]); returns the new masters (the kernel also writes them,
/// rounded, into the model's compute copy). Nothing changes when `found_inf`.
#[allow(clippy::too_many_arguments)]
pub fn adamw_master(
    master: &mut [f32],
    m: &mut [f32],
    v: &mut [f32],
    grad: &[f32],
    hyper: &AdamW,
    step: i32,
    inv_scale: f32,
    found_inf: bool,
) {
    if found_inf {
        return;
    }
    let (bc1, bc2) = hyper.bias_corrections(step);
    let (bc1, bc2) = (bc1 as f32, bc2 as f32);
    let (lr, beta1, beta2, eps, weight_decay) =
        (hyper.lr as f32, hyper.beta1 as f32, hyper.beta2 as f32, hyper.eps as f32, hyper.weight_decay as f32);
    for i in 0..master.len() {
        let g = grad[i] * inv_scale;
        let mi = beta1 * m[i] + (1.0 - beta1) * g;
        let vi = beta2 * v[i] + (1.0 - beta2) * g * g;
        let (m_hat, v_hat) = (mi / bc1, vi / bc2);
        m[i] = mi;
        v[i] = vi;
        master[i] = master[i] * (1.0 - lr * weight_decay) - lr * m_hat / (v_hat.sqrt() + eps);
    }
}
