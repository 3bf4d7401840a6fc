// The optimizer's step (kernels/src/cuda/optim_step.cu) on the host emulator, to the bit: the
// per-tensor and multi-tensor updates against the host loops' arithmetic, and the step's scalars
// computed on the device (`wick_step_scalars`: AdamW's constants, the step counter, clipping's
// norm and coefficient, the skip flags) against the same values computed here with std::pow in
// f64 — independent of the kernel's repeated squaring. Part of target/emu-check (see check.cpp).
#include "harness.h"

#include <numeric>

#include "../src/cuda/optim_step.cu"
#include "../src/cuda/amp_unscale.cu"

// A table (table.cuh) of the tensors whose K addresses a tensor are `flat` and lengths `lens`.
template <int K>
static WickTable<K> table(const std::vector<long long>& flat, const std::vector<long long>& lens) {
  WickTable<K> t{};
  t.count = (int)lens.size();
  for (size_t i = 0; i < flat.size(); i++) t.ptrs[i] = flat[i];
  for (size_t i = 0; i < lens.size(); i++) t.lens[i] = lens[i];
  return t;
}

// The optimizer's step (optim_step.cu) against the host loops' arithmetic (wick_kernels::cpu::optim,
// transcribed: the same operations in the same order, each rounded to f32), to the bit: SGD with
// momentum and AdamW, on an f32 parameter and on an f32 master with a bf16 model copy, the state
// updated in place as the trainer does.
static void optimizer() {
  const long long n = 3001;
  auto p0 = narrow<float>(randn(n, 70)), g32 = narrow<float>(randn(n, 71, 3.0)), m0 = narrow<float>(randn(n, 72, 0.1));
  std::vector<float> v0(n);
  for (long long i = 0; i < n; i++) v0[i] = std::fabs(m0[i]) * 0.5f;
  std::vector<__nv_bfloat16> gb(n);
  for (long long i = 0; i < n; i++) gb[i] = __float2bfloat16_rn(g32[i]);
  const double lr = 1e-3, beta1 = 0.9, beta2 = 0.999, eps_d = 1e-8, wd = 0.01;
  const int step = 3;
  const double bc1 = 1 - std::pow(beta1, step), bc2 = 1 - std::pow(beta2, step);
  const float step_size = (float)(lr / bc1), inv_bc2_sqrt = (float)(1 / std::sqrt(bc2)), decay = (float)(1 - lr * wd);
  const float b1 = (float)beta1, b2 = (float)beta2, c1 = (float)(1 - beta1), c2 = (float)(1 - beta2), eps = (float)eps_d;
  // The block of scalars the multi-tensor kernels read (WickStepSlot's order), from the values above.
  const auto block = [&](float factor, bool skip) {
    std::vector<float> s(WICK_SLOTS);
    s[WICK_SLOT_B1] = b1, s[WICK_SLOT_B2] = b2, s[WICK_SLOT_C1] = c1, s[WICK_SLOT_C2] = c2, s[WICK_SLOT_EPS] = eps;
    s[WICK_SLOT_DECAY] = decay, s[WICK_SLOT_STEP_SIZE] = step_size, s[WICK_SLOT_INV_BC2_SQRT] = inv_bc2_sqrt;
    s[WICK_SLOT_LR] = (float)0.05, s[WICK_SLOT_MOMENTUM] = (float)0.9, s[WICK_SLOT_FACTOR] = factor;
    s[WICK_SLOT_SKIP] = skip ? 1.0f : 0.0f;
    return s;
  };
  const auto plain = block(1.0f, false);
  for (bool bf16 : {false, true}) {
    auto p = p0, m = m0, v = v0;
    std::vector<__nv_bfloat16> model(n);
    if (bf16) {
      launch(elementwise(n), THREADS, [&] {
        wick_adamw_step_bf16(p.data(), m.data(), v.data(), m.data(), v.data(), gb.data(), model.data(), n, b1, b2, c1, c2, eps, decay,
                             step_size, inv_bc2_sqrt);
      });
    } else {
      launch(elementwise(n), THREADS, [&] {
        wick_adamw_step_f32(p.data(), m.data(), v.data(), m.data(), v.data(), g32.data(), nullptr, n, b1, b2, c1, c2, eps, decay,
                            step_size, inv_bc2_sqrt);
      });
    }
    std::vector<double> wp(n), wm(n), wv(n), gotm(n), gotv(n), wmodel(n), gotmodel(n);
    for (long long i = 0; i < n; i++) {
      const float gi = bf16 ? __bfloat162float(gb[i]) : g32[i];
      const float mi = b1 * m0[i] + c1 * gi;
      const float vi = b2 * v0[i] + c2 * gi * gi;
      const float denom = std::sqrt(vi) * inv_bc2_sqrt + eps;
      const float w = p0[i] * decay - step_size * mi / denom;
      wp[i] = w, wm[i] = mi, wv[i] = vi, gotm[i] = m[i], gotv[i] = v[i];
      wmodel[i] = __bfloat162float(__float2bfloat16_rn(w)), gotmodel[i] = __bfloat162float(model[i]);
    }
    const std::string what = std::string("AdamW step ") + (bf16 ? "(bf16 gradient, f32 master, bf16 model)" : "(f32)");
    check(what + " parameter, to the bit", wide(p), wp, 0);
    check(what + " moments, to the bit", [&] { auto a = gotm; a.insert(a.end(), gotv.begin(), gotv.end()); return a; }(),
          [&] { auto a = wm; a.insert(a.end(), wv.begin(), wv.end()); return a; }(), 0);
    if (bf16) check(what + " model copy, to the bit", gotmodel, wmodel, 0);
  }
  auto p = p0, b = m0;
  const float lrf = (float)0.05, mu = (float)0.9;
  launch(elementwise(n), THREADS, [&] { wick_sgd_momentum_f32(p.data(), b.data(), b.data(), g32.data(), nullptr, n, lrf, mu); });
  std::vector<double> wp(n), wb(n);
  for (long long i = 0; i < n; i++) {
    const float bi = mu * m0[i] + g32[i];
    wb[i] = bi, wp[i] = p0[i] - lrf * bi;
  }
  check("SGD momentum step (f32) parameter, to the bit", wide(p), wp, 0);
  check("SGD momentum step (f32) buffer, to the bit", wide(b), wb, 0);

  // The multi-tensor forms against the single-tensor kernels, to the bit: three tensors of
  // different lengths (one, 1 000, 3 001 elements) in one launch, bf16 gradients and model copies.
  const long long lens[3] = {1, 1000, 3001};
  std::vector<std::vector<float>> ps, ms, vs, ps1, ms1, vs1;
  std::vector<std::vector<__nv_bfloat16>> gs, models, models1;
  for (int t = 0; t < 3; t++) {
    auto pt = narrow<float>(randn(lens[t], 80 + t)), mt = narrow<float>(randn(lens[t], 90 + t, 0.1));
    std::vector<float> vt(lens[t]);
    for (long long i = 0; i < lens[t]; i++) vt[i] = std::fabs(mt[i]);
    std::vector<__nv_bfloat16> gt(lens[t]);
    auto gd = randn(lens[t], 100 + t);
    for (long long i = 0; i < lens[t]; i++) gt[i] = __float2bfloat16_rn((float)gd[i]);
    ps.push_back(pt), ms.push_back(mt), vs.push_back(vt), gs.push_back(gt), models.emplace_back(lens[t]);
  }
  ps1 = ps, ms1 = ms, vs1 = vs, models1 = models;
  std::vector<long long> ptrs, lens_v(lens, lens + 3);
  for (int t = 0; t < 3; t++) {
    for (void* q : {(void*)ps[t].data(), (void*)ms[t].data(), (void*)vs[t].data(), (void*)gs[t].data(), (void*)models[t].data()})
      ptrs.push_back((long long)(intptr_t)q);
  }
  launch(dim3{4, 3, 1}, THREADS, [&] {
    wick_adamw_multi_bf16(table<5>(ptrs, lens_v), plain.data(), nullptr);
  });
  bool same = true;
  for (int t = 0; t < 3; t++) {
    launch(elementwise(lens[t]), THREADS, [&] {
      wick_adamw_step_bf16(ps1[t].data(), ms1[t].data(), vs1[t].data(), ms1[t].data(), vs1[t].data(), gs[t].data(), models1[t].data(),
                           lens[t], b1, b2, c1, c2, eps, decay, step_size, inv_bc2_sqrt);
    });
    for (long long i = 0; i < lens[t]; i++) {
      same &= ps[t][i] == ps1[t][i] && ms[t][i] == ms1[t][i] && vs[t][i] == vs1[t][i] && models[t][i].bits == models1[t][i].bits;
    }
  }
  check("AdamW multi-tensor (3 tensors, bf16) = one launch each, to the bit", {same ? 0.0 : 1.0}, {0.0}, 0);
  std::vector<long long> sptrs;
  for (int t = 0; t < 3; t++) {
    for (void* q : {(void*)ps[t].data(), (void*)ms[t].data(), (void*)gs[t].data(), (void*)models[t].data()})
      sptrs.push_back((long long)(intptr_t)q);
  }
  const float clear = 0.0f;
  launch(dim3{4, 3, 1}, THREADS, [&] { wick_sgd_momentum_multi_bf16(table<4>(sptrs, lens_v), plain.data(), &clear); });
  same = true;
  for (int t = 0; t < 3; t++) {
    launch(elementwise(lens[t]), THREADS, [&] {
      wick_sgd_momentum_bf16(ps1[t].data(), ms1[t].data(), ms1[t].data(), gs[t].data(), models1[t].data(), lens[t], lrf, mu);
    });
    for (long long i = 0; i < lens[t]; i++) same &= ps[t][i] == ps1[t][i] && ms[t][i] == ms1[t][i] && models[t][i].bits == models1[t][i].bits;
  }
  check("SGD momentum multi-tensor (3 tensors, bf16) = one launch each, to the bit", {same ? 0.0 : 1.0}, {0.0}, 0);
  // With the loss scaler's flag raised, a multi-tensor launch changes nothing.
  const float raised = 1.0f;
  const auto before_p = ps, before_m = ms, before_v = vs;
  const auto before_models = models;
  launch(dim3{4, 3, 1}, THREADS, [&] {
    wick_adamw_multi_bf16(table<5>(ptrs, lens_v), plain.data(), &raised);
  });
  launch(dim3{4, 3, 1}, THREADS, [&] { wick_sgd_momentum_multi_bf16(table<4>(sptrs, lens_v), plain.data(), &raised); });
  same = ps == before_p && ms == before_m && vs == before_v;
  for (int t = 0; t < 3; t++)
    for (long long i = 0; i < lens[t]; i++) same &= models[t][i].bits == before_models[t][i].bits;
  check("multi-tensor steps with the inf flag raised change nothing", {same ? 0.0 : 1.0}, {0.0}, 0);
  const auto skipped = block(1.0f, true);
  launch(dim3{4, 3, 1}, THREADS, [&] { wick_adamw_multi_bf16(table<5>(ptrs, lens_v), skipped.data(), &clear); });
  launch(dim3{4, 3, 1}, THREADS, [&] { wick_sgd_momentum_multi_bf16(table<4>(sptrs, lens_v), skipped.data(), nullptr); });
  same = ps == before_p && ms == before_m && vs == before_v;
  for (int t = 0; t < 3; t++)
    for (long long i = 0; i < lens[t]; i++) same &= models[t][i].bits == before_models[t][i].bits;
  check("multi-tensor steps with the block's skip flag raised change nothing", {same ? 0.0 : 1.0}, {0.0}, 0);
  // Gradient clipping's factor: each bf16 gradient element widened, times the factor (rounded),
  // then the step — the same as the single f32 kernel given those products as its gradient.
  const float factor = 0.37f;
  const auto clipped = block(factor, false);
  ps1 = ps, ms1 = ms, vs1 = vs;
  launch(dim3{4, 3, 1}, THREADS, [&] {
    wick_adamw_multi_bf16(table<5>(ptrs, lens_v), clipped.data(), nullptr);
  });
  same = true;
  for (int t = 0; t < 3; t++) {
    std::vector<float> scaled(lens[t]);
    for (long long i = 0; i < lens[t]; i++) scaled[i] = __bfloat162float(gs[t][i]) * factor;
    launch(elementwise(lens[t]), THREADS, [&] {
      wick_adamw_step_f32(ps1[t].data(), ms1[t].data(), vs1[t].data(), ms1[t].data(), vs1[t].data(), scaled.data(), nullptr, lens[t],
                          b1, b2, c1, c2, eps, decay, step_size, inv_bc2_sqrt);
    });
    for (long long i = 0; i < lens[t]; i++) {
      same &= ps[t][i] == ps1[t][i] && ms[t][i] == ms1[t][i] && vs[t][i] == vs1[t][i] &&
              models[t][i].bits == __float2bfloat16_rn(ps1[t][i]).bits;
    }
  }
  check("AdamW multi-tensor with a clipping factor = the step on the scaled gradient, to the bit", {same ? 0.0 : 1.0}, {0.0}, 0);
  ps1 = ps, ms1 = ms;
  launch(dim3{4, 3, 1}, THREADS, [&] { wick_sgd_momentum_multi_bf16(table<4>(sptrs, lens_v), clipped.data(), &clear); });
  same = true;
  for (int t = 0; t < 3; t++) {
    std::vector<float> scaled(lens[t]);
    for (long long i = 0; i < lens[t]; i++) scaled[i] = __bfloat162float(gs[t][i]) * factor;
    launch(elementwise(lens[t]), THREADS, [&] {
      wick_sgd_momentum_f32(ps1[t].data(), ms1[t].data(), ms1[t].data(), scaled.data(), nullptr, lens[t], lrf, mu);
    });
    for (long long i = 0; i < lens[t]; i++) same &= ps[t][i] == ps1[t][i] && ms[t][i] == ms1[t][i];
  }
  check("SGD momentum multi-tensor with a clipping factor = the step on the scaled gradient, to the bit", {same ? 0.0 : 1.0}, {0.0}, 0);
  // Clipping's squared norm: the partial sums of every (block, tensor), added up in order as the
  // host does, against the plain f64 sum of the widened squares.
  std::vector<long long> gptrs;
  for (int t = 0; t < 3; t++) gptrs.push_back((long long)(intptr_t)gs[t].data());
  const int gx = 4;
  std::vector<double> partials(3 * gx, -1.0);
  launch(dim3{gx, 3, 1}, THREADS, [&] { wick_squares_multi_bf16(table<1>(gptrs, lens_v), partials.data()); });
  double got = 0.0, want = 0.0;
  for (double p : partials) got += p;
  for (int t = 0; t < 3; t++)
    for (long long i = 0; i < lens[t]; i++) want += (double)__bfloat162float(gs[t][i]) * (double)__bfloat162float(gs[t][i]);
  check("squared norm over 3 bf16 tensors (one launch, partials in order)", {got}, {want}, 1e-12);
}

