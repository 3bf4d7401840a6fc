// The optimizer's update in one pass, on a CUDA device: SGD with momentum and AdamW on an f32
// tensor (a parameter, or the f32 master of a low-precision one) from its gradient (f32, f16 or
// bf16) and the old state, writing the new state (beside the old, as the host's update does, or
// in place when given the same buffers: the trainer's use) and — for a low-precision model — the
// new value into the model's compute copy. The same arithmetic, in the same order and rounding, as the
// host's loops (`wick_kernels::cpu::optim::{sgd_momentum, adamw}`): every product and sum is
// rounded on its own (`__fmul_rn`, `__fadd_rn`: no fused multiply-add that the host does not
// do), and `sqrtf` and `/` are IEEE-rounded (nvcc's defaults), so the device's step is the
// host's to the bit. One launch per parameter replaces the dozen composed tensor ops (each a
// kernel and an allocation) the device update was.
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

template <typename G, typename M>
__device__ void sgd_momentum(float* p, const float* b, float* b_new, const G* g, M* model, long long n, float lr,
                             float momentum) {
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        const float bi = __fadd_rn(__fmul_rn(momentum, b[i]), wick_load(g, i));
        const float w = __fsub_rn(p[i], __fmul_rn(lr, bi));
        b_new[i] = bi;
        p[i] = w;
        wick_copy(model, i, w);
    }
}

template <typename G, typename M>
__device__ void adamw(float* p, const float* m, const float* v, float* m_new, float* v_new, const G* g, M* model,
                      long long n, float b1, float b2, float c1, float c2, float eps, float decay, float step_size,
                      float inv_bc2_sqrt) {
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        const float gi = wick_load(g, i);
        const float mi = __fadd_rn(__fmul_rn(b1, m[i]), __fmul_rn(c1, gi));
        const float vi = __fadd_rn(__fmul_rn(b2, v[i]), __fmul_rn(__fmul_rn(c2, gi), gi));
        const float denom = __fadd_rn(__fmul_rn(sqrtf(vi), inv_bc2_sqrt), eps);
        const float w = __fsub_rn(__fmul_rn(p[i], decay), __fdiv_rn(__fmul_rn(step_size, mi), denom));
        m_new[i] = mi;
        v_new[i] = vi;
        p[i] = w;
        wick_copy(model, i, w);
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
