// wick-nn's attention on tensor cores for f16 and bf16 tensors (the same op, contract and
// arguments as nn_attention.cu's kernels, which keep f32 and f64 and any device without the
// shared memory these need): the products q·kᵀ, p·v, dO·vᵀ, ds·k, pᵀ·dO and dsᵀ·q as 16 × 16 × 16
// WMMA tiles summed in f32, FlashAttention-2's blocking, and the softmax between them on CUDA
// cores in f32.
//
// A block of 4 warps takes 64 rows (16 a warp) — query rows forward and for dq, key rows for dk
// and dv — and walks the other side in tiles of 64. A warp's scores land in its own f32 tile of
// shared memory, where each lane pair (2r, 2r + 1) takes row r (columns of one parity each): the
// bias, the row end, the online softmax (forward: the running maximum and sum in registers, the
// output rows rescaled in shared memory before the next product adds onto them) or the
// probabilities from the kept log-sum-exp and ds (backward). The probabilities and ds are rounded
// to the tensors' type for the next product, as FlashAttention-2 does; the sums, the maximum and
// the log-sum-exp stay f32 (the log-sum-exp and D kept in f64 as by the other kernels). A head
// dimension that is not a multiple of 16 is padded with zeros in shared memory. Row ends as in
// nn_attention.cu: keys after a row's end count as exactly 0 and past a block's last end are never
// read. Fixed summation orders: the same inputs give the same bits on every run (no atomics).
//
// Shared memory (E = the storage type; ld = d16 + 8, ldo = d16 + 4, 16-byte multiples): the tiles
// of rows [64][ld] E (three forward, four backward), and per warp an f32 score tile [16][68] (two
// in backward: scores and dO·vᵀ), its probabilities or ds [16][72] E (two in dk/dv), and forward's
// f32 output rows [16][ldo]; dk/dv add the query tile's log-sum-exps, D and ends.
#include <mma.h>

#include "attention.cuh"

#define WICK_TC_ROWS 64  // rows a block takes: 4 warps × 16
#define WICK_TC_COLS 64  // rows of the other side a tile
#define WICK_TC_SLD 68   // leading dimension of an f32 score tile
#define WICK_TC_PLD 72   // leading dimension of a probability tile

namespace wmma = nvcuda::wmma;

template <typename E> using FragA = wmma::fragment<wmma::matrix_a, 16, 16, 16, E, wmma::row_major>;
template <typename E> using FragB = wmma::fragment<wmma::matrix_b, 16, 16, 16, E, wmma::row_major>;
template <typename E> using FragBt = wmma::fragment<wmma::matrix_b, 16, 16, 16, E, wmma::col_major>;
typedef wmma::fragment<wmma::accumulator, 16, 16, 16, float> FragC;

// dst (16 × 64, f32, leading dimension WICK_TC_SLD) = a (16 rows × d16, row-major) · bᵀ, b being
// 64 rows × d16 (row-major: its transpose read column-major).
template <typename E>
__device__ __forceinline__ void product_nt(const E* a, const E* b, int ld, int d16, float* dst) {
#pragma unroll
  for (int nt = 0; nt < WICK_TC_COLS / 16; nt++) {
    FragC acc;
    wmma::fill_fragment(acc, 0.f);
    for (int kt = 0; kt < d16 / 16; kt++) {
      FragA<E> fa;
      FragBt<E> fb;
      wmma::load_matrix_sync(fa, a + kt * 16, ld);
      wmma::load_matrix_sync(fb, b + nt * 16 * ld + kt * 16, ld);
      wmma::mma_sync(acc, fa, fb, acc);
    }
    wmma::store_matrix_sync(dst + nt * 16, acc, WICK_TC_SLD, wmma::mem_row_major);
  }
}

// acc += p (16 × 64, E, leading dimension WICK_TC_PLD) · b[:, nt·16 … nt·16 + 15] (64 rows).
template <typename E>
__device__ __forceinline__ void product_nn_tile(const E* p, const E* b, int ld, int nt, FragC& acc) {
#pragma unroll
  for (int kt = 0; kt < WICK_TC_COLS / 16; kt++) {
    FragA<E> fa;
    FragB<E> fb;
    wmma::load_matrix_sync(fa, p + kt * 16, WICK_TC_PLD);
    wmma::load_matrix_sync(fb, b + kt * 16 * ld + nt * 16, ld);
    wmma::mma_sync(acc, fa, fb, acc);
  }
}

