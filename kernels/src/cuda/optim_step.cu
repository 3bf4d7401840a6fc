// The optimizer's update in one pass, on a CUDA device: SGD with momentum and AdamW on an f32
// tensor (a parameter, or the f32 master of a low-precision one) from its gradient (f32, f16 or
// bf16) and the old state, writing the new state (beside the old, as the host's update does, or
// in place when given the same buffers: the trainer's use) and — for a low-precision model — the
// new value into the model's compute copy. The same arithmetic, in the same order and rounding, as the
// host's loops (`wick_kernels::cpu::optim::{sgd_momentum, adamw}`): every product and sum is
// rounded on its own (`__fmul_rn`, `__fadd_rn`: no fused multiply-add that the host does not
// do), and `sqrtf` and `/` are IEEE-rounded (nvcc's defaults), so the device's step is the
// host's to the bit. One launch per parameter replaces the dozen composed tensor ops (each a
// kernel and an allocation) the device update was; the multi-tensor forms (end of the file) take
// every parameter of one gradient dtype in one launch.
//
//   SGD with momentum (PyTorch's form):  b = mu b + g;  p = p - lr b
//   AdamW:  m = b1 m + c1 g;  v = b2 v + c2 g^2;  p = p decay - step_size m / (sqrt(v) inv_bc2_sqrt + eps)
//           (c_i = 1 - b_i, decay = 1 - lr wd, step_size = lr / bc1, inv_bc2_sqrt = 1 / sqrt(bc2),
//           computed on the host in f64 and rounded to f32 as the host's loop does)
#include "common.cuh"

// No compute copy: the f32 tensor is the parameter itself.
struct NoCopy {};
__device__ __forceinline__ void wick_copy(NoCopy*, long long, float) {}
template <typename T>
__device__ __forceinline__ void wick_copy(T* model, long long i, float v) {
    wick_store(model, i, v);
}

// One element of SGD with momentum.
// `factor` multiplies the gradient as it is read: gradient clipping's coefficient (the host's
// loops multiply by it too; 1 leaves every bit as it was).
template <typename G, typename M>
__device__ __forceinline__ void sgd_at(float* p, const float* b, float* b_new, const G* g, M* model, long long i, float lr,
                                       float momentum, float factor) {
    const float bi = __fadd_rn(__fmul_rn(momentum, b[i]), __fmul_rn(wick_load(g, i), factor));
    const float w = __fsub_rn(p[i], __fmul_rn(lr, bi));
    b_new[i] = bi;
    p[i] = w;
    wick_copy(model, i, w);
}

template <typename G, typename M>
__device__ void sgd_momentum(float* p, const float* b, float* b_new, const G* g, M* model, long long n, float lr,
                             float momentum) {
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        sgd_at(p, b, b_new, g, model, i, lr, momentum, 1.0f);
    }
}

// AdamW's constants, as the host computes them (f64, rounded to f32).
struct AdamWConsts {
    float b1, b2, c1, c2, eps, decay, step_size, inv_bc2_sqrt;
};

// One element of AdamW.
template <typename G, typename M>
__device__ __forceinline__ void adamw_at(float* p, const float* m, const float* v, float* m_new, float* v_new, const G* g,
                                         M* model, long long i, const AdamWConsts& k, float factor) {
    const float gi = __fmul_rn(wick_load(g, i), factor);
    const float mi = __fadd_rn(__fmul_rn(k.b1, m[i]), __fmul_rn(k.c1, gi));
    const float vi = __fadd_rn(__fmul_rn(k.b2, v[i]), __fmul_rn(__fmul_rn(k.c2, gi), gi));
    const float denom = __fadd_rn(__fmul_rn(sqrtf(vi), k.inv_bc2_sqrt), k.eps);
    const float w = __fsub_rn(__fmul_rn(p[i], k.decay), __fdiv_rn(__fmul_rn(k.step_size, mi), denom));
    m_new[i] = mi;
    v_new[i] = vi;
    p[i] = w;
    wick_copy(model, i, w);
}

template <typename G, typename M>
__device__ void adamw(float* p, const float* m, const float* v, float* m_new, float* v_new, const G* g, M* model,
                      long long n, float b1, float b2, float c1, float c2, float eps, float decay, float step_size,
                      float inv_bc2_sqrt) {
    const AdamWConsts k{b1, b2, c1, c2, eps, decay, step_size, inv_bc2_sqrt};
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        adamw_at(p, m, v, m_new, v_new, g, model, i, k, 1.0f);
    }
}

// Multi-tensor forms: every parameter of one gradient dtype in one launch, the state in place
// (the trainer's use). Tensor t's buffers are at ptrs[t·K + j] — SGD (K = 4): parameter or
// master, momentum buffer, gradient, model copy (0: none); AdamW (K = 5): parameter or master,
// first moment, second moment, gradient, model copy — and its length at lens[t]. Grid: y over
// the tensors, x grid-stride within each. `skip` (null: none) is a device flag, the loss
// scaler's `found_inf`: when it is non-zero the launch changes nothing, so a step with non-finite
// gradients is skipped without the host reading the flag first. `factor` multiplies every
// gradient element as it is read (gradient clipping's coefficient; 1 for none).
template <typename G, typename M>
__device__ void sgd_multi(const long long* ptrs, const long long* lens, int count, float lr, float momentum,
                          float factor, const float* skip) {
    if (skip && *skip != 0.0f) return;
    for (int t = blockIdx.y; t < count; t += gridDim.y) {
        float* p = (float*)ptrs[4 * t];
        float* b = (float*)ptrs[4 * t + 1];
        const G* g = (const G*)ptrs[4 * t + 2];
        M* model = (M*)ptrs[4 * t + 3];
        for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < lens[t];
             i += (long long)gridDim.x * blockDim.x) {
            sgd_at(p, b, b, g, model, i, lr, momentum, factor);
        }
    }
}

