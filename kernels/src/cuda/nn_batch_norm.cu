// The CUDA body of wick-nn's batch norm over (N, C, H, W) per channel (wick-nn's `native::norm`),
// with the host kernels' arithmetic: each channel's mean and variance summed in f64 (two passes:
// the mean, then the squared deviations), the per-channel affine `y = x·scale + shift` formed in
// f64 and rounded once to the compute type (f32; f64 for f64 tensors), an optional ReLU or ReLU6
// applied in the same pass (the normalised value before it is neither stored nor kept: backward
// recomputes it); backward from the kept (mean, inverse deviation) of each channel.
//
// Launch shapes. A channel's N·H·W elements are split into `segs` segments of `seg` elements
// (segs ≤ 256); the reductions run one block of 256 threads per (segment, channel) — grid
// (segs, min(C, 65535)), looping over channels beyond — each writing its f64 partial sum, and a
// per-channel kernel adds a channel's partials in segment order: the same bits on every run (no
// atomics). The element-wise passes are grid-stride over N·C·H·W.
//
// Per-channel buffers: stats = [mean C | inverse deviation C] (f64); affine = [scale C | shift C]
// and coef = [k C | e C | c C | mean C] (compute type); partials = C × segs (× 2 for backward).
// Activations: 0 none, 1 ReLU (gradient where y > 0), 2 ReLU6 (where 0 < y < 6); backward takes
// the kinks as the host moves them to where the stored value reaches them (`lower`, `upper`).
#include "common.cuh"

// The channel of element i of an (N, C, HW) tensor, in 32-bit arithmetic when the tensor's size
// allows (`narrow`, the same for every thread of a launch).
__device__ __forceinline__ long long bn_channel(long long i, long long c, long long hw, bool narrow) {
  if (narrow) return (long long)(((unsigned)i / (unsigned)hw) % (unsigned)c);
  return (i / hw) % c;
}

// Calls f(index) for each element of channel ch's segment s (elements [s·seg, min((s+1)·seg, n·hw))
// of the channel, in (image, position) order) that this thread takes: every blockDim.x-th from
// threadIdx.x, the image and position advanced without a division per element.
template <typename F>
__device__ __forceinline__ void bn_segment(long long ch, long long s, long long n, long long c, long long hw,
                                           long long seg, F f) {
  const long long count = n * hw;
  const long long first = s * seg, last = first + seg < count ? first + seg : count;
  long long m = first + threadIdx.x;
  if (m >= last) return;
  long long b = m / hw, p = m % hw;
  const long long step_b = blockDim.x / hw, step_p = blockDim.x % hw;
  for (; m < last; m += blockDim.x) {
    f((b * c + ch) * hw + p);
    p += step_p;
    b += step_b;
    if (p >= hw) {
      p -= hw;
      b++;
    }
  }
}

// The mean of channel ch from its partial sums, added in segment order.
__device__ __forceinline__ double bn_mean(const double* sums, long long ch, long long segs, long long count) {
  double s = 0.0;
  for (long long k = 0; k < segs; k++) s += sums[ch * segs + k];
  return s / (double)(count > 0 ? count : 1);
}

// sums[ch][s] = Σ x over the segment.
template <typename E>
__device__ void bn_sums(const E* x, double* sums, long long n, long long c, long long hw, long long seg,
                        long long segs) {
  __shared__ double scratch[32];
  for (long long ch = blockIdx.y; ch < c; ch += gridDim.y) {
    double v = 0.0;
    bn_segment(ch, (long long)blockIdx.x, n, c, hw, seg, [&](long long i) { v += (double)wick_load(x, i); });
    const double total = block_sum(v, scratch);
    if (threadIdx.x == 0) sums[ch * segs + blockIdx.x] = total;
  }
}

// squares[ch][s] = Σ (x − mean)² over the segment, the mean from `sums`.
template <typename E>
__device__ void bn_squares(const E* x, const double* sums, double* squares, long long n, long long c, long long hw,
                           long long seg, long long segs) {
  __shared__ double scratch[32];
  for (long long ch = blockIdx.y; ch < c; ch += gridDim.y) {
    const double mean = bn_mean(sums, ch, segs, n * hw);
    double v = 0.0;
    bn_segment(ch, (long long)blockIdx.x, n, c, hw, seg, [&](long long i) {
      const double d = (double)wick_load(x, i) - mean;
      v += d * d;
    });
    const double total = block_sum(v, scratch);
    if (threadIdx.x == 0) squares[ch * segs + blockIdx.x] = total;
  }
}

