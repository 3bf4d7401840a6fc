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
//           computed in f64 and rounded to f32 as the host's loop does: on the host for the
//           single-tensor kernels, on the device by `wick_step_scalars` for the multi-tensor ones)
#include "common.cuh"
#include "table.cuh"

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

// The scalars one multi-tensor step reads, on the device: written by `wick_step_scalars` (the
// device's own rule, below) or copied from the host (`wick_kernels::step_scalars::host`), in
// this order — the order of `wick_kernels::step_scalars::Slot`, which a Rust test reads from
// this list. SKIP non-zero: the step changes nothing (an inf gradient under the loss scaler, or
// a clipping norm that is not finite); BAD_NORM: the latter (the host's error after the step).
enum WickStepSlot {
    WICK_SLOT_B1,
    WICK_SLOT_B2,
    WICK_SLOT_C1,
    WICK_SLOT_C2,
    WICK_SLOT_EPS,
    WICK_SLOT_DECAY,
    WICK_SLOT_STEP_SIZE,
    WICK_SLOT_INV_BC2_SQRT,
    WICK_SLOT_LR,
    WICK_SLOT_MOMENTUM,
    WICK_SLOT_FACTOR,
    WICK_SLOT_SKIP,
    WICK_SLOT_BAD_NORM,
    WICK_SLOTS
};

// The hyper-parameters `wick_step_scalars` reads (f64, written by the host when they change: the
// learning rate at every step of a schedule), in the order of `wick_kernels::step_scalars::Hyper`.
// MAX_NORM is clipping's bound (read only when partial sums are given).
enum WickHyper {
    WICK_HYPER_LR,
    WICK_HYPER_BETA1,
    WICK_HYPER_BETA2,
    WICK_HYPER_EPS,
    WICK_HYPER_WEIGHT_DECAY,
    WICK_HYPER_MOMENTUM,
    WICK_HYPER_MAX_NORM,
    WICK_HYPERS
};

// a^b for an int b by repeated squaring, every product rounded on its own: the algorithm of the
// host's `f64::powi` (compiler-builtins' `__powidf2`), so AdamW's bias corrections are the host's
// to the bit (`wick_kernels::step_scalars::powi` states it and a Rust test holds it to `powi`).
__device__ __forceinline__ double wick_powi(double a, int b) {
    const bool recip = b < 0;
    unsigned int n = recip ? 0u - (unsigned int)b : (unsigned int)b;
    double r = 1.0;
    for (;;) {
        if (n & 1u) r = __dmul_rn(r, a);
        n >>= 1;
        if (n == 0) break;
        a = __dmul_rn(a, a);
    }
    return recip ? __ddiv_rn(1.0, r) : r;
}

