// Linear layers over GGUF-quantized weights, read as the file stores them.
//
// A weight row of K inputs is K / 32 blocks, each 32 weights and their scale (llama.cpp's
// ggml-common.h layouts, little-endian):
//   Q4_0: fp16 d, 16 bytes of nibbles        w = (q - 8) * d   (q: byte j's low nibble is
//   Q4_1: fp16 d, fp16 m, 16 bytes           w = q * d + m      weight j, its high nibble
//   Q8_0: fp16 d, 32 int8                    w = q * d          weight j + 16)
// or, for the K-quants, K / 256 super-blocks of 256 weights in sub-blocks with scales of
// their own, themselves quantized against the super-block's fp16 d (and dmin):
//   Q4_K: d, dmin, 12 bytes of 6-bit scale/min pairs for 8 sub-blocks of 32, 128 bytes of
//         nibbles (bytes 32j..32j+31: sub-block 2j low, 2j + 1 high)   w = d sc q - dmin m
//   Q5_K: as Q4_K with 32 bytes of fifth bits (bit i of byte l: sub-block i, weight l)
//         between the scales and the nibbles
//   Q6_K: 128 bytes of low nibbles, 64 of high bit pairs, 16 int8 scales of sub-blocks
//         of 16, fp16 d                                                  w = d sc (q - 32)
// gguf_matmul multiplies a few activation rows (decode steps) by such rows without ever
// widening the weight matrix in memory: each block is widened in registers (two 16-lane
// vectors with AVX-512, -march=native on a CPU that has it; 32 floats on the stack
// elsewhere) and used for every activation row, so the bytes read per step are the
// file's (4.5-8.5 bits a weight against 32 for float32), which is what bounds a decode
// step. A K-quant super-block is widened once into 256 floats on the stack (vectorised
// with AVX-512) and dotted with every activation row. Sums are float32; the result equals
// the dequantized weights' product up to the order of float32 sums and roundings. For
// Q4_0, Q4_1, Q8_0, Q4_K and Q5_K on a CPU with AVX-512 VNNI, gguf_matmul can instead quantize the
// activations and take integer dot products (llama.cpp's way; see "Integer products").
// gguf_dequantize widens a whole matrix, for prefill chunks, where a oneDNN product over
// widened weights is faster than this loop.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include "bf16.h"

#include <cstdint>
#include <cstring>
#include <algorithm>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__) || defined(__F16C__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t BLOCK = 32;
constexpr int64_t SUPER = 256;    // weights in a K-quant super-block
constexpr int64_t MAX_ROWS = 16;  // activation rows gguf_matmul takes at once
enum Type : int64_t { Q4_0 = 2, Q4_1 = 3, Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14 };  // ggml's type ids

constexpr bool is_k(int64_t type) { return type == Q4_K || type == Q5_K || type == Q6_K; }
constexpr int64_t block_weights(int64_t type) { return is_k(type) ? SUPER : BLOCK; }

inline float half_at(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, sizeof(bits));
#ifdef __F16C__
  return _cvtsh_ss(bits);  // one instruction, where c10's conversion is a dozen
#else
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
#endif
}

int64_t block_bytes(int64_t type) {
  switch (type) {
    case Q4_0: return 18;
    case Q4_1: return 20;
    case Q8_0: return 34;
    case Q4_K: return 144;
    case Q5_K: return 176;
    case Q6_K: return 210;
    default:
      TORCH_CHECK(false, "GGUF type ", type,
                  " is not executed quantized (Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K are)");
  }
  return 0;
}

// Calls ``f`` with the ggml type as a compile-time constant, so each type gets its own loop.
template <typename F>
void dispatch(int64_t type, F&& f) {
  switch (type) {
    case Q4_0: return f(std::integral_constant<int64_t, Q4_0>{});
    case Q4_1: return f(std::integral_constant<int64_t, Q4_1>{});
    case Q8_0: return f(std::integral_constant<int64_t, Q8_0>{});
    case Q4_K: return f(std::integral_constant<int64_t, Q4_K>{});
    case Q5_K: return f(std::integral_constant<int64_t, Q5_K>{});
    case Q6_K: return f(std::integral_constant<int64_t, Q6_K>{});
    default: block_bytes(type);  // refuses it by name
  }
}

#ifdef __AVX512F__
// One block's 32 values as two float vectors (values 0-15, 16-31), unscaled: Q4's raw
// nibbles (0..15), Q8_0's int8.
template <int64_t TYPE>
inline void block_values(const uint8_t* p, __m512& low, __m512& high) {
  if constexpr (TYPE == Q8_0) {
    low = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 2))));
    high = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 18))));
  } else {
    const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + (TYPE == Q4_1 ? 4 : 2))));
    low = _mm512_cvtepi32_ps(_mm512_and_si512(bytes, _mm512_set1_epi32(0x0F)));
    high = _mm512_cvtepi32_ps(_mm512_srli_epi32(bytes, 4));
  }
}

