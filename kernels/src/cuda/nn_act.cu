// The CUDA bodies of wick-nn's element-wise activations, forward and backward: the same functions
// as the host kernels (wick-nn's `native::act`), each element computed in f32 (f64 for f64 tensors)
// and rounded once to the tensor's type. One launch per op, grid-stride over contiguous tensors;
// each backward writes its gradient directly (no composed mask, no intermediate tensor).
//
//   clamp:          v <= 0 ? 0 : v >= max ? max : v   (ReLU: max = inf; ReLU6: 6; NaN passes through)
//   clamp_grad:     0 < v < max ? g : 0               (PyTorch's rule at the kinks)
//   gelu:           v * (erf(v / sqrt 2) + 1) / 2
//   gelu_grad:      g * (cdf(v) + v * pdf(v))
//   silu_mul:       a * sigmoid(a) * b                (SwiGLU's gate; packed: a and b halves of a row)
//   add_relu:       relu(a + b);  add_relu_grad: a + b > 0 ? g : 0
#include "common.cuh"

template <typename T> __device__ __forceinline__ T sigmoid(T v) { return T(1) / (T(1) + wick_exp(-v)); }

struct Clamp {
  double max;
  template <typename T> __device__ __forceinline__ T operator()(T v) const {
    const T m = (T)max;
    return v <= T(0) ? T(0) : (v >= m ? m : v);
  }
};
struct ClampGrad {
  double max;
  template <typename T> __device__ __forceinline__ T operator()(T v, T g) const {
    return (v > T(0) && v < (T)max) ? g : T(0);
  }
};
struct Gelu {
  double unused;
  template <typename T> __device__ __forceinline__ T operator()(T v) const {
    return (wick_erf(v * (T)0.70710678118654752440) + T(1)) * T(0.5) * v;
  }
};
struct GeluGrad {
  double unused;
  template <typename T> __device__ __forceinline__ T operator()(T v, T g) const {
    // 0.5 * 2/sqrt(pi) * 1/sqrt(2) = 1/sqrt(2 pi)
    const T cdf = (wick_erf(v * (T)0.70710678118654752440) + T(1)) * T(0.5);
    const T pdf = (T)0.39894228040143267794;
    return g * (cdf + v * pdf * wick_exp(-(v * v) * T(0.5)));
  }
};
struct SiluMul {
  double unused;
  template <typename T> __device__ __forceinline__ T operator()(T a, T b) const { return a * sigmoid(a) * b; }
};
struct AddRelu {
  double unused;
  template <typename T> __device__ __forceinline__ T operator()(T a, T b) const {
    const T s = a + b;
    return s <= T(0) ? T(0) : s;
  }
};
struct AddReluGrad {
  double unused;
  template <typename T> __device__ __forceinline__ T operator()(T a, T b, T g) const {
    return a + b > T(0) ? g : T(0);
  }
};

template <typename E, typename F> __device__ void map1(const E* x, E* y, long long n, F f) {
  typedef typename WickCompute<E>::T T;
  WICK_FOR_EACH(i, n) { wick_store(y, i, f((T)wick_load(x, i))); }
}
template <typename E, typename F> __device__ void map2(const E* a, const E* b, E* y, long long n, F f) {
  typedef typename WickCompute<E>::T T;
  WICK_FOR_EACH(i, n) { wick_store(y, i, f((T)wick_load(a, i), (T)wick_load(b, i))); }
}
template <typename E, typename F>
__device__ void map3(const E* a, const E* b, const E* c, E* y, long long n, F f) {
  typedef typename WickCompute<E>::T T;
  WICK_FOR_EACH(i, n) { wick_store(y, i, f((T)wick_load(a, i), (T)wick_load(b, i), (T)wick_load(c, i))); }
}

// silu(a)·b's gradients: da = g b s (1 + a (1 - s)), db = g a s.
template <typename T> __device__ __forceinline__ void silu_mul_grads(T a, T b, T g, T* da, T* db) {
  const T s = sigmoid(a);
  *da = g * b * s * (T(1) + a * (T(1) - s));
  *db = g * a * s;
}

