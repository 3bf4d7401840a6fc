// The host emulator's stand-in for CUDA's <cuda_fp16.h> (see emu.h): __half and its two
// conversions, through GCC's _Float16 (IEEE binary16, round to nearest even).
#pragma once
#include <cstdint>
#include <cstring>

struct __half {
  uint16_t bits;
};
inline float __half2float(__half h) {
  _Float16 v;
  std::memcpy(&v, &h.bits, 2);
  return (float)v;
}
inline __half __float2half_rn(float f) {
  _Float16 v = (_Float16)f;
  __half h;
  std::memcpy(&h.bits, &v, 2);
  return h;
}
