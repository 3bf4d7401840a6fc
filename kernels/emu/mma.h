// The emulator's stand-in for CUDA's <mma.h> (nvcuda::wmma, the 16 × 16 × 16 shapes wick's
// kernels use). On a GPU a fragment is spread over the 32 lanes of a warp in a layout CUDA leaves
// unspecified; here every lane holds the whole 16 × 16 tile, so a kernel that only loads, fills,
// multiplies and stores fragments (never touches `x[]` by position) computes the same here as on
// the device. Each call is a warp-collective: the stores write once (lane 0) and end with a
// barrier of the warp. The device's constraints are asserted: a 32-byte aligned pointer and a
// leading dimension of a whole 16 bytes.
#pragma once
#include <cassert>
#include <cstdint>

#include "cuda_bf16.h"
#include "cuda_fp16.h"
#include "emu.h"

namespace nvcuda {
namespace wmma {

struct matrix_a {};
struct matrix_b {};
struct accumulator {};
struct row_major {};
struct col_major {};
enum layout_t { mem_row_major, mem_col_major };

template <typename Use, int M, int N, int K, typename T, typename Layout = void> struct fragment {
  float v[16][16];  // the whole tile, widened (exact for half and bf16)
};

inline float wide(float x) { return x; }
inline float wide(__half x) { return __half2float(x); }
inline float wide(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T> inline void assert_layout(const T* p, unsigned ldm) {
  assert(reinterpret_cast<uintptr_t>(p) % 32 == 0 && "wmma: pointer not 256-bit aligned");
  assert((ldm * sizeof(T)) % 16 == 0 && "wmma: leading dimension not a multiple of 16 bytes");
  (void)p, (void)ldm;
}

template <typename Use, typename T, typename L> inline void load_matrix_sync(fragment<Use, 16, 16, 16, T, L>& f, const T* p, unsigned ldm) {
  assert_layout(p, ldm);
  for (int r = 0; r < 16; r++)
    for (int c = 0; c < 16; c++) {
      // Element (r, c) of the operand: row-major reads p[r·ldm + c], column-major p[c·ldm + r].
      f.v[r][c] = wide(std::is_same_v<L, row_major> ? p[r * ldm + c] : p[c * ldm + r]);
    }
}

inline void load_matrix_sync(fragment<accumulator, 16, 16, 16, float>& f, const float* p, unsigned ldm, layout_t layout) {
  assert_layout(p, ldm);
  for (int r = 0; r < 16; r++)
    for (int c = 0; c < 16; c++) f.v[r][c] = layout == mem_row_major ? p[r * ldm + c] : p[c * ldm + r];
}

inline void store_matrix_sync(float* p, const fragment<accumulator, 16, 16, 16, float>& f, unsigned ldm, layout_t layout) {
  assert_layout(p, ldm);
  if (threadIdx.x % 32 == 0)
    for (int r = 0; r < 16; r++)
      for (int c = 0; c < 16; c++) (layout == mem_row_major ? p[r * ldm + c] : p[c * ldm + r]) = f.v[r][c];
  __syncwarp();
}

template <typename Use, typename T, typename L> inline void fill_fragment(fragment<Use, 16, 16, 16, T, L>& f, float x) {
  for (auto& row : f.v)
    for (auto& e : row) e = x;
}

// d = a·b + c, summed in f32 in k's order.
template <typename T, typename LA, typename LB>
inline void mma_sync(fragment<accumulator, 16, 16, 16, float>& d, const fragment<matrix_a, 16, 16, 16, T, LA>& a,
                     const fragment<matrix_b, 16, 16, 16, T, LB>& b, const fragment<accumulator, 16, 16, 16, float>& c) {
  float out[16][16];
  for (int r = 0; r < 16; r++)
    for (int col = 0; col < 16; col++) {
      float s = c.v[r][col];
      for (int k = 0; k < 16; k++) s += a.v[r][k] * b.v[k][col];
      out[r][col] = s;
    }
  for (int r = 0; r < 16; r++)
    for (int col = 0; col < 16; col++) d.v[r][col] = out[r][col];
}

}  // namespace wmma
}  // namespace nvcuda
