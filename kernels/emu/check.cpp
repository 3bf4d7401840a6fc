// wick-nn's CUDA kernels (kernels/src/cuda/nn_*.cu) run on the host emulator (emu.h) with the
// launch shapes wick-nn's launchers use (crates/wick-nn/src/native/cuda), against direct
// reference computations in f64 written here: activations, layer/RMS norm, RoPE, cross-entropy,
// embeddings, the broadcast sum of embeddings, max and global average pooling — forward and
// backward; attention, batch norm, the linear layer's passes and the optimizer's step in
// check_*.cpp. Prints one line per check; exits non-zero if any fails.
//
//   g++ -std=c++20 -O1 -g -fsanitize=address -ffp-contract=off -pthread -Wall -Wno-unknown-pragmas -I kernels/emu
//     kernels/emu/check*.cpp -o target/emu-check
//   target/emu-check     (scripts/cuda-ci.sh runs it)
#include "emu.h"

#include <algorithm>
#include <cstdio>
#include <functional>
#include <numeric>
#include <random>
#include <string>

#include "../src/cuda/nn_act.cu"
#undef WICK_KERNEL
#include "../src/cuda/nn_norm.cu"
#undef WICK_KERNEL
#include "../src/cuda/nn_rows.cu"
#undef WICK_KERNEL
#include "../src/cuda/nn_pool.cu"

#include "harness.h"

static void activations() {
  const long long n = 1000;
  auto x = randn(n, 1, 4.0), y = randn(n, 2), g = randn(n, 3);
  x[0] = 0, x[1] = 6;
  auto xf = narrow<float>(x), yf = narrow<float>(y), gf = narrow<float>(g);
  std::vector<float> out(n), out2(n);
  launch(elementwise(n), THREADS, [&] { wick_clamp_f32(xf.data(), out.data(), n, 6.0); });
  std::vector<double> want(n);
  for (long long i = 0; i < n; i++) want[i] = xf[i] <= 0 ? 0 : xf[i] >= 6 ? 6 : xf[i];
  check("relu6 forward", wide(out), want, 0);
  launch(elementwise(n), THREADS, [&] { wick_clamp_grad_f32(xf.data(), gf.data(), out.data(), n, 6.0); });
  for (long long i = 0; i < n; i++) want[i] = xf[i] > 0 && xf[i] < 6 ? gf[i] : 0;
  check("relu6 backward (0 at 0 and 6)", wide(out), want, 0);
  launch(elementwise(n), THREADS, [&] { wick_gelu_grad_f32(xf.data(), gf.data(), out.data(), n, 0.0); });
  for (long long i = 0; i < n; i++) {
    const double v = xf[i];
    want[i] = gf[i] * (0.5 * (1 + std::erf(v / std::sqrt(2.0))) + v * std::exp(-v * v / 2) / std::sqrt(2 * M_PI));
  }
  check("gelu backward", wide(out), want, 1e-5);
  // Packed SiLU·mul: rows of 2w holding a then b.
  const long long rows = 7, w = 100;
  auto u = randn(rows * 2 * w, 4);
  auto uf = narrow<float>(u);
  std::vector<float> yo(rows * w), du(rows * 2 * w);
  auto gg = narrow<float>(randn(rows * w, 5));
  launch(elementwise(rows * w), THREADS, [&] { wick_silu_mul_packed_f32(uf.data(), yo.data(), rows, w); });
  launch(elementwise(rows * w), THREADS, [&] { wick_silu_mul_packed_grad_f32(uf.data(), gg.data(), du.data(), rows, w); });
  std::vector<double> wy(rows * w), wdu(rows * 2 * w);
  for (long long r = 0; r < rows; r++)
    for (long long j = 0; j < w; j++) {
      const double a = uf[r * 2 * w + j], b = uf[r * 2 * w + w + j], s = 1 / (1 + std::exp(-a)), gv = gg[r * w + j];
      wy[r * w + j] = a * s * b;
      wdu[r * 2 * w + j] = gv * b * s * (1 + a * (1 - s));
      wdu[r * 2 * w + w + j] = gv * a * s;
    }
  check("silu_mul packed forward", wide(yo), wy, 1e-6);
  check("silu_mul packed backward", wide(du), wdu, 1e-6);
  // bf16 through the conversions: relu(a + b) and its gradient, a + b exactly 0 at [2].
  std::vector<__nv_bfloat16> ab(n), bb(n), gb(n), ob(n);
  for (long long i = 0; i < n; i++) ab[i] = __float2bfloat16_rn((float)x[i]), bb[i] = __float2bfloat16_rn((float)y[i]), gb[i] = __float2bfloat16_rn((float)g[i]);
  bb[2].bits = ab[2].bits ^ 0x8000;
  launch(elementwise(n), THREADS, [&] { wick_add_relu_grad_bf16(ab.data(), bb.data(), gb.data(), ob.data(), n, 0.0); });
  std::vector<double> got(n);
  for (long long i = 0; i < n; i++) {
    got[i] = __bfloat162float(ob[i]);
    const double s = (double)__bfloat162float(ab[i]) + __bfloat162float(bb[i]);
    want[i] = s > 0 ? __bfloat162float(gb[i]) : 0;
  }
  check("add_relu backward bf16 (0 where a + b = 0)", got, want, 0);
}

