// Shared helpers of wick's CUDA kernels: loads and stores of f32, f16 and bf16 through f32 (and of
// f64 as itself), rounded to nearest even on the way back as the host's `half` crate rounds.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>

__device__ __forceinline__ float wick_load(const float* p, long long i) { return p[i]; }
__device__ __forceinline__ float wick_load(const __half* p, long long i) { return __half2float(p[i]); }
__device__ __forceinline__ float wick_load(const __nv_bfloat16* p, long long i) { return __bfloat162float(p[i]); }
__device__ __forceinline__ double wick_load(const double* p, long long i) { return p[i]; }

__device__ __forceinline__ void wick_store(float* p, long long i, float v) { p[i] = v; }
__device__ __forceinline__ void wick_store(__half* p, long long i, float v) { p[i] = __float2half_rn(v); }
__device__ __forceinline__ void wick_store(__nv_bfloat16* p, long long i, float v) { p[i] = __float2bfloat16_rn(v); }
__device__ __forceinline__ void wick_store(double* p, long long i, double v) { p[i] = v; }

// exp, log and erf of the compute type (f32 or f64), for templates over it.
__device__ __forceinline__ float wick_exp(float v) { return expf(v); }
__device__ __forceinline__ double wick_exp(double v) { return exp(v); }
__device__ __forceinline__ float wick_log(float v) { return logf(v); }
__device__ __forceinline__ double wick_log(double v) { return log(v); }
__device__ __forceinline__ float wick_erf(float v) { return erff(v); }
__device__ __forceinline__ double wick_erf(double v) { return erf(v); }

// The compute type of a storage type: f64 for f64, f32 for the others (the host kernels' rule).
template <typename E> struct WickCompute { typedef float T; };
template <> struct WickCompute<double> { typedef double T; };

// The sum of `v` over the block (every thread gets it). `scratch` holds one double per warp;
// the call begins and ends with a barrier, so it can be called again at once.
__device__ __forceinline__ double block_sum(double v, double* scratch) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, warps = blockDim.x / 32;
  __syncthreads();
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  double total = 0.0;
  for (int w = 0; w < warps; w++) total += scratch[w];  // the same order in every thread
  __syncthreads();
  return total;
}

// `name`: the block's dynamic shared memory (as many bytes as the launch gives) as an array of T.
#ifdef WICK_EMU
#define WICK_DYNAMIC_SHARED(T, name) T* name = reinterpret_cast<T*>(emu::current->shared)
#else
#define WICK_DYNAMIC_SHARED(T, name)                                  \
  extern __shared__ __align__(128) unsigned char wick_dynamic_shared[]; \
  T* name = reinterpret_cast<T*>(wick_dynamic_shared)
#endif

// A grid-stride loop over `n` elements.
#define WICK_FOR_EACH(i, n) \
  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < (n); i += (long long)gridDim.x * blockDim.x)

// Instantiates `WICK_KERNEL(E, suffix)` (a macro the file defines) for every storage type.
#define WICK_FOR_FLOATS(WICK_KERNEL) \
  WICK_KERNEL(float, f32)            \
  WICK_KERNEL(__half, f16)           \
  WICK_KERNEL(__nv_bfloat16, bf16)   \
  WICK_KERNEL(double, f64)