// Per channel: stats = (mean, 1/√(var + eps)) from the partials; with `update`, the running
// estimates moved by `momentum` (the variance unbiased) into new_mean / new_var (R: their dtype),
// as the host blends them: old·(1 − momentum) + new·factor·momentum in f64, rounded once.
template <typename R>
__device__ void bn_finish(const double* sums, const double* squares, long long c, long long segs, long long count,
                          double eps, double* stats, const R* old_mean, const R* old_var, R* new_mean, R* new_var,
                          double momentum, int update) {
  WICK_FOR_EACH(ch, c) {
    const double mean = bn_mean(sums, ch, segs, count);
    const double var = bn_mean(squares, ch, segs, count);
    stats[ch] = mean;
    stats[c + ch] = 1.0 / sqrt(var + eps);
    if (update) {
      const double cnt = (double)(count > 0 ? count : 1);
      const double unbiased = cnt / (cnt - 1.0 > 1.0 ? cnt - 1.0 : 1.0);
      new_mean[ch] = (R)((double)old_mean[ch] * (1.0 - momentum) + mean * 1.0 * momentum);
      new_var[ch] = (R)((double)old_var[ch] * (1.0 - momentum) + var * unbiased * momentum);
    }
  }
}

// Per channel: stats = (mean, 1/√(var + eps)) from given (running) estimates.
template <typename R>
__device__ void bn_given(const R* mean, const R* var, long long c, double eps, double* stats) {
  WICK_FOR_EACH(ch, c) {
    stats[ch] = (double)mean[ch];
    stats[c + ch] = 1.0 / sqrt((double)var[ch] + eps);
  }
}

// Per channel: affine = (scale, shift) = (w·inv, b − mean·w·inv), formed in f64 and rounded once.
template <typename T>
__device__ void bn_affine(const T* w, const T* b, const double* stats, T* affine, long long c) {
  WICK_FOR_EACH(ch, c) {
    const double scale = (double)w[ch] * stats[c + ch];
    affine[ch] = (T)scale;
    affine[c + ch] = (T)((double)b[ch] - stats[ch] * scale);
  }
}

// The activation of the normalised value (a NaN passes through).
template <typename T> __device__ __forceinline__ T bn_act(T y, int act) {
  if (act == 0) return y;
  if (y <= (T)0) return (T)0;
  return act == 2 && y >= (T)6 ? (T)6 : y;
}

// The gradient through the activation at normalised value y: g where lower < y < upper — the
// kinks (0, and 6 for ReLU6, ∞ for ReLU) moved to where the value as stored reaches them (the host
// computes them: wick-nn's `native::norm::mask_bounds`).
template <typename T> __device__ __forceinline__ T bn_through(T g, T y, int act, T lower, T upper) {
  if (act == 0) return g;
  return y > lower && y < upper ? g : (T)0;
}

template <typename E>
__device__ void bn_forward(const E* x, const typename WickCompute<E>::T* affine, E* y, long long n, long long c,
                           long long hw, int act) {
  typedef typename WickCompute<E>::T T;
  const long long total = n * c * hw;
  const bool narrow = total < 4294967296LL;
  WICK_FOR_EACH(i, total) {
    const long long ch = bn_channel(i, c, hw, narrow);
    const T v = (T)wick_load(x, i) * affine[ch] + affine[c + ch];
    wick_store(y, i, bn_act(v, act));
  }
}

// partial[ch][s] = (Σ g', Σ g'·(x − mean)) over the segment, g' the gradient through the activation.
template <typename E>
__device__ void bn_grad_sums(const E* x, const E* g, const typename WickCompute<E>::T* affine, const double* stats,
                             double* partial, long long n, long long c, long long hw, long long seg, long long segs,
                             int act, typename WickCompute<E>::T lower, typename WickCompute<E>::T upper) {
  typedef typename WickCompute<E>::T T;
  __shared__ double scratch[32];
  for (long long ch = blockIdx.y; ch < c; ch += gridDim.y) {
    const double mean = stats[ch];
    const T a = affine[ch], t = affine[c + ch];
    double sg = 0.0, sgx = 0.0;
    bn_segment(ch, (long long)blockIdx.x, n, c, hw, seg, [&](long long i) {
      const T xv = (T)wick_load(x, i);
      const double gv = (double)bn_through((T)wick_load(g, i), xv * a + t, act, lower, upper);
      sg += gv;
      sgx += gv * ((double)xv - mean);
    });
    const double tg = block_sum(sg, scratch), tgx = block_sum(sgx, scratch);
    if (threadIdx.x == 0) {
      partial[2 * (ch * segs + blockIdx.x)] = tg;
      partial[2 * (ch * segs + blockIdx.x) + 1] = tgx;
    }
  }
}

// Per channel: dweight = Σ g'·x̂, dbias = Σ g' (partials added in segment order, rounded once), and
// the input gradient's coefficients dx = k·g' + e·(x − mean) + c0: k = w·inv, and with `batch`
// (the statistics are this batch's own) e = −k·inv·Σg'x̂/M and c0 = −k·Σg'/M (else 0).
template <typename T>
__device__ void bn_grad_finish(const double* partial, const double* stats, const T* w, long long c, long long segs,
                               long long count, int batch, T* dw, T* db, T* coef) {
  WICK_FOR_EACH(ch, c) {
    double sg = 0.0, sgx = 0.0;
    for (long long k = 0; k < segs; k++) {
      sg += partial[2 * (ch * segs + k)];
      sgx += partial[2 * (ch * segs + k) + 1];
    }
    const double mean = stats[ch], inv = stats[c + ch];
    sgx *= inv;
    dw[ch] = (T)sgx;
    db[ch] = (T)sg;
    const double k = (double)w[ch] * inv, cnt = (double)(count > 0 ? count : 1);
    const double mg = batch ? sg / cnt : 0.0, mgx = batch ? sgx / cnt : 0.0;
    coef[ch] = (T)k;
    coef[c + ch] = (T)(-k * mgx * inv);
    coef[2 * c + ch] = (T)(-k * mg);
    coef[3 * c + ch] = (T)mean;
  }
}

