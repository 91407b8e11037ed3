// bf16 <-> float32 for the CPU kernels: widening is exact (bf16 is float32's top half);
// narrowing rounds to nearest even, as torch does, without c10's NaN branch so that
// loops over it vectorise (every value the kernels narrow is finite: see -ffast-math).
#pragma once

#include <c10/util/BFloat16.h>

#include <cstdint>
#include <cstring>

namespace memserve_kernels {

inline float widen(float x) { return x; }
inline float widen(c10::BFloat16 x) {
  uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
}

// float32 -> bf16 bits, rounded to nearest even.
inline uint16_t bf16_bits(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof(bits));
  return static_cast<uint16_t>((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16);
}

// A float32 value stored as T (rounded to nearest even for bf16).
inline float store(float x, float*) { return x; }
inline c10::BFloat16 store(float x, c10::BFloat16*) { return c10::BFloat16(bf16_bits(x), c10::BFloat16::from_bits()); }

// A float32 value rounded as T stores it, as float32.
inline float narrow(float x, float*) { return x; }
inline float narrow(float x, c10::BFloat16*) {
  const uint32_t bits = static_cast<uint32_t>(bf16_bits(x)) << 16;
  float out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
}

}  // namespace memserve_kernels