// 16 bytes from ``p`` as 16 int32 lanes.
inline __m512i bytes16(const uint8_t* p) {
  return _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
#endif

// The 32 weights of the block at ``p``, widened to float32.
template <int64_t TYPE>
inline void widen_block(const uint8_t* p, float* w) {
  const float d = half_at(p);
#ifdef __AVX512F__
  const __m512 scale = _mm512_set1_ps(d);
  const __m512 offset = _mm512_set1_ps(TYPE == Q4_1 ? half_at(p + 2) : TYPE == Q4_0 ? -8.0f * d : 0.0f);
  __m512 low, high;
  block_values<TYPE>(p, low, high);
  _mm512_storeu_ps(w, _mm512_fmadd_ps(low, scale, offset));
  _mm512_storeu_ps(w + 16, _mm512_fmadd_ps(high, scale, offset));
#else
  if constexpr (TYPE == Q8_0) {
    const int8_t* q = reinterpret_cast<const int8_t*>(p + 2);
    for (int64_t i = 0; i < BLOCK; ++i) w[i] = static_cast<float>(q[i]) * d;
  } else {
    const float m = TYPE == Q4_1 ? half_at(p + 2) : -8.0f * d;
    const uint8_t* q = p + (TYPE == Q4_1 ? 4 : 2);
    for (int64_t i = 0; i < BLOCK / 2; ++i) {
      w[i] = static_cast<float>(q[i] & 0x0F) * d + m;
      w[i + BLOCK / 2] = static_cast<float>(q[i] >> 4) * d + m;
    }
  }
#endif
}

// Q4_K's and Q5_K's 8 sub-block scales and mins, 6 bits each in 12 bytes (ggml's
// get_scale_min_k4): bytes 0-3 hold scales 0-3, 4-7 mins 0-3, each with 2 high bits of
// scale/min 4-7, whose low 4 bits are bytes 8-11's nibbles.
inline void k_scales(const uint8_t* s, float d, float dmin, float* scale, float* min) {
  for (int64_t j = 0; j < 4; ++j) {
    scale[j] = d * static_cast<float>(s[j] & 63);
    min[j] = dmin * static_cast<float>(s[j + 4] & 63);
    scale[j + 4] = d * static_cast<float>((s[j + 8] & 0x0F) | ((s[j] >> 6) << 4));
    min[j + 4] = dmin * static_cast<float>((s[j + 8] >> 4) | ((s[j + 4] >> 6) << 4));
  }
}

// The 256 weights of the Q4_K or Q5_K super-block at ``p``: sub-block 2j's weight l is
// byte 32j + l's low nibble, 2j + 1's its high one (and bit 2j, 2j + 1 of Q5_K's byte l
// their fifth bit).
template <int64_t TYPE>
inline void widen_q45_k(const uint8_t* p, float* w) {
  float scale[8], min[8];
  k_scales(p + 4, half_at(p), half_at(p + 2), scale, min);
  const uint8_t* qh = p + 16;
  const uint8_t* qs = p + (TYPE == Q5_K ? 48 : 16);
  for (int64_t j = 0; j < 4; ++j) {
#ifdef __AVX512F__
    const __m512 d1 = _mm512_set1_ps(scale[2 * j]), m1 = _mm512_set1_ps(-min[2 * j]);
    const __m512 d2 = _mm512_set1_ps(scale[2 * j + 1]), m2 = _mm512_set1_ps(-min[2 * j + 1]);
    for (int64_t half = 0; half < 2; ++half) {
      const __m512i bytes = bytes16(qs + 32 * j + 16 * half);
      __m512i low = _mm512_and_si512(bytes, _mm512_set1_epi32(0x0F)), high = _mm512_srli_epi32(bytes, 4);
      if constexpr (TYPE == Q5_K) {
        const __m512i bits = bytes16(qh + 16 * half), sixteen = _mm512_set1_epi32(16);
        low = _mm512_mask_add_epi32(low, _mm512_test_epi32_mask(bits, _mm512_set1_epi32(1 << (2 * j))), low, sixteen);
        high = _mm512_mask_add_epi32(high, _mm512_test_epi32_mask(bits, _mm512_set1_epi32(2 << (2 * j))), high,
                                     sixteen);
      }
      _mm512_storeu_ps(w + 64 * j + 16 * half, _mm512_fmadd_ps(_mm512_cvtepi32_ps(low), d1, m1));
      _mm512_storeu_ps(w + 64 * j + 32 + 16 * half, _mm512_fmadd_ps(_mm512_cvtepi32_ps(high), d2, m2));
    }
#else
    for (int64_t l = 0; l < 32; ++l) {
      int low = qs[32 * j + l] & 0x0F, high = qs[32 * j + l] >> 4;
      if constexpr (TYPE == Q5_K) {
        low |= ((qh[l] >> (2 * j)) & 1) << 4;
        high |= ((qh[l] >> (2 * j + 1)) & 1) << 4;
      }
      w[64 * j + l] = scale[2 * j] * static_cast<float>(low) - min[2 * j];
      w[64 * j + 32 + l] = scale[2 * j + 1] * static_cast<float>(high) - min[2 * j + 1];
    }
#endif
  }
}

// The 256 weights of the Q6_K super-block at ``p``, two halves of 128: weight l, l + 32,
// l + 64, l + 96 of half h (l < 32) are the low nibbles of ql[64h + l], ql[64h + 32 + l],
// then their high nibbles, with bit pairs 0-1, 2-3, 4-5, 6-7 of qh[32h + l] on top.
inline void widen_q6_k(const uint8_t* p, float* w) {
  const float d = half_at(p + 208);
  const int8_t* sc = reinterpret_cast<const int8_t*>(p + 192);
  for (int64_t h = 0; h < 2; ++h) {
    const uint8_t* ql = p + 64 * h;
    const uint8_t* qh = p + 128 + 32 * h;
    float* y = w + 128 * h;
#ifdef __AVX512F__
    for (int64_t quarter = 0; quarter < 2; ++quarter) {  // l = 16 quarter .. + 15
      const int64_t l = 16 * quarter;
      const __m512i a = bytes16(ql + l), b = bytes16(ql + 32 + l), hb = bytes16(qh + l);
      const __m512i nibble = _mm512_set1_epi32(0x0F), pair = _mm512_set1_epi32(3), bias = _mm512_set1_epi32(32);
      const __m512i low[4] = {_mm512_and_si512(a, nibble), _mm512_and_si512(b, nibble), _mm512_srli_epi32(a, 4),
                              _mm512_srli_epi32(b, 4)};
      for (int64_t i = 0; i < 4; ++i) {
        const __m512i high = _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(hb, 2 * i), pair), 4);
        const __m512i q = _mm512_sub_epi32(_mm512_or_si512(low[i], high), bias);
        const __m512 scale = _mm512_set1_ps(d * static_cast<float>(sc[8 * h + 2 * i + quarter]));
        _mm512_storeu_ps(y + 32 * i + l, _mm512_mul_ps(_mm512_cvtepi32_ps(q), scale));
      }
    }
#else
    for (int64_t l = 0; l < 32; ++l) {
      const int low[4] = {ql[l] & 0x0F, ql[l + 32] & 0x0F, ql[l] >> 4, ql[l + 32] >> 4};
      for (int64_t i = 0; i < 4; ++i) {
        const int q = (low[i] | (((qh[l] >> (2 * i)) & 3) << 4)) - 32;
        y[32 * i + l] = d * static_cast<float>(sc[8 * h + 2 * i + l / 16]) * static_cast<float>(q);
      }
    }
#endif
  }
}

