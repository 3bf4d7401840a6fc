// The loss-scale update (PyTorch's `_amp_update_scale_`), on the device: after a step with
// inf/NaN gradients the scale backs off and the growth tracker resets; after `growth_interval`
// clean steps in a row the scale grows (unless growing would overflow f32).
// Launch with one thread.
extern "C" __global__ void wick_amp_update_scale(float* scale, int* growth_tracker, const float* found_inf,
                                                 float growth_factor, float backoff_factor, int growth_interval) {
    if (threadIdx.x != 0 || blockIdx.x != 0) return;
    if (*found_inf != 0.0f) {
        *scale = *scale * backoff_factor;
        *growth_tracker = 0;
    } else {
        const int successful = *growth_tracker + 1;
        if (successful == growth_interval) {
            const float grown = *scale * growth_factor;
            if (isfinite(grown)) *scale = grown;
            *growth_tracker = 0;
        } else {
            *growth_tracker = successful;
        }
    }
}
