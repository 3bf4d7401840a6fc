// Batch norm's CUDA kernels (kernels/src/cuda/nn_batch_norm.cu) on the host emulator against a
// direct f64 reference: the per-channel statistics and running estimates, the forward pass with
// each fused activation, and the three gradients, in training (this batch's statistics) and with
// given estimates; segments that split a channel at and across image boundaries, channels looped
// over a short grid, and one bf16 forward pass. Part of target/emu-check (see check.cpp).
#include "harness.h"

#include "../src/cuda/nn_batch_norm.cu"

namespace {

struct Case {
  long long n, c, hw;
  long long seg;     // elements a segment (0: the launchers' rule)
  unsigned grid_y;   // blocks in y, channels looped beyond (0: the launchers' min(C, 65 535))
  int act;           // 0 none, 1 ReLU, 2 ReLU6
  bool batch;        // this batch's statistics (else given estimates)
};

double act_ref(double y, int act) {
  if (act == 0) return y;
  if (y <= 0) return 0;
  return act == 2 && y >= 6 ? 6 : y;
}

void run(const Case& k) {
  const long long n = k.n, c = k.c, hw = k.hw, total = n * c * hw, count = n * hw;
  const long long seg = k.seg ? k.seg : bn_seg(count), segs = (count + seg - 1) / seg;
  char name[160];
  std::snprintf(name, sizeof name, "batch norm %lldx%lldx%lld seg %lld (%lld segs) grid.y %u act %d %s", n, c, hw, seg,
                segs, k.grid_y ? k.grid_y : (unsigned)std::min<long long>(c, 65535), k.act, k.batch ? "batch" : "given");
  const std::string what = name;
  // Channels with their own offset (the two-pass variance matters), weights around 1.
  auto xd = randn(total, 11, 2.0);
  for (long long i = 0; i < total; i++) xd[i] += (double)((i / hw) % c) - 1.5;
  auto x = narrow<float>(xd);
  auto w = narrow<float>(randn(c, 12, 0.5)), b = narrow<float>(randn(c, 13)), g = narrow<float>(randn(total, 14));
  for (auto& v : w) v += 1.0f;
  std::vector<float> old_mean = narrow<float>(randn(c, 15)), old_var(c), new_mean(c, -1), new_var(c, -1);
  for (long long i = 0; i < c; i++) old_var[i] = 0.5f + (float)i / 4;
  const double eps = 1e-5, momentum = 0.1;

  // The reference statistics.
  std::vector<double> mean(c), var(c);
  for (long long ch = 0; ch < c; ch++) {
    double s = 0, q = 0;
    for (long long bi = 0; bi < n; bi++)
      for (long long p = 0; p < hw; p++) s += x[(bi * c + ch) * hw + p];
    const double m = s / count;
    for (long long bi = 0; bi < n; bi++)
      for (long long p = 0; p < hw; p++) q += (x[(bi * c + ch) * hw + p] - m) * (x[(bi * c + ch) * hw + p] - m);
    mean[ch] = k.batch ? m : old_mean[ch];
    var[ch] = k.batch ? q / count : old_var[ch];
  }

  std::vector<double> stats(2 * c), sums(c * segs), squares(c * segs);
  const dim3 grid{(unsigned)segs, k.grid_y ? k.grid_y : (unsigned)std::min<long long>(c, 65535), 1};
  if (k.batch) {
    launch(grid, THREADS, [&] { wick_bn_sums_f32(x.data(), sums.data(), n, c, hw, seg, segs); });
    launch(grid, THREADS, [&] { wick_bn_squares_f32(x.data(), sums.data(), squares.data(), n, c, hw, seg, segs); });
    launch(elementwise(c), THREADS, [&] {
      wick_bn_finish_f32(sums.data(), squares.data(), c, segs, count, eps, stats.data(), old_mean.data(), old_var.data(),
                         new_mean.data(), new_var.data(), momentum, 1);
    });
    std::vector<double> want_mean(c), want_var(c);
    for (long long ch = 0; ch < c; ch++) {
      want_mean[ch] = (float)(old_mean[ch] * (1 - momentum) + mean[ch] * momentum);
      want_var[ch] = (float)(old_var[ch] * (1 - momentum) + var[ch] * ((double)count / (count - 1)) * momentum);
    }
    check(what + ": running estimates", wide(new_mean), want_mean, 1.2e-7);
    check(what + ": running variance (unbiased)", wide(new_var), want_var, 1.2e-7);
  } else {
    launch(elementwise(c), THREADS, [&] { wick_bn_given_f32(old_mean.data(), old_var.data(), c, eps, stats.data()); });
  }
  std::vector<double> want_stats(2 * c);
  for (long long ch = 0; ch < c; ch++) want_stats[ch] = mean[ch], want_stats[c + ch] = 1 / std::sqrt(var[ch] + eps);
  check(what + ": (mean, inverse deviation)", stats, want_stats, 1e-12);

  std::vector<float> affine(2 * c), y(total);
  launch(elementwise(c), THREADS, [&] { wick_bn_affine_f32(w.data(), b.data(), stats.data(), affine.data(), c); });
  launch(elementwise(total), THREADS, [&] { wick_bn_forward_f32(x.data(), affine.data(), y.data(), n, c, hw, k.act); });
  std::vector<double> want(total), yf(total);
  for (long long i = 0; i < total; i++) {
    const long long ch = (i / hw) % c;
    const double scale = w[ch] * want_stats[c + ch], shift = b[ch] - mean[ch] * scale;
    want[i] = act_ref(x[i] * scale + shift, k.act);
    yf[i] = x[i] * (float)scale + (float)shift;  // in f32, as the kernels: the activation's mask
  }
  check(what + ": forward", wide(y), want, 1e-6);

  // Backward (f32 outputs: the kinks themselves, 0 and 6 or ∞).
  const float upper = k.act == 1 ? INFINITY : 6.0f;
  std::vector<double> partial(2 * c * segs);
  std::vector<float> dw(c), db(c), coef(4 * c), dx(total);
  launch(grid, THREADS, [&] {
    wick_bn_grad_sums_f32(x.data(), g.data(), affine.data(), stats.data(), partial.data(), n, c, hw, seg, segs, k.act,
                          0.0f, upper);
  });
  launch(elementwise(c), THREADS, [&] {
    wick_bn_grad_finish_f32(partial.data(), stats.data(), w.data(), c, segs, count, k.batch, dw.data(), db.data(),
                            coef.data());
  });
  launch(elementwise(total), THREADS, [&] {
    wick_bn_input_grad_f32(x.data(), g.data(), affine.data(), coef.data(), dx.data(), n, c, hw, k.act, 0.0f, upper);
  });
  std::vector<double> gp(total), sg(c), sgx(c), want_dx(total);
  for (long long i = 0; i < total; i++) {
    const long long ch = (i / hw) % c;
    gp[i] = k.act == 0 || (yf[i] > 0 && yf[i] < upper) ? g[i] : 0;
    sg[ch] += gp[i];
    sgx[ch] += gp[i] * (x[i] - mean[ch]) * want_stats[c + ch];
  }
  for (long long i = 0; i < total; i++) {
    const long long ch = (i / hw) % c;
    const double inv = want_stats[c + ch], kk = w[ch] * inv;
    want_dx[i] = kk * gp[i];
    if (k.batch) want_dx[i] -= kk * (sg[ch] / count + (x[i] - mean[ch]) * inv * sgx[ch] / count);
  }
  check(what + ": dweight", wide(dw), sgx, 1e-6);
  check(what + ": dbias", wide(db), sg, 1e-6);
  check(what + ": dx", wide(dx), want_dx, 1e-5);
}

// A bf16 forward pass (f32 compute, stored rounded): within bf16's spacing of the reference.
void bf16_forward() {
  const long long n = 2, c = 3, hw = 50, total = n * c * hw, count = n * hw, seg = bn_seg(count), segs = 1;
  auto xd = randn(total, 21, 3.0);
  std::vector<__nv_bfloat16> x(total), y(total);
  for (long long i = 0; i < total; i++) x[i] = __float2bfloat16_rn((float)xd[i]);
  std::vector<float> w{1.5f, 0.5f, -1.0f}, b{0.1f, -0.2f, 0.3f}, mean(c), var(c), new_mean(c), new_var(c), affine(2 * c);
  std::vector<double> sums(c), squares(c), stats(2 * c);
  launch(dim3{1, (unsigned)c, 1}, THREADS, [&] { wick_bn_sums_bf16(x.data(), sums.data(), n, c, hw, seg, segs); });
  launch(dim3{1, (unsigned)c, 1}, THREADS,
         [&] { wick_bn_squares_bf16(x.data(), sums.data(), squares.data(), n, c, hw, seg, segs); });
  launch(elementwise(c), THREADS, [&] {
    wick_bn_finish_f32(sums.data(), squares.data(), c, segs, count, 1e-5, stats.data(), mean.data(), var.data(),
                       new_mean.data(), new_var.data(), 0.1, 0);
  });
  launch(elementwise(c), THREADS, [&] { wick_bn_affine_f32(w.data(), b.data(), stats.data(), affine.data(), c); });
  launch(elementwise(total), THREADS, [&] { wick_bn_forward_bf16(x.data(), affine.data(), y.data(), n, c, hw, 2); });
  std::vector<double> got(total), want(total);
  for (long long ch = 0; ch < c; ch++) {
    double s = 0, q = 0;
    for (long long bi = 0; bi < n; bi++)
      for (long long p = 0; p < hw; p++) s += __bfloat162float(x[(bi * c + ch) * hw + p]);
    const double m = s / count;
    for (long long bi = 0; bi < n; bi++)
      for (long long p = 0; p < hw; p++) {
        const double d = __bfloat162float(x[(bi * c + ch) * hw + p]) - m;
        q += d * d;
      }
    const double scale = w[ch] / std::sqrt(q / count + 1e-5);
    for (long long bi = 0; bi < n; bi++)
      for (long long p = 0; p < hw; p++) {
        const long long i = (bi * c + ch) * hw + p;
        want[i] = act_ref((__bfloat162float(x[i]) - m) * scale + b[ch], 2);
        got[i] = __bfloat162float(y[i]);
      }
  }
  check("batch norm bf16 forward with ReLU6 (within bf16's spacing)", got, want, 8e-3);
}

}  // namespace

void batch_norm_checks() {
  run({8, 5, 63, 300, 2, 1, true});     // segments across images (256 threads: 4 images and 4 positions a step)
  run({2, 3, 700, 600, 3, 2, true});    // positions beyond the block (a step inside one image)
  run({4, 7, 9, 0, 0, 0, true});        // the launchers' rule: one segment a channel
  run({3, 6, 25, 40, 4, 2, false});     // given estimates: no batch terms in dx
  run({5, 4, 16, 0, 0, 1, false});
  bf16_forward();
}