// The weights of the block (32) or super-block (256) of type TYPE at ``p``, widened to float32.
template <int64_t TYPE>
inline void widen(const uint8_t* p, float* w) {
  if constexpr (TYPE == Q6_K) {
    widen_q6_k(p, w);
  } else if constexpr (is_k(TYPE)) {
    widen_q45_k<TYPE>(p, w);
  } else {
    widen_block<TYPE>(p, w);
  }
}

#ifdef __AVX512F__
// out[r, n] for R activation rows from ``r0`` on, against weight row ``row``: each block
// widened once into two vectors of weights (q d + m), then two FMAs per activation row
// into R accumulators held in registers (R is small and known here).
template <int64_t TYPE, int64_t R>
inline void dot_rows(float* out, const float* x, const uint8_t* row, int64_t r0, int64_t n, int64_t n_out,
                     int64_t k) {
  const int64_t nb = k / BLOCK, bytes = block_bytes(TYPE);
  __m512 vacc[R];
  for (int64_t r = 0; r < R; ++r) vacc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* block = row + b * bytes;
    const float d = half_at(block);
    const __m512 scale = _mm512_set1_ps(d);
    const __m512 offset = _mm512_set1_ps(TYPE == Q4_1 ? half_at(block + 2) : TYPE == Q4_0 ? -8.0f * d : 0.0f);
    __m512 low, high;
    block_values<TYPE>(block, low, high);
    low = _mm512_fmadd_ps(low, scale, offset);
    high = _mm512_fmadd_ps(high, scale, offset);
    for (int64_t r = 0; r < R; ++r) {
      const float* xr = x + (r0 + r) * k + b * BLOCK;
      vacc[r] = _mm512_fmadd_ps(high, _mm512_loadu_ps(xr + 16), _mm512_fmadd_ps(low, _mm512_loadu_ps(xr), vacc[r]));
    }
  }
  for (int64_t r = 0; r < R; ++r) out[(r0 + r) * n_out + n] = _mm512_reduce_add_ps(vacc[r]);
}
#endif

// A row's running sum over the blocks: a vector of partial sums with AVX-512 (reduced
// once at the end of the row), a float elsewhere.
#ifdef __AVX512F__
using Sum = __m512;
inline Sum zero_sum() { return _mm512_setzero_ps(); }
inline float total(Sum s) { return _mm512_reduce_add_ps(s); }
#else
using Sum = float;
inline Sum zero_sum() { return 0.0f; }
inline float total(Sum s) { return s; }
#endif

// s + the dot product of N (a multiple of 32) widened weights ``w`` (64-byte aligned) with
// ``x``: independent FMA chains, so that one row's product is not bound by their latency.
template <int64_t N>
inline Sum add_dot(Sum s, const float* w, const float* x) {
#ifdef __AVX512F__
  constexpr int64_t chains = N % 64 == 0 ? 4 : 2;
  __m512 acc[chains];
  for (int64_t v = 0; v < chains; ++v) acc[v] = _mm512_setzero_ps();
  for (int64_t i = 0; i < N; i += 16 * chains)
    for (int64_t v = 0; v < chains; ++v)
      acc[v] = _mm512_fmadd_ps(_mm512_load_ps(w + i + 16 * v), _mm512_loadu_ps(x + i + 16 * v), acc[v]);
  for (int64_t v = 1; v < chains; ++v) acc[0] = _mm512_add_ps(acc[0], acc[v]);
  return _mm512_add_ps(s, acc[0]);
#else
  for (int64_t i = 0; i < N; ++i) s += w[i] * x[i];
  return s;
#endif
}