// One step's scalars from the device's own state, so a step needs no value from the host that
// changes while it runs (what a captured CUDA graph replays): `step` is the count of applied
// steps (AdamW's t - 1, advanced here unless the step is skipped, so a skipped step does not
// move the bias corrections, as PyTorch's fused AdamW); `found_inf` (null: none) the loss
// scaler's flag; with `partials` (null: no clipping), clipping's per-(block, tensor) sums of
// squares of up to three dtypes, section k ending at end_k (cumulative), are added in order —
// each section from zero, then the sections — the host's order, the norm written to `norm` and
// the coefficient min(1, max_norm / (norm + 1e-6)) rounded to f32 once (`wick_train::clip`'s).
// Everything in f64 with each operation rounded on its own, as the host computes it, then
// rounded to f32 once. Launch with one thread.
extern "C" __global__ void wick_step_scalars(const double* hyper, int* step, const float* found_inf,
                                             const double* partials, long long end0, long long end1, long long end2,
                                             float* out, double* norm) {
    if (threadIdx.x != 0 || blockIdx.x != 0) return;
    const double lr = hyper[WICK_HYPER_LR], beta1 = hyper[WICK_HYPER_BETA1], beta2 = hyper[WICK_HYPER_BETA2];
    const bool inf = found_inf && *found_inf != 0.0f;
    float factor = 1.0f;
    bool bad = false;
    if (partials) {
        const long long ends[3] = {end0, end1, end2};
        double total = 0.0;
        long long at = 0;
        for (int k = 0; k < 3; k++) {
            double sum = 0.0;
            for (; at < ends[k]; at++) sum = __dadd_rn(sum, partials[at]);
            total = __dadd_rn(total, sum);
        }
        const double root = __dsqrt_rn(total);
        const double c = __ddiv_rn(hyper[WICK_HYPER_MAX_NORM], __dadd_rn(root, 1e-6));
        // f64::min: the other operand where one is NaN.
        factor = __double2float_rn(isnan(c) ? 1.0 : (c < 1.0 ? c : 1.0));
        bad = !inf && !isfinite(root);
        if (norm) *norm = root;
    }
    const bool skip = inf || bad;
    const int t = *step + 1;
    if (!skip) *step = t;
    const double bc1 = __dsub_rn(1.0, wick_powi(beta1, t)), bc2 = __dsub_rn(1.0, wick_powi(beta2, t));
    out[WICK_SLOT_B1] = __double2float_rn(beta1);
    out[WICK_SLOT_B2] = __double2float_rn(beta2);
    out[WICK_SLOT_C1] = __double2float_rn(__dsub_rn(1.0, beta1));
    out[WICK_SLOT_C2] = __double2float_rn(__dsub_rn(1.0, beta2));
    out[WICK_SLOT_EPS] = __double2float_rn(hyper[WICK_HYPER_EPS]);
    out[WICK_SLOT_DECAY] = __double2float_rn(__dsub_rn(1.0, __dmul_rn(lr, hyper[WICK_HYPER_WEIGHT_DECAY])));
    out[WICK_SLOT_STEP_SIZE] = __double2float_rn(__ddiv_rn(lr, bc1));
    out[WICK_SLOT_INV_BC2_SQRT] = __double2float_rn(__ddiv_rn(1.0, __dsqrt_rn(bc2)));
    out[WICK_SLOT_LR] = __double2float_rn(lr);
    out[WICK_SLOT_MOMENTUM] = __double2float_rn(hyper[WICK_HYPER_MOMENTUM]);
    out[WICK_SLOT_FACTOR] = factor;
    out[WICK_SLOT_SKIP] = skip ? 1.0f : 0.0f;
    out[WICK_SLOT_BAD_NORM] = bad ? 1.0f : 0.0f;
}

// Multi-tensor forms: every parameter of one gradient dtype in one launch (or one a table, for
// more than a table holds), the state in place (the trainer's use). Tensor t's buffers are at
// table.ptrs[t·K + j] (table.cuh) — SGD (K = 4): parameter or master, momentum buffer,
// gradient, model copy (0: none); AdamW (K = 5): parameter or master, first moment, second
// moment, gradient, model copy — and its length at table.lens[t]. Grid: y over the tensors, x
// grid-stride within each. The step's constants, clipping's factor (each gradient element
// multiplied by it as it is read; 1 for none) and its skip flag are read from `s`, a block of
// WICK_SLOTS floats on the device; `skip` (null: none) is a second device flag, the loss
// scaler's `found_inf`: when either is non-zero the launch changes nothing, so a step with
// non-finite gradients is skipped without the host reading a flag first.
template <typename G, typename M>
__device__ void sgd_multi(const WickTable<4>& table, const float* s, const float* skip) {
    if ((skip && *skip != 0.0f) || s[WICK_SLOT_SKIP] != 0.0f) return;
    const float lr = s[WICK_SLOT_LR], momentum = s[WICK_SLOT_MOMENTUM], factor = s[WICK_SLOT_FACTOR];
    for (int t = blockIdx.y; t < table.count; t += gridDim.y) {
        float* p = (float*)table.ptrs[4 * t];
        float* b = (float*)table.ptrs[4 * t + 1];
        const G* g = (const G*)table.ptrs[4 * t + 2];
        M* model = (M*)table.ptrs[4 * t + 3];
        WICK_FOR_EACH(i, table.lens[t]) { sgd_at(p, b, b, g, model, i, lr, momentum, factor); }
    }
}

