// Pointwise steps of a decoder layer fused into one pass over memory each.
//
// In eager torch, an RMSNorm is six ops (widen, square, mean, rsqrt, scale, narrow and
// weight) and SwiGLU's act(gate) * up three, each a pass over the activations and a
// dispatch: in a 1600-token bf16 prefill they took a quarter of the step, and at decode
// their dispatch alone is felt. Each function here reads its inputs once and writes its
// outputs once, row by row on torch's threads.
//
// The rounding is transformers': values are widened to float32, and narrowed to the
// tensor's dtype exactly where the eager ops narrow them, so bf16 results equal the eager
// path's but for the order of one float32 sum (the mean of squares):
//   rms_norm:      out = w * narrow(x * rsqrt(mean(x^2) + eps))       (Llama)
//                  out = narrow(x * rsqrt(mean(x^2) + eps) * (1 + w))   (Gemma, unit_offset)
//   add_rms_norm:  sum = narrow(x + residual); out = rms_norm(sum)
//   silu_and_mul:  out = narrow(narrow(silu(gate)) * up), x = [gate | up] along the last dim
//   rotary_write_kv: the rotary embedding of [q heads | k heads],
//                  out = narrow(narrow(x * cos) + narrow(rotate_half(x) * sin)) on the first
//                  rotary_dim dims of each head, the rest copied (Phi's partial rotary),
//                  then the rotated k heads and v stored at each token's cache slot
//                  (attention.write_kv's stores: the cache's dtype, into FP8 clamped to
//                  e4m3's range first), which in eager ops are two indexed writes a layer
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Float8_e4m3fn.h>
#include <torch/library.h>

#include "bf16.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

namespace {

using memserve_kernels::narrow;
using memserve_kernels::store;
using memserve_kernels::widen;

constexpr int64_t GRAIN_ROWS = 16;

template <typename T>
void rms_rows(T* out, T* sum_out, const T* x, const T* residual, const T* weight, int64_t rows, int64_t width,
              double eps, bool unit_offset) {
  at::parallel_for(0, rows, GRAIN_ROWS, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* xr = x + r * width;
      const T* rr = residual != nullptr ? residual + r * width : nullptr;
      T* sr = sum_out != nullptr ? sum_out + r * width : nullptr;
      T* outr = out + r * width;
      float squares = 0.0f;
      for (int64_t i = 0; i < width; ++i) {
        float v = widen(xr[i]);
        if (rr != nullptr) {
          v = narrow(v + widen(rr[i]), static_cast<T*>(nullptr));
          sr[i] = store(v, static_cast<T*>(nullptr));
        }
        squares += v * v;
      }
      const float inv = 1.0f / std::sqrt(squares / static_cast<float>(width) + static_cast<float>(eps));
      const T* source = rr != nullptr ? sr : xr;
      if (unit_offset) {
        for (int64_t i = 0; i < width; ++i) outr[i] = store(widen(source[i]) * inv * (1.0f + widen(weight[i])), static_cast<T*>(nullptr));
      } else {
        for (int64_t i = 0; i < width; ++i) {
          outr[i] = store(widen(weight[i]) * narrow(widen(source[i]) * inv, static_cast<T*>(nullptr)),
                          static_cast<T*>(nullptr));
        }
      }
    }
  });
}

template <typename T>
void silu_mul_rows(T* out, const T* x, int64_t rows, int64_t width) {
  at::parallel_for(0, rows, GRAIN_ROWS, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* gate = x + r * 2 * width;
      const T* up = gate + width;
      T* outr = out + r * width;
      for (int64_t i = 0; i < width; ++i) {
        const float g = widen(gate[i]);
        const float act = narrow(g / (1.0f + std::exp(-g)), static_cast<T*>(nullptr));
        outr[i] = store(act * widen(up[i]), static_cast<T*>(nullptr));
      }
    }
  });
}