// Layer norm (rms = false) or RMS norm, forward and backward, against the direct formulas.
static void norms(bool rms, long long rows, long long d) {
  auto x = randn(rows * d, 10 + d), w = randn(d, 11), b = randn(d, 12), g = randn(rows * d, 13);
  for (auto& v : w) v += 1;
  auto xf = narrow<float>(x), wf = narrow<float>(w), bf = narrow<float>(b), gf = narrow<float>(g);
  std::vector<float> y(rows * d), dx(rows * d), dw(d), db(d);
  std::vector<double> stats(2 * rows);
  const double eps = 1e-5;
  launch(per_row(rows), THREADS, [&] {
    wick_row_norm_f32(xf.data(), wf.data(), rms ? nullptr : bf.data(), y.data(), stats.data(), rows, d, rms, eps);
  });
  launch(per_row(rows), THREADS, [&] { wick_row_norm_input_grad_f32(xf.data(), wf.data(), gf.data(), stats.data(), dx.data(), rows, d, rms); });
  const long long chunk = std::max<long long>(64, (rows + 65534) / 65535), chunks = std::max<long long>(1, (rows + chunk - 1) / chunk);
  std::vector<double> partial(chunks * 2 * d);
  launch(dim3{(unsigned)((d + 255) / 256), (unsigned)chunks, 1}, THREADS,
         [&] { wick_row_norm_weight_partials_f32(xf.data(), gf.data(), stats.data(), partial.data(), rows, d, chunk); });
  launch(elementwise(2 * d), THREADS, [&] { wick_row_norm_weight_sums_f32(partial.data(), dw.data(), db.data(), chunks, d); });
  std::vector<double> wy(rows * d), wdx(rows * d), wdw(d, 0), wdb(d, 0);
  for (long long r = 0; r < rows; r++) {
    double mean = 0, var = 0;
    if (!rms) {
      for (long long j = 0; j < d; j++) mean += xf[r * d + j];
      mean /= d;
    }
    for (long long j = 0; j < d; j++) var += (xf[r * d + j] - mean) * (xf[r * d + j] - mean);
    const double inv = 1 / std::sqrt(var / d + eps);
    double s1 = 0, s2 = 0;
    for (long long j = 0; j < d; j++) {
      const double xh = (xf[r * d + j] - mean) * inv, gw = (double)gf[r * d + j] * wf[j];
      wy[r * d + j] = xh * wf[j] + (rms ? 0 : bf[j]);
      s1 += gw, s2 += gw * xh;
      wdw[j] += gf[r * d + j] * xh, wdb[j] += gf[r * d + j];
    }
    for (long long j = 0; j < d; j++) {
      const double xh = (xf[r * d + j] - mean) * inv, gw = (double)gf[r * d + j] * wf[j];
      wdx[r * d + j] = inv * (gw - (rms ? 0 : s1 / d) - xh * s2 / d);
    }
  }
  const std::string what = std::string(rms ? "rms_norm " : "layer_norm ") + std::to_string(rows) + "x" + std::to_string(d);
  check(what + " forward", wide(y), wy, 1e-5);
  check(what + " dx", wide(dx), wdx, 1e-5);
  check(what + " dweight", wide(dw), wdw, 1e-5);
  if (!rms) check(what + " dbias", wide(db), wdb, 1e-5);
}

