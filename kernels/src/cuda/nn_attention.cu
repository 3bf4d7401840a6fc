// The CUDA body of wick-nn's scaled dot-product attention (the host body: wick-nn's
// `native::attention`), in the manner of FlashAttention-2: forward keeps the output and one
// log-sum-exp per query row and never an s × s tensor (an online softmax over the keys);
// backward recomputes each probability from q, k and that log-sum-exp.
//
//   forward:   s_ij = scale q_i·k_j + bias_ij;  o_i = sum_j softmax_j(s_i) v_j;  lse_i = log sum_j exp(s_ij)
//   backward:  p_ij = exp(s_ij - lse_i);  D_i = dO_i·o_i;  ds_ij = p_ij (dO_i·v_j - D_i)
//              dq_i = scale sum_j ds_ij k_j;  dk_j = scale sum_i ds_ij q_i;  dv_j = sum_i p_ij dO_i
//
// One warp per row (a query row forward and for dq, a key row for dk and dv), the head dimension
// split over its lanes (at most 4 elements a lane: head_dim <= 128), dot products by warp
// shuffles; each result row summed by one warp in a fixed order, so the same inputs give the
// same bits on every run (no atomics). dq's kernel writes D for dk/dv's, which runs after it.
// K and V rows are read from global memory (one head's are a few tens of KiB and stay in cache).
// Computes in f32 (f64 for f64 tensors); inputs and outputs in the tensors' own type.
//
// Operands are addressed by a layout (`Lay`): row i of head (b, h) starts at
// base + b·batch + h·head + i·row, its head_dim elements contiguous — heads apart (B, H, S, D) or
// packed side by side in a (B, S, 3·H·D) projection. The bias (optional: null) is the compute
// type, addressed by four strides (0 along broadcast axes) over (B, H, Sq, Sk).
#include "common.cuh"

struct Lay {
  long long base, batch, head, row;
};

struct Dims {
  long long b, h, sq, sk, d;
};

struct BiasStrides {
  long long b, h, q, k;
};

#define WICK_ATT_LANES 4  // head_dim <= 32 * WICK_ATT_LANES