template <typename T>
void rotary_rows(T* out, const T* x, const T* cos, const T* sin, int64_t tokens, int64_t heads, int64_t dim,
                 int64_t rotary_dim, int64_t token_stride, int64_t head_stride) {
  const int64_t half = rotary_dim / 2;
  at::parallel_for(0, tokens, GRAIN_ROWS, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const T* c = cos + t * rotary_dim;
      const T* s = sin + t * rotary_dim;
      for (int64_t h = 0; h < heads; ++h) {
        const T* xh = x + t * token_stride + h * head_stride;
        T* oh = out + (t * heads + h) * dim;
        // rotate_half(x) is -x[i + half] on the first half, x[i - half] on the second:
        // two loops without a branch, so that each vectorises.
        for (int64_t i = 0; i < half; ++i) {
          const float a = narrow(widen(xh[i]) * widen(c[i]), static_cast<T*>(nullptr));
          const float b = narrow(-widen(xh[i + half]) * widen(s[i]), static_cast<T*>(nullptr));
          oh[i] = store(a + b, static_cast<T*>(nullptr));
        }
        for (int64_t i = half; i < rotary_dim; ++i) {
          const float a = narrow(widen(xh[i]) * widen(c[i]), static_cast<T*>(nullptr));
          const float b = narrow(widen(xh[i - half]) * widen(s[i]), static_cast<T*>(nullptr));
          oh[i] = store(a + b, static_cast<T*>(nullptr));
        }
        for (int64_t i = rotary_dim; i < dim; ++i) oh[i] = xh[i];
      }
    }
  });
}

// A K or V value as an FP8 cache holds it: clamped to e4m3's range and rounded to nearest,
// as torch's clamp and cast do.
template <typename T>
inline c10::Float8_e4m3fn to_fp8(T x) {
  return c10::Float8_e4m3fn(std::clamp(widen(x), -448.0f, 448.0f));
}

// Token t's kv_heads rows of dim values, from ``src`` (token and head strides given) into
// its cache slot (block, offset) of ``cache`` (block, token, head strides given).
template <typename C, typename T>
void store_heads(C* cache, const int64_t* cache_strides, const T* src, int64_t src_token_stride,
                 int64_t src_head_stride, int64_t t, int64_t block, int64_t offset, int64_t kv_heads, int64_t dim) {
  C* slot = cache + block * cache_strides[0] + offset * cache_strides[1];
  for (int64_t h = 0; h < kv_heads; ++h) {
    const T* from = src + t * src_token_stride + h * src_head_stride;
    C* to = slot + h * cache_strides[2];
    if constexpr (std::is_same_v<C, T>) {
      std::memcpy(to, from, dim * sizeof(T));
    } else {
      for (int64_t i = 0; i < dim; ++i) to[i] = to_fp8(from[i]);
    }
  }
}

template <typename T, typename C>
void rotary_write_kv_typed(at::Tensor& out, const at::Tensor& qk, const at::Tensor& v, const at::Tensor& cos,
                           const at::Tensor& sin, at::Tensor& k_cache, at::Tensor& v_cache,
                           const at::Tensor& write_blocks, const at::Tensor& write_offsets) {
  const int64_t tokens = qk.size(0), heads = qk.size(1), dim = qk.size(2), kv_heads = v.size(1);
  T* rotated = out.data_ptr<T>();
  rotary_rows<T>(rotated, qk.data_ptr<T>(), cos.data_ptr<T>(), sin.data_ptr<T>(), tokens, heads, dim, cos.size(1),
                 qk.stride(0), qk.stride(1));
  const int64_t k_strides[3] = {k_cache.stride(0), k_cache.stride(1), k_cache.stride(2)};
  const int64_t v_strides[3] = {v_cache.stride(0), v_cache.stride(1), v_cache.stride(2)};
  const int64_t* blocks = write_blocks.data_ptr<int64_t>();
  const int64_t* offsets = write_offsets.data_ptr<int64_t>();
  C* kp = k_cache.data_ptr<C>();
  C* vp = v_cache.data_ptr<C>();
  const T* first_k = rotated + (heads - kv_heads) * dim;
  const T* values = v.data_ptr<T>();
  at::parallel_for(0, tokens, GRAIN_ROWS, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      store_heads<C, T>(kp, k_strides, first_k, heads * dim, dim, t, blocks[t], offsets[t], kv_heads, dim);
      store_heads<C, T>(vp, v_strides, values, v.stride(0), v.stride(1), t, blocks[t], offsets[t], kv_heads, dim);
    }
  });
}