static void rope(bool packed) {
  const long long b = 2, h = 3, s = 5, d = 8, half = d / 2;
  const long long width = packed ? 3 * h * d : d, rotated = packed ? 2 * h : 1, rows = packed ? b * s : b * h * s;
  auto x = narrow<float>(randn(rows * width, 30));
  std::vector<float> cos(s * half), sin(s * half), y(x.size());
  for (long long p = 0; p < s; p++)
    for (long long i = 0; i < half; i++) cos[p * half + i] = std::cos(p * 0.3 * (i + 1)), sin[p * half + i] = std::sin(p * 0.3 * (i + 1));
  for (double sign : {1.0, -1.0}) {
    launch(elementwise(x.size()), THREADS, [&] { wick_rope_f32(x.data(), y.data(), cos.data(), sin.data(), rows, s, width, d, rotated, sign); });
    std::vector<double> want(x.begin(), x.end());
    for (long long r = 0; r < rows; r++)
      for (long long hd = 0; hd < rotated; hd++)
        for (long long i = 0; i < half; i++) {
          const long long at = r * width + hd * d + i, pos = r % s;
          const double c = cos[pos * half + i], sn = sign * sin[pos * half + i], x1 = x[at], x2 = x[at + half];
          want[at] = x1 * c - x2 * sn, want[at + half] = x1 * sn + x2 * c;
        }
    check(std::string("rope ") + (packed ? "packed " : "") + (sign > 0 ? "forward" : "backward"), wide(y), want, 1e-6);
  }
}

static void cross_entropy() {
  const long long n = 70, c = 1000;
  auto x = narrow<float>(randn(n * c, 40, 3.0));
  std::vector<unsigned> t(n);
  for (long long i = 0; i < n; i++) t[i] = (unsigned)((i * 7919 + 3) % c);
  t[5] = (unsigned)c;  // outside the vocabulary: NaN
  std::vector<double> lse(n), loss(n);
  std::vector<float> mean(1), dx(n * c), g{2.0f};
  launch(per_row(n), THREADS, [&] { wick_cross_entropy_rows_f32(x.data(), t.data(), lse.data(), loss.data(), n, c); });
  launch(dim3{1, 1, 1}, THREADS, [&] { wick_mean_f32(loss.data(), mean.data(), n); });
  launch(elementwise(n * c), THREADS, [&] { wick_cross_entropy_grad_f32(x.data(), t.data(), lse.data(), g.data(), dx.data(), n, c); });
  std::vector<double> wl(n), wloss(n), wdx(n * c);
  for (long long i = 0; i < n; i++) {
    double m = -INFINITY, sum = 0;
    for (long long j = 0; j < c; j++) m = std::max(m, (double)x[i * c + j]);
    for (long long j = 0; j < c; j++) sum += std::exp(x[i * c + j] - m);
    wl[i] = m + std::log(sum);
    wloss[i] = t[i] < c ? wl[i] - x[i * c + t[i]] : NAN;
    for (long long j = 0; j < c; j++) wdx[i * c + j] = t[i] < c ? (std::exp(x[i * c + j] - wl[i]) - (j == t[i])) * 2.0 / n : NAN;
  }
  check("cross_entropy log-sum-exp", lse, wl, 1e-12);
  check("cross_entropy row losses (NaN for a target outside the vocabulary)", loss, wloss, 1e-12);
  check("cross_entropy mean (NaN with it)", wide(mean), {NAN}, 0);
  check("cross_entropy dx", wide(dx), wdx, 1e-6);
}

