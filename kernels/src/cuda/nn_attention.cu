// The CUDA body of wick-nn's scaled dot-product attention (the host body: wick-nn's
// `native::attention`), in the manner of FlashAttention-2: forward keeps the output and one
// log-sum-exp per query row and never an s × s tensor (an online softmax over tiles of keys);
// backward recomputes each probability from q, k and that log-sum-exp.
//
//   forward:   s_ij = scale q_i·k_j + bias_ij;  o_i = sum_j softmax_j(s_i) v_j;  lse_i = log sum_j exp(s_ij)
//   backward:  p_ij = exp(s_ij - lse_i);  D_i = dO_i·o_i;  ds_ij = p_ij (dO_i·v_j - D_i)
//              dq_i = scale sum_j ds_ij k_j;  dk_j = scale sum_i ds_ij q_i;  dv_j = sum_i p_ij dO_i
//
// Tiles in shared memory. A block of 4 warps takes a tile of R rows a warp (8 in f32, 4 in f64)
// — query rows forward and for dq, key rows for dk and dv — and walks the other side in tiles of
// 32, one row of that tile a lane: each lane computes its 32-wide column of the tile's scores
// against the warp's R rows (row values read from shared memory as broadcasts, the lane's own
// row from a tile padded to d + 1 so that the 32 lanes hit 32 banks), and the products with V,
// K, Q or dO read the probabilities back from shared memory, a lane owning the head columns
// lane, lane + 32, … (at most 4: head_dim <= 128). Every result row is summed by one thread in a
// fixed order (tile after tile), so the same inputs give the same bits on every run; dq's kernel
// writes D for dk/dv's, which runs after it (no atomics). Computes in f32 (f64 for f64 tensors);
// inputs and outputs in the tensors' own type. f16 and bf16 run here where the tensor-core kernels
// (nn_attention_tc.cu) cannot: before sm_80, or without the shared memory those take.
//
// Row ends, as the host body: a query row weighs the keys up to its last one whose bias is above
// WICK_ATT_MASKED (-9 900: a bf16 -1e4 is -9 984), all of them when there is none; the keys after
// it count as exactly 0 and are never read past the last end of a block's rows (a NaN there
// changes nothing). `wick_attention_ends_*` finds each distinct bias row's end once (the op keeps
// them for backward); a tile of keys after every end of a block's rows is never loaded, so a
// causal mask costs half the work of none.
//
// Operands are addressed by a layout (`Lay`): row i of head (b, h) starts at
// base + b·batch + h·head + i·row, its head_dim elements contiguous — heads apart (B, H, S, D) or
// packed side by side in a (B, S, 3·H·D) projection. The bias (optional: null) is the compute
// type, addressed by four strides (0 along broadcast axes) over (B, H, Sq, Sk); the row ends
// (null without a bias) by two more: end of (b, h, i) = ends[b·eb + h·eh + i].
#include "attention.cuh"

// Each distinct bias row's end: one warp a row, 32 keys at a time from the row's end.
template <typename T>
__device__ void attention_ends(const T* bias, int* ends, Dims n, BiasStrides bs, long long nb, long long nh) {
  const int lane = threadIdx.x % 32;
  const long long warps = (long long)gridDim.x * (blockDim.x / 32);
  for (long long w = (long long)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32; w < nb * nh * n.sq; w += warps) {
    const long long b = w / (nh * n.sq), h = (w / n.sq) % nh, i = w % n.sq;
    const T* row = bias + b * bs.b + h * bs.h + i * bs.q;
    long long end = n.sk;
    for (long long top = n.sk; top > 0; top -= 32) {
      const long long j = top - 1 - lane;
      const long long found = warp_max(j >= 0 && row[j * bs.k] > (T)WICK_ATT_MASKED ? j : -1LL);
      if (found >= 0) {
        end = found + 1;
        break;
      }
    }
    if (lane == 0) ends[w] = (int)end;
  }
}