// out[r, n] for every activation row against weight row ``row``, each block (super-block
// for the K-quants) widened once on the stack and dotted with every row.
template <int64_t TYPE>
inline void widened_dot_rows(float* out, const float* x, const uint8_t* row, int64_t rows, int64_t n,
                             int64_t n_out, int64_t k) {
  constexpr int64_t weights = block_weights(TYPE);
  const int64_t bytes = block_bytes(TYPE);
  alignas(64) float w[weights];
  Sum sums[MAX_ROWS];
  for (int64_t r = 0; r < rows; ++r) sums[r] = zero_sum();
  for (int64_t b = 0; b < k / weights; ++b) {
    widen<TYPE>(row + b * bytes, w);
    for (int64_t r = 0; r < rows; ++r) sums[r] = add_dot<weights>(sums[r], w, x + r * k + b * weights);
  }
  for (int64_t r = 0; r < rows; ++r) out[r * n_out + n] = total(sums[r]);
}

template <int64_t TYPE>
void matmul_rows(float* out, const float* x, const uint8_t* blocks, int64_t rows, int64_t n_out, int64_t k) {
  const int64_t row_bytes = k / block_weights(TYPE) * block_bytes(TYPE);
  at::parallel_for(0, n_out, 16, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      const uint8_t* row = blocks + n * row_bytes;
#ifdef __AVX512F__
      if constexpr (!is_k(TYPE)) {
        // Four rows at a time; the weight row stays in L1 between groups.
        int64_t r0 = 0;
        for (; r0 + 4 <= rows; r0 += 4) dot_rows<TYPE, 4>(out, x, row, r0, n, n_out, k);
        const int64_t left = rows - r0;
        if (left == 3) dot_rows<TYPE, 3>(out, x, row, r0, n, n_out, k);
        if (left == 2) dot_rows<TYPE, 2>(out, x, row, r0, n, n_out, k);
        if (left == 1) dot_rows<TYPE, 1>(out, x, row, r0, n, n_out, k);
        continue;
      }
#endif
      widened_dot_rows<TYPE>(out, x, row, rows, n, n_out, k);
    }
  });
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define GGUF_INT8 1
// Integer products (llama.cpp's, for Q4_0, Q4_1, Q8_0, and Q4_K, Q5_K as 8 blocks of 32
// like Q4_1's with their sub-block's scale and minimum; Q6_K's sub-blocks of 16 do not fit
// the 32-blocks below and keep float32): each activation row is quantized once per call
// per 32-block (llama.cpp's Q8_0 / Q8_1: d = max|x| / 127, q = round(x / d); for the
// K-quants llama.cpp takes one scale per 256, Q8_K), and a weight block's product with it
// is d_w d (sum of q_w q) in integers, with vpdpbusd
// (u8 x s8 -> s32, four products a lane). With DIGITS = 2 the rounding error x - d q
// (at most d / 2) is quantized again, q2 = round((x - d q) 256 / d), so x = d (q + q2 / 256)
// to 1/512 of d where int8 alone is off by up to d / 2: the integer sum is
// 256 (sum q_w q) + sum q_w q2, two more dot products per activation row.
// Four weight rows share one 512-bit vector, a 128-bit lane each, their weights 0-15 in
// one vector and 16-31 in another, so each lane sums 8 products and one conversion and
// one FMA scale 4 weight rows' blocks; the activation block (16 bytes broadcast to the
// four lanes) is read once for the four. Q4 nibbles (0..15) are the unsigned side; Q8_0
// weights are signed, so its activations are stored as q + 128 (unsigned) and 128 times
// each lane's weight sum is taken off. Q4_0's -8 and Q4_1's minimum m multiply the block's
// activation sum, d (sum q) (llama.cpp's Q8_1 s), in float.

constexpr int64_t MAX_DIGITS = 2;

// Activation rows quantized per 32-block, the rows of one block side by side.
struct Int8Rows {
  int64_t rows;
  std::vector<uint8_t> q;  // [digits][blocks][rows][32]: int8 q, or q + 128 against Q8_0 weights
  std::vector<float> d;    // [blocks][rows]: the integer sum's scale, d or d / 256
  std::vector<float> sum;  // [blocks][rows]: the block's sum as quantized, d (sum q (+ q2 / 256))
};

// 32 int32 values (two vectors) stored as bytes, plus ``shift`` (128 against Q8_0 weights).
inline void store_bytes(uint8_t* dst, __m512i lo, __m512i hi, __m512i shift) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(dst), _mm512_cvtepi32_epi8(_mm512_add_epi32(lo, shift)));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + 16), _mm512_cvtepi32_epi8(_mm512_add_epi32(hi, shift)));
}

