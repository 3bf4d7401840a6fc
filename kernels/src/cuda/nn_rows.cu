// The CUDA bodies of wick-nn's row-wise ops outside the norms: rotary position embeddings,
// softmax cross-entropy over a vocabulary, and embedding lookups — forward and backward, with
// the host bodies' arithmetic (wick-nn's `native::rope` and `native::loss`) — and the broadcast
// sum of position and type embeddings.
//
//   rope:           (x1, x2) -> (x1 c - x2 s, x1 s + x2 c) for the pairs (j, j + d/2) of each rotated head,
//                   s = sign · sin (sign -1: the backward pass, the rotation by the inverse angles)
//   cross-entropy:  lse_i = log sum_j exp(x_ij);  loss = mean_i (lse_i - x_i,t_i);
//                   dx_ij = (exp(x_ij - lse_i) - [j = t_i]) · g / n — no probability tensor kept
//   embedding:      y_k = table[id_k];  dtable[r] = the sum, in position order, of g_k over k with id_k = r
//   add_broadcast:  y_i = x_i + a_(i mod |a|) + b_(i mod |b|), summed left to right in the compute type and
//                   rounded once (its gradients: dx = g, da and db column sums, nn_linear.cu's)
//
// Sums over a row or the rows are in f64, each in a fixed order (the same bits on every run).
// A target outside the vocabulary makes its row's loss (and gradient) NaN rather than reading
// past the row: the host checks nothing on the device's ids, so no synchronisation is needed.
#include "common.cuh"

// Rows of `width` elements (position row % seq); the first `rotated` heads of d elements of each
// row are rotated, the rest copied. Tables (seq × d/2) in the compute type.
template <typename E>
__device__ void rope(const E* x, E* y, const typename WickCompute<E>::T* cos, const typename WickCompute<E>::T* sin,
                     long long rows, long long seq, long long width, long long d, long long rotated, double sign) {
  typedef typename WickCompute<E>::T T;
  const long long half = d / 2;
  WICK_FOR_EACH(i, rows * width) {
    const long long r = i / width, c = i % width;
    if (c >= rotated * d) {
      y[i] = x[i];
      continue;
    }
    const long long j = c % d, pos = r % seq;
    const long long pair = j < half ? j : j - half;
    const T cv = cos[pos * half + pair], sv = (T)sign * sin[pos * half + pair];
    const long long lo = j < half ? i : i - half;
    const T x1 = (T)wick_load(x, lo), x2 = (T)wick_load(x, lo + half);
    wick_store(y, i, j < half ? x1 * cv - x2 * sv : x1 * sv + x2 * cv);
  }
}

// The sum of `v` over the block, every thread getting it; `scratch` holds one value per warp.
template <typename T> __device__ __forceinline__ T block_reduce(T v, T* scratch, bool max) {
  for (int o = 16; o > 0; o >>= 1) {
    const T other = __shfl_xor_sync(0xffffffffu, v, o);
    v = max ? (other > v ? other : v) : v + other;
  }
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, warps = blockDim.x / 32;
  __syncthreads();
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  T total = scratch[0];
  for (int w = 1; w < warps; w++) total = max ? (scratch[w] > total ? scratch[w] : total) : total + scratch[w];
  __syncthreads();
  return total;
}

// One block per row: lse_i and the row's loss lse_i - x_i,t_i (NaN for a target outside 0..c).
template <typename E>
__device__ void cross_entropy_rows(const E* x, const unsigned int* targets, double* lse, double* loss, long long n,
                                   long long c) {
  __shared__ double scratch[32];
  for (long long i = blockIdx.x; i < n; i += gridDim.x) {
    const E* row = x + i * c;
    double m = -INFINITY;
    for (long long j = threadIdx.x; j < c; j += blockDim.x) m = fmax(m, (double)wick_load(row, j));
    m = block_reduce(m, scratch, true);
    double s = 0.0;
    for (long long j = threadIdx.x; j < c; j += blockDim.x) s += exp((double)wick_load(row, j) - m);
    s = block_reduce(s, scratch, false);
    if (threadIdx.x == 0) {
      const double l = m + log(s);
      const long long t = targets[i];
      lse[i] = l;
      loss[i] = t < c ? l - (double)wick_load(row, t) : NAN;
    }
  }
}

// The mean of n row losses, summed by one block in a fixed order, into `out` (compute type).
template <typename T> __device__ void mean_of(const double* loss, T* out, long long n) {
  __shared__ double scratch[32];
  double s = 0.0;
  for (long long i = threadIdx.x; i < n; i += blockDim.x) s += loss[i];
  s = block_reduce(s, scratch, false);
  if (threadIdx.x == 0) out[0] = (T)(s / (double)(n > 0 ? n : 1));
}