template <typename G, typename M>
__device__ void adamw_multi(const WickTable<5>& table, const float* s, const float* skip) {
    if ((skip && *skip != 0.0f) || s[WICK_SLOT_SKIP] != 0.0f) return;
    const AdamWConsts k{s[WICK_SLOT_B1],  s[WICK_SLOT_B2],    s[WICK_SLOT_C1],        s[WICK_SLOT_C2],
                        s[WICK_SLOT_EPS], s[WICK_SLOT_DECAY], s[WICK_SLOT_STEP_SIZE], s[WICK_SLOT_INV_BC2_SQRT]};
    const float factor = s[WICK_SLOT_FACTOR];
    for (int t = blockIdx.y; t < table.count; t += gridDim.y) {
        float* p = (float*)table.ptrs[5 * t];
        float* m = (float*)table.ptrs[5 * t + 1];
        float* v = (float*)table.ptrs[5 * t + 2];
        const G* g = (const G*)table.ptrs[5 * t + 3];
        M* model = (M*)table.ptrs[5 * t + 4];
        WICK_FOR_EACH(i, table.lens[t]) { adamw_at(p, m, v, m, v, g, model, i, k, factor); }
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

#define WICK_SGD_MULTI(name, G, M)                                                                  \
    extern "C" __global__ void name(WickTable<4> table, const float* s, const float* skip) {        \
        sgd_multi<G, M>(table, s, skip);                                                            \
    }

#define WICK_ADAMW_MULTI(name, G, M)                                                                \
    extern "C" __global__ void name(WickTable<5> table, const float* s, const float* skip) {        \
        adamw_multi<G, M>(table, s, skip);                                                          \
    }

WICK_SGD_MULTI(wick_sgd_momentum_multi_f32, float, NoCopy)
WICK_SGD_MULTI(wick_sgd_momentum_multi_f16, __half, __half)
WICK_SGD_MULTI(wick_sgd_momentum_multi_bf16, __nv_bfloat16, __nv_bfloat16)
WICK_ADAMW_MULTI(wick_adamw_multi_f32, float, NoCopy)
WICK_ADAMW_MULTI(wick_adamw_multi_f16, __half, __half)
WICK_ADAMW_MULTI(wick_adamw_multi_bf16, __nv_bfloat16, __nv_bfloat16)

// Gradient clipping's squared norm, sum of g^2 over every gradient of one dtype in one launch a
// table: tensor t's gradient at table.ptrs[t], its length at table.lens[t]. Block (x, t) sums its
// grid-stride share in f64 (each element widened to f32, then to f64, as the host's sum reads
// it) and writes the sum to partials[t * gridDim.x + x] (the launcher moves `partials` on by a
// table's tensors × gridDim.x for the next table, so the sums lie in the order of one launch over
// every tensor); the sums are added up in order afterwards (`wick_step_scalars`, or the host). No
// atomics: the same bits every run.
template <typename G>
__device__ void squares_multi(const WickTable<1>& table, double* partials) {
    __shared__ double scratch[32];
    for (int t = blockIdx.y; t < table.count; t += gridDim.y) {
        const G* g = (const G*)table.ptrs[t];
        double s = 0.0;
        WICK_FOR_EACH(i, table.lens[t]) {
            const double v = (double)wick_load(g, i);
            s = __dadd_rn(s, __dmul_rn(v, v));
        }
        s = block_sum(s, scratch);
        if (threadIdx.x == 0) partials[(long long)t * gridDim.x + blockIdx.x] = s;
    }
}

#define WICK_SQUARES_MULTI(name, G)                                                   \
    extern "C" __global__ void name(WickTable<1> table, double* partials) {          \
        squares_multi<G>(table, partials);                                            \
    }

WICK_SQUARES_MULTI(wick_squares_multi_f32, float)
WICK_SQUARES_MULTI(wick_squares_multi_f16, __half)
WICK_SQUARES_MULTI(wick_squares_multi_bf16, __nv_bfloat16)
