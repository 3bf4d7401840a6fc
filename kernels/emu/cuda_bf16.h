// The host emulator's stand-in for CUDA's <cuda_bf16.h> (see emu.h): __nv_bfloat16 and its two
// conversions (round to nearest even, NaN kept quiet), as the device's and the `half` crate's.
#pragma once
#include <cstdint>
#include <cstring>

struct __nv_bfloat16 {
  uint16_t bits;
};
inline float __bfloat162float(__nv_bfloat16 b) {
  uint32_t u = (uint32_t)b.bits << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline __nv_bfloat16 __float2bfloat16_rn(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  __nv_bfloat16 b;
  if ((u & 0x7fffffffu) > 0x7f800000u) {
    b.bits = (uint16_t)((u >> 16) | 0x40);
  } else {
    b.bits = (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
  }
  return b;
}
