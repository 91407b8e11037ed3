// Decode attention over the paged KV cache, read in place.
//
// Each query row (one new token of a sequence) attends to its sequence's first
// context_lens[row] tokens, held in the cache blocks its block table names; with a
// sliding window W > 0, to the last W of them only (Mistral's window: the key at
// position j is seen by the query at position p when p - j < W). With a soft-cap
// C > 0 (Gemma 2's attn_logit_softcapping), each scaled score s becomes C * tanh(s / C)
// before the softmax. Nothing is
// gathered: every K and V vector is read once, where it lies, for all the query heads
// that share its KV head (GQA). Work items are (row, KV head, partition of up to
// PARTITION tokens) so that one long sequence still keeps every thread busy; each item
// keeps its partial max, sum of exponentials and weighted values in float32, and a second
// pass merges the partitions (flash-decoding). bf16 inputs are widened to float32 as they
// are read, and so is an FP8 cache's float8_e4m3fn (--kv-cache-dtype fp8, scale 1.0), by
// a 256-entry table of c10's exact conversion: the queries and output keep their dtype.
// Compiled with -ffast-math for vectorised exp and reductions: every score is finite
// (only real tokens are visited, no masks; an FP8 cache holds no NaN, its writes are
// clamped to e4m3's range), which is what fast-math assumes.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Float8_e4m3fn.h>
#include <torch/library.h>

#include "bf16.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

constexpr int64_t PARTITION = 512;

using memserve_kernels::widen;

// Every e4m3fn byte's float32 value, exact (c10's conversion, made once at load).
struct Fp8Table {
  float value[256];
  Fp8Table() {
    for (int i = 0; i < 256; ++i) value[i] = static_cast<float>(c10::Float8_e4m3fn(i, c10::Float8_e4m3fn::from_bits()));
  }
};
const Fp8Table fp8_table;

inline float widen(c10::Float8_e4m3fn x) { return fp8_table.value[x.x]; }

constexpr int64_t MAX_DIM = 256;