// acc[nt] += p · b[:, nt·16 …] for every 16 columns of b's d16 (product_nn_tile).
template <typename E>
__device__ __forceinline__ void product_nn(const E* p, const E* b, int ld, int d16, FragC* acc) {
#pragma unroll
  for (int nt = 0; nt < 8; nt++) {
    if (nt >= d16 / 16) break;
    product_nn_tile(p, b, ld, nt, acc[nt]);
  }
}

// A warp's accumulators (16 × d16) into its f32 scratch (leading dimension ldo), readable by
// every lane of the warp afterwards.
__device__ __forceinline__ void stage(const FragC* acc, int d16, float* dst, int ldo) {
  __syncwarp();
#pragma unroll
  for (int nt = 0; nt < 8; nt++) {
    if (nt >= d16 / 16) break;
    wmma::store_matrix_sync(dst + nt * 16, acc[nt], ldo, wmma::mem_row_major);
  }
  __syncwarp();
}

template <typename E>
__device__ void attention_forward_tc(const E* q, const E* k, const E* v, const float* bias, const int* ends, E* out,
                                     double* lse, Lay lq, Lay lk, Lay lv, Lay lo, Dims n, BiasStrides bs) {
  WICK_DYNAMIC_SHARED(unsigned char, smem);
  const int d = (int)n.d, d16 = (d + 15) / 16 * 16, ld = d16 + 8, ldo = d16 + 4;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, r = lane / 2, half = lane % 2;
  E* qs = reinterpret_cast<E*>(smem);
  E* ks = qs + WICK_TC_ROWS * ld;
  E* vs = ks + WICK_TC_COLS * ld;
  float* ss = reinterpret_cast<float*>(vs + WICK_TC_COLS * ld);
  float* os = ss + 4 * 16 * WICK_TC_SLD;
  E* ps = reinterpret_cast<E*>(os + 4 * 16 * ldo) + warp * 16 * WICK_TC_PLD;
  ss += warp * 16 * WICK_TC_SLD;
  os += warp * 16 * ldo;
  const long long tiles = (n.sq + WICK_TC_ROWS - 1) / WICK_TC_ROWS;
  const float scale = (float)(1.0 / sqrt((double)d));
  for (long long blk = blockIdx.x; blk < n.b * n.h * tiles; blk += gridDim.x) {
    const long long bh = blk / tiles, i0 = (blk % tiles) * WICK_TC_ROWS, i = i0 + warp * 16 + r;
    const long long kend = tile_end(ends, bs, n, bh, i0, WICK_TC_ROWS), iend = row_end(ends, bs, n, bh, i);
    __syncthreads();
    load_tile(q, lq, bh, n.h, i0, n.sq, WICK_TC_ROWS, d, d16, qs, ld);
    for (int c = half; c < d16; c += 2) os[r * ldo + c] = 0.f;
    float m = -INFINITY, l = 0.f;
    for (long long j0 = 0; j0 < kend; j0 += WICK_TC_COLS) {
      __syncthreads();
      load_tile(k, lk, bh, n.h, j0, kend, WICK_TC_COLS, d, d16, ks, ld);
      load_tile(v, lv, bh, n.h, j0, kend, WICK_TC_COLS, d, d16, vs, ld);
      __syncthreads();
      product_nt(qs + warp * 16 * ld, ks, ld, d16, ss);
      __syncwarp();
      float top = -INFINITY;
      for (int c = half; c < WICK_TC_COLS; c += 2) {
        const long long j = j0 + c;
        const float sv = j < iend ? scale * ss[r * WICK_TC_SLD + c] + bias_at(bias, bs, bh, n.h, i, j) : -INFINITY;
        ss[r * WICK_TC_SLD + c] = sv;
        top = sv > top ? sv : top;
      }
      const float other = __shfl_xor_sync(0xffffffffu, top, 1);
      top = other > top ? other : top;
      const float m_new = top > m ? top : m;
      // Every score so far -inf: nothing to weigh yet.
      const float corr = m_new == -INFINITY ? 1.f : expf(m - m_new);
      float sum = 0.f;
      for (int c = half; c < WICK_TC_COLS; c += 2) {
        const float p = m_new == -INFINITY ? 0.f : expf(ss[r * WICK_TC_SLD + c] - m_new);
        sum += p;
        wick_store(ps, r * WICK_TC_PLD + c, p);
      }
      sum += __shfl_xor_sync(0xffffffffu, sum, 1);
      l = l * corr + sum;
      m = m_new;
      for (int c = half; c < d16; c += 2) os[r * ldo + c] *= corr;
      __syncwarp();
#pragma unroll
      for (int nt = 0; nt < 8; nt++) {
        if (nt >= d16 / 16) break;
        // The output rows live in shared memory (rescaled there by the new maximum): loaded,
        // added onto, stored back.
        FragC acc;
        wmma::load_matrix_sync(acc, os + nt * 16, ldo, wmma::mem_row_major);
        product_nn_tile(ps, vs, ld, nt, acc);
        wmma::store_matrix_sync(os + nt * 16, acc, ldo, wmma::mem_row_major);
      }
      __syncwarp();
    }
    if (i < n.sq) {
      const long long at_o = at(lo, bh, n.h, i);
      for (int c = half; c < d; c += 2) wick_store(out, at_o + c, os[r * ldo + c] / l);
      if (half == 0) lse[bh * n.sq + i] = (double)m + log((double)l);
    }
  }
}