// Forward: a block takes R·4 query rows of one head (R a warp) and walks the keys up to its
// rows' last end in tiles of 32. Shared memory: the query tile [R·4][d], one key-or-value tile
// [32][d + 1] (K, then V in the same place), the warps' probabilities [R·4][32].
template <typename E>
__device__ void attention_forward(const E* q, const E* k, const E* v, const typename WickCompute<E>::T* bias,
                                  const int* ends, E* out, double* lse, Lay lq, Lay lk, Lay lv, Lay lo, Dims n,
                                  BiasStrides bs) {
  typedef typename WickCompute<E>::T T;
  const int R = AttRows<T>::R, ROWS = R * WICK_ATT_WARPS;
  WICK_DYNAMIC_SHARED(T, smem);
  const int d = (int)n.d, kd = d + 1;  // at most 128 (the launcher checks)
  const int lanes = (d + 31) / 32;   // the 32-column chunks of a row that hold columns (uniform)
  T* qs = smem;
  T* kv = qs + ROWS * d;
  T* ps = kv + 32 * kd;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const long long tiles = (n.sq + ROWS - 1) / ROWS;
  const T scale = (T)(1.0 / sqrt((double)d));
  for (long long blk = blockIdx.x; blk < n.b * n.h * tiles; blk += gridDim.x) {
    const long long bh = blk / tiles, i0 = (blk % tiles) * ROWS;
    const long long kend = tile_end(ends, bs, n, bh, i0, ROWS);
    __syncthreads();  // the previous tile's readers are done with the shared memory
    load_tile(q, lq, bh, n.h, i0, n.sq, ROWS, d, d, qs, d);
    T m[R], l[R], acc[R][WICK_ATT_LANES];
    long long iend[R];
#pragma unroll
    for (int r = 0; r < R; r++) {
      iend[r] = row_end(ends, bs, n, bh, i0 + warp * R + r);
      m[r] = -INFINITY, l[r] = T(0);
#pragma unroll
      for (int t = 0; t < WICK_ATT_LANES; t++) acc[r][t] = T(0);
    }
    for (long long j0 = 0; j0 < kend; j0 += 32) {
      __syncthreads();
      load_tile(k, lk, bh, n.h, j0, kend, 32, d, d, kv, kd);
      __syncthreads();
      T s[R];
#pragma unroll
      for (int r = 0; r < R; r++) s[r] = T(0);
      dot_rows<R>(qs + warp * R * d, d, kv + lane * kd, s);
      const long long j = j0 + lane;
#pragma unroll
      for (int r = 0; r < R; r++) {
        const long long i = i0 + warp * R + r;
        const T sv = j < iend[r] ? scale * s[r] + bias_at(bias, bs, bh, n.h, i, j) : (T)-INFINITY;
        const T top = warp_max(sv);
        const T m_new = top > m[r] ? top : m[r];
        // Every score so far -inf: nothing to weigh yet (warp-uniform).
        const T corr = m_new == (T)-INFINITY ? T(1) : wick_exp(m[r] - m_new);
        const T p = m_new == (T)-INFINITY ? T(0) : wick_exp(sv - m_new);
        l[r] = l[r] * corr + warp_sum(p);
#pragma unroll
        for (int t = 0; t < WICK_ATT_LANES; t++) acc[r][t] *= corr;
        ps[(warp * R + r) * 32 + lane] = p;
        m[r] = m_new;
      }
      __syncthreads();
      load_tile(v, lv, bh, n.h, j0, kend, 32, d, d, kv, kd);
      __syncthreads();
      add_rows<R>(acc, ps + warp * R * 32, kv, kd, d, lanes);
    }
#pragma unroll
    for (int r = 0; r < R; r++) {
      const long long i = i0 + warp * R + r;
      if (i >= n.sq) continue;
      const long long os = at(lo, bh, n.h, i);
      const T inv = T(1) / l[r];
#pragma unroll
      for (int t = 0; t < WICK_ATT_LANES; t++) {
        const int c = lane + 32 * t;
        if (c < d) wick_store(out, os + c, acc[r][t] * inv);
      }
      if (lane == 0) lse[bh * n.sq + i] = (double)m[r] + (double)wick_log(l[r]);
    }
  }
}