// T: the queries' and output's dtype; KV: the caches' (T, or float8_e4m3fn). DIM: the
// head dim when known at compile time (64, 128: fully unrolled loops), else 0.
template <typename T, typename KV, int64_t DIM>
void decode_attention(at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                      const at::Tensor& block_tables, const at::Tensor& context_lens, double scale,
                      int64_t window, double softcap) {
  const int64_t rows = q.size(0), heads = q.size(1), dim = q.size(2);
  const int64_t D = DIM > 0 ? DIM : dim;
  const int64_t block_size = k_cache.size(1), kv_heads = k_cache.size(2), group = heads / kv_heads;
  const int64_t kb = k_cache.stride(0), kt = k_cache.stride(1), kh = k_cache.stride(2);
  const int64_t vb = v_cache.stride(0), vt = v_cache.stride(1), vh = v_cache.stride(2);
  const int64_t table_stride = block_tables.stride(0);
  const T* qp = q.data_ptr<T>();
  const KV* kp = k_cache.data_ptr<KV>();
  const KV* vp = v_cache.data_ptr<KV>();
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t* lens = context_lens.data_ptr<int64_t>();
  T* op = out.data_ptr<T>();

  std::vector<int64_t> first_key(rows);  // row r attends to positions [first_key[r], lens[r])
  std::vector<int64_t> first_part(rows + 1, 0);  // partitions of row r: [first_part[r], first_part[r + 1])
  for (int64_t r = 0; r < rows; ++r) {
    first_key[r] = window > 0 ? std::max<int64_t>(0, lens[r] - window) : 0;
    first_part[r + 1] = first_part[r] + std::max<int64_t>(1, (lens[r] - first_key[r] + PARTITION - 1) / PARTITION);
  }
  const int64_t parts = first_part[rows];
  std::vector<float> part_max(parts * kv_heads * group), part_sum(parts * kv_heads * group);
  std::vector<float> part_acc(parts * kv_heads * group * dim);
  const float fscale = static_cast<float>(scale);
  const float cap = static_cast<float>(softcap);

  at::parallel_for(0, parts * kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(group * PARTITION), query(group * dim);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t part = item / kv_heads, h = item % kv_heads;
      const int64_t row = std::upper_bound(first_part.begin(), first_part.end(), part) - first_part.begin() - 1;
      const int64_t start = first_key[row] + (part - first_part[row]) * PARTITION;
      const int64_t count = std::min(PARTITION, lens[row] - start);
      const int64_t* table = tables + row * table_stride;
      float* maxes = &part_max[item * group];
      float* sums = &part_sum[item * group];
      float* acc = &part_acc[item * group * dim];
      if (count <= 0) {  // an empty context: nothing to attend (the merge gives zeros)
        std::fill(acc, acc + group * dim, 0.0f);
        std::fill(maxes, maxes + group, 0.0f);
        std::fill(sums, sums + group, 0.0f);
        continue;
      }
      for (int64_t g = 0; g < group; ++g) {
        const T* src = qp + (row * heads + h * group + g) * dim;
        for (int64_t d = 0; d < dim; ++d) query[g * dim + d] = widen(src[d]) * fscale;
      }
      // Block by block (one table lookup and no division per token; a partition starts
      // at a block boundary, or inside its first block where a window starts there),
      // one query head at a time so that its query and accumulator stay in registers.
      for (int64_t g = 0; g < group; ++g) {
        const float* qg = &query[g * dim];
        float* sg = &scores[g * PARTITION];
        for (int64_t i = 0, block = start / block_size, first = start % block_size; i < count; ++block, first = 0) {
          const KV* keys = kp + table[block] * kb + h * kh;
          for (int64_t o = first; o < block_size && i < count; ++o, ++i) {
            const KV* key = keys + o * kt;
            float s = 0.0f;
#pragma omp simd reduction(+ : s)
            for (int64_t d = 0; d < D; ++d) s += qg[d] * widen(key[d]);
            sg[i] = s;
          }
        }
      }
      for (int64_t g = 0; g < group; ++g) {
        float* sg = &scores[g * PARTITION];
        if (cap > 0.0f) {
          for (int64_t i = 0; i < count; ++i) sg[i] = cap * std::tanh(sg[i] / cap);
        }
        float m = sg[0];
        for (int64_t i = 1; i < count; ++i) m = std::max(m, sg[i]);
        float total = 0.0f;
#pragma omp simd reduction(+ : total)
        for (int64_t i = 0; i < count; ++i) {
          sg[i] = std::exp(sg[i] - m);
          total += sg[i];
        }
        maxes[g] = m;
        sums[g] = total;
      }
      for (int64_t g = 0; g < group; ++g) {
        const float* sg = &scores[g * PARTITION];
        float ag[DIM > 0 ? DIM : MAX_DIM] = {};
        for (int64_t i = 0, block = start / block_size, first = start % block_size; i < count; ++block, first = 0) {
          const KV* values = vp + table[block] * vb + h * vh;
          for (int64_t o = first; o < block_size && i < count; ++o, ++i) {
            const KV* value = values + o * vt;
            const float p = sg[i];
#pragma omp simd
            for (int64_t d = 0; d < D; ++d) ag[d] += p * widen(value[d]);
          }
        }
        std::copy(ag, ag + D, acc + g * dim);
      }
    }
  });

  at::parallel_for(0, rows * kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> merged(dim);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t row = item / kv_heads, h = item % kv_heads;
      for (int64_t g = 0; g < group; ++g) {
        float m = 0.0f;  // the largest partition max (no infinities: fast-math assumes none)
        bool seen = false;
        for (int64_t part = first_part[row]; part < first_part[row + 1]; ++part) {
          const int64_t at = (part * kv_heads + h) * group + g;
          if (part_sum[at] > 0.0f) {
            m = seen ? std::max(m, part_max[at]) : part_max[at];
            seen = true;
          }
        }
        std::fill(merged.begin(), merged.end(), 0.0f);
        float total = 0.0f;
        for (int64_t part = first_part[row]; part < first_part[row + 1]; ++part) {
          const int64_t at = (part * kv_heads + h) * group + g;
          if (part_sum[at] == 0.0f) continue;
          const float w = std::exp(part_max[at] - m);
          total += part_sum[at] * w;
          const float* acc = &part_acc[at * dim];
          for (int64_t d = 0; d < dim; ++d) merged[d] += acc[d] * w;
        }
        T* dst = op + (row * heads + h * group + g) * dim;
        const float inv = total > 0.0f ? 1.0f / total : 0.0f;
        for (int64_t d = 0; d < dim; ++d) dst[d] = static_cast<T>(merged[d] * inv);
      }
    }
  });
}

