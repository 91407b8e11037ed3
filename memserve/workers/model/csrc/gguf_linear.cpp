// Linear layers over GGUF-quantized weights, read as the file stores them.
//
// A weight row of K inputs is K / 32 blocks, each 32 weights and their scale (llama.cpp's
// ggml-common.h layouts, little-endian):
//   Q4_0: fp16 d, 16 bytes of nibbles        w = (q - 8) * d   (q: byte j's low nibble is
//   Q4_1: fp16 d, fp16 m, 16 bytes           w = q * d + m      weight j, its high nibble
//   Q8_0: fp16 d, 32 int8                    w = q * d          weight j + 16)
// gguf_matmul multiplies a few activation rows (decode steps) by such rows without ever
// widening the weight matrix in memory: each block is widened in registers (two 16-lane
// vectors with AVX-512, -march=native on a CPU that has it; 32 floats on the stack
// elsewhere) and used for every activation row, so the bytes read per step are the
// file's (4.5-8.5 bits a weight against 32 for float32), which is what bounds a decode
// step. Sums are float32; the result equals the dequantized weights' product up
// to the order of float32 sums and roundings. gguf_dequantize widens a whole matrix, for prefill chunks,
// where a oneDNN product over widened weights is faster than this loop.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <cstdint>
#include <cstring>
#include <type_traits>

#if defined(__AVX512F__) || defined(__F16C__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t BLOCK = 32;
constexpr int64_t MAX_ROWS = 16;  // activation rows gguf_matmul takes at once
enum Type : int64_t { Q4_0 = 2, Q4_1 = 3, Q8_0 = 8 };  // ggml's type ids

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
    default: TORCH_CHECK(false, "GGUF type ", type, " is not executed quantized (Q4_0, Q4_1, Q8_0 are)");
  }
  return 0;
}

// The 32 weights of the block at ``p``, widened to float32.
template <int64_t TYPE>
inline void widen_block(const uint8_t* p, float* w) {
  const float d = half_at(p);
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
#endif

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

template <int64_t TYPE>
void matmul_rows(float* out, const float* x, const uint8_t* blocks, int64_t rows, int64_t n_out, int64_t k) {
  const int64_t row_bytes = k / BLOCK * block_bytes(TYPE);
  at::parallel_for(0, n_out, 16, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      const uint8_t* row = blocks + n * row_bytes;
#ifdef __AVX512F__
      // Four rows at a time; the weight row stays in L1 between groups.
      int64_t r0 = 0;
      for (; r0 + 4 <= rows; r0 += 4) dot_rows<TYPE, 4>(out, x, row, r0, n, n_out, k);
      const int64_t left = rows - r0;
      if (left == 3) dot_rows<TYPE, 3>(out, x, row, r0, n, n_out, k);
      if (left == 2) dot_rows<TYPE, 2>(out, x, row, r0, n, n_out, k);
      if (left == 1) dot_rows<TYPE, 1>(out, x, row, r0, n, n_out, k);
#else
      float w[BLOCK];
      for (int64_t r = 0; r < rows; ++r) out[r * n_out + n] = 0.0f;
      for (int64_t b = 0; b < k / BLOCK; ++b) {
        widen_block<TYPE>(row + b * block_bytes(TYPE), w);
        for (int64_t r = 0; r < rows; ++r) {
          const float* xr = x + r * k + b * BLOCK;
          float sum = 0.0f;
          for (int64_t i = 0; i < BLOCK; ++i) sum += w[i] * xr[i];
          out[r * n_out + n] += sum;
        }
      }
#endif
    }
  });
}