static void embedding() {
  const long long v = 50, d = 300, n = 80;
  const unsigned pad = 3;
  auto table = narrow<float>(randn(v * d, 50)), g = narrow<float>(randn(n * d, 51));
  std::vector<unsigned> ids(n);
  for (long long k = 0; k < n; k++) ids[k] = (unsigned)((k * 7919 + 3) % v);
  std::vector<float> y(n * d), dt(v * d, 0.f);
  launch(elementwise(n * d), THREADS, [&] { wick_embedding_f32(table.data(), ids.data(), y.data(), n, d); });
  // The host's preparation (wick-nn's native::cuda::loss::embedding_grad).
  std::vector<unsigned> order, start, run_id;
  for (long long k = 0; k < n; k++)
    if (ids[k] != pad) order.push_back((unsigned)k);
  std::stable_sort(order.begin(), order.end(), [&](unsigned a, unsigned b2) { return ids[a] < ids[b2]; });
  for (size_t i = 0; i < order.size(); i++)
    if (i == 0 || ids[order[i - 1]] != ids[order[i]]) start.push_back((unsigned)i), run_id.push_back(ids[order[i]]);
  const long long runs = (long long)run_id.size();
  start.push_back((unsigned)order.size());
  launch(per_row(runs), THREADS, [&] { wick_embedding_grad_f32(g.data(), order.data(), start.data(), run_id.data(), runs, dt.data(), d); });
  std::vector<double> wy(n * d), wdt(v * d, 0.0);
  for (long long k = 0; k < n; k++)
    for (long long j = 0; j < d; j++) {
      wy[k * d + j] = table[ids[k] * d + j];
      if (ids[k] != pad) wdt[ids[k] * d + j] += g[k * d + j];
    }
  check("embedding forward", wide(y), wy, 0);
  check("embedding backward (padding id's row zero)", wide(dt), wdt, 1e-6);
}

// The broadcast sum of embeddings: y_i = x_i + a_(i mod |a|) + b_(i mod |b|) in f32 left to right,
// rounded once (the host body's arithmetic, so the same bits), in f32 and bf16.
static void add_broadcast() {
  const long long n = 6 * 105, na = 35, nb = 105;
  auto x = narrow<float>(randn(n, 60)), a = narrow<float>(randn(na, 61)), b = narrow<float>(randn(nb, 62));
  std::vector<float> y(n);
  launch(elementwise(n), THREADS, [&] { wick_add_broadcast_f32(x.data(), a.data(), b.data(), y.data(), n, na, nb); });
  std::vector<double> want(n);
  for (long long i = 0; i < n; i++) want[i] = (double)(x[i] + a[i % na] + b[i % nb]);
  check("add_broadcast f32 (the host's sum, bit for bit)", wide(y), want, 0);
  std::vector<__nv_bfloat16> xb(n), ab(na), bb(nb), yb(n);
  for (long long i = 0; i < n; i++) xb[i] = __float2bfloat16_rn(x[i]);
  for (long long i = 0; i < na; i++) ab[i] = __float2bfloat16_rn(a[i]);
  for (long long i = 0; i < nb; i++) bb[i] = __float2bfloat16_rn(b[i]);
  launch(elementwise(n), THREADS, [&] { wick_add_broadcast_bf16(xb.data(), ab.data(), bb.data(), yb.data(), n, na, nb); });
  bool same = true;
  for (long long i = 0; i < n; i++) {
    const float s = __bfloat162float(xb[i]) + __bfloat162float(ab[i % na]) + __bfloat162float(bb[i % nb]);
    same &= yb[i].bits == __float2bfloat16_rn(s).bits;
  }
  check("add_broadcast bf16 (summed in f32, rounded once)", {same ? 0.0 : 1.0}, {0.0}, 0);
}