template <int64_t TYPE, int64_t DIGITS>
Int8Rows quantize_activations(const float* x, int64_t rows, int64_t k) {
  const int64_t nb = k / BLOCK, plane = nb * rows * BLOCK;
  Int8Rows a{rows, std::vector<uint8_t>(DIGITS * plane), std::vector<float>(nb * rows), std::vector<float>(nb * rows)};
  const __m512i shift = _mm512_set1_epi32(TYPE == Q8_0 ? 128 : 0), top = _mm512_set1_epi32(127);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t b = 0; b < nb; ++b) {
      const __m512 lo = _mm512_loadu_ps(x + r * k + b * BLOCK), hi = _mm512_loadu_ps(x + r * k + b * BLOCK + 16);
      // max / 127 as -ffast-math compiles it anyway, written out so that tests can match it
      const float d = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi))) * (1.0f / 127.0f);
      const float inverse = d != 0.0f ? 1.0f / d : 0.0f;
      const __m512 id = _mm512_set1_ps(inverse), vd = _mm512_set1_ps(d);
      const __m512i qlo = _mm512_cvtps_epi32(_mm512_mul_ps(lo, id)), qhi = _mm512_cvtps_epi32(_mm512_mul_ps(hi, id));
      const int64_t at = b * rows + r;
      store_bytes(a.q.data() + at * BLOCK, qlo, qhi, shift);
      float total = static_cast<float>(_mm512_reduce_add_epi32(_mm512_add_epi32(qlo, qhi)));
      if constexpr (DIGITS == 2) {  // the residuals, in 1/256ths of d (|.| <= 128, 128 kept as 127)
        const __m512 id2 = _mm512_set1_ps(256.0f * inverse);
        const __m512 elo = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(qlo), vd, lo);  // x - d q
        const __m512 ehi = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(qhi), vd, hi);
        const __m512i rlo = _mm512_min_epi32(top, _mm512_cvtps_epi32(_mm512_mul_ps(elo, id2)));
        const __m512i rhi = _mm512_min_epi32(top, _mm512_cvtps_epi32(_mm512_mul_ps(ehi, id2)));
        store_bytes(a.q.data() + plane + at * BLOCK, rlo, rhi, shift);
        total += static_cast<float>(_mm512_reduce_add_epi32(_mm512_add_epi32(rlo, rhi))) / 256.0f;
      }
      a.d[at] = DIGITS == 2 ? d / 256.0f : d;
      a.sum[at] = d * total;
    }
  }
  return a;
}

// 16 bytes at ``p`` and at the next three weight rows (``stride`` apart), one 128-bit lane each.
inline __m512i lanes4(const uint8_t* p, int64_t stride) {
  __m512i v = _mm512_castsi128_si512(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  v = _mm512_inserti32x4(v, _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + stride)), 1);
  v = _mm512_inserti32x4(v, _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 2 * stride)), 2);
  return _mm512_inserti32x4(v, _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 3 * stride)), 3);
}

// Four weight rows' block: weights 0-15 (lo) and 16-31 (hi) a lane per row, the scales d
// spread over each row's lane, the factor of the activations' sum (Q4_0's -8 d, Q4_1's m)
// in each lane's first element only, and the integer sum each lane starts from (Q8_0: -128
// times its weights' sum).
struct Blocks4 {
  __m512i lo, hi, start;
  __m512 scale, min;
};

template <int64_t TYPE>
inline Blocks4 blocks4(const uint8_t* p, int64_t stride) {
  Blocks4 w;
  if constexpr (TYPE == Q8_0) {
    w.lo = lanes4(p + 2, stride);
    w.hi = lanes4(p + 18, stride);
    const __m512i u128 = _mm512_set1_epi8(static_cast<char>(0x80));
    const __m512i sums = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), u128, w.lo), u128, w.hi);
    w.start = _mm512_sub_epi32(_mm512_setzero_si512(), sums);  // -128 (sum of the lane's weights)
  } else {
    const __m512i raw = lanes4(p + (TYPE == Q4_1 ? 4 : 2), stride), nibble = _mm512_set1_epi8(0x0F);
    w.lo = _mm512_and_si512(raw, nibble);
    w.hi = _mm512_and_si512(_mm512_srli_epi16(raw, 4), nibble);
    w.start = _mm512_setzero_si512();
  }
  int32_t heads[4];  // each block's first 4 bytes: fp16 d, and Q4_1's fp16 m
  for (int64_t i = 0; i < 4; ++i) std::memcpy(&heads[i], p + i * stride, sizeof(int32_t));
  const __m128i halves = _mm_setr_epi32(heads[0], heads[1], heads[2], heads[3]);  // not through memory: no
  const __m512 dm = _mm512_castps256_ps512(_mm256_cvtph_ps(halves));              // store-forwarding stall
  w.scale = _mm512_permutexvar_ps(_mm512_setr_epi32(0, 0, 0, 0, 2, 2, 2, 2, 4, 4, 4, 4, 6, 6, 6, 6), dm);
  if constexpr (TYPE == Q4_1)
    w.min = _mm512_maskz_permutexvar_ps(0x1111, _mm512_setr_epi32(1, 0, 0, 0, 3, 0, 0, 0, 5, 0, 0, 0, 7, 0, 0, 0), dm);
  else
    w.min = _mm512_maskz_mul_ps(0x1111, w.scale, _mm512_set1_ps(-8.0f));  // Q4_0's (Q8_0 has none)
  return w;
}