template <int64_t TYPE, typename T>
void dequantize_rows(T* out, const uint8_t* blocks, int64_t n_out, int64_t k) {
  const int64_t nb = k / BLOCK, bytes = block_bytes(TYPE), row_bytes = nb * bytes;
  at::parallel_for(0, n_out, 16, [&](int64_t begin, int64_t end) {
    float w[BLOCK];
    for (int64_t n = begin; n < end; ++n) {
      for (int64_t b = 0; b < nb; ++b) {
        const uint8_t* block = blocks + n * row_bytes + b * bytes;
        T* dst = out + n * k + b * BLOCK;
#ifdef __AVX512F__
        if constexpr (std::is_same_v<T, float>) {
          const float d = half_at(block);
          const __m512 scale = _mm512_set1_ps(d);
          const __m512 offset = _mm512_set1_ps(TYPE == Q4_1 ? half_at(block + 2) : TYPE == Q4_0 ? -8.0f * d : 0.0f);
          __m512 low, high;
          block_values<TYPE>(block, low, high);
          _mm512_storeu_ps(dst, _mm512_fmadd_ps(low, scale, offset));
          _mm512_storeu_ps(dst + 16, _mm512_fmadd_ps(high, scale, offset));
          continue;
        }
#endif
        widen_block<TYPE>(block, w);
        for (int64_t i = 0; i < BLOCK; ++i) dst[i] = static_cast<T>(w[i]);
      }
    }
  });
}

void check_blocks(const at::Tensor& blocks, int64_t type, int64_t k) {
  TORCH_CHECK(blocks.scalar_type() == at::kByte && blocks.dim() == 2 && blocks.is_contiguous(),
              "GGUF blocks: contiguous uint8 [out_features, row bytes]");
  TORCH_CHECK(k % BLOCK == 0 && blocks.size(1) == k / BLOCK * block_bytes(type),
              "GGUF blocks: ", blocks.size(1), " bytes a row do not hold ", k, " weights of type ", type);
}

// out [rows, n] float32 = x [rows, k] float32 @ W^T, W the GGUF ``blocks`` [n, k / 32 blocks].
void gguf_matmul(at::Tensor out, const at::Tensor& x, const at::Tensor& blocks, int64_t type) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && x.is_contiguous() && x.size(0) <= MAX_ROWS,
              "gguf_matmul: x contiguous float32 [rows <= ", MAX_ROWS, ", in_features]");
  check_blocks(blocks, type, x.size(1));
  TORCH_CHECK(out.scalar_type() == at::kFloat && out.is_contiguous() && out.size(0) == x.size(0) &&
                  out.size(1) == blocks.size(0), "gguf_matmul: out contiguous float32 [rows, out_features]");
  auto run = type == Q4_0 ? matmul_rows<Q4_0> : type == Q4_1 ? matmul_rows<Q4_1> : matmul_rows<Q8_0>;
  run(out.data_ptr<float>(), x.data_ptr<float>(), blocks.data_ptr<uint8_t>(), x.size(0), blocks.size(0), x.size(1));
}

// out [n, k] (float32 or bf16) = the weights the GGUF ``blocks`` hold.
void gguf_dequantize(at::Tensor out, const at::Tensor& blocks, int64_t type) {
  TORCH_CHECK(out.dim() == 2 && out.is_contiguous() && out.size(0) == blocks.size(0),
              "gguf_dequantize: out contiguous [out_features, in_features]");
  check_blocks(blocks, type, out.size(1));
  const uint8_t* src = blocks.data_ptr<uint8_t>();
  const int64_t n = out.size(0), k = out.size(1);
  if (out.scalar_type() == at::kFloat) {
    auto run = type == Q4_0 ? dequantize_rows<Q4_0, float> : type == Q4_1 ? dequantize_rows<Q4_1, float>
                                                                           : dequantize_rows<Q8_0, float>;
    run(out.data_ptr<float>(), src, n, k);
  } else if (out.scalar_type() == at::kBFloat16) {
    auto run = type == Q4_0 ? dequantize_rows<Q4_0, c10::BFloat16>
               : type == Q4_1 ? dequantize_rows<Q4_1, c10::BFloat16>
                              : dequantize_rows<Q8_0, c10::BFloat16>;
    run(out.data_ptr<c10::BFloat16>(), src, n, k);
  } else {
    TORCH_CHECK(false, "gguf_dequantize: float32 or bfloat16 only");
  }
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(memserve, m) {
  m.def("gguf_matmul(Tensor(a!) out, Tensor x, Tensor blocks, int type) -> ()");
  m.def("gguf_dequantize(Tensor(a!) out, Tensor blocks, int type) -> ()");
}

TORCH_LIBRARY_IMPL(memserve, CPU, m) {
  m.impl("gguf_matmul", &gguf_matmul);
  m.impl("gguf_dequantize", &gguf_dequantize);
}