// Max pooling (first maximum in row-major order, a NaN winning, padding never winning; ties made
// on purpose) and global average pooling, forward and backward.
static void pooling(long long h, long long w, long long k, long long st, long long p, bool nan) {
  const long long planes = 3, oh = (h + 2 * p - k) / st + 1, ow = (w + 2 * p - k) / st + 1;
  auto xd = randn(planes * h * w, 60);
  for (long long i = 0; i < planes * h * w; i += 5) xd[i] = std::round(xd[i]);  // ties
  if (nan) xd[h * w + 4] = NAN;
  auto x = narrow<float>(xd), g = narrow<float>(randn(planes * oh * ow, 61));
  std::vector<float> y(planes * oh * ow), dx(planes * h * w);
  launch(elementwise(y.size()), THREADS, [&] { wick_max_pool_f32(x.data(), y.data(), planes, h, w, oh, ow, k, st, p); });
  launch(elementwise(dx.size()), THREADS, [&] { wick_max_pool_grad_f32(x.data(), g.data(), dx.data(), planes, h, w, oh, ow, k, st, p); });
  std::vector<double> wy(y.size()), wdx(dx.size(), 0.0);
  for (long long pl = 0; pl < planes; pl++)
    for (long long oy = 0; oy < oh; oy++)
      for (long long ox = 0; ox < ow; ox++) {
        long long at = -1;
        double best = 0;
        for (long long iy = std::max(oy * st - p, 0LL); iy < std::min(oy * st - p + k, h); iy++)
          for (long long ix = std::max(ox * st - p, 0LL); ix < std::min(ox * st - p + k, w); ix++) {
            const double v = x[pl * h * w + iy * w + ix];
            if (at < 0 || v > best || std::isnan(v)) best = v, at = iy * w + ix;
          }
        wy[(pl * oh + oy) * ow + ox] = best;
        wdx[pl * h * w + at] += g[(pl * oh + oy) * ow + ox];
      }
  const std::string what = "max_pool " + std::to_string(h) + "x" + std::to_string(w) + " k" + std::to_string(k) + " s" +
                           std::to_string(st) + " p" + std::to_string(p) + (nan ? " with a NaN" : "");
  check(what + " forward", wide(y), wy, 0);
  check(what + " backward", wide(dx), wdx, 1e-6);
  std::vector<float> avg(planes), davg(planes * h * w);
  launch(warps(planes), THREADS, [&] { wick_global_avg_f32(x.data(), avg.data(), planes, h * w); });
  launch(elementwise(davg.size()), THREADS, [&] { wick_global_avg_grad_f32(g.data(), davg.data(), planes, h * w); });
  std::vector<double> wavg(planes, 0.0), wdavg(davg.size());
  for (long long pl = 0; pl < planes; pl++) {
    for (long long i = 0; i < h * w; i++) wavg[pl] += x[pl * h * w + i] / (double)(h * w);
    for (long long i = 0; i < h * w; i++) wdavg[pl * h * w + i] = g[pl] / (double)(h * w);
  }
  check("global_avg_pool " + std::to_string(h) + "x" + std::to_string(w) + (nan ? " with a NaN" : "") + " forward", wide(avg), wavg, 1e-6);
  check("global_avg_pool " + std::to_string(h) + "x" + std::to_string(w) + " backward", wide(davg), wdavg, 1e-6);
}

int main() {
  activations();
  for (bool rms : {false, true}) {
    norms(rms, 130, 37);
    norms(rms, 3, 1000);
    norms(rms, 70, 768);
  }
  attention_checks();
  rope(false);
  rope(true);
  cross_entropy();
  embedding();
  add_broadcast();
  pooling(9, 7, 3, 2, 1, false);
  pooling(9, 7, 3, 2, 1, true);
  pooling(8, 8, 2, 2, 0, false);
  pooling(5, 6, 3, 1, 1, false);
  optimizer_checks();
  batch_norm_checks();
  linear_checks();
  if (failures) {
    std::printf("%d check(s) failed\n", failures);
    return 1;
  }
  std::printf("all kernels agree with the references\n");
  return 0;
}