template <typename E>
__device__ void attention_dq_tc(const E* q, const E* k, const E* v, const float* bias, const int* ends, const E* out,
                                const E* dout, const double* lse, double* dsum, E* dq, Lay lq, Lay lk, Lay lv, Lay lo,
                                Lay ldq, Dims n, BiasStrides bs) {
  WICK_DYNAMIC_SHARED(unsigned char, smem);
  const int d = (int)n.d, d16 = (d + 15) / 16 * 16, ld = d16 + 8, ldo = d16 + 4;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, r = lane / 2, half = lane % 2;
  E* qs = reinterpret_cast<E*>(smem);
  E* gs = qs + WICK_TC_ROWS * ld;
  E* ks = gs + WICK_TC_ROWS * ld;
  E* vs = ks + WICK_TC_COLS * ld;
  float* sc = reinterpret_cast<float*>(vs + WICK_TC_COLS * ld);
  E* dss = reinterpret_cast<E*>(sc + 4 * 32 * WICK_TC_SLD) + warp * 16 * WICK_TC_PLD;
  sc += warp * 32 * WICK_TC_SLD;  // scores, then dO·vᵀ 16 rows on
  float* dp = sc + 16 * WICK_TC_SLD;
  const long long tiles = (n.sq + WICK_TC_ROWS - 1) / WICK_TC_ROWS;
  const float scale = (float)(1.0 / sqrt((double)d));
  for (long long blk = blockIdx.x; blk < n.b * n.h * tiles; blk += gridDim.x) {
    const long long bh = blk / tiles, i0 = (blk % tiles) * WICK_TC_ROWS, i = i0 + warp * 16 + r;
    const long long kend = tile_end(ends, bs, n, bh, i0, WICK_TC_ROWS), iend = row_end(ends, bs, n, bh, i);
    __syncthreads();
    load_tile(q, lq, bh, n.h, i0, n.sq, WICK_TC_ROWS, d, d16, qs, ld);
    load_tile(dout, lo, bh, n.h, i0, n.sq, WICK_TC_ROWS, d, d16, gs, ld);
    __syncthreads();
    float part = 0.f;
    if (i < n.sq) {
      const long long at_o = at(lo, bh, n.h, i);
      for (int c = half; c < d; c += 2) part += wick_load(gs, (long long)(warp * 16 + r) * ld + c) * wick_load(out, at_o + c);
    }
    const float dsum_r = part + __shfl_xor_sync(0xffffffffu, part, 1);
    if (i < n.sq && half == 0) dsum[bh * n.sq + i] = (double)dsum_r;
    const float lse_r = i < n.sq ? (float)lse[bh * n.sq + i] : 0.f;
    FragC acc[8];
#pragma unroll
    for (int nt = 0; nt < 8; nt++) wmma::fill_fragment(acc[nt], 0.f);
    for (long long j0 = 0; j0 < kend; j0 += WICK_TC_COLS) {
      __syncthreads();
      load_tile(k, lk, bh, n.h, j0, kend, WICK_TC_COLS, d, d16, ks, ld);
      load_tile(v, lv, bh, n.h, j0, kend, WICK_TC_COLS, d, d16, vs, ld);
      __syncthreads();
      product_nt(qs + warp * 16 * ld, ks, ld, d16, sc);
      product_nt(gs + warp * 16 * ld, vs, ld, d16, dp);
      __syncwarp();
      for (int c = half; c < WICK_TC_COLS; c += 2) {
        const long long j = j0 + c;
        const bool in = j < iend;
        const float p = in ? expf(scale * sc[r * WICK_TC_SLD + c] + bias_at(bias, bs, bh, n.h, i, j) - lse_r) : 0.f;
        wick_store(dss, r * WICK_TC_PLD + c, in ? p * (dp[r * WICK_TC_SLD + c] - dsum_r) : 0.f);
      }
      __syncwarp();
      product_nn(dss, ks, ld, d16, acc);
    }
    stage(acc, d16, sc, ldo);
    if (i < n.sq) {
      const long long at_q = at(ldq, bh, n.h, i);
      for (int c = half; c < d; c += 2) wick_store(dq, at_q + c, sc[r * ldo + c] * scale);
    }
  }
}

