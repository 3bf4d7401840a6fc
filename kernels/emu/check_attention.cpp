// Attention's kernels (kernels/src/cuda/nn_attention.cu) on the host emulator, with the launch
// shapes of wick-nn's `native::cuda::attention` (4 warps a block, its tiles of rows, the dynamic
// shared memory it asks for): the row ends of a bias, the forward pass (output and log-sum-exp)
// and the gradients, against direct sums in f64 over the keys each row weighs. Heads apart and
// packed; no bias, a padding bias (b, 1, 1, s), a causal one (s, s) at -1e4 and at bf16's -9 984,
// and sequences that end inside a tile and span several; f32 and f64 (their tiles differ). The
// masked keys of the padding case hold NaN in K and V: the kernels must never read them.
// Part of target/emu-check (see check.cpp).
#include "harness.h"

#include "../src/cuda/nn_attention.cu"

namespace {

// The launcher's figures (wick-nn's native::cuda::attention): rows a block takes, and the shared
// memory of each kernel in bytes.
template <typename E> long long rows_a_block() { return 4 * AttRows<typename WickCompute<E>::T>::R; }
template <typename E> size_t shared_bytes(int kernel, long long d) {
  const size_t t = sizeof(typename WickCompute<E>::T), rows = rows_a_block<E>(), kd = d + 1;
  if (kernel == 0) return (rows * d + 32 * kd + rows * 32) * t;
  if (kernel == 1) return (2 * rows * d + 2 * 32 * kd + rows * 32) * t;
  return (2 * rows * d + 2 * 32 * kd + 2 * rows * 32 + 64) * t + 32 * sizeof(int);
}
dim3 blocks(long long n) { return dim3{(unsigned)std::clamp<long long>(n, 1, 65535), 1, 1}; }
const dim3 BLOCK{128, 1, 1};

enum Bias { NONE, PADDING, CAUSAL, CAUSAL_BF16 };

template <typename E> void attention(long long b, long long h, long long s, long long d, bool packed, Bias kind) {
  typedef typename WickCompute<E>::T T;
  const char* names[] = {"", " padding", " causal", " causal (bf16 -9984)"};
  const std::string what = std::string("attention ") + (sizeof(E) == 8 ? "f64 " : "f32 ") + (packed ? "packed " : "") +
                           std::to_string(b) + "x" + std::to_string(h) + "x" + std::to_string(s) + "x" +
                           std::to_string(d) + names[kind];
  // Layouts: element (bh, i, c) of q, k, v, out.
  auto lay = [&](int part) -> Lay {
    if (!packed) return Lay{0, h * s * d, s * d, d};
    const long long width = (part < 3 ? 3 : 1) * h * d;
    return Lay{(part < 3 ? part : 0) * h * d, s * width, d, width};
  };
  const Lay lq = lay(0), lk = lay(1), lv = lay(2), lo = lay(3);
  auto idx = [&](const Lay& l, long long bh, long long i, long long c) {
    return l.base + (bh / h) * l.batch + (bh % h) * l.head + i * l.row + c;
  };
  const long long n_in = b * h * s * d, rows = b * h * s;
  auto qv = narrow<E>(randn(packed ? 3 * n_in : n_in, 20)), kv = narrow<E>(randn(n_in, 21)), vv = narrow<E>(randn(n_in, 22));
  E *q = qv.data(), *k = packed ? qv.data() : kv.data(), *v = packed ? qv.data() : vv.data();
  std::vector<T> bias;
  BiasStrides bs{0, 0, 0, 0, 0, 0};
  long long nb = 1, nh = 1;  // distinct bias rows' batches and heads
  const long long pad = std::min<long long>(3, s - 1);
  if (kind == PADDING) {
    bias.assign(b * s, T(0));
    for (long long j = s - pad; j < s; j++) {
      bias[(b - 1) * s + j] = T(-1e4);
      for (long long hh = 0; hh < h; hh++)
        for (long long c = 0; c < d; c++) {
          k[idx(lk, (b - 1) * h + hh, j, c)] = NAN;  // never read: after every row's end
          v[idx(lv, (b - 1) * h + hh, j, c)] = NAN;
        }
    }
    bs = BiasStrides{s, 0, 0, 1, s, 0};
    nb = b;
  } else if (kind == CAUSAL || kind == CAUSAL_BF16) {
    bias.assign(s * s, T(0));
    for (long long i = 0; i < s; i++)
      for (long long j = i + 1; j < s; j++) bias[i * s + j] = T(kind == CAUSAL ? -1e4 : -9984);
    bs = BiasStrides{0, 0, s, 1, 0, 0};
  }
  const T* bp = bias.empty() ? nullptr : bias.data();
  const Dims n{b, h, s, s, d};
  // Row ends: the kernel against the last key above the bound (all keys when none is).
  std::vector<int> ends(nb * nh * s, -1);
  if (bp) {
    launch(blocks((nb * nh * s + 7) / 8), dim3{256, 1, 1}, [&] {
      if constexpr (sizeof(T) == 8)
        wick_attention_ends_f64(bp, ends.data(), n, bs, nb, nh);
      else
        wick_attention_ends_f32(bp, ends.data(), n, bs, nb, nh);
    });
    std::vector<double> want(ends.size()), got(ends.begin(), ends.end());
    for (long long r = 0; r < nb * nh * s; r++) {
      const long long bb = r / s, i = r % s;
      long long e = s;
      for (long long j = s - 1; j >= 0; j--)
        if (bias[bb * bs.b + i * bs.q + j * bs.k] > -9900) {
          e = j + 1;
          break;
        }
      want[r] = (double)e;
    }
    check(what + " row ends", got, want, 0);
  }
  const int* ep = bp ? ends.data() : nullptr;
  auto end_of = [&](long long bh, long long i) { return ep ? (long long)ep[(bh / h) * bs.eb + (bh % h) * bs.eh + i] : s; };
  std::vector<E> out(n_in), dout = narrow<E>(randn(n_in, 23));
  std::vector<double> lse(rows), dsum(rows);
  const long long tiles = b * h * ((s + rows_a_block<E>() - 1) / rows_a_block<E>());
  launch(
      blocks(tiles), BLOCK,
      [&] {
        if constexpr (sizeof(E) == 8)
          wick_attention_f64(q, k, v, bp, ep, out.data(), lse.data(), lq, lk, lv, lo, n, bs);
        else
          wick_attention_f32(q, k, v, bp, ep, out.data(), lse.data(), lq, lk, lv, lo, n, bs);
      },
      shared_bytes<E>(0, d));
  std::vector<E> grads(3 * n_in, E(NAN));
  E *dq = grads.data(), *dk = packed ? grads.data() : grads.data() + n_in, *dv = packed ? grads.data() : grads.data() + 2 * n_in;
  launch(
      blocks(tiles), BLOCK,
      [&] {
        if constexpr (sizeof(E) == 8)
          wick_attention_dq_f64(q, k, v, bp, ep, out.data(), dout.data(), lse.data(), dsum.data(), dq, lq, lk, lv, lo, lq, n, bs);
        else
          wick_attention_dq_f32(q, k, v, bp, ep, out.data(), dout.data(), lse.data(), dsum.data(), dq, lq, lk, lv, lo, lq, n, bs);
      },
      shared_bytes<E>(1, d));
  launch(
      blocks(tiles), BLOCK,
      [&] {
        if constexpr (sizeof(E) == 8)
          wick_attention_dkdv_f64(q, k, v, bp, ep, dout.data(), lse.data(), dsum.data(), dk, dv, lq, lk, lv, lo, lk, lv, n, bs);
        else
          wick_attention_dkdv_f32(q, k, v, bp, ep, dout.data(), lse.data(), dsum.data(), dk, dv, lq, lk, lv, lo, lk, lv, n, bs);
      },
      shared_bytes<E>(2, d));
  // The reference: each row over the keys before its end (the masked ones' exponentials are 0).
  std::vector<double> wout(n_in), wlse(rows), wgrad(3 * n_in, 0.0);
  const double scale = 1 / std::sqrt((double)d);
  for (long long bh = 0; bh < b * h; bh++) {
    std::vector<double> p(s * s, 0.0), ds(s * s, 0.0);
    for (long long i = 0; i < s; i++) {
      const long long e = end_of(bh, i);
      double m = -INFINITY;
      for (long long j = 0; j < e; j++) {
        double dot = 0;
        for (long long c = 0; c < d; c++) dot += (double)q[idx(lq, bh, i, c)] * (double)k[idx(lk, bh, j, c)];
        p[i * s + j] = scale * dot + (bp ? (double)bp[(bh / h) * bs.b + (bh % h) * bs.h + i * bs.q + j * bs.k] : 0);
        m = std::max(m, p[i * s + j]);
      }
      double sum = 0;
      for (long long j = 0; j < e; j++) sum += std::exp(p[i * s + j] - m);
      wlse[bh * s + i] = m + std::log(sum);
      for (long long j = 0; j < e; j++) p[i * s + j] = std::exp(p[i * s + j] - wlse[bh * s + i]);
      for (long long c = 0; c < d; c++) {
        double o = 0;
        for (long long j = 0; j < e; j++) o += p[i * s + j] * (double)v[idx(lv, bh, j, c)];
        wout[idx(lo, bh, i, c)] = o;
      }
      double rowdot = 0;
      std::vector<double> dp(e);
      for (long long j = 0; j < e; j++) {
        for (long long c = 0; c < d; c++) dp[j] += (double)dout[idx(lo, bh, i, c)] * (double)v[idx(lv, bh, j, c)];
        rowdot += p[i * s + j] * dp[j];
      }
      for (long long j = 0; j < e; j++) ds[i * s + j] = p[i * s + j] * (dp[j] - rowdot);
    }
    const long long gq = 0, gk = packed ? 0 : n_in, gv = packed ? 0 : 2 * n_in;
    for (long long i = 0; i < s; i++)
      for (long long j = 0; j < end_of(bh, i); j++)
        for (long long c = 0; c < d; c++) {
          wgrad[gq + idx(lq, bh, i, c)] += scale * ds[i * s + j] * (double)k[idx(lk, bh, j, c)];
          wgrad[gk + idx(lk, bh, j, c)] += scale * ds[i * s + j] * (double)q[idx(lq, bh, i, c)];
          wgrad[gv + idx(lv, bh, j, c)] += p[i * s + j] * (double)dout[idx(lo, bh, i, c)];
        }
  }
  // The f32 kernels within 2e-5 of f64 (sums over up to 70 keys); f64 to rounding.
  const double tol = sizeof(E) == 8 ? 1e-12 : 2e-5;
  check(what + " output", wide(out), wout, tol);
  check(what + " log-sum-exp", lse, wlse, tol);
  check(what + " dq, dk, dv", wide(grads), wgrad, tol);
}

}  // namespace

void attention_checks() {
  attention<float>(2, 3, 1, 8, false, NONE);
  attention<float>(2, 3, 16, 32, false, PADDING);
  attention<float>(2, 3, 9, 100, false, CAUSAL);
  attention<float>(1, 2, 33, 64, true, CAUSAL);
  attention<float>(2, 2, 7, 20, true, PADDING);
  attention<float>(1, 2, 70, 64, false, CAUSAL_BF16);  // three query tiles, the last partial
  attention<float>(2, 1, 45, 128, true, PADDING);
  attention<float>(1, 1, 64, 16, false, NONE);  // whole tiles
  attention<double>(1, 2, 37, 40, false, CAUSAL);
  attention<double>(2, 1, 20, 128, true, PADDING);
}
