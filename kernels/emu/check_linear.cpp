// The linear layer's element passes (kernels/src/cuda/nn_linear.cu) on the host emulator: the
// bias rows a product adds onto, and the bias gradient's column sums (chunks of rows, added in
// order), against direct sums in f64. Part of target/emu-check (see check.cpp).
#include "harness.h"

#include "../src/cuda/nn_linear.cu"

void linear_checks() {
  for (long long rows : {1LL, 130LL, 300LL}) {
    const long long n = 37, chunk = 64, chunks = (rows + chunk - 1) / chunk;
    auto b = narrow<float>(randn(n, 31)), g = narrow<float>(randn(rows * n, 32));
    std::vector<float> y(rows * n, -1), db(n);
    std::vector<double> partial(chunks * n, -1);
    launch(elementwise(rows * n), THREADS, [&] { wick_bias_rows_f32(b.data(), y.data(), rows, n); });
    std::vector<double> want(rows * n), sums(n);
    for (long long i = 0; i < rows * n; i++) want[i] = b[i % n], sums[i % n] += g[i];
    check("linear bias rows (" + std::to_string(rows) + " rows)", wide(y), want, 0);
    launch(dim3{(unsigned)((n + 255) / 256), (unsigned)chunks, 1}, THREADS,
           [&] { wick_column_partials_f32(g.data(), partial.data(), rows, n, chunk); });
    launch(elementwise(n), THREADS, [&] { wick_column_finish_f32(partial.data(), db.data(), chunks, n); });
    check("linear bias gradient (" + std::to_string(chunks) + " chunks)", wide(db), sums, 1e-7);
  }
  // bf16 rows: the bias copied bit for bit.
  std::vector<__nv_bfloat16> b(5), y(15);
  for (int j = 0; j < 5; j++) b[j] = __float2bfloat16_rn(0.3f * (float)j - 0.7f);
  launch(elementwise(15), THREADS, [&] { wick_bias_rows_bf16(b.data(), y.data(), 3, 5); });
  bool same = true;
  for (int i = 0; i < 15; i++) same &= y[i].bits == b[i % 5].bits;
  check("linear bias rows bf16, bit for bit", {same ? 0.0 : 1.0}, {0.0}, 0);
}
