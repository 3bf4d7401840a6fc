// The two element passes of wick-nn's linear layer on CUDA (the products are cuBLAS's,
// `native::cuda::linear`): the output's rows filled with the bias before a product that adds onto
// them (beta = 1: the bias added inside the product's f32 sums, the output rounded once, as the
// host op rounds it), and the bias gradient as column sums of the output gradient over every row,
// summed in f64 per chunk of rows, then the chunks added in order (the same bits on every run).
//
// Launch shapes: the fill is grid-stride over rows × n; the partial sums take a grid of
// (ceil(n / 256), chunks) blocks of 256 threads, one column a thread; the finish is grid-stride
// over n.
#include "common.cuh"

// y[r][j] = b[j] for every row r.
template <typename E> __device__ void bias_rows(const E* b, E* y, long long rows, long long n) {
  WICK_FOR_EACH(i, rows * n) y[i] = b[i % n];
}

// partial[c][j] = sum of g[r][j] over the rows r of chunk c.
template <typename E>
__device__ void column_partials(const E* g, double* partial, long long rows, long long n, long long chunk) {
  const long long j = (long long)blockIdx.x * blockDim.x + threadIdx.x, c = blockIdx.y;
  if (j >= n) return;
  const long long first = c * chunk, last = first + chunk < rows ? first + chunk : rows;
  double s = 0.0;
  for (long long r = first; r < last; r++) s += (double)wick_load(g, r * n + j);
  partial[c * n + j] = s;
}

// out[j] = the sum over chunks, in order, of partial[c][j], rounded once to T.
template <typename T> __device__ void column_finish(const double* partial, T* out, long long chunks, long long n) {
  WICK_FOR_EACH(j, n) {
    double s = 0.0;
    for (long long c = 0; c < chunks; c++) s += partial[c * n + j];
    out[j] = (T)s;
  }
}

#define WICK_KERNEL(E, sfx)                                                                                       \
  extern "C" __global__ void wick_bias_rows_##sfx(const E* b, E* y, long long rows, long long n) {               \
    bias_rows(b, y, rows, n);                                                                                     \
  }                                                                                                               \
  extern "C" __global__ void wick_column_partials_##sfx(const E* g, double* partial, long long rows, long long n, \
                                                        long long chunk) {                                       \
    column_partials(g, partial, rows, n, chunk);                                                                  \
  }

WICK_FOR_FLOATS(WICK_KERNEL)

extern "C" __global__ void wick_column_finish_f32(const double* partial, float* out, long long chunks, long long n) {
  column_finish(partial, out, chunks, n);
}
extern "C" __global__ void wick_column_finish_f64(const double* partial, double* out, long long chunks, long long n) {
  column_finish(partial, out, chunks, n);
}
