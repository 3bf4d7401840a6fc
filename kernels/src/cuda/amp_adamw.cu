// Fused AdamW on f32 master weights: reads the low-precision gradient, unscales it, updates the
// f32 moments and the f32 master, and writes the master back into the model's low-precision
// compute copy — one pass over memory instead of the ~12 elementwise kernels of the unfused
// update. Nothing is written when `*found_inf` is set (the loss scaler skips the step).
//
// The update is PyTorch's AdamW (decoupled weight decay, bias-corrected moments):
//   g = grad * inv_scale;  m = b1 m + (1 - b1) g;  v = b2 v + (1 - b2) g^2
//   master = master (1 - lr wd) - lr (m / bc1) / (sqrt(v / bc2) + eps),  bc_i = 1 - b_i^t
#include "common.cuh"

template <typename T>
__device__ void adamw_master(float* master, float* m, float* v, const T* grad, T* model, long long n, float lr,
                             float beta1, float beta2, float eps, float weight_decay, float bias_correction1,
                             float bias_correction2, const float* inv_scale, const float* found_inf) {
    if (*found_inf != 0.0f) return;
    const float s = *inv_scale;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        const float g = wick_load(grad, i) * s;
        const float mi = beta1 * m[i] + (1.0f - beta1) * g;
        const float vi = beta2 * v[i] + (1.0f - beta2) * g * g;
        const float m_hat = mi / bias_correction1;
        const float v_hat = vi / bias_correction2;
        const float w = master[i] * (1.0f - lr * weight_decay) - lr * m_hat / (sqrtf(v_hat) + eps);
        m[i] = mi;
        v[i] = vi;
        master[i] = w;
        wick_store(model, i, w);
    }
}

#define WICK_ADAMW(name, T)                                                                                      \
    extern "C" __global__ void name(float* master, float* m, float* v, const T* grad, T* model, long long n,     \
                                    float lr, float beta1, float beta2, float eps, float weight_decay,           \
                                    float bias_correction1, float bias_correction2, const float* inv_scale,      \
                                    const float* found_inf) {                                                    \
        adamw_master<T>(master, m, v, grad, model, n, lr, beta1, beta2, eps, weight_decay, bias_correction1,      \
                        bias_correction2, inv_scale, found_inf);                                                 \
    }

WICK_ADAMW(wick_amp_adamw_f32, float)
WICK_ADAMW(wick_amp_adamw_f16, __half)
WICK_ADAMW(wick_amp_adamw_bf16, __nv_bfloat16)