template <typename E>
__device__ void bn_input_grad(const E* x, const E* g, const typename WickCompute<E>::T* affine,
                              const typename WickCompute<E>::T* coef, E* dx, long long n, long long c, long long hw,
                              int act, typename WickCompute<E>::T lower, typename WickCompute<E>::T upper) {
  typedef typename WickCompute<E>::T T;
  const long long total = n * c * hw;
  const bool narrow = total < 4294967296LL;
  WICK_FOR_EACH(i, total) {
    const long long ch = bn_channel(i, c, hw, narrow);
    const T xv = (T)wick_load(x, i);
    const T gv = bn_through((T)wick_load(g, i), xv * affine[ch] + affine[c + ch], act, lower, upper);
    wick_store(dx, i, coef[ch] * gv + coef[c + ch] * (xv - coef[3 * c + ch]) + coef[2 * c + ch]);
  }
}

#define WICK_KERNEL(E, sfx)                                                                                           \
  extern "C" __global__ void wick_bn_sums_##sfx(const E* x, double* sums, long long n, long long c, long long hw,     \
                                                long long seg, long long segs) {                                      \
    bn_sums(x, sums, n, c, hw, seg, segs);                                                                            \
  }                                                                                                                   \
  extern "C" __global__ void wick_bn_squares_##sfx(const E* x, const double* sums, double* squares, long long n,      \
                                                   long long c, long long hw, long long seg, long long segs) {        \
    bn_squares(x, sums, squares, n, c, hw, seg, segs);                                                                \
  }                                                                                                                   \
  extern "C" __global__ void wick_bn_forward_##sfx(const E* x, const WickCompute<E>::T* affine, E* y, long long n,    \
                                                   long long c, long long hw, int act) {                              \
    bn_forward(x, affine, y, n, c, hw, act);                                                                          \
  }                                                                                                                   \
  extern "C" __global__ void wick_bn_grad_sums_##sfx(                                                                \
      const E* x, const E* g, const WickCompute<E>::T* affine, const double* stats, double* partial, long long n,      \
      long long c, long long hw, long long seg, long long segs, int act, WickCompute<E>::T lower,                      \
      WickCompute<E>::T upper) {                                                                                      \
    bn_grad_sums(x, g, affine, stats, partial, n, c, hw, seg, segs, act, lower, upper);                               \
  }                                                                                                                   \
  extern "C" __global__ void wick_bn_input_grad_##sfx(const E* x, const E* g, const WickCompute<E>::T* affine,       \
                                                      const WickCompute<E>::T* coef, E* dx, long long n, long long c, \
                                                      long long hw, int act, WickCompute<E>::T lower,                 \
                                                      WickCompute<E>::T upper) {                                      \
    bn_input_grad(x, g, affine, coef, dx, n, c, hw, act, lower, upper);                                               \
  }

WICK_FOR_FLOATS(WICK_KERNEL)

// The per-channel kernels, over the compute types (and the running estimates' dtypes) f32 and f64.
#define WICK_CHANNEL_KERNEL(T, sfx)                                                                                   \
  extern "C" __global__ void wick_bn_finish_##sfx(const double* sums, const double* squares, long long c,             \
                                                  long long segs, long long count, double eps, double* stats,         \
                                                  const T* old_mean, const T* old_var, T* new_mean, T* new_var,       \
                                                  double momentum, int update) {                                      \
    bn_finish(sums, squares, c, segs, count, eps, stats, old_mean, old_var, new_mean, new_var, momentum, update);     \
  }                                                                                                                   \
  extern "C" __global__ void wick_bn_given_##sfx(const T* mean, const T* var, long long c, double eps,                \
                                                 double* stats) {                                                     \
    bn_given(mean, var, c, eps, stats);                                                                               \
  }                                                                                                                   \
  extern "C" __global__ void wick_bn_affine_##sfx(const T* w, const T* b, const double* stats, T* affine,             \
                                                  long long c) {                                                      \
    bn_affine(w, b, stats, affine, c);                                                                                \
  }                                                                                                                   \
  extern "C" __global__ void wick_bn_grad_finish_##sfx(const double* partial, const double* stats, const T* w,        \
                                                       long long c, long long segs, long long count, int batch, T* dw, \
                                                       T* db, T* coef) {                                              \
    bn_grad_finish(partial, stats, w, c, segs, count, batch, dw, db, coef);                                           \
  }

WICK_CHANNEL_KERNEL(float, f32)
WICK_CHANNEL_KERNEL(double, f64)