// The integer sum of one activation row's block (``xq``: its digits ``plane`` bytes apart)
// against four weight rows' block.
template <int64_t TYPE, int64_t DIGITS>
inline __m512i block_dot(const Blocks4& w, const uint8_t* xq, int64_t plane) {
  __m512i dot = w.start;
  for (int64_t digit = 0; digit < DIGITS; ++digit) {
    const uint8_t* q = xq + digit * plane;
    const __m512i xlo = _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q)));
    const __m512i xhi = _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 16)));
    if (digit > 0) dot = _mm512_slli_epi32(dot, 8);
    if (digit > 0 && TYPE == Q8_0) dot = _mm512_add_epi32(dot, w.start);
    if constexpr (TYPE == Q8_0) {
      dot = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(dot, xlo, w.lo), xhi, w.hi);
    } else {
      dot = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(dot, w.lo, xlo), w.hi, xhi);
    }
  }
  return dot;
}

// Four weight rows' Q4_K or Q5_K super-block as its 8 sub-blocks of 32 (``w``), each a
// block like Q4_1's: scale d sc, minimum -dmin m (k_scales), 4- or 5-bit values.
template <int64_t TYPE>
inline void k_blocks4(const uint8_t* p, int64_t stride, Blocks4* w) {
  alignas(16) float scale[8][4], min[8][4];
  for (int64_t i = 0; i < 4; ++i) {
    const uint8_t* q = p + i * stride;
    float sc[8], m[8];
    k_scales(q + 4, half_at(q), half_at(q + 2), sc, m);
    for (int64_t j = 0; j < 8; ++j) scale[j][i] = sc[j], min[j][i] = -m[j];
  }
  const __m512i spread = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
  const __m512i nibble = _mm512_set1_epi8(0x0F);
  const uint8_t* qs = p + (TYPE == Q5_K ? 48 : 16);
  const __m512i bits0 = lanes4(p + 16, stride), bits1 = lanes4(p + 32, stride), sixteen = _mm512_set1_epi8(16);
  for (int64_t j = 0; j < 8; ++j) {
    const __m512i raw0 = lanes4(qs + 32 * (j / 2), stride), raw1 = lanes4(qs + 32 * (j / 2) + 16, stride);
    const int shift = j % 2 == 0 ? 0 : 4;  // sub-block 2i: low nibbles, 2i + 1: high
    w[j].lo = _mm512_and_si512(_mm512_srli_epi16(raw0, shift), nibble);
    w[j].hi = _mm512_and_si512(_mm512_srli_epi16(raw1, shift), nibble);
    if constexpr (TYPE == Q5_K) {  // bit j of each weight's qh byte: its fifth bit
      const __m512i bit = _mm512_set1_epi8(static_cast<char>(1 << j));
      w[j].lo = _mm512_mask_add_epi8(w[j].lo, _mm512_test_epi8_mask(bits0, bit), w[j].lo, sixteen);
      w[j].hi = _mm512_mask_add_epi8(w[j].hi, _mm512_test_epi8_mask(bits1, bit), w[j].hi, sixteen);
    }
    w[j].start = _mm512_setzero_si512();
    w[j].scale = _mm512_permutexvar_ps(spread, _mm512_castps128_ps512(_mm_load_ps(scale[j])));
    w[j].min = _mm512_maskz_permutexvar_ps(0x1111, spread, _mm512_castps128_ps512(_mm_load_ps(min[j])));
  }
}

// acc[r] += activation rows r0 .. r0 + R's block ``b`` times four weight rows' block ``w``.
template <int64_t TYPE, int64_t DIGITS, int64_t R>
inline void add_block(__m512* acc, const Blocks4& w, const Int8Rows& a, int64_t b, int64_t r0, int64_t plane) {
  const int64_t at = b * a.rows + r0;
  for (int64_t r = 0; r < R; ++r) {
    const __m512i dot = block_dot<TYPE, DIGITS>(w, a.q.data() + (at + r) * BLOCK, plane);
    acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(w.scale, _mm512_set1_ps(a.d[at + r])), acc[r]);
    if constexpr (TYPE != Q8_0) acc[r] = _mm512_fmadd_ps(w.min, _mm512_set1_ps(a.sum[at + r]), acc[r]);
  }
}

