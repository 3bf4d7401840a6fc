// Shared helpers for wick's AMP kernels: loads and stores of f32, f16 and bf16 through f32.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>

__device__ __forceinline__ float wick_load(const float* p, long long i) { return p[i]; }
__device__ __forceinline__ float wick_load(const __half* p, long long i) { return __half2float(p[i]); }
__device__ __forceinline__ float wick_load(const __nv_bfloat16* p, long long i) { return __bfloat162float(p[i]); }

__device__ __forceinline__ void wick_store(float* p, long long i, float v) { p[i] = v; }
__device__ __forceinline__ void wick_store(__half* p, long long i, float v) { p[i] = __float2half_rn(v); }
__device__ __forceinline__ void wick_store(__nv_bfloat16* p, long long i, float v) { p[i] = __float2bfloat16_rn(v); }