template <typename E>
__device__ void attention_dkdv_tc(const E* q, const E* k, const E* v, const float* bias, const int* ends, const E* dout,
                                  const double* lse, const double* dsum, E* dk, E* dv, Lay lq, Lay lk, Lay lv, Lay lo,
                                  Lay ldk, Lay ldv, Dims n, BiasStrides bs) {
  WICK_DYNAMIC_SHARED(unsigned char, smem);
  const int d = (int)n.d, d16 = (d + 15) / 16 * 16, ld = d16 + 8, ldo = d16 + 4;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, r = lane / 2, half = lane % 2;
  E* ks = reinterpret_cast<E*>(smem);
  E* vs = ks + WICK_TC_ROWS * ld;
  E* qs = vs + WICK_TC_ROWS * ld;
  E* gs = qs + WICK_TC_COLS * ld;
  float* sc = reinterpret_cast<float*>(gs + WICK_TC_COLS * ld);
  E* pts = reinterpret_cast<E*>(sc + 4 * 32 * WICK_TC_SLD);
  E* dsts = pts + 4 * 16 * WICK_TC_PLD;
  float* lse_s = reinterpret_cast<float*>(dsts + 4 * 16 * WICK_TC_PLD);
  float* dsum_s = lse_s + WICK_TC_COLS;
  int* end_s = reinterpret_cast<int*>(dsum_s + WICK_TC_COLS);
  sc += warp * 32 * WICK_TC_SLD;  // kqᵀ, then v·dOᵀ 16 rows on
  float* dpt = sc + 16 * WICK_TC_SLD;
  pts += warp * 16 * WICK_TC_PLD;
  dsts += warp * 16 * WICK_TC_PLD;
  const long long tiles = (n.sk + WICK_TC_ROWS - 1) / WICK_TC_ROWS;
  const float scale = (float)(1.0 / sqrt((double)d));
  for (long long blk = blockIdx.x; blk < n.b * n.h * tiles; blk += gridDim.x) {
    const long long bh = blk / tiles, j0 = (blk % tiles) * WICK_TC_ROWS, j = j0 + warp * 16 + r;
    __syncthreads();
    load_tile(k, lk, bh, n.h, j0, n.sk, WICK_TC_ROWS, d, d16, ks, ld);
    load_tile(v, lv, bh, n.h, j0, n.sk, WICK_TC_ROWS, d, d16, vs, ld);
    FragC ak[8], av[8];
#pragma unroll
    for (int nt = 0; nt < 8; nt++) wmma::fill_fragment(ak[nt], 0.f), wmma::fill_fragment(av[nt], 0.f);
    for (long long i0 = 0; i0 < n.sq; i0 += WICK_TC_COLS) {
      if (tile_end(ends, bs, n, bh, i0, WICK_TC_COLS) <= j0) continue;  // every row ends before these keys
      __syncthreads();
      load_tile(q, lq, bh, n.h, i0, n.sq, WICK_TC_COLS, d, d16, qs, ld);
      load_tile(dout, lo, bh, n.h, i0, n.sq, WICK_TC_COLS, d, d16, gs, ld);
      if (threadIdx.x < WICK_TC_COLS) {
        const long long i = i0 + threadIdx.x;
        lse_s[threadIdx.x] = i < n.sq ? (float)lse[bh * n.sq + i] : 0.f;
        dsum_s[threadIdx.x] = i < n.sq ? (float)dsum[bh * n.sq + i] : 0.f;
        end_s[threadIdx.x] = (int)row_end(ends, bs, n, bh, i);
      }
      __syncthreads();
      product_nt(ks + warp * 16 * ld, qs, ld, d16, sc);
      product_nt(vs + warp * 16 * ld, gs, ld, d16, dpt);
      __syncwarp();
      for (int c = half; c < WICK_TC_COLS; c += 2) {
        const long long i = i0 + c;
        const bool in = j < end_s[c];
        const float p = in ? expf(scale * sc[r * WICK_TC_SLD + c] + bias_at(bias, bs, bh, n.h, i, j) - lse_s[c]) : 0.f;
        wick_store(pts, r * WICK_TC_PLD + c, p);
        wick_store(dsts, r * WICK_TC_PLD + c, in ? p * (dpt[r * WICK_TC_SLD + c] - dsum_s[c]) : 0.f);
      }
      __syncwarp();
      product_nn(pts, gs, ld, d16, av);
      product_nn(dsts, qs, ld, d16, ak);
    }
    // The stores of fragments are the warp's together: every lane stages, the rows in range write.
    stage(ak, d16, sc, ldo);
    if (j < n.sk)
      for (int c = half; c < d; c += 2) wick_store(dk, at(ldk, bh, n.h, j) + c, sc[r * ldo + c] * scale);
    stage(av, d16, sc, ldo);
    if (j < n.sk)
      for (int c = half; c < d; c += 2) wick_store(dv, at(ldv, bh, n.h, j) + c, sc[r * ldo + c]);
  }
}