template <typename G, typename M>
__device__ void adamw_multi(const long long* ptrs, const long long* lens, int count, const AdamWConsts& k,
                            float factor, const float* skip) {
    if (skip && *skip != 0.0f) return;
    for (int t = blockIdx.y; t < count; t += gridDim.y) {
        float* p = (float*)ptrs[5 * t];
        float* m = (float*)ptrs[5 * t + 1];
        float* v = (float*)ptrs[5 * t + 2];
        const G* g = (const G*)ptrs[5 * t + 3];
        M* model = (M*)ptrs[5 * t + 4];
        for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < lens[t];
             i += (long long)gridDim.x * blockDim.x) {
            adamw_at(p, m, v, m, v, g, model, i, k, factor);
        }
    }
}

#define WICK_SGD(name, G, M)                                                                                     \
    extern "C" __global__ void name(float* p, const float* b, float* b_new, const G* g, M* model, long long n,   \
                                    float lr, float momentum) {                                                 \
        sgd_momentum<G, M>(p, b, b_new, g, model, n, lr, momentum);                                              \
    }

#define WICK_ADAMW_STEP(name, G, M)                                                                              \
    extern "C" __global__ void name(float* p, const float* m, const float* v, float* m_new, float* v_new,        \
                                    const G* g, M* model, long long n, float b1, float b2, float c1, float c2,  \
                                    float eps, float decay, float step_size, float inv_bc2_sqrt) {              \
        adamw<G, M>(p, m, v, m_new, v_new, g, model, n, b1, b2, c1, c2, eps, decay, step_size, inv_bc2_sqrt);    \
    }

// The gradient's dtype is the model's: an f32 parameter (no copy), or an f16 / bf16 model whose
// f32 master is updated and copied back.
WICK_SGD(wick_sgd_momentum_f32, float, NoCopy)
WICK_SGD(wick_sgd_momentum_f16, __half, __half)
WICK_SGD(wick_sgd_momentum_bf16, __nv_bfloat16, __nv_bfloat16)
WICK_ADAMW_STEP(wick_adamw_step_f32, float, NoCopy)
WICK_ADAMW_STEP(wick_adamw_step_f16, __half, __half)
WICK_ADAMW_STEP(wick_adamw_step_bf16, __nv_bfloat16, __nv_bfloat16)

#define WICK_SGD_MULTI(name, G, M)                                                                               \
    extern "C" __global__ void name(const long long* ptrs, const long long* lens, int count, float lr,          \
                                    float momentum, float factor, const float* skip) {                          \
        sgd_multi<G, M>(ptrs, lens, count, lr, momentum, factor, skip);                                          \
    }

#define WICK_ADAMW_MULTI(name, G, M)                                                                             \
    extern "C" __global__ void name(const long long* ptrs, const long long* lens, int count, float b1, float b2, \
                                    float c1, float c2, float eps, float decay, float step_size,                \
                                    float inv_bc2_sqrt, float factor, const float* skip) {                      \
        adamw_multi<G, M>(ptrs, lens, count, AdamWConsts{b1, b2, c1, c2, eps, decay, step_size, inv_bc2_sqrt},   \
                          factor, skip);                                                                        \
    }

WICK_SGD_MULTI(wick_sgd_momentum_multi_f32, float, NoCopy)
WICK_SGD_MULTI(wick_sgd_momentum_multi_f16, __half, __half)
WICK_SGD_MULTI(wick_sgd_momentum_multi_bf16, __nv_bfloat16, __nv_bfloat16)
WICK_ADAMW_MULTI(wick_adamw_multi_f32, float, NoCopy)
WICK_ADAMW_MULTI(wick_adamw_multi_f16, __half, __half)
WICK_ADAMW_MULTI(wick_adamw_multi_bf16, __nv_bfloat16, __nv_bfloat16)

// Gradient clipping's squared norm, sum of g^2 over every gradient of one dtype in one launch:
// tensor t's gradient at ptrs[t], its length at lens[t]. Block (x, t) sums its grid-stride share
// in f64 (each element widened to f32, then to f64, as the host's sum reads it) and writes the
// sum to partials[t * gridDim.x + x]; the host adds the partials up in order. No atomics: the
// same bits every run.
template <typename G>
__device__ void squares_multi(const long long* ptrs, const long long* lens, int count, double* partials) {
    __shared__ double scratch[32];
    for (int t = blockIdx.y; t < count; t += gridDim.y) {
        const G* g = (const G*)ptrs[t];
        double s = 0.0;
        WICK_FOR_EACH(i, lens[t]) {
            const double v = (double)wick_load(g, i);
            s = __dadd_rn(s, __dmul_rn(v, v));
        }
        s = block_sum(s, scratch);
        if (threadIdx.x == 0) partials[(long long)t * gridDim.x + blockIdx.x] = s;
    }
}

#define WICK_SQUARES_MULTI(name, G)                                                                              \
    extern "C" __global__ void name(const long long* ptrs, const long long* lens, int count, double* partials) { \
        squares_multi<G>(ptrs, lens, count, partials);                                                           \
    }

WICK_SQUARES_MULTI(wick_squares_multi_f32, float)
WICK_SQUARES_MULTI(wick_squares_multi_f16, __half)
WICK_SQUARES_MULTI(wick_squares_multi_bf16, __nv_bfloat16)