// dq (and D_i = dO_i·o_i, written for the dk/dv kernel): a block takes R·4 query rows of one head
// and walks the keys up to its rows' last end in tiles of 32. Shared memory: the query and dO
// tiles [R·4][d] each, the K and V tiles [32][d + 1] each, the warps' ds [R·4][32].
template <typename E>
__device__ void attention_dq(const E* q, const E* k, const E* v, const typename WickCompute<E>::T* bias,
                             const int* ends, const E* out, const E* dout, const double* lse, double* dsum, E* dq,
                             Lay lq, Lay lk, Lay lv, Lay lo, Lay ldq, Dims n, BiasStrides bs) {
  typedef typename WickCompute<E>::T T;
  const int R = AttRows<T>::R, ROWS = R * WICK_ATT_WARPS;
  WICK_DYNAMIC_SHARED(T, smem);
  const int d = (int)n.d, kd = d + 1;  // at most 128 (the launcher checks)
  const int lanes = (d + 31) / 32;   // the 32-column chunks of a row that hold columns (uniform)
  T* qs = smem;
  T* gs = qs + ROWS * d;
  T* ks = gs + ROWS * d;
  T* vs = ks + 32 * kd;
  T* dss = vs + 32 * kd;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const long long tiles = (n.sq + ROWS - 1) / ROWS;
  const T scale = (T)(1.0 / sqrt((double)d));
  for (long long blk = blockIdx.x; blk < n.b * n.h * tiles; blk += gridDim.x) {
    const long long bh = blk / tiles, i0 = (blk % tiles) * ROWS;
    const long long kend = tile_end(ends, bs, n, bh, i0, ROWS);
    __syncthreads();
    load_tile(q, lq, bh, n.h, i0, n.sq, ROWS, d, d, qs, d);
    load_tile(dout, lo, bh, n.h, i0, n.sq, ROWS, d, d, gs, d);
    __syncthreads();
    T dsum_r[R], lse_r[R], acc[R][WICK_ATT_LANES];
    long long iend[R];
#pragma unroll
    for (int r = 0; r < R; r++) {
      const long long i = i0 + warp * R + r;
      iend[r] = row_end(ends, bs, n, bh, i);
      T part = T(0);
      if (i < n.sq) {
        const long long os = at(lo, bh, n.h, i);
#pragma unroll
        for (int t = 0; t < WICK_ATT_LANES; t++) {
          const int c = lane + 32 * t;
          if (c < d) part += gs[(warp * R + r) * d + c] * (T)wick_load(out, os + c);
        }
      }
      dsum_r[r] = warp_sum(part);
      if (i < n.sq && lane == 0) dsum[bh * n.sq + i] = (double)dsum_r[r];
      lse_r[r] = i < n.sq ? (T)lse[bh * n.sq + i] : T(0);
#pragma unroll
      for (int t = 0; t < WICK_ATT_LANES; t++) acc[r][t] = T(0);
    }
    for (long long j0 = 0; j0 < kend; j0 += 32) {
      __syncthreads();
      load_tile(k, lk, bh, n.h, j0, kend, 32, d, d, ks, kd);
      load_tile(v, lv, bh, n.h, j0, kend, 32, d, d, vs, kd);
      __syncthreads();
      T s[R], dp[R];
#pragma unroll
      for (int r = 0; r < R; r++) s[r] = dp[r] = T(0);
      dot_rows<R>(qs + warp * R * d, d, ks + lane * kd, s);
      dot_rows<R>(gs + warp * R * d, d, vs + lane * kd, dp);
      const long long j = j0 + lane;
#pragma unroll
      for (int r = 0; r < R; r++) {
        const long long i = i0 + warp * R + r;
        const bool in = j < iend[r];
        const T p = in ? wick_exp(scale * s[r] + bias_at(bias, bs, bh, n.h, i, j) - lse_r[r]) : T(0);
        dss[(warp * R + r) * 32 + lane] = in ? p * (dp[r] - dsum_r[r]) : T(0);
      }
      __syncwarp();
      add_rows<R>(acc, dss + warp * R * 32, ks, kd, d, lanes);
    }
#pragma unroll
    for (int r = 0; r < R; r++) {
      const long long i = i0 + warp * R + r;
      if (i >= n.sq) continue;
      const long long os = at(ldq, bh, n.h, i);
#pragma unroll
      for (int t = 0; t < WICK_ATT_LANES; t++) {
        const int c = lane + 32 * t;
        if (c < d) wick_store(dq, os + c, acc[r][t] * scale);
      }
    }
  }
}