// `wick_step_scalars` against the host's rule (wick_kernels::step_scalars::host, transcribed with
// std::pow): every value of the block to the bit at steps 1-800 (1-60 for the other two
// settings) and four far ones (to 2·10^7), the counter advanced by each step; a step under the
// scaler's flag skipped without moving the counter; and clipping from partial sums in three
// sections — the norm, the coefficient, a bound that does not clip, and a NaN sum (an error
// without the scaler's flag, a plain skip with it).
static void step_scalars() {
  struct Setting { double lr, beta1, beta2, eps, wd, momentum; };
  const auto one = [](std::vector<double>& hyper, int& counter, const float* inf, const double* partials, long long e0,
                      long long e1, long long e2, double* norm) {
    std::vector<float> out(WICK_SLOTS, -7.0f);
    launch(dim3{1, 1, 1}, dim3{32, 1, 1},
           [&] { wick_step_scalars(hyper.data(), &counter, inf, partials, e0, e1, e2, out.data(), norm); });
    return out;
  };
  for (const Setting& h : {Setting{1e-3, 0.9, 0.999, 1e-8, 0.01, 0.0}, Setting{3e-4, 0.9, 0.95, 1e-6, 0.1, 0.0},
                           Setting{0.05, 0.0, 0.0, 0.0, 0.0, 0.9}}) {
    std::vector<double> hyper = {h.lr, h.beta1, h.beta2, h.eps, h.wd, h.momentum, 0.0};
    int counter = 0, mismatches = 0;
    // Steps 1 to 800 in turn, then far ones (the counter set just below each).
    std::vector<int> steps(h.lr == 1e-3 ? 800 : 60);
    std::iota(steps.begin(), steps.end(), 1);
    for (int far : {10000, 123457, 1000000, 20000000}) steps.push_back(far);
    for (int t : steps) {
      counter = t - 1;
      const auto out = one(hyper, counter, nullptr, nullptr, 0, 0, 0, nullptr);
      const double bc1 = 1 - std::pow(h.beta1, t), bc2 = 1 - std::pow(h.beta2, t);
      const float want[WICK_SLOTS] = {(float)h.beta1, (float)h.beta2, (float)(1 - h.beta1), (float)(1 - h.beta2), (float)h.eps,
                                      (float)(1 - h.lr * h.wd), (float)(h.lr / bc1), (float)(1 / std::sqrt(bc2)), (float)h.lr,
                                      (float)h.momentum, 1.0f, 0.0f, 0.0f};
      for (int k = 0; k < WICK_SLOTS; k++) mismatches += std::memcmp(&out[k], &want[k], sizeof(float)) != 0;
      mismatches += counter != t;
    }
    check("step scalars on the device, " + std::to_string(steps.size()) + " steps to 2e7 (lr " + std::to_string(h.lr) + ", betas " + std::to_string(h.beta1) + "/" +
              std::to_string(h.beta2) + "), to the bit",
          {(double)mismatches}, {0.0}, 0);
  }
  std::vector<double> hyper = {1e-3, 0.9, 0.999, 1e-8, 0.01, 0.0, 1.0};
  int counter = 4;
  const float raised = 1.0f, clear = 0.0f;
  auto out = one(hyper, counter, &raised, nullptr, 0, 0, 0, nullptr);
  const bool kept = counter == 4 && out[WICK_SLOT_SKIP] == 1.0f && out[WICK_SLOT_BAD_NORM] == 0.0f;
  out = one(hyper, counter, &clear, nullptr, 0, 0, 0, nullptr);
  const float step5 = (float)(1e-3 / (1 - std::pow(0.9, 5)));
  check("a step under the scaler's flag is skipped and does not move the counter; the next is step 5",
        {kept ? 0.0 : 1.0, (double)counter, (double)out[WICK_SLOT_STEP_SIZE], (double)out[WICK_SLOT_SKIP]},
        {0.0, 5.0, (double)step5, 0.0}, 0);
  // Clipping: sections of 2, 0 and 3 partial sums.
  std::vector<double> partials = {0.75, 1.5, 0.125, 2.0, 0.3};
  double norm = -1.0;
  out = one(hyper, counter, nullptr, partials.data(), 2, 2, 5, &norm);
  const double total = (0.0 + (0.0 + 0.75 + 1.5)) + 0.0 + (0.0 + 0.125 + 2.0 + 0.3), root = std::sqrt(total);
  const float coefficient = (float)std::min(1.0 / (root + 1e-6), 1.0);
  check("clipping on the device: the norm of three sections and its coefficient, to the bit",
        {norm, (double)out[WICK_SLOT_FACTOR], (double)out[WICK_SLOT_SKIP], (double)counter},
        {root, (double)coefficient, 0.0, 6.0}, 0);
  hyper[WICK_HYPER_MAX_NORM] = 1e3;
  out = one(hyper, counter, nullptr, partials.data(), 2, 2, 5, &norm);
  check("clipping on the device within the bound: the coefficient is exactly 1", {(double)out[WICK_SLOT_FACTOR]}, {1.0}, 0);
  partials[3] = std::nan("");
  out = one(hyper, counter, nullptr, partials.data(), 2, 2, 5, &norm);
  const bool bad = out[WICK_SLOT_BAD_NORM] == 1.0f && out[WICK_SLOT_SKIP] == 1.0f && counter == 7 && std::isnan(norm);
  out = one(hyper, counter, &raised, partials.data(), 2, 2, 5, &norm);
  const bool excused = out[WICK_SLOT_BAD_NORM] == 0.0f && out[WICK_SLOT_SKIP] == 1.0f && counter == 7;
  check("a NaN norm skips the step: an error without the scaler's flag, a plain skip with it",
        {bad ? 0.0 : 1.0, excused ? 0.0 : 1.0}, {0.0, 0.0}, 0);
}

