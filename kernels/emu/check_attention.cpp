// Attention's kernels (kernels/src/cuda/nn_attention.cu) on the host emulator, with the launch
// shapes of wick-nn's `native::cuda::attention` (4 warps a block, its tiles of rows, the dynamic
// shared memory it asks for): the row ends of a bias, the forward pass (output and log-sum-exp)
// and the gradients, against direct sums in f64 over the keys each row weighs. Heads apart and
// packed; no bias, a padding bias (b, 1, 1, s), a causal one (s, s) at -1e4 and at bf16's -9 984,
// and sequences that end inside a tile and span several; the CUDA-core kernels in f32 and f64
// (their tiles differ) and bf16, the tensor-core ones (nn_attention_tc.cu, on the emulator's
// WMMA: mma.h) in bf16 and f16, head dimensions that are and are not multiples of 16. The masked
// keys of the padding case hold NaN in K and V: the kernels must never read them.
// Part of target/emu-check (see check.cpp).
#include "harness.h"

#include "../src/cuda/nn_attention.cu"
#undef WICK_KERNEL
#include "../src/cuda/nn_attention_tc.cu"

namespace {

// The launcher's figures (wick-nn's native::cuda::attention): rows a block takes, and the shared
// memory of each kernel (0 forward, 1 dq, 2 dk/dv) in bytes — on CUDA cores or tensor cores.
template <typename E> long long rows_a_block(bool tc) { return tc ? 64 : 4 * AttRows<typename WickCompute<E>::T>::R; }
template <typename E> size_t shared_bytes(bool tc, int kernel, long long d) {
  if (tc) {
    const size_t d16 = (d + 15) / 16 * 16, ld = d16 + 8, ldo = d16 + 4, e = sizeof(E);
    if (kernel == 0) return 3 * 64 * ld * e + 4 * 16 * 68 * 4 + 4 * 16 * ldo * 4 + 4 * 16 * 72 * e;
    if (kernel == 1) return 4 * 64 * ld * e + 4 * 32 * 68 * 4 + 4 * 16 * 72 * e;
    return 4 * 64 * ld * e + 4 * 32 * 68 * 4 + 2 * 4 * 16 * 72 * e + 64 * 4 * 2 + 64 * 4;
  }
  const size_t t = sizeof(typename WickCompute<E>::T), rows = rows_a_block<E>(false), kd = d + 1;
  if (kernel == 0) return (rows * d + 32 * kd + rows * 32) * t;
  if (kernel == 1) return (2 * rows * d + 2 * 32 * kd + rows * 32) * t;
  return (2 * rows * d + 2 * 32 * kd + 2 * rows * 32 + 64) * t + 32 * sizeof(int);
}
dim3 blocks(long long n) { return dim3{(unsigned)std::clamp<long long>(n, 1, 65535), 1, 1}; }
const dim3 BLOCK{128, 1, 1};

// The three kernels of one kind and storage type.
template <typename E, bool TC> struct Kernels;
// KIND: empty for the CUDA-core kernels, tc_ for the tensor-core ones.
#define WICK_CHECK_KERNELS(E, TC, KIND, SFX)                   \
  template <> struct Kernels<E, TC> {                          \
    static constexpr auto forward = wick_attention_##KIND##SFX;   \
    static constexpr auto dq = wick_attention_##KIND##dq_##SFX;   \
    static constexpr auto dkdv = wick_attention_##KIND##dkdv_##SFX; \
  };
WICK_CHECK_KERNELS(float, false, , f32)
WICK_CHECK_KERNELS(double, false, , f64)
WICK_CHECK_KERNELS(__nv_bfloat16, false, , bf16)
WICK_CHECK_KERNELS(__nv_bfloat16, true, tc_, bf16)
WICK_CHECK_KERNELS(__half, true, tc_, f16)

enum Bias { NONE, PADDING, CAUSAL, CAUSAL_BF16 };

template <typename E, bool TC = false>
void attention(long long b, long long h, long long s, long long d, bool packed, Bias kind, double tol) {
  typedef typename WickCompute<E>::T T;
  const char* names[] = {"", " padding", " causal", " causal (bf16 -9984)"};
  const char* type = std::is_same_v<E, double> ? "f64 " : std::is_same_v<E, float> ? "f32 " : std::is_same_v<E, __half> ? "f16 " : "bf16 ";
  const std::string what = std::string("attention ") + (TC ? "tensor cores " : "") + type + (packed ? "packed " : "") +
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
          k[idx(lk, (b - 1) * h + hh, j, c)] = to<E>(NAN);  // never read: after every row's end
          v[idx(lv, (b - 1) * h + hh, j, c)] = to<E>(NAN);
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
  const long long tiles = b * h * ((s + rows_a_block<E>(TC) - 1) / rows_a_block<E>(TC));
  typedef Kernels<E, TC> K;
  launch(blocks(tiles), BLOCK, [&] { K::forward(q, k, v, bp, ep, out.data(), lse.data(), lq, lk, lv, lo, n, bs); },
         shared_bytes<E>(TC, 0, d));
  std::vector<E> grads(3 * n_in, to<E>(NAN));
  E *dq = grads.data(), *dk = packed ? grads.data() : grads.data() + n_in, *dv = packed ? grads.data() : grads.data() + 2 * n_in;
  launch(
      blocks(tiles), BLOCK,
      [&] { K::dq(q, k, v, bp, ep, out.data(), dout.data(), lse.data(), dsum.data(), dq, lq, lk, lv, lo, lq, n, bs); },
      shared_bytes<E>(TC, 1, d));
  launch(
      blocks(tiles), BLOCK,
      [&] { K::dkdv(q, k, v, bp, ep, dout.data(), lse.data(), dsum.data(), dk, dv, lq, lk, lv, lo, lk, lv, n, bs); },
      shared_bytes<E>(TC, 2, d));
  // The reference, from the inputs as stored: each row over the keys before its end (the masked
  // ones' exponentials are 0), backward from the kernels' own output as the op's backward is.
  std::vector<double> wout(n_in), wlse(rows), wgrad(3 * n_in, 0.0);
  const double scale = 1 / std::sqrt((double)d);
  for (long long bh = 0; bh < b * h; bh++) {
    std::vector<double> p(s * s, 0.0), ds(s * s, 0.0);
    for (long long i = 0; i < s; i++) {
      const long long e = end_of(bh, i);
      double m = -INFINITY;
      for (long long j = 0; j < e; j++) {
        double dot = 0;
        for (long long c = 0; c < d; c++) dot += wd(q[idx(lq, bh, i, c)]) * wd(k[idx(lk, bh, j, c)]);
        p[i * s + j] = scale * dot + (bp ? (double)bp[(bh / h) * bs.b + (bh % h) * bs.h + i * bs.q + j * bs.k] : 0);
        m = std::max(m, p[i * s + j]);
      }
      double sum = 0;
      for (long long j = 0; j < e; j++) sum += std::exp(p[i * s + j] - m);
      wlse[bh * s + i] = m + std::log(sum);
      for (long long j = 0; j < e; j++) p[i * s + j] = std::exp(p[i * s + j] - wlse[bh * s + i]);
      for (long long c = 0; c < d; c++) {
        double o = 0;
        for (long long j = 0; j < e; j++) o += p[i * s + j] * wd(v[idx(lv, bh, j, c)]);
        wout[idx(lo, bh, i, c)] = o;
      }
      double rowdot = 0;
      for (long long c = 0; c < d; c++) rowdot += wd(dout[idx(lo, bh, i, c)]) * wd(out[idx(lo, bh, i, c)]);
      for (long long j = 0; j < e; j++) {
        double dpv = 0;
        for (long long c = 0; c < d; c++) dpv += wd(dout[idx(lo, bh, i, c)]) * wd(v[idx(lv, bh, j, c)]);
        ds[i * s + j] = p[i * s + j] * (dpv - rowdot);
      }
    }
    const long long gq = 0, gk = packed ? 0 : n_in, gv = packed ? 0 : 2 * n_in;
    for (long long i = 0; i < s; i++)
      for (long long j = 0; j < end_of(bh, i); j++)
        for (long long c = 0; c < d; c++) {
          wgrad[gq + idx(lq, bh, i, c)] += scale * ds[i * s + j] * wd(k[idx(lk, bh, j, c)]);
          wgrad[gk + idx(lk, bh, j, c)] += scale * ds[i * s + j] * wd(q[idx(lq, bh, i, c)]);
          wgrad[gv + idx(lv, bh, j, c)] += p[i * s + j] * wd(dout[idx(lo, bh, i, c)]);
        }
  }
  check(what + " output", wide(out), wout, tol);
  check(what + " log-sum-exp", lse, wlse, std::min(tol, 2e-5));
  check(what + " dq, dk, dv", wide(grads), wgrad, tol);
}

}  // namespace