// dx_ij = (exp(x_ij - lse_i) - [j = t_i]) g / n, g the loss's gradient (one element, compute type).
template <typename E>
__device__ void cross_entropy_grad(const E* x, const unsigned int* targets, const double* lse,
                                   const typename WickCompute<E>::T* g, E* dx, long long n, long long c) {
  const double scale = (double)g[0] / (double)(n > 0 ? n : 1);
  WICK_FOR_EACH(k, n * c) {
    const long long i = k / c, j = k % c;
    const long long t = targets[i];
    const double p = exp((double)wick_load(x, k) - lse[i]);
    const double v = t < c ? (p - (j == t ? 1.0 : 0.0)) * scale : NAN;
    wick_store(dx, k, (typename WickCompute<E>::T)v);
  }
}

// y_k = table[id_k] (ids checked on the host), copied as stored.
template <typename E> __device__ void embedding(const E* table, const unsigned int* ids, E* y, long long n, long long d) {
  WICK_FOR_EACH(k, n * d) { y[k] = table[(long long)ids[k / d] * d + k % d]; }
}

// One block per run of equal ids (the positions `order[start[r]] .. order[start[r + 1] - 1]`, in
// position order), summing their gradient rows in the compute type into row `run_id[r]` of a
// zeroed table gradient, rounded once.
template <typename E>
__device__ void embedding_grad(const E* g, const unsigned int* order, const unsigned int* start,
                               const unsigned int* run_id, long long runs, E* dt, long long d) {
  typedef typename WickCompute<E>::T T;
  for (long long r = blockIdx.x; r < runs; r += gridDim.x) {
    for (long long j = threadIdx.x; j < d; j += blockDim.x) {
      T acc = T(0);
      for (unsigned int p = start[r]; p < start[r + 1]; p++) acc = acc + (T)wick_load(g, (long long)order[p] * d + j);
      wick_store(dt, (long long)run_id[r] * d + j, acc);
    }
  }
}

// y_i = x_i + a_(i mod na) + b_(i mod nb) in the compute type, left to right, rounded once.
template <typename E>
__device__ void add_broadcast(const E* x, const E* a, const E* b, E* y, long long n, long long na, long long nb) {
  WICK_FOR_EACH(i, n) wick_store(y, i, wick_load(x, i) + wick_load(a, i % na) + wick_load(b, i % nb));
}

#define WICK_KERNEL(E, sfx)                                                                                           \
  extern "C" __global__ void wick_rope_##sfx(const E* x, E* y, const WickCompute<E>::T* cos,                          \
                                             const WickCompute<E>::T* sin, long long rows, long long seq,             \
                                             long long width, long long d, long long rotated, double sign) {          \
    rope(x, y, cos, sin, rows, seq, width, d, rotated, sign);                                                         \
  }                                                                                                                   \
  extern "C" __global__ void wick_cross_entropy_rows_##sfx(const E* x, const unsigned int* targets, double* lse,      \
                                                           double* loss, long long n, long long c) {                  \
    cross_entropy_rows(x, targets, lse, loss, n, c);                                                                  \
  }                                                                                                                   \
  extern "C" __global__ void wick_cross_entropy_grad_##sfx(const E* x, const unsigned int* targets, const double* lse, \
                                                           const WickCompute<E>::T* g, E* dx, long long n,            \
                                                           long long c) {                                             \
    cross_entropy_grad(x, targets, lse, g, dx, n, c);                                                                 \
  }                                                                                                                   \
  extern "C" __global__ void wick_embedding_##sfx(const E* table, const unsigned int* ids, E* y, long long n,         \
                                                  long long d) {                                                      \
    embedding(table, ids, y, n, d);                                                                                   \
  }                                                                                                                   \
  extern "C" __global__ void wick_embedding_grad_##sfx(const E* g, const unsigned int* order,                         \
                                                       const unsigned int* start, const unsigned int* run_id,         \
                                                       long long runs, E* dt, long long d) {                          \
    embedding_grad(g, order, start, run_id, runs, dt, d);                                                             \
  }                                                                                                                   \
  extern "C" __global__ void wick_add_broadcast_##sfx(const E* x, const E* a, const E* b, E* y, long long n,          \
                                                      long long na, long long nb) {                                   \
    add_broadcast(x, a, b, y, n, na, nb);                                                                             \
  }

WICK_FOR_FLOATS(WICK_KERNEL)

extern "C" __global__ void wick_mean_f32(const double* loss, float* out, long long n) { mean_of(loss, out, n); }
extern "C" __global__ void wick_mean_f64(const double* loss, double* out, long long n) { mean_of(loss, out, n); }
