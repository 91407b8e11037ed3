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
//   rotary:        out = narrow(narrow(x * cos) + narrow(rotate_half(x) * sin)) on the first
//                  rotary_dim dims of each head, the rest copied (Phi's partial rotary)
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "bf16.h"

#include <cmath>
#include <cstdint>
#include <cstring>

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
        for (int64_t i = 0; i < rotary_dim; ++i) {
          const float rotated = i < half ? -widen(xh[i + half]) : widen(xh[i - half]);
          const float a = narrow(widen(xh[i]) * widen(c[i]), static_cast<T*>(nullptr));
          const float b = narrow(rotated * widen(s[i]), static_cast<T*>(nullptr));
          oh[i] = store(a + b, static_cast<T*>(nullptr));
        }
        for (int64_t i = rotary_dim; i < dim; ++i) oh[i] = xh[i];
      }
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

void rotary(at::Tensor out, const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1, "rotary: x [tokens, heads, dim] with contiguous dim");
  TORCH_CHECK(out.is_contiguous() && out.sizes() == x.sizes() && out.scalar_type() == x.scalar_type(),
              "rotary: out contiguous, of x's shape and dtype");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.dim() == 2 && cos.sizes() == sin.sizes() &&
                  cos.size(0) == x.size(0) && cos.size(1) <= x.size(2) && cos.size(1) % 2 == 0 &&
                  cos.scalar_type() == x.scalar_type() && sin.scalar_type() == x.scalar_type(),
              "rotary: cos and sin contiguous [tokens, rotary_dim <= dim], even, of x's dtype");
  const int64_t tokens = x.size(0), heads = x.size(1), dim = x.size(2), rotary_dim = cos.size(1);
  if (x.scalar_type() == at::kFloat) {
    rotary_rows<float>(out.data_ptr<float>(), x.data_ptr<float>(), cos.data_ptr<float>(), sin.data_ptr<float>(),
                       tokens, heads, dim, rotary_dim, x.stride(0), x.stride(1));
  } else if (x.scalar_type() == at::kBFloat16) {
    rotary_rows<c10::BFloat16>(out.data_ptr<c10::BFloat16>(), x.data_ptr<c10::BFloat16>(),
                               cos.data_ptr<c10::BFloat16>(), sin.data_ptr<c10::BFloat16>(), tokens, heads, dim,
                               rotary_dim, x.stride(0), x.stride(1));
  } else {
    TORCH_CHECK(false, "rotary: float32 or bfloat16 only");
  }
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(memserve, m) {
  m.def("rms_norm(Tensor(a!) out, Tensor x, Tensor weight, float eps, bool unit_offset) -> ()");
  m.def("add_rms_norm(Tensor(a!) out, Tensor(b!) sum, Tensor x, Tensor residual, Tensor weight, float eps, "
        "bool unit_offset) -> ()");
  m.def("silu_and_mul(Tensor(a!) out, Tensor x) -> ()");
  m.def("rotary(Tensor(a!) out, Tensor x, Tensor cos, Tensor sin) -> ()");
}

TORCH_LIBRARY_IMPL(memserve, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("add_rms_norm", &add_rms_norm);
  m.impl("silu_and_mul", &silu_and_mul);
  m.impl("rotary", &rotary);
}