// out[r0 .. r0 + R, n0 .. n0 + 4] from the quantized activation rows ``a`` (``nb``
// 32-blocks a row) and the four weight rows at ``row0`` (``row_bytes`` apart): R float
// accumulators of 16 lanes, four a weight row, summed at the end.
template <int64_t TYPE, int64_t DIGITS, int64_t R>
inline void int8_dot4(float* out, const Int8Rows& a, const uint8_t* row0, int64_t row_bytes, int64_t r0, int64_t n0,
                      int64_t n_out, int64_t nb) {
  constexpr int64_t per_unit = block_weights(TYPE) / BLOCK;  // 32-blocks in a block or super-block
  const int64_t plane = nb * a.rows * BLOCK, units = nb / per_unit;
  __m512 acc[R];
  for (int64_t r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  // The next group of four weight rows (they follow these in memory), a few cache lines
  // a block: the hardware prefetcher alone left a decode step's products at 60% of the
  // speed they have with it (the rows are short: 360-612 bytes).
  const uint8_t* next = row0 + 4 * row_bytes;
  const int64_t per_block = ((4 * row_bytes + 63) / 64 + units - 1) / units;
  for (int64_t u = 0; u < units; ++u) {
    for (int64_t i = 0; i < per_block; ++i)
      _mm_prefetch(reinterpret_cast<const char*>(next + 64 * (u * per_block + i)), _MM_HINT_T0);
    if constexpr (is_k(TYPE)) {
      Blocks4 w[8];
      k_blocks4<TYPE>(row0 + u * block_bytes(TYPE), row_bytes, w);
      for (int64_t j = 0; j < 8; ++j) add_block<TYPE, DIGITS, R>(acc, w[j], a, u * 8 + j, r0, plane);
    } else {
      add_block<TYPE, DIGITS, R>(acc, blocks4<TYPE>(row0 + u * block_bytes(TYPE), row_bytes), a, u, r0, plane);
    }
  }
  const __m512i firsts = _mm512_setr_epi32(0, 4, 8, 12, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0);
  for (int64_t r = 0; r < R; ++r) {
    __m512 s = _mm512_add_ps(acc[r], _mm512_permute_ps(acc[r], 0xB1));  // lane pairs
    s = _mm512_add_ps(s, _mm512_permute_ps(s, 0x4E));                   // lane quads
    _mm_storeu_ps(out + (r0 + r) * n_out + n0, _mm512_castps512_ps128(_mm512_permutexvar_ps(firsts, s)));
  }
}

// Up to 8 rows from ``r0`` on at once (their accumulators stay in registers).
template <int64_t TYPE, int64_t DIGITS>
void int8_rows4(float* out, const Int8Rows& a, const uint8_t* row0, int64_t row_bytes, int64_t n0, int64_t n_out,
                int64_t nb) {
  for (int64_t r0 = 0; r0 < a.rows; r0 += 8) {
    switch (std::min<int64_t>(8, a.rows - r0)) {
      case 1: int8_dot4<TYPE, DIGITS, 1>(out, a, row0, row_bytes, r0, n0, n_out, nb); break;
      case 2: int8_dot4<TYPE, DIGITS, 2>(out, a, row0, row_bytes, r0, n0, n_out, nb); break;
      case 3: int8_dot4<TYPE, DIGITS, 3>(out, a, row0, row_bytes, r0, n0, n_out, nb); break;
      case 4: int8_dot4<TYPE, DIGITS, 4>(out, a, row0, row_bytes, r0, n0, n_out, nb); break;
      case 5: int8_dot4<TYPE, DIGITS, 5>(out, a, row0, row_bytes, r0, n0, n_out, nb); break;
      case 6: int8_dot4<TYPE, DIGITS, 6>(out, a, row0, row_bytes, r0, n0, n_out, nb); break;
      case 7: int8_dot4<TYPE, DIGITS, 7>(out, a, row0, row_bytes, r0, n0, n_out, nb); break;
      default: int8_dot4<TYPE, DIGITS, 8>(out, a, row0, row_bytes, r0, n0, n_out, nb); break;
    }
  }
}

// The integer products for the weight rows in groups of four; the last n_out % 4 rows
// (no model here has such a layer) copied beside zero blocks (d = 0) to make a group.
template <int64_t TYPE, int64_t DIGITS>
void matmul_int8(float* out, const float* x, const uint8_t* blocks, int64_t rows, int64_t n_out, int64_t k) {
  const int64_t nb = k / BLOCK, row_bytes = k / block_weights(TYPE) * block_bytes(TYPE), whole = n_out / 4 * 4;
  const Int8Rows a = quantize_activations<TYPE, DIGITS>(x, rows, k);
  at::parallel_for(0, n_out / 4, 4, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g)
      int8_rows4<TYPE, DIGITS>(out, a, blocks + 4 * g * row_bytes, row_bytes, 4 * g, n_out, nb);
  });
  if (whole == n_out) return;
  std::vector<uint8_t> last(4 * row_bytes, 0);
  std::memcpy(last.data(), blocks + whole * row_bytes, (n_out - whole) * row_bytes);
  std::vector<float> part(rows * 4);
  int8_rows4<TYPE, DIGITS>(part.data(), a, last.data(), row_bytes, 0, 4, nb);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t n = whole; n < n_out; ++n) out[r * n_out + n] = part[r * 4 + n - whole];
}
#endif

template <int64_t TYPE, typename T>
void dequantize_rows(T* out, const uint8_t* blocks, int64_t n_out, int64_t k) {
  constexpr int64_t weights = block_weights(TYPE);
  const int64_t nb = k / weights, bytes = block_bytes(TYPE), row_bytes = nb * bytes;
  at::parallel_for(0, n_out, 16, [&](int64_t begin, int64_t end) {
    alignas(64) float w[weights];
    for (int64_t n = begin; n < end; ++n) {
      for (int64_t b = 0; b < nb; ++b) {
        const uint8_t* block = blocks + n * row_bytes + b * bytes;
        T* dst = out + n * k + b * weights;
        if constexpr (std::is_same_v<T, float>) {
          widen<TYPE>(block, dst);
        } else {
          widen<TYPE>(block, w);
          for (int64_t i = 0; i < weights; ++i) dst[i] = static_cast<T>(w[i]);
        }
      }
    }
  });
}