#define WICK_KERNEL(E, sfx)                                                                                   \
  extern "C" __global__ void wick_clamp_##sfx(const E* x, E* y, long long n, double p) {                     \
    map1(x, y, n, Clamp{p});                                                                                \
  }                                                                                                         \
  extern "C" __global__ void wick_clamp_grad_##sfx(const E* x, const E* g, E* y, long long n, double p) {    \
    map2(x, g, y, n, ClampGrad{p});                                                                         \
  }                                                                                                         \
  extern "C" __global__ void wick_gelu_##sfx(const E* x, E* y, long long n, double p) {                      \
    map1(x, y, n, Gelu{p});                                                                                 \
  }                                                                                                         \
  extern "C" __global__ void wick_gelu_grad_##sfx(const E* x, const E* g, E* y, long long n, double p) {     \
    map2(x, g, y, n, GeluGrad{p});                                                                          \
  }                                                                                                         \
  extern "C" __global__ void wick_silu_mul_##sfx(const E* a, const E* b, E* y, long long n, double p) {      \
    map2(a, b, y, n, SiluMul{p});                                                                           \
  }                                                                                                         \
  extern "C" __global__ void wick_add_relu_##sfx(const E* a, const E* b, E* y, long long n, double p) {      \
    map2(a, b, y, n, AddRelu{p});                                                                           \
  }                                                                                                         \
  extern "C" __global__ void wick_add_relu_grad_##sfx(const E* a, const E* b, const E* g, E* y, long long n, \
                                                      double p) {                                           \
    map3(a, b, g, y, n, AddReluGrad{p});                                                                    \
  }                                                                                                         \
  /* silu(a)·b's two gradients in one pass. */                                                              \
  extern "C" __global__ void wick_silu_mul_grad_##sfx(const E* a, const E* b, const E* g, E* da, E* db,     \
                                                      long long n) {                                        \
    typedef WickCompute<E>::T T;                                                                            \
    WICK_FOR_EACH(i, n) {                                                                                   \
      T x, y;                                                                                               \
      silu_mul_grads((T)wick_load(a, i), (T)wick_load(b, i), (T)wick_load(g, i), &x, &y);                   \
      wick_store(da, i, x);                                                                                 \
      wick_store(db, i, y);                                                                                 \
    }                                                                                                       \
  }                                                                                                         \
  /* silu(a)·b of rows of 2·width holding a then b (a fused gate-and-up projection's output). */           \
  extern "C" __global__ void wick_silu_mul_packed_##sfx(const E* u, E* y, long long rows, long long width) { \
    typedef WickCompute<E>::T T;                                                                            \
    WICK_FOR_EACH(i, rows* width) {                                                                         \
      const long long r = i / width, j = i % width;                                                         \
      const T a = (T)wick_load(u, r * 2 * width + j), b = (T)wick_load(u, r * 2 * width + width + j);       \
      wick_store(y, i, a * sigmoid(a) * b);                                                                 \
    }                                                                                                       \
  }                                                                                                         \
  extern "C" __global__ void wick_silu_mul_packed_grad_##sfx(const E* u, const E* g, E* du, long long rows,  \
                                                             long long width) {                             \
    typedef WickCompute<E>::T T;                                                                            \
    WICK_FOR_EACH(i, rows* width) {                                                                         \
      const long long r = i / width, j = i % width, at = r * 2 * width + j;                                 \
      T x, y;                                                                                               \
      silu_mul_grads((T)wick_load(u, at), (T)wick_load(u, at + width), (T)wick_load(g, i), &x, &y);         \
      wick_store(du, at, x);                                                                                \
      wick_store(du, at + width, y);                                                                        \
    }                                                                                                       \
  }

WICK_FOR_FLOATS(WICK_KERNEL)
