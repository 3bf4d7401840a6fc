// The CUDA bodies of wick-nn's row norms (layer norm and RMS norm over the last dimension),
// forward and backward, with the host kernels' arithmetic (wick-nn's `native::row_norm`): each row's
// mean and variance summed in f64, the output computed in the compute type (f32; f64 for f64
// tensors) and rounded once; forward keeps one (mean, inverse deviation) pair per row in f64,
// as the host op does, and backward reads it instead of recomputing the statistics.
//
// Launch shapes: forward and the input gradient take one block of 256 threads (a multiple of 32) per
// row (grid-stride over rows). The weight and bias gradients are column sums over every row:
// summed in f64 per chunk of rows (64, more when there would be over 65 535 chunks) into a partial
// buffer (chunks × 2d), then the partials added in chunk order by a second kernel, so the same
// inputs give the same bits on every run (no atomics).
//
// Weights, biases and their gradients are in the compute type (the host converts them).
#include "common.cuh"

template <typename E>
__device__ void row_norm_forward(const E* x, const typename WickCompute<E>::T* w, const typename WickCompute<E>::T* b,
                                 E* y, double* stats, long long rows, long long d, int rms, double eps) {
  typedef typename WickCompute<E>::T T;
  __shared__ double scratch[32];
  for (long long row = blockIdx.x; row < rows; row += gridDim.x) {
    const E* xr = x + row * d;
    E* yr = y + row * d;
    double mean = 0.0;
    if (!rms) {
      double s = 0.0;
      for (long long j = threadIdx.x; j < d; j += blockDim.x) s += (double)wick_load(xr, j);
      mean = block_sum(s, scratch) / (double)d;
    }
    double q = 0.0;
    for (long long j = threadIdx.x; j < d; j += blockDim.x) {
      const double v = (double)wick_load(xr, j) - mean;
      q += v * v;
    }
    const double var = block_sum(q, scratch) / (double)d;
    const double inv = 1.0 / sqrt(var + eps);
    const T m = (T)mean, i = (T)inv;
    for (long long j = threadIdx.x; j < d; j += blockDim.x) {
      const T v = (T)wick_load(xr, j);
      wick_store(yr, j, b ? (v - m) * i * w[j] + b[j] : v * i * w[j]);
    }
    if (threadIdx.x == 0) {
      stats[2 * row] = mean;
      stats[2 * row + 1] = inv;
    }
  }
}

// dx = inv (g w - mean(g w) - xhat mean(g w xhat)), the first mean 0 for RMS norm.
template <typename E>
__device__ void row_norm_input_grad(const E* x, const typename WickCompute<E>::T* w, const E* g, const double* stats,
                                    E* dx, long long rows, long long d, int rms) {
  typedef typename WickCompute<E>::T T;
  __shared__ double scratch[32];
  for (long long row = blockIdx.x; row < rows; row += gridDim.x) {
    const E *xr = x + row * d, *gr = g + row * d;
    const double mean = stats[2 * row], inv = stats[2 * row + 1];
    double s1 = 0.0, s2 = 0.0;
    for (long long j = threadIdx.x; j < d; j += blockDim.x) {
      const double xhat = ((double)wick_load(xr, j) - mean) * inv;
      const double gw = (double)wick_load(gr, j) * (double)w[j];
      s1 += gw;
      s2 += gw * xhat;
    }
    const double m1 = rms ? 0.0 : block_sum(s1, scratch) / (double)d;
    const double m2 = block_sum(s2, scratch) / (double)d;
    for (long long j = threadIdx.x; j < d; j += blockDim.x) {
      const double xhat = ((double)wick_load(xr, j) - mean) * inv;
      const double gw = (double)wick_load(gr, j) * (double)w[j];
      wick_store(dx + row * d, j, (T)(inv * (gw - m1 - xhat * m2)));
    }
  }
}

// Per chunk of rows c and column j: partial[c][j] = sum g xhat, partial[c][d + j] = sum g.
// Grid: (ceil(d / blockDim.x), chunks).
template <typename E>
__device__ void row_norm_weight_partials(const E* x, const E* g, const double* stats, double* partial, long long rows,
                                         long long d, long long chunk) {
  const long long j = (long long)blockIdx.x * blockDim.x + threadIdx.x, c = blockIdx.y;
  if (j >= d) return;
  const long long first = c * chunk;
  const long long last = first + chunk < rows ? first + chunk : rows;
  double sw = 0.0, sb = 0.0;
  for (long long row = first; row < last; row++) {
    const double gv = (double)wick_load(g, row * d + j);
    sw += gv * (((double)wick_load(x, row * d + j) - stats[2 * row]) * stats[2 * row + 1]);
    sb += gv;
  }
  partial[c * 2 * d + j] = sw;
  partial[c * 2 * d + d + j] = sb;
}

// The sum over chunks, in order, of partial[c][k] for k < 2d, rounded once to the compute type:
// dweight[k] for k < d, dbias[k - d] after.
template <typename T>
__device__ void row_norm_weight_sums(const double* partial, T* dw, T* db, long long chunks, long long d) {
  WICK_FOR_EACH(k, 2 * d) {
    double s = 0.0;
    for (long long c = 0; c < chunks; c++) s += partial[c * 2 * d + k];
    if (k < d) {
      dw[k] = (T)s;
    } else {
      db[k - d] = (T)s;
    }
  }
}

#define WICK_KERNEL(E, sfx)                                                                                          \
  extern "C" __global__ void wick_row_norm_##sfx(const E* x, const WickCompute<E>::T* w, const WickCompute<E>::T* b, \
                                                 E* y, double* stats, long long rows, long long d, int rms,          \
                                                 double eps) {                                                       \
    row_norm_forward(x, w, b, y, stats, rows, d, rms, eps);                                                          \
  }                                                                                                                  \
  extern "C" __global__ void wick_row_norm_input_grad_##sfx(const E* x, const WickCompute<E>::T* w, const E* g,      \
                                                            const double* stats, E* dx, long long rows, long long d, \
                                                            int rms) {                                               \
    row_norm_input_grad(x, w, g, stats, dx, rows, d, rms);                                                           \
  }                                                                                                                  \
  extern "C" __global__ void wick_row_norm_weight_partials_##sfx(const E* x, const E* g, const double* stats,        \
                                                                 double* partial, long long rows, long long d,       \
                                                                 long long chunk) {                                  \
    row_norm_weight_partials(x, g, stats, partial, rows, d, chunk);                                                     \
  }

WICK_FOR_FLOATS(WICK_KERNEL)

extern "C" __global__ void wick_row_norm_weight_sums_f32(const double* partial, float* dw, float* db, long long chunks,
                                                         long long d) {
  row_norm_weight_sums(partial, dw, db, chunks, d);
}
extern "C" __global__ void wick_row_norm_weight_sums_f64(const double* partial, double* dw, double* db,
                                                         long long chunks, long long d) {
  row_norm_weight_sums(partial, dw, db, chunks, d);
}