// The launch figures against the table wick-kernels' `launch` module holds its own to (its test
// `shared_memory_matches_the_emulators_table`): the same bytes for the same kernels, in C++ here.
static void shared_table() {
  const struct {
    const char* what;
    size_t got, want;
  } rows[] = {
      {"CUDA cores f32 forward, d 64", shared_bytes<float>(false, 0, 64), 20608},
      {"CUDA cores f32 dq, d 100", shared_bytes<float>(false, 1, 100), 55552},
      {"CUDA cores f32 dk/dv, d 64", shared_bytes<float>(false, 2, 64), 41600},
      {"CUDA cores f64 dq, d 64", shared_bytes<double>(false, 1, 64), 53760},
      {"CUDA cores f64 dk/dv, d 128", shared_bytes<double>(false, 2, 128), 107648},
      {"tensor cores forward, d 64", shared_bytes<__nv_bfloat16>(true, 0, 64), 71680},
      {"tensor cores dq, d 64", shared_bytes<__nv_bfloat16>(true, 1, 64), 80896},
      {"tensor cores dk/dv, d 128", shared_bytes<__nv_bfloat16>(true, 2, 128), 123648},
      {"tensor cores forward, d 100", shared_bytes<__nv_bfloat16>(true, 0, 100), 102400},
  };
  std::vector<double> got, want;
  for (const auto& r : rows) got.push_back((double)r.got), want.push_back((double)r.want);
  check("attention shared memory = wick-kernels' launch table (9 kernels and sizes)", got, want, 0);
  check("attention rows a block = wick-kernels' (tensor cores, f32, f64)",
        {(double)rows_a_block<__half>(true), (double)rows_a_block<float>(false), (double)rows_a_block<double>(false)},
        {64, 32, 16}, 0);
}