// More tensors than a table holds: AdamW over 82 f32 tensors (a table takes 80) in two launches,
// clipping's squares over 245 bf16 tensors (240 a table) in two with the partials moved on
// between them, and the unscale over the same 245 — each against one launch per tensor (or the
// plain sum of squares), to the bit.
static void tables() {
  const dim3 WARP{32, 1, 1};  // one warp a block: the tables' walk does not depend on the block's size
  const int many = 82, cap5 = WICK_TABLE_CAPACITY(5);
  std::vector<std::vector<float>> p(many), m(many), v(many), g(many);
  std::vector<long long> lens(many);
  for (int t = 0; t < many; t++) {
    lens[t] = 1 + (t * 37) % 300;
    p[t] = narrow<float>(randn(lens[t], 300 + t)), m[t] = narrow<float>(randn(lens[t], 500 + t, 0.1));
    g[t] = narrow<float>(randn(lens[t], 700 + t));
    v[t].resize(lens[t]);
    for (long long i = 0; i < lens[t]; i++) v[t][i] = std::fabs(m[t][i]);
  }
  auto p1 = p, m1 = m, v1 = v;
  std::vector<float> block(WICK_SLOTS, 0.0f);
  block[WICK_SLOT_B1] = 0.9f, block[WICK_SLOT_B2] = 0.999f, block[WICK_SLOT_C1] = (float)(1 - 0.9), block[WICK_SLOT_C2] = (float)(1 - 0.999);
  block[WICK_SLOT_EPS] = 1e-8f, block[WICK_SLOT_DECAY] = 0.99999f, block[WICK_SLOT_STEP_SIZE] = 0.01f;
  block[WICK_SLOT_INV_BC2_SQRT] = 31.6f, block[WICK_SLOT_FACTOR] = 1.0f;
  for (int start = 0; start < many; start += cap5) {
    const int end = std::min(many, start + cap5);
    std::vector<long long> flat, chunk(lens.begin() + start, lens.begin() + end);
    for (int t = start; t < end; t++)
      for (void* q : {(void*)p[t].data(), (void*)m[t].data(), (void*)v[t].data(), (void*)g[t].data(), (void*)nullptr})
        flat.push_back((long long)(intptr_t)q);
    launch(dim3{2, (unsigned)(end - start), 1}, WARP, [&] { wick_adamw_multi_f32(table<5>(flat, chunk), block.data(), nullptr); });
  }
  bool same = true;
  for (int t = 0; t < many; t++) {
    launch(dim3{1, 1, 1}, WARP, [&] {
      wick_adamw_step_f32(p1[t].data(), m1[t].data(), v1[t].data(), m1[t].data(), v1[t].data(), g[t].data(), nullptr, lens[t], 0.9f,
                          0.999f, (float)(1 - 0.9), (float)(1 - 0.999), 1e-8f, 0.99999f, 0.01f, 31.6f);
    });
    same &= p[t] == p1[t] && m[t] == m1[t] && v[t] == v1[t];
  }
  check("AdamW over 82 tensors in two tables = one launch each, to the bit", {same ? 0.0 : 1.0}, {0.0}, 0);

  const int n = 245, cap1 = WICK_TABLE_CAPACITY(1), gx = 2;
  std::vector<std::vector<__nv_bfloat16>> gb(n);
  std::vector<long long> blens(n);
  double want = 0.0;
  bool seeded_inf = false;
  for (int t = 0; t < n; t++) {
    blens[t] = 1 + (t * 53) % 200;
    auto d = randn(blens[t], 900 + t);
    gb[t].resize(blens[t]);
    for (long long i = 0; i < blens[t]; i++) {
      gb[t][i] = __float2bfloat16_rn((float)d[i]);
      want += (double)__bfloat162float(gb[t][i]) * (double)__bfloat162float(gb[t][i]);
    }
  }
  std::vector<double> partials(n * gx, -1.0);
  for (int start = 0; start < n; start += cap1) {
    const int end = std::min(n, start + cap1);
    std::vector<long long> flat, chunk(blens.begin() + start, blens.begin() + end);
    for (int t = start; t < end; t++) flat.push_back((long long)(intptr_t)gb[t].data());
    double* at = partials.data() + (long long)start * gx;
    launch(dim3{gx, (unsigned)(end - start), 1}, WARP, [&] { wick_squares_multi_bf16(table<1>(flat, chunk), at); });
  }
  double got = 0.0;
  for (double q : partials) got += q;
  check("squared norm over 245 bf16 tensors in two tables (partials moved on)", {got}, {want}, 1e-12);
  // The unscale over the same tables: every element times 1/4 (exact in bf16), the flag raised
  // only once an inf is put in the second table.
  for (int pass = 0; pass < 2; pass++) {
    if (pass == 1) gb[n - 1][0] = __float2bfloat16_rn(INFINITY), seeded_inf = true;
    auto before = gb;
    float found = 0.0f;
    const float inv = 0.25f;
    for (int start = 0; start < n; start += cap1) {
      const int end = std::min(n, start + cap1);
      std::vector<long long> flat, chunk(blens.begin() + start, blens.begin() + end);
      for (int t = start; t < end; t++) flat.push_back((long long)(intptr_t)gb[t].data());
      launch(dim3{gx, (unsigned)(end - start), 1}, WARP, [&] { wick_amp_unscale_bf16(table<1>(flat, chunk), &found, &inv); });
    }
    bool exact = true;
    for (int t = 0; t < n; t++)
      for (long long i = 0; i < blens[t]; i++)
        exact &= __bfloat162float(gb[t][i]) == __bfloat162float(before[t][i]) * 0.25f || std::isinf(__bfloat162float(before[t][i]));
    check(std::string("unscale over 245 bf16 tensors in two tables") + (seeded_inf ? ", an inf in the second: flag raised" : ": flag clear"),
          {exact ? 0.0 : 1.0, (double)found}, {0.0, seeded_inf ? 1.0 : 0.0}, 0);
  }
}

void optimizer_checks() {
  optimizer();
  step_scalars();
  tables();
}