// dk and dv (after attention_dq has written D): a block takes R·4 key rows of one head and walks
// the query rows in tiles of 32, leaving out the tiles whose rows all end at or before its first
// key. Shared memory: the K and V tiles [R·4][d] each, the Q and dO tiles [32][d + 1] each, the
// warps' p and ds [R·4][32] each, and the query tile's log-sum-exps, D and ends.
template <typename E>
__device__ void attention_dkdv(const E* q, const E* k, const E* v, const typename WickCompute<E>::T* bias,
                               const int* ends, const E* dout, const double* lse, const double* dsum, E* dk, E* dv,
                               Lay lq, Lay lk, Lay lv, Lay lo, Lay ldk, Lay ldv, Dims n, BiasStrides bs) {
  typedef typename WickCompute<E>::T T;
  const int R = AttRows<T>::R, ROWS = R * WICK_ATT_WARPS;
  WICK_DYNAMIC_SHARED(T, smem);
  const int d = (int)n.d, kd = d + 1;  // at most 128 (the launcher checks)
  const int lanes = (d + 31) / 32;   // the 32-column chunks of a row that hold columns (uniform)
  T* ks = smem;
  T* vs = ks + ROWS * d;
  T* qs = vs + ROWS * d;
  T* gs = qs + 32 * kd;
  T* ps = gs + 32 * kd;
  T* dss = ps + ROWS * 32;
  T* lse_s = dss + ROWS * 32;
  T* dsum_s = lse_s + 32;
  int* end_s = reinterpret_cast<int*>(dsum_s + 32);
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const long long tiles = (n.sk + ROWS - 1) / ROWS;
  const T scale = (T)(1.0 / sqrt((double)d));
  for (long long blk = blockIdx.x; blk < n.b * n.h * tiles; blk += gridDim.x) {
    const long long bh = blk / tiles, j0 = (blk % tiles) * ROWS;
    __syncthreads();
    load_tile(k, lk, bh, n.h, j0, n.sk, ROWS, d, d, ks, d);
    load_tile(v, lv, bh, n.h, j0, n.sk, ROWS, d, d, vs, d);
    T ak[R][WICK_ATT_LANES], av[R][WICK_ATT_LANES];
#pragma unroll
    for (int r = 0; r < R; r++)
#pragma unroll
      for (int t = 0; t < WICK_ATT_LANES; t++) ak[r][t] = av[r][t] = T(0);
    for (long long i0 = 0; i0 < n.sq; i0 += 32) {
      if (tile_end(ends, bs, n, bh, i0, 32) <= j0) continue;  // every row ends before these keys
      __syncthreads();
      load_tile(q, lq, bh, n.h, i0, n.sq, 32, d, d, qs, kd);
      load_tile(dout, lo, bh, n.h, i0, n.sq, 32, d, d, gs, kd);
      if (threadIdx.x < 32) {
        const long long i = i0 + threadIdx.x;
        lse_s[threadIdx.x] = i < n.sq ? (T)lse[bh * n.sq + i] : T(0);
        dsum_s[threadIdx.x] = i < n.sq ? (T)dsum[bh * n.sq + i] : T(0);
        end_s[threadIdx.x] = (int)row_end(ends, bs, n, bh, i);
      }
      __syncthreads();
      T s[R], dp[R];
#pragma unroll
      for (int r = 0; r < R; r++) s[r] = dp[r] = T(0);
      dot_rows<R>(ks + warp * R * d, d, qs + lane * kd, s);
      dot_rows<R>(vs + warp * R * d, d, gs + lane * kd, dp);
      const long long i = i0 + lane;
#pragma unroll
      for (int r = 0; r < R; r++) {
        const long long j = j0 + warp * R + r;
        const bool in = j < end_s[lane];
        const T p = in ? wick_exp(scale * s[r] + bias_at(bias, bs, bh, n.h, i, j) - lse_s[lane]) : T(0);
        ps[(warp * R + r) * 32 + lane] = p;
        dss[(warp * R + r) * 32 + lane] = in ? p * (dp[r] - dsum_s[lane]) : T(0);
      }
      __syncwarp();
      add_rows<R>(av, ps + warp * R * 32, gs, kd, d, lanes);
      add_rows<R>(ak, dss + warp * R * 32, qs, kd, d, lanes);
    }
#pragma unroll
    for (int r = 0; r < R; r++) {
      const long long j = j0 + warp * R + r;
      if (j >= n.sk) continue;
      const long long ks_at = at(ldk, bh, n.h, j), vs_at = at(ldv, bh, n.h, j);
#pragma unroll
      for (int t = 0; t < WICK_ATT_LANES; t++) {
        const int c = lane + 32 * t;
        if (c < d) {
          wick_store(dk, ks_at + c, ak[r][t] * scale);
          wick_store(dv, vs_at + c, av[r][t]);
        }
      }
    }
  }
}

