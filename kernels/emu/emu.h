// A host emulator for wick's CUDA C kernels (kernels/src/cuda/*.cu), so that their indexing and
// arithmetic are tested on a machine without a GPU (kernels/emu/check.cpp; run by
// scripts/cuda-ci.sh). Each block of a launch runs on its own, one OS thread per CUDA thread;
// __syncthreads is a barrier over the block, __shfl_xor_sync an exchange through memory between
// two barriers of the warp; __shared__ variables are function statics (one block at a time).
// What it cannot check: the device's own limits (registers, the real scheduling, memory
// coalescing) and the driver's launch path. Include this before a .cu file, with this folder
// first on the include path (its cuda_fp16.h and cuda_bf16.h stand in for CUDA's).
#pragma once
#define WICK_EMU 1
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <new>
#include <thread>
#include <vector>

struct alignas(16) float4 {
  float x, y, z, w;
};

struct dim3 {
  unsigned x = 1, y = 1, z = 1;
};
inline thread_local dim3 threadIdx, blockIdx;
inline dim3 blockDim, gridDim;

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __shared__ static

namespace emu {
struct Block {
  std::barrier<>* all;
  std::vector<std::unique_ptr<std::barrier<>>> warps;
  std::vector<uint64_t> slots;
  unsigned char* shared;  // the launch's dynamic shared memory (128-byte aligned, exactly its size)
};
inline Block* current = nullptr;
}  // namespace emu

inline void __syncthreads() { emu::current->all->arrive_and_wait(); }
inline void __syncwarp(unsigned = 0xffffffffu) { emu::current->warps[threadIdx.x / 32]->arrive_and_wait(); }

// IEEE f32 operations rounded on their own (compile with -ffp-contract=off: no fused multiply-add).
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fsub_rn(float a, float b) { return a - b; }
inline float __fdiv_rn(float a, float b) { return a / b; }
inline double __dmul_rn(double a, double b) { return a * b; }
inline double __dadd_rn(double a, double b) { return a + b; }
using std::isfinite;
using std::isnan;
inline double __dsub_rn(double a, double b) { return a - b; }
inline double __ddiv_rn(double a, double b) { return a / b; }
inline double __dsqrt_rn(double a) { return std::sqrt(a); }
inline float __double2float_rn(double a) { return (float)a; }

template <typename T> T __shfl_xor_sync(unsigned, T v, int o) {
  emu::Block& b = *emu::current;
  const unsigned t = threadIdx.x, w = t / 32, lane = t % 32;
  uint64_t bits = 0;
  std::memcpy(&bits, &v, sizeof(T));
  b.slots[t] = bits;
  b.warps[w]->arrive_and_wait();
  const uint64_t other = b.slots[w * 32 + (lane ^ (unsigned)o)];
  b.warps[w]->arrive_and_wait();
  T r;
  std::memcpy(&r, &other, sizeof(T));
  return r;
}

// Runs `kernel` over `grid` × `block` (x and y of the grid, x of the block; a multiple of 32) with
// `shared` bytes of dynamic shared memory a block.
template <typename F> void launch(dim3 grid, dim3 block, F kernel, size_t shared = 0) {
  gridDim = grid;
  blockDim = block;
  for (unsigned by = 0; by < grid.y; by++) {
    for (unsigned bx = 0; bx < grid.x; bx++) {
      std::barrier<> all(block.x);
      auto* bytes = static_cast<unsigned char*>(::operator new(shared + 1, std::align_val_t(128)));
      std::memset(bytes, 0xff, shared);  // NaN until written, as garbage would be
      emu::Block b{&all, {}, std::vector<uint64_t>(block.x), bytes};
      for (unsigned w = 0; w < block.x / 32; w++) b.warps.push_back(std::make_unique<std::barrier<>>(32));
      emu::current = &b;
      std::vector<std::thread> threads;
      for (unsigned t = 0; t < block.x; t++) {
        threads.emplace_back([&, t, bx, by] {
          threadIdx = dim3{t, 0, 0};
          blockIdx = dim3{bx, by, 0};
          kernel();
        });
      }
      for (auto& t : threads) t.join();
      ::operator delete(bytes, std::align_val_t(128));
    }
  }
}
