// Fused multi-tensor unscale and inf/NaN check (PyTorch's
// `_amp_foreach_non_finite_check_and_unscale_`): every gradient element is multiplied by
// `*inv_scale` in place, and `*found_inf` is set to 1.0 if any product is inf or NaN.
//
// One launch covers a table of tensors (table.cuh: each one's device address and element count,
// passed by value); grid.y walks the tensors, grid.x × block strides over each one's elements.
// The scale lives on the device, so no host round trip is needed between backward and the step.
#include "common.cuh"
#include "table.cuh"

template <typename T>
__device__ void unscale_tensors(const WickTable<1>& table, float* found_inf, const float* inv_scale) {
    const float s = *inv_scale;
    for (int t = blockIdx.y; t < table.count; t += gridDim.y) {
        T* g = reinterpret_cast<T*>(table.ptrs[t]);
        const long long n = table.lens[t];
        bool bad = false;
        for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;
             i += (long long)gridDim.x * blockDim.x) {
            const float v = wick_load(g, i) * s;
            bad |= !isfinite(v);
            wick_store(g, i, v);
        }
        // Any thread that saw a non-finite value raises the flag; the value written is the same
        // from every writer, so a plain store suffices.
        if (bad) *found_inf = 1.0f;
    }
}

extern "C" __global__ void wick_amp_unscale_f32(WickTable<1> table, float* found_inf, const float* inv_scale) {
    unscale_tensors<float>(table, found_inf, inv_scale);
}

extern "C" __global__ void wick_amp_unscale_f16(WickTable<1> table, float* found_inf, const float* inv_scale) {
    unscale_tensors<__half>(table, found_inf, inv_scale);
}

extern "C" __global__ void wick_amp_unscale_bf16(WickTable<1> table, float* found_inf, const float* inv_scale) {
    unscale_tensors<__nv_bfloat16>(table, found_inf, inv_scale);
}