template <typename T> __device__ __forceinline__ T warp_sum(T v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

__device__ __forceinline__ long long at(const Lay& l, long long bh, long long heads, long long i) {
  return l.base + (bh / heads) * l.batch + (bh % heads) * l.head + i * l.row;
}

// This lane's elements of a row (lane, lane + 32, …), widened; zero past d.
template <typename E, typename T>
__device__ __forceinline__ void load_row(const E* p, long long start, long long d, int lane, T* r) {
#pragma unroll
  for (int t = 0; t < WICK_ATT_LANES; t++) {
    const long long c = lane + 32 * t;
    r[t] = c < d ? (T)wick_load(p, start + c) : T(0);
  }
}

template <typename E, typename T>
__device__ __forceinline__ T dot_row(const T* r, const E* p, long long start, long long d, int lane) {
  T s = T(0);
#pragma unroll
  for (int t = 0; t < WICK_ATT_LANES; t++) {
    const long long c = lane + 32 * t;
    if (c < d) s += r[t] * (T)wick_load(p, start + c);
  }
  return warp_sum(s);
}

template <typename T>
__device__ __forceinline__ T bias_at(const T* bias, const BiasStrides& bs, long long bh, long long heads, long long i,
                                     long long j) {
  return bias ? bias[(bh / heads) * bs.b + (bh % heads) * bs.h + i * bs.q + j * bs.k] : T(0);
}

// One warp per (head, query row): the output row and its log-sum-exp.
template <typename E>
__device__ void attention_forward(const E* q, const E* k, const E* v, const typename WickCompute<E>::T* bias, E* out,
                                  double* lse, Lay lq, Lay lk, Lay lv, Lay lo, Dims n, BiasStrides bs) {
  typedef typename WickCompute<E>::T T;
  const int lane = threadIdx.x % 32;
  const long long warps = (long long)gridDim.x * (blockDim.x / 32);
  const T scale = (T)(1.0 / sqrt((double)n.d));
  for (long long w = (long long)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32; w < n.b * n.h * n.sq; w += warps) {
    const long long bh = w / n.sq, i = w % n.sq;
    T qr[WICK_ATT_LANES], acc[WICK_ATT_LANES];
    load_row(q, at(lq, bh, n.h, i), n.d, lane, qr);
#pragma unroll
    for (int t = 0; t < WICK_ATT_LANES; t++) acc[t] = T(0);
    T m = -INFINITY, l = T(0);
    for (long long j = 0; j < n.sk; j++) {
      const T s = scale * dot_row(qr, k, at(lk, bh, n.h, j), n.d, lane) + bias_at(bias, bs, bh, n.h, i, j);
      const T m_new = s > m ? s : m;
      if (m_new == -INFINITY) continue;  // every score so far -inf: nothing to weigh yet
      const T corr = wick_exp(m - m_new), p = wick_exp(s - m_new);
      l = l * corr + p;
      const long long vs = at(lv, bh, n.h, j);
#pragma unroll
      for (int t = 0; t < WICK_ATT_LANES; t++) {
        const long long c = lane + 32 * t;
        acc[t] = acc[t] * corr + (c < n.d ? p * (T)wick_load(v, vs + c) : T(0));
      }
      m = m_new;
    }
    const long long os = at(lo, bh, n.h, i);
    const T inv = T(1) / l;
#pragma unroll
    for (int t = 0; t < WICK_ATT_LANES; t++) {
      const long long c = lane + 32 * t;
      if (c < n.d) wick_store(out, os + c, acc[t] * inv);
    }
    if (lane == 0) lse[w] = (double)m + (double)wick_log(l);
  }
}

// One warp per (head, query row): D_i = dO_i·o_i (written for the dk/dv kernel) and dq_i.
template <typename E>
__device__ void attention_dq(const E* q, const E* k, const E* v, const typename WickCompute<E>::T* bias, const E* out,
                             const E* dout, const double* lse, double* dsum, E* dq, Lay lq, Lay lk, Lay lv, Lay lo,
                             Lay ldq, Dims n, BiasStrides bs) {
  typedef typename WickCompute<E>::T T;
  const int lane = threadIdx.x % 32;
  const long long warps = (long long)gridDim.x * (blockDim.x / 32);
  const T scale = (T)(1.0 / sqrt((double)n.d));
  for (long long w = (long long)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32; w < n.b * n.h * n.sq; w += warps) {
    const long long bh = w / n.sq, i = w % n.sq;
    T qr[WICK_ATT_LANES], gr[WICK_ATT_LANES], acc[WICK_ATT_LANES];
    load_row(q, at(lq, bh, n.h, i), n.d, lane, qr);
    load_row(dout, at(lo, bh, n.h, i), n.d, lane, gr);
    const T dsum_i = dot_row(gr, out, at(lo, bh, n.h, i), n.d, lane);
    if (lane == 0) dsum[w] = (double)dsum_i;
    const T lse_i = (T)lse[w];
#pragma unroll
    for (int t = 0; t < WICK_ATT_LANES; t++) acc[t] = T(0);
    for (long long j = 0; j < n.sk; j++) {
      const long long ks = at(lk, bh, n.h, j);
      const T s = scale * dot_row(qr, k, ks, n.d, lane) + bias_at(bias, bs, bh, n.h, i, j);
      const T p = wick_exp(s - lse_i);
      const T ds = p * (dot_row(gr, v, at(lv, bh, n.h, j), n.d, lane) - dsum_i);
#pragma unroll
      for (int t = 0; t < WICK_ATT_LANES; t++) {
        const long long c = lane + 32 * t;
        if (c < n.d) acc[t] += ds * (T)wick_load(k, ks + c);
      }
    }
    const long long os = at(ldq, bh, n.h, i);
#pragma unroll
    for (int t = 0; t < WICK_ATT_LANES; t++) {
      const long long c = lane + 32 * t;
      if (c < n.d) wick_store(dq, os + c, acc[t] * scale);
    }
  }
}

// One warp per (head, key row): dk_j and dv_j (after attention_dq has written D).
template <typename E>
__device__ void attention_dkdv(const E* q, const E* k, const E* v, const typename WickCompute<E>::T* bias,
                               const E* dout, const double* lse, const double* dsum, E* dk, E* dv, Lay lq, Lay lk,
                               Lay lv, Lay lo, Lay ldk, Lay ldv, Dims n, BiasStrides bs) {
  typedef typename WickCompute<E>::T T;
  const int lane = threadIdx.x % 32;
  const long long warps = (long long)gridDim.x * (blockDim.x / 32);
  const T scale = (T)(1.0 / sqrt((double)n.d));
  for (long long w = (long long)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32; w < n.b * n.h * n.sk; w += warps) {
    const long long bh = w / n.sk, j = w % n.sk;
    T kr[WICK_ATT_LANES], vr[WICK_ATT_LANES], ak[WICK_ATT_LANES], av[WICK_ATT_LANES];
    load_row(k, at(lk, bh, n.h, j), n.d, lane, kr);
    load_row(v, at(lv, bh, n.h, j), n.d, lane, vr);
#pragma unroll
    for (int t = 0; t < WICK_ATT_LANES; t++) ak[t] = av[t] = T(0);
    for (long long i = 0; i < n.sq; i++) {
      const long long qs = at(lq, bh, n.h, i), gs = at(lo, bh, n.h, i), row = bh * n.sq + i;
      const T s = scale * dot_row(kr, q, qs, n.d, lane) + bias_at(bias, bs, bh, n.h, i, j);
      const T p = wick_exp(s - (T)lse[row]);
      const T ds = p * (dot_row(vr, dout, gs, n.d, lane) - (T)dsum[row]);
#pragma unroll
      for (int t = 0; t < WICK_ATT_LANES; t++) {
        const long long c = lane + 32 * t;
        if (c < n.d) {
          av[t] += p * (T)wick_load(dout, gs + c);
          ak[t] += ds * (T)wick_load(q, qs + c);
        }
      }
    }
    const long long ks = at(ldk, bh, n.h, j), vs = at(ldv, bh, n.h, j);
#pragma unroll
    for (int t = 0; t < WICK_ATT_LANES; t++) {
      const long long c = lane + 32 * t;
      if (c < n.d) {
        wick_store(dk, ks + c, ak[t] * scale);
        wick_store(dv, vs + c, av[t]);
      }
    }
  }
}

#define WICK_KERNEL(E, sfx)                                                                                         \
  extern "C" __global__ void wick_attention_##sfx(const E* q, const E* k, const E* v, const WickCompute<E>::T* bias, \
                                                  E* out, double* lse, Lay lq, Lay lk, Lay lv, Lay lo, Dims n,      \
                                                  BiasStrides bs) {                                                 \
    attention_forward(q, k, v, bias, out, lse, lq, lk, lv, lo, n, bs);                                              \
  }                                                                                                                 \
  extern "C" __global__ void wick_attention_dq_##sfx(const E* q, const E* k, const E* v,                             \
                                                     const WickCompute<E>::T* bias, const E* out, const E* dout,    \
                                                     const double* lse, double* dsum, E* dq, Lay lq, Lay lk,        \
                                                     Lay lv, Lay lo, Lay ldq, Dims n, BiasStrides bs) {             \
    attention_dq(q, k, v, bias, out, dout, lse, dsum, dq, lq, lk, lv, lo, ldq, n, bs);                              \
  }                                                                                                                 \
  extern "C" __global__ void wick_attention_dkdv_##sfx(const E* q, const E* k, const E* v,                           \
                                                       const WickCompute<E>::T* bias, const E* dout,                \
                                                       const double* lse, const double* dsum, E* dk, E* dv, Lay lq, \
                                                       Lay lk, Lay lv, Lay lo, Lay ldk, Lay ldv, Dims n,            \
                                                       BiasStrides bs) {                                            \
    attention_dkdv(q, k, v, bias, dout, lse, dsum, dk, dv, lq, lk, lv, lo, ldk, ldv, n, bs);                        \
  }

WICK_FOR_FLOATS(WICK_KERNEL)
