// The emulator checks' shared harness (kernels/emu/check*.cpp): comparison against f64
// references, random inputs, and the launch shapes of wick-nn's launchers.
#pragma once
#include "cuda_bf16.h"
#include "cuda_fp16.h"
#include "emu.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

inline int failures = 0;

// Largest |a - b| / (1 + |b|).
inline double err(const std::vector<double>& a, const std::vector<double>& b) {
  if (a.size() != b.size()) return INFINITY;
  double e = 0;
  for (size_t i = 0; i < a.size(); i++) {
    const double d = std::fabs(a[i] - b[i]) / (1 + std::fabs(b[i]));
    e = std::isnan(a[i]) != std::isnan(b[i]) ? INFINITY : std::max(e, std::isnan(d) ? 0.0 : d);
  }
  return e;
}

inline void check(const std::string& what, const std::vector<double>& got, const std::vector<double>& want, double tol) {
  const double e = err(got, want);
  const bool ok = e <= tol;
  std::printf("%s %s: max rel err %.2e (%zu values)\n", ok ? "PASS" : "FAIL", what.c_str(), e, want.size());
  failures += !ok;
}

// One value of a storage type (f32, f64, f16, bf16) to f64 and back (rounded to nearest even).
inline double wd(float x) { return x; }
inline double wd(double x) { return x; }
inline double wd(__half x) { return __half2float(x); }
inline double wd(__nv_bfloat16 x) { return __bfloat162float(x); }
template <typename E> E to(double x) {
  if constexpr (std::is_same_v<E, __half>)
    return __float2half_rn((float)x);
  else if constexpr (std::is_same_v<E, __nv_bfloat16>)
    return __float2bfloat16_rn((float)x);
  else
    return (E)x;
}

template <typename T> inline std::vector<double> wide(const std::vector<T>& v) {
  std::vector<double> r(v.size());
  for (size_t i = 0; i < v.size(); i++) r[i] = wd(v[i]);
  return r;
}

inline std::vector<double> randn(size_t n, unsigned seed, double scale = 1.0) {
  std::mt19937_64 g(seed);
  std::normal_distribution<double> d(0.0, scale);
  std::vector<double> v(n);
  for (auto& x : v) x = d(g);
  return v;
}

template <typename T> inline std::vector<T> narrow(const std::vector<double>& v) {
  std::vector<T> r(v.size());
  for (size_t i = 0; i < v.size(); i++) r[i] = to<T>(v[i]);
  return r;
}

// The launchers' shapes (wick-nn's native::cuda).
inline dim3 elementwise(size_t n) { return dim3{(unsigned)std::clamp<size_t>((n + 255) / 256, 1, 65535), 1, 1}; }
inline dim3 per_row(size_t rows) { return dim3{(unsigned)std::clamp<size_t>(rows, 1, 65535), 1, 1}; }
inline dim3 warps(size_t rows) { return dim3{(unsigned)std::clamp<size_t>((rows + 7) / 8, 1, 65535), 1, 1}; }
inline const dim3 THREADS{256, 1, 1};


// Batch norm's segments (wick-nn's native::cuda::batch_norm::segments): at least 8 192 elements
// of a channel each, at most 256 segments a channel.
inline long long bn_seg(long long count) { return std::max<long long>(8192, (count + 255) / 256); }

// The checks in other files.
void attention_checks();
void batch_norm_checks();
void linear_checks();
void optimizer_checks();
