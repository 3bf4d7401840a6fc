// The CUDA bodies of wick-nn's pooling (the host bodies: wick-nn's `native::pool`): max pooling
// with PyTorch's rule — each window's gradient goes to its first maximum in row-major order, a NaN
// wins (a later NaN replaces an earlier one), padding never wins — and global average pooling.
// Max pooling keeps only its input, as the host op: backward finds each window's maximum again.
//
// Backward is a gather, one thread per input element: it visits the outputs whose windows hold
// it (at most ceil(k/s)² of them), in row-major order, and adds the gradient of each whose
// maximum it is — the host's order of additions, with no atomics (the same bits every run).
// Sums in the compute type (f32; f64 for f64), rounded once.
#include "common.cuh"

// The input range [lo, hi) of output o's window along an axis of `len` (padding excluded).
__device__ __forceinline__ void window(long long o, long long len, long long k, long long s, long long p, long long* lo,
                                       long long* hi) {
  const long long start = o * s;
  *lo = start > p ? start - p : 0;
  const long long end = start + k > p ? start + k - p : 0;
  *hi = end < len ? end : len;
}

// The plane index of the first maximum of output (oy, ox)'s window, and its value.
template <typename E>
__device__ __forceinline__ long long argmax(const E* plane, long long h, long long w, long long oy, long long ox,
                                            long long k, long long s, long long p,
                                            typename WickCompute<E>::T* best_out) {
  typedef typename WickCompute<E>::T T;
  long long y0, y1, x0, x1;
  window(oy, h, k, s, p, &y0, &y1);
  window(ox, w, k, s, p, &x0, &x1);
  long long at = y0 * w + x0;
  T best = (T)wick_load(plane, at);
  for (long long iy = y0; iy < y1; iy++) {
    for (long long ix = x0; ix < x1; ix++) {
      const T v = (T)wick_load(plane, iy * w + ix);
      if (v > best || v != v) {
        best = v;
        at = iy * w + ix;
      }
    }
  }
  *best_out = best;
  return at;
}

template <typename E>
__device__ void max_pool(const E* x, E* y, long long planes, long long h, long long w, long long oh, long long ow,
                         long long k, long long s, long long p) {
  typedef typename WickCompute<E>::T T;
  WICK_FOR_EACH(i, planes * oh * ow) {
    const long long plane = i / (oh * ow), o = i % (oh * ow);
    T best;
    argmax(x + plane * h * w, h, w, o / ow, o % ow, k, s, p, &best);
    wick_store(y, i, best);
  }
}

// The first output index along an axis whose window starts at or before `i` + p - k + 1.
__device__ __forceinline__ long long first_output(long long i, long long k, long long s, long long p) {
  const long long lo = i + p - k + 1;
  return lo <= 0 ? 0 : (lo + s - 1) / s;
}

template <typename E>
__device__ void max_pool_grad(const E* x, const E* g, E* dx, long long planes, long long h, long long w, long long oh,
                              long long ow, long long k, long long s, long long p) {
  typedef typename WickCompute<E>::T T;
  WICK_FOR_EACH(i, planes * h * w) {
    const long long plane = i / (h * w), at = i % (h * w), iy = at / w, ix = at % w;
    const E* xp = x + plane * h * w;
    const long long oy1 = (iy + p) / s < oh - 1 ? (iy + p) / s : oh - 1;
    const long long ox1 = (ix + p) / s < ow - 1 ? (ix + p) / s : ow - 1;
    T acc = T(0);
    for (long long oy = first_output(iy, k, s, p); oy <= oy1; oy++) {
      for (long long ox = first_output(ix, k, s, p); ox <= ox1; ox++) {
        T best;
        if (argmax(xp, h, w, oy, ox, k, s, p, &best) == at) acc = acc + (T)wick_load(g, (plane * oh + oy) * ow + ox);
      }
    }
    wick_store(dx, i, acc);
  }
}

// One warp per plane: the mean of its h·w values, summed in f64.
template <typename E> __device__ void global_avg(const E* x, E* y, long long planes, long long hw) {
  typedef typename WickCompute<E>::T T;
  const int lane = threadIdx.x % 32;
  const long long warps = (long long)gridDim.x * (blockDim.x / 32);
  for (long long pl = (long long)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32; pl < planes; pl += warps) {
    double s = 0.0;
    for (long long j = lane; j < hw; j += 32) s += (double)wick_load(x, pl * hw + j);
    for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
    if (lane == 0) wick_store(y, pl, (T)(s / (double)(hw > 0 ? hw : 1)));
  }
}

// dx = g / hw over each plane.
template <typename E> __device__ void global_avg_grad(const E* g, E* dx, long long planes, long long hw) {
  typedef typename WickCompute<E>::T T;
  const T scale = (T)(1.0 / (double)(hw > 0 ? hw : 1));
  WICK_FOR_EACH(i, planes * hw) { wick_store(dx, i, (T)wick_load(g, i / hw) * scale); }
}

#define WICK_KERNEL(E, sfx)                                                                                        \
  extern "C" __global__ void wick_max_pool_##sfx(const E* x, E* y, long long planes, long long h, long long w,     \
                                                 long long oh, long long ow, long long k, long long s, long long p) { \
    max_pool(x, y, planes, h, w, oh, ow, k, s, p);                                                                 \
  }                                                                                                                \
  extern "C" __global__ void wick_max_pool_grad_##sfx(const E* x, const E* g, E* dx, long long planes, long long h, \
                                                      long long w, long long oh, long long ow, long long k,        \
                                                      long long s, long long p) {                                  \
    max_pool_grad(x, g, dx, planes, h, w, oh, ow, k, s, p);                                                        \
  }                                                                                                                \
  extern "C" __global__ void wick_global_avg_##sfx(const E* x, E* y, long long planes, long long hw) {              \
    global_avg(x, y, planes, hw);                                                                                  \
  }                                                                                                                \
  extern "C" __global__ void wick_global_avg_grad_##sfx(const E* g, E* dx, long long planes, long long hw) {        \
    global_avg_grad(g, dx, planes, hw);                                                                            \
  }

WICK_FOR_FLOATS(WICK_KERNEL)