#define WICK_KERNEL(E, sfx)                                                                                          \
  extern "C" __global__ void wick_attention_tc_##sfx(const E* q, const E* k, const E* v, const float* bias,          \
                                                     const int* ends, E* out, double* lse, Lay lq, Lay lk, Lay lv,   \
                                                     Lay lo, Dims n, BiasStrides bs) {                               \
    attention_forward_tc(q, k, v, bias, ends, out, lse, lq, lk, lv, lo, n, bs);                                      \
  }                                                                                                                  \
  extern "C" __global__ void wick_attention_tc_dq_##sfx(const E* q, const E* k, const E* v, const float* bias,       \
                                                        const int* ends, const E* out, const E* dout,                \
                                                        const double* lse, double* dsum, E* dq, Lay lq, Lay lk,      \
                                                        Lay lv, Lay lo, Lay ldq, Dims n, BiasStrides bs) {           \
    attention_dq_tc(q, k, v, bias, ends, out, dout, lse, dsum, dq, lq, lk, lv, lo, ldq, n, bs);                      \
  }                                                                                                                  \
  extern "C" __global__ void wick_attention_tc_dkdv_##sfx(                                                           \
      const E* q, const E* k, const E* v, const float* bias, const int* ends, const E* dout, const double* lse,       \
      const double* dsum, E* dk, E* dv, Lay lq, Lay lk, Lay lv, Lay lo, Lay ldk, Lay ldv, Dims n, BiasStrides bs) {  \
    attention_dkdv_tc(q, k, v, bias, ends, dout, lse, dsum, dk, dv, lq, lk, lv, lo, ldk, ldv, n, bs);                \
  }

WICK_KERNEL(__half, f16)
WICK_KERNEL(__nv_bfloat16, bf16)
