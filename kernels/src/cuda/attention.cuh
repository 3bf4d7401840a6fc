// What wick-nn's two kinds of attention kernels share (nn_attention.cu on CUDA cores,
// nn_attention_tc.cu on tensor cores): the operands' layouts, the bias and its row ends, warp
// reductions and the loads of a tile of rows into shared memory. See nn_attention.cu for the
// arithmetic and the contract.
#pragma once
#include "common.cuh"

struct Lay {
  long long base, batch, head, row;
};

struct Dims {
  long long b, h, sq, sk, d;
};

struct BiasStrides {
  long long b, h, q, k, eb, eh;
};

#define WICK_ATT_LANES 4      // head_dim <= 32 * WICK_ATT_LANES
#define WICK_ATT_WARPS 4      // warps (and so 128 threads) a block
#define WICK_ATT_MASKED -9900.0

// Rows a warp owns in a tile: fewer in f64 (twice the registers a value).
template <typename T> struct AttRows { static const int R = 8; };
template <> struct AttRows<double> { static const int R = 4; };

template <typename T> __device__ __forceinline__ T warp_sum(T v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

template <typename T> __device__ __forceinline__ T warp_max(T v) {
  for (int o = 16; o > 0; o >>= 1) {
    const T u = __shfl_xor_sync(0xffffffffu, v, o);
    v = u > v ? u : v;
  }
  return v;
}

__device__ __forceinline__ long long at(const Lay& l, long long bh, long long heads, long long i) {
  return l.base + (bh / heads) * l.batch + (bh % heads) * l.head + i * l.row;
}

template <typename T>
__device__ __forceinline__ T bias_at(const T* bias, const BiasStrides& bs, long long bh, long long heads, long long i,
                                     long long j) {
  return bias ? bias[(bh / heads) * bs.b + (bh % heads) * bs.h + i * bs.q + j * bs.k] : T(0);
}

// The keys query row i of head bh weighs (those before the end); 0 past the last row.
__device__ __forceinline__ long long row_end(const int* ends, const BiasStrides& bs, const Dims& n, long long bh,
                                             long long i) {
  if (i >= n.sq) return 0;
  return ends ? (long long)ends[(bh / n.h) * bs.eb + (bh % n.h) * bs.eh + i] : n.sk;
}

// The largest end among query rows i0 … i0 + rows - 1 (every thread reads them: a block-uniform value).
__device__ __forceinline__ long long tile_end(const int* ends, const BiasStrides& bs, const Dims& n, long long bh,
                                              long long i0, long long rows) {
  long long e = 0;
  for (long long r = 0; r < rows; r++) {
    const long long x = row_end(ends, bs, n, bh, i0 + r);
    e = x > e ? x : e;
  }
  return e;
}

// Rows r0 … r0 + rows - 1 of an operand into shared memory (row r at dst + r·stride) in dst's type
// (the compute type on CUDA cores, the storage type on tensor cores), `width` columns a row of
// which d … width - 1 are zero (a head dimension padded to the tensor cores' 16); zero past the
// operand's last row. Every thread of the block takes part.
template <typename E, typename D>
__device__ __forceinline__ void load_tile(const E* p, const Lay& l, long long bh, long long heads, long long r0,
                                          long long last, int rows, int d, int width, D* dst, int stride) {
  typedef typename WickCompute<E>::T T;
  for (int e = threadIdx.x; e < rows * width; e += blockDim.x) {
    const int r = e / width, c = e - r * width;
    const T x = r0 + r < last && c < d ? (T)wick_load(p, at(l, bh, heads, r0 + r) + c) : T(0);
    wick_store(dst, (long long)r * stride + c, x);
  }
}

// s[r] += rows[r·d + c] · own[c] summed over c < d in column order, for the R rows at `rows` (shared
// memory, the same for the whole warp: broadcast reads) and this lane's row `own` (shared memory):
// in f32 four columns of the rows a load where d is a multiple of 4, one otherwise.
template <int R, typename T>
__device__ __forceinline__ void dot_rows(const T* rows, int d, const T* own, T* s) {
  int c = 0;
  if constexpr (sizeof(T) == 4) {
    if ((d & 3) == 0) {
      for (; c < d; c += 4) {
        const T o0 = own[c], o1 = own[c + 1], o2 = own[c + 2], o3 = own[c + 3];
#pragma unroll
        for (int r = 0; r < R; r++) {
          const float4 x = *reinterpret_cast<const float4*>(rows + r * d + c);
          s[r] += x.x * o0;
          s[r] += x.y * o1;
          s[r] += x.z * o2;
          s[r] += x.w * o3;
        }
      }
    }
  }
  for (; c < d; c++) {
    const T o = own[c];
#pragma unroll
    for (int r = 0; r < R; r++) s[r] += rows[r * d + c] * o;
  }
}

// acc[r][t] += w[r·32 + jj] · tile[jj·stride + lane + 32t] over the 32 rows jj of a tile, in jj's
// order: w the warp's R rows of weights (probabilities or ds; shared memory, read as broadcasts),
// tile 32 rows of values in shared memory; only the chunks t of 32 columns that hold some of the
// d columns (`lanes` of them) are added to.
template <int R, typename T>
__device__ __forceinline__ void add_rows(T (&acc)[R][WICK_ATT_LANES], const T* w, const T* tile, int stride, int d,
                                         int lanes) {
  const int lane = threadIdx.x % 32;
#pragma unroll 4
  for (int jj = 0; jj < 32; jj++) {
    T x[WICK_ATT_LANES];
#pragma unroll
    for (int t = 0; t < WICK_ATT_LANES; t++) {
      const int c = lane + 32 * t;
      x[t] = c < d ? tile[jj * stride + c] : T(0);
    }
#pragma unroll
    for (int r = 0; r < R; r++) {
      const T wr = w[r * 32 + jj];
#pragma unroll
      for (int t = 0; t < WICK_ATT_LANES; t++)
        if (t < lanes) acc[r][t] += wr * x[t];
    }
  }
}