#define WICK_KERNEL(E, sfx)                                                                                         \
  extern "C" __global__ void wick_attention_##sfx(const E* q, const E* k, const E* v, const WickCompute<E>::T* bias, \
                                                  const int* ends, E* out, double* lse, Lay lq, Lay lk, Lay lv,     \
                                                  Lay lo, Dims n, BiasStrides bs) {                                 \
    attention_forward(q, k, v, bias, ends, out, lse, lq, lk, lv, lo, n, bs);                                        \
  }                                                                                                                 \
  extern "C" __global__ void wick_attention_dq_##sfx(                                                               \
      const E* q, const E* k, const E* v, const WickCompute<E>::T* bias, const int* ends, const E* out,              \
      const E* dout, const double* lse, double* dsum, E* dq, Lay lq, Lay lk, Lay lv, Lay lo, Lay ldq, Dims n,        \
      BiasStrides bs) {                                                                                             \
    attention_dq(q, k, v, bias, ends, out, dout, lse, dsum, dq, lq, lk, lv, lo, ldq, n, bs);                         \
  }                                                                                                                 \
  extern "C" __global__ void wick_attention_dkdv_##sfx(                                                             \
      const E* q, const E* k, const E* v, const WickCompute<E>::T* bias, const int* ends, const E* dout,             \
      const double* lse, const double* dsum, E* dk, E* dv, Lay lq, Lay lk, Lay lv, Lay lo, Lay ldk, Lay ldv, Dims n, \
      BiasStrides bs) {                                                                                             \
    attention_dkdv(q, k, v, bias, ends, dout, lse, dsum, dk, dv, lq, lk, lv, lo, ldk, ldv, n, bs);                  \
  }

WICK_FOR_FLOATS(WICK_KERNEL)

extern "C" __global__ void wick_attention_ends_f32(const float* bias, int* ends, Dims n, BiasStrides bs, long long nb,
                                                   long long nh) {
  attention_ends(bias, ends, n, bs, nb, nh);
}
extern "C" __global__ void wick_attention_ends_f64(const double* bias, int* ends, Dims n, BiasStrides bs, long long nb,
                                                   long long nh) {
  attention_ends(bias, ends, n, bs, nb, nh);
}