void check_rows(const at::Tensor& t, const at::Tensor& like, const char* name) {
  TORCH_CHECK(t.is_contiguous() && t.sizes() == like.sizes() && t.scalar_type() == like.scalar_type(), name,
              ": contiguous, of the input's shape and dtype");
}

void rms_norm(at::Tensor out, const at::Tensor& x, const at::Tensor& weight, double eps, bool unit_offset) {
  TORCH_CHECK(x.is_contiguous() && weight.is_contiguous() && weight.dim() == 1 && x.size(-1) == weight.size(0) &&
                  weight.scalar_type() == x.scalar_type(), "rms_norm: contiguous x [..., width], weight [width]");
  check_rows(out, x, "rms_norm: out");
  const int64_t width = x.size(-1), rows = width > 0 ? x.numel() / width : 0;
  if (x.scalar_type() == at::kFloat) {
    rms_rows<float>(out.data_ptr<float>(), nullptr, x.data_ptr<float>(), nullptr, weight.data_ptr<float>(), rows,
                    width, eps, unit_offset);
  } else if (x.scalar_type() == at::kBFloat16) {
    rms_rows<c10::BFloat16>(out.data_ptr<c10::BFloat16>(), nullptr, x.data_ptr<c10::BFloat16>(), nullptr,
                            weight.data_ptr<c10::BFloat16>(), rows, width, eps, unit_offset);
  } else {
    TORCH_CHECK(false, "rms_norm: float32 or bfloat16 only");
  }
}

void add_rms_norm(at::Tensor out, at::Tensor sum, const at::Tensor& x, const at::Tensor& residual,
                  const at::Tensor& weight, double eps, bool unit_offset) {
  TORCH_CHECK(x.is_contiguous() && weight.is_contiguous() && weight.dim() == 1 && x.size(-1) == weight.size(0) &&
                  weight.scalar_type() == x.scalar_type(), "add_rms_norm: contiguous x [..., width], weight [width]");
  check_rows(residual, x, "add_rms_norm: residual");
  check_rows(out, x, "add_rms_norm: out");
  check_rows(sum, x, "add_rms_norm: sum");
  const int64_t width = x.size(-1), rows = width > 0 ? x.numel() / width : 0;
  if (x.scalar_type() == at::kFloat) {
    rms_rows<float>(out.data_ptr<float>(), sum.data_ptr<float>(), x.data_ptr<float>(), residual.data_ptr<float>(),
                    weight.data_ptr<float>(), rows, width, eps, unit_offset);
  } else if (x.scalar_type() == at::kBFloat16) {
    rms_rows<c10::BFloat16>(out.data_ptr<c10::BFloat16>(), sum.data_ptr<c10::BFloat16>(),
                            x.data_ptr<c10::BFloat16>(), residual.data_ptr<c10::BFloat16>(),
                            weight.data_ptr<c10::BFloat16>(), rows, width, eps, unit_offset);
  } else {
    TORCH_CHECK(false, "add_rms_norm: float32 or bfloat16 only");
  }
}

void silu_and_mul(at::Tensor out, const at::Tensor& x) {
  TORCH_CHECK(x.is_contiguous() && x.size(-1) % 2 == 0, "silu_and_mul: contiguous x [..., 2 * width]");
  TORCH_CHECK(out.is_contiguous() && out.scalar_type() == x.scalar_type() && out.size(-1) * 2 == x.size(-1) &&
                  out.numel() * 2 == x.numel(), "silu_and_mul: out contiguous [..., width], of x's dtype");
  const int64_t width = out.size(-1), rows = width > 0 ? out.numel() / width : 0;
  if (x.scalar_type() == at::kFloat) {
    silu_mul_rows<float>(out.data_ptr<float>(), x.data_ptr<float>(), rows, width);
  } else if (x.scalar_type() == at::kBFloat16) {
    silu_mul_rows<c10::BFloat16>(out.data_ptr<c10::BFloat16>(), x.data_ptr<c10::BFloat16>(), rows, width);
  } else {
    TORCH_CHECK(false, "silu_and_mul: float32 or bfloat16 only");
  }
}