void check_blocks(const at::Tensor& blocks, int64_t type, int64_t k) {
  TORCH_CHECK(blocks.scalar_type() == at::kByte && blocks.dim() == 2 && blocks.is_contiguous(),
              "GGUF blocks: contiguous uint8 [out_features, row bytes]");
  const int64_t weights = block_weights(type);
  TORCH_CHECK(k % weights == 0 && blocks.size(1) == k / weights * block_bytes(type),
              "GGUF blocks: ", blocks.size(1), " bytes a row do not hold ", k, " weights of type ", type);
}

// out [rows, n] = x [rows, k] @ W^T, W the GGUF ``blocks`` [n, row bytes]; x and out of one
// dtype, float32 or bf16 (bf16 rows widened on entry and the sums rounded on exit here,
// as torch's conversions around a float32 product would: a decode step's layers then
// need no conversion ops of their own).
// activation_bits: 8 or 16 (one or two int8 digits) for the integer products where they
// are compiled in and the type has them (all but Q6_K); 32 or Q6_K: float32.
void gguf_matmul(at::Tensor out, const at::Tensor& x, const at::Tensor& blocks, int64_t type, int64_t activation_bits) {
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  TORCH_CHECK((bf16 || x.scalar_type() == at::kFloat) && x.dim() == 2 && x.is_contiguous() && x.size(0) <= MAX_ROWS,
              "gguf_matmul: x contiguous float32 or bf16 [rows <= ", MAX_ROWS, ", in_features]");
  check_blocks(blocks, type, x.size(1));
  TORCH_CHECK(out.scalar_type() == x.scalar_type() && out.is_contiguous() && out.size(0) == x.size(0) &&
                  out.size(1) == blocks.size(0), "gguf_matmul: out contiguous [rows, out_features], of x's dtype");
  TORCH_CHECK(activation_bits == 8 || activation_bits == 16 || activation_bits == 32,
              "gguf_matmul: activation_bits 8, 16 or 32, not ", activation_bits);
  const int64_t rows = x.size(0), n = blocks.size(0), k = x.size(1);
  std::vector<float> wide_x(bf16 ? rows * k : 0), wide_out(bf16 ? rows * n : 0);
  if (bf16) {
    const c10::BFloat16* in = x.data_ptr<c10::BFloat16>();
    for (int64_t i = 0; i < rows * k; ++i) wide_x[i] = memserve_kernels::widen(in[i]);
  }
  float* dst = bf16 ? wide_out.data() : out.data_ptr<float>();
  const float* src = bf16 ? wide_x.data() : x.data_ptr<float>();
  const uint8_t* w = blocks.data_ptr<uint8_t>();
  dispatch(type, [&](auto t) {
    constexpr int64_t TYPE = decltype(t)::value;
#ifdef GGUF_INT8
    if constexpr (TYPE != Q6_K) {
      if (activation_bits == 8) return matmul_int8<TYPE, 1>(dst, src, w, rows, n, k);
      if (activation_bits == 16) return matmul_int8<TYPE, MAX_DIGITS>(dst, src, w, rows, n, k);
    }
#endif
    matmul_rows<TYPE>(dst, src, w, rows, n, k);
  });
  if (bf16) {
    c10::BFloat16* narrowed = out.data_ptr<c10::BFloat16>();
    for (int64_t i = 0; i < rows * n; ++i) narrowed[i] = memserve_kernels::store(wide_out[i], static_cast<c10::BFloat16*>(nullptr));
  }
}

// The ggml types gguf_matmul multiplies with int8 activations in this build (none without VNNI).
std::vector<int64_t> gguf_int8_types() {
#ifdef GGUF_INT8
  return {Q4_0, Q4_1, Q8_0, Q4_K, Q5_K};
#else
  return {};
#endif
}

// out [n, k] (float32 or bf16) = the weights the GGUF ``blocks`` hold.
void gguf_dequantize(at::Tensor out, const at::Tensor& blocks, int64_t type) {
  TORCH_CHECK(out.dim() == 2 && out.is_contiguous() && out.size(0) == blocks.size(0),
              "gguf_dequantize: out contiguous [out_features, in_features]");
  TORCH_CHECK(out.scalar_type() == at::kFloat || out.scalar_type() == at::kBFloat16,
              "gguf_dequantize: float32 or bfloat16 only");
  check_blocks(blocks, type, out.size(1));
  const uint8_t* src = blocks.data_ptr<uint8_t>();
  const int64_t n = out.size(0), k = out.size(1);
  dispatch(type, [&](auto t) {
    constexpr int64_t TYPE = decltype(t)::value;
    if (out.scalar_type() == at::kFloat) {
      dequantize_rows<TYPE, float>(out.data_ptr<float>(), src, n, k);
    } else {
      dequantize_rows<TYPE, c10::BFloat16>(out.data_ptr<c10::BFloat16>(), src, n, k);
    }
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(memserve, m) {
  m.def("gguf_matmul(Tensor(a!) out, Tensor x, Tensor blocks, int type, int activation_bits) -> ()");
  m.def("gguf_int8_types() -> int[]", &gguf_int8_types);
  m.def("gguf_dequantize(Tensor(a!) out, Tensor blocks, int type) -> ()");
}

TORCH_LIBRARY_IMPL(memserve, CPU, m) {
  m.impl("gguf_matmul", &gguf_matmul);
  m.impl("gguf_dequantize", &gguf_dequantize);
}