using DecodeFn = void (*)(at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                         const at::Tensor&, double, int64_t, double);

// The instance for head dim ``dim``: unrolled for 64 and 128.
template <typename T, typename KV>
DecodeFn dispatch_dim(int64_t dim) {
  return dim == 64 ? decode_attention<T, KV, 64> : dim == 128 ? decode_attention<T, KV, 128> : decode_attention<T, KV, 0>;
}

void paged_decode_attention(at::Tensor out, const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                            const at::Tensor& block_tables, const at::Tensor& context_lens, double scale,
                            int64_t window, double softcap) {
  TORCH_CHECK(q.dim() == 3 && q.is_contiguous() && out.is_contiguous() && out.sizes() == q.sizes(),
              "q and out: contiguous [rows, heads, dim]");
  TORCH_CHECK(k_cache.dim() == 4 && v_cache.dim() == 4 && k_cache.stride(3) == 1 && v_cache.stride(3) == 1,
              "caches: [blocks, block_size, kv_heads, dim] with contiguous dim");
  TORCH_CHECK(k_cache.size(3) == q.size(2) && q.size(1) % k_cache.size(2) == 0, "head shapes do not match");
  TORCH_CHECK(q.scalar_type() == out.scalar_type() && k_cache.scalar_type() == v_cache.scalar_type() &&
                  (k_cache.scalar_type() == q.scalar_type() || k_cache.scalar_type() == at::kFloat8_e4m3fn),
              "q and out need one dtype, the caches that one or float8_e4m3fn");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && block_tables.stride(1) == 1 &&
                  context_lens.scalar_type() == at::kLong && context_lens.is_contiguous(),
              "block_tables [rows, blocks] and context_lens [rows]: int64");
  TORCH_CHECK(PARTITION % k_cache.size(1) == 0, "the block size must divide ", PARTITION);
  TORCH_CHECK(block_tables.size(0) == q.size(0) && context_lens.size(0) == q.size(0), "one table and length per row");
  TORCH_CHECK(q.size(2) <= MAX_DIM, "head dim at most ", MAX_DIM);
  const bool fp8 = k_cache.scalar_type() == at::kFloat8_e4m3fn;
  if (q.scalar_type() == at::kFloat) {
    (fp8 ? dispatch_dim<float, c10::Float8_e4m3fn>(q.size(2)) : dispatch_dim<float, float>(q.size(2)))(
        out, q, k_cache, v_cache, block_tables, context_lens, scale, window, softcap);
  } else if (q.scalar_type() == at::kBFloat16) {
    (fp8 ? dispatch_dim<c10::BFloat16, c10::Float8_e4m3fn>(q.size(2))
         : dispatch_dim<c10::BFloat16, c10::BFloat16>(q.size(2)))(out, q, k_cache, v_cache, block_tables, context_lens,
                                                                 scale, window, softcap);
  } else {
    TORCH_CHECK(false, "paged_decode_attention: float32 or bfloat16 only");
  }
}

}  // namespace

TORCH_LIBRARY(memserve, m) {
  m.def("paged_decode_attention(Tensor(a!) out, Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
        "Tensor context_lens, float scale, int window=0, float softcap=0.0) -> ()");
}

TORCH_LIBRARY_IMPL(memserve, CPU, m) { m.impl("paged_decode_attention", &paged_decode_attention); }