void check_rotary(const at::Tensor& out, const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1, "rotary: x [tokens, heads, dim] with contiguous dim");
  TORCH_CHECK(out.is_contiguous() && out.sizes() == x.sizes() && out.scalar_type() == x.scalar_type(),
              "rotary: out contiguous, of x's shape and dtype");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.dim() == 2 && cos.sizes() == sin.sizes() &&
                  cos.size(0) == x.size(0) && cos.size(1) <= x.size(2) && cos.size(1) % 2 == 0 &&
                  cos.scalar_type() == x.scalar_type() && sin.scalar_type() == x.scalar_type(),
              "rotary: cos and sin contiguous [tokens, rotary_dim <= dim], even, of x's dtype");
}

// out [T, q_heads + kv_heads, dim] = qk rotated; k_cache and v_cache [blocks, block_size,
// kv_heads, dim] (any strides but the last) get the rotated k heads and v [T, kv_heads, dim]
// at (write_blocks[t], write_offsets[t]).
void rotary_write_kv(at::Tensor out, const at::Tensor& qk, const at::Tensor& v, const at::Tensor& cos,
                     const at::Tensor& sin, at::Tensor k_cache, at::Tensor v_cache, const at::Tensor& write_blocks,
                     const at::Tensor& write_offsets) {
  check_rotary(out, qk, cos, sin);
  TORCH_CHECK(v.dim() == 3 && v.stride(2) == 1 && v.size(0) == qk.size(0) && v.size(2) == qk.size(2) &&
                  v.size(1) < qk.size(1) && v.scalar_type() == qk.scalar_type(),
              "rotary_write_kv: v [tokens, kv_heads, dim] with contiguous dim, of qk's dtype");
  TORCH_CHECK(k_cache.dim() == 4 && v_cache.dim() == 4 && k_cache.stride(3) == 1 && v_cache.stride(3) == 1 &&
                  k_cache.size(2) == v.size(1) && k_cache.size(3) == v.size(2) && v_cache.sizes() == k_cache.sizes() &&
                  k_cache.scalar_type() == v_cache.scalar_type() &&
                  (k_cache.scalar_type() == qk.scalar_type() || k_cache.scalar_type() == at::kFloat8_e4m3fn),
              "rotary_write_kv: caches [blocks, block_size, kv_heads, dim] of qk's dtype or float8_e4m3fn");
  TORCH_CHECK(write_blocks.scalar_type() == at::kLong && write_offsets.scalar_type() == at::kLong &&
                  write_blocks.is_contiguous() && write_offsets.is_contiguous() &&
                  write_blocks.numel() == qk.size(0) && write_offsets.numel() == qk.size(0),
              "rotary_write_kv: write_blocks and write_offsets int64 [tokens]");
  const bool fp8 = k_cache.scalar_type() == at::kFloat8_e4m3fn;
  if (qk.scalar_type() == at::kFloat) {
    (fp8 ? rotary_write_kv_typed<float, c10::Float8_e4m3fn> : rotary_write_kv_typed<float, float>)(
        out, qk, v, cos, sin, k_cache, v_cache, write_blocks, write_offsets);
  } else if (qk.scalar_type() == at::kBFloat16) {
    (fp8 ? rotary_write_kv_typed<c10::BFloat16, c10::Float8_e4m3fn> : rotary_write_kv_typed<c10::BFloat16, c10::BFloat16>)(
        out, qk, v, cos, sin, k_cache, v_cache, write_blocks, write_offsets);
  } else {
    TORCH_CHECK(false, "rotary_write_kv: float32 or bfloat16 only");
  }
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(memserve, m) {
  m.def("rms_norm(Tensor(a!) out, Tensor x, Tensor weight, float eps, bool unit_offset) -> ()");
  m.def("add_rms_norm(Tensor(a!) out, Tensor(b!) sum, Tensor x, Tensor residual, Tensor weight, float eps, "
        "bool unit_offset) -> ()");
  m.def("silu_and_mul(Tensor(a!) out, Tensor x) -> ()");
  m.def("rotary_write_kv(Tensor(a!) out, Tensor qk, Tensor v, Tensor cos, Tensor sin, Tensor(b!) k_cache, "
        "Tensor(c!) v_cache, Tensor write_blocks, Tensor write_offsets) -> ()");
}

TORCH_LIBRARY_IMPL(memserve, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("add_rms_norm", &add_rms_norm);
  m.impl("silu_and_mul", &silu_and_mul);
  m.impl("rotary_write_kv", &rotary_write_kv);
}