void attention_checks() {
  shared_table();
  // f32 within 2e-5 of f64 (sums over up to 70 keys); f64 to rounding; bf16 and f16 within 3
  // spacings at 1 (2^-8, 2^-11: the outputs rounded, and on tensor cores the probabilities and ds).
  attention<float>(2, 3, 1, 8, false, NONE, 2e-5);
  attention<float>(2, 3, 16, 32, false, PADDING, 2e-5);
  attention<float>(2, 3, 9, 100, false, CAUSAL, 2e-5);
  attention<float>(1, 2, 33, 64, true, CAUSAL, 2e-5);
  attention<float>(2, 2, 7, 20, true, PADDING, 2e-5);
  attention<float>(1, 2, 70, 64, false, CAUSAL_BF16, 2e-5);  // three query tiles, the last partial
  attention<float>(2, 1, 45, 128, true, PADDING, 2e-5);
  attention<float>(1, 1, 64, 16, false, NONE, 2e-5);  // whole tiles
  attention<double>(1, 2, 37, 40, false, CAUSAL, 1e-12);
  attention<double>(2, 1, 20, 128, true, PADDING, 1e-12);
  attention<__nv_bfloat16>(1, 2, 40, 64, false, CAUSAL_BF16, 1e-2);
  attention<__nv_bfloat16, true>(1, 2, 70, 64, false, CAUSAL_BF16, 1e-2);  // two tiles each way
  attention<__nv_bfloat16, true>(2, 2, 33, 32, true, PADDING, 1e-2);
  attention<__nv_bfloat16, true>(2, 1, 20, 100, false, NONE, 1e-2);  // d padded to 112
  attention<__half, true>(1, 2, 130, 64, true, CAUSAL, 1.5e-3);  // three tiles each way
  attention<__half, true>(2, 1, 9, 128, false, PADDING, 1.5e-3);
  attention<__nv_bfloat16, true>(1, 1, 65, 16, true, CAUSAL, 1e-2);  // one row past a tile
  attention<__half, true>(1, 1, 129, 128, false, NONE, 1.5e-3);       // one row past two tiles
}
