//! CPU references of the kernels: the same arithmetic, element by element in f32, on plain
//! slices. The GPU check runs each kernel and its reference on the same random data (NaN and inf
//! cases included) and compares; wick-train's tests tie the references to its `GradScaler` and
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
