// Decode attention over the paged KV cache, read in place.
//
// Each query row (one new token of a sequence) attends to its sequence's first
// context_lens[row] tokens, held in the cache blocks its block table names; with a
// sliding window W > 0, to the last W of them only (Mistral's window: the key at
// position j is seen by the query at position p when p - j < W). With a soft-cap
// C > 0 (Gemma 2's attn_logit_softcapping), each scaled score s becomes C * tanh(s / C)
// before the softmax. Nothing is gathered: every K and V vector is read once, where it
// lies, for all the query heads that share its KV head (GQA). Work items are partitions
// of a row's keys (up to PARTITION, shorter where the rows are too few to keep every
// thread busy), each over every KV head; each (partition, KV head) keeps its partial
// max, sum of exponentials and weighted values in float32, and a second pass merges the
// partitions (flash-decoding). With AVX-512 (head dims a multiple of 32)
// each key is scored for all the group's heads at once, 16 keys a tile, and values are
// summed in register tiles; bf16 keys meet bf16 queries in VDPBF16PS (exact products,
// float32 sums), other bf16 and FP8 (--kv-cache-dtype fp8, scale 1.0) rows are widened
// to float32 by vector instructions, exactly. Without it, scalar loops widen each element
// (FP8 by a 256-entry table of c10's exact conversion). Queries and output keep their dtype.
// Compiled with -ffast-math for vectorised exp and reductions: every score is finite
// (only real tokens are visited, no masks; an FP8 cache holds no NaN, its writes are
// clamped to e4m3's range), which is what fast-math assumes.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Float8_e4m3fn.h>
#include <torch/library.h>

#include "bf16.h"

#ifdef __AVX512F__
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <tuple>
#include <utility>
#include <vector>

namespace {

constexpr int64_t PARTITION = 512;
constexpr int64_t MIN_PARTITION = 64;
constexpr int64_t MAX_DIM = 256;
constexpr int64_t TILE = 16;  // keys scored together: one float32 vector of scores

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

// What every work item shares: shapes, the caches' strides, the scale and the cap.
struct Geometry {
  int64_t heads, dim, group, kv_heads, block_size, table_stride;
  int64_t kb, kt, kh, vb, vt, vh;
  float scale, cap;
};

// One KV head's K (or V) rows of a partition, in order: one block-table lookup per
// block and no division per token (a partition starts at a block boundary, or inside
// its first block where a window starts there). Blocks lie anywhere in the pool, out of
// the hardware prefetcher's sight: entering a block asks for the next one's rows.
template <typename KV>
struct Rows {
  const KV* base;
  const int64_t* table;
  int64_t block_stride, token_stride, block_size, row_bytes, block, offset, last;
  const KV* row;

  Rows(const KV* head, const int64_t* table, int64_t block_stride, int64_t token_stride, const Geometry& geo,
       int64_t start, int64_t count)
      : base(head), table(table), block_stride(block_stride), token_stride(token_stride),
        block_size(geo.block_size), row_bytes(geo.dim * static_cast<int64_t>(sizeof(KV))),
        block(start / block_size), offset(start % block_size), last((start + count - 1) / block_size),
        row(head + table[block] * block_stride + offset * token_stride) {
    prefetch(block + 1);
  }

  void prefetch(int64_t b) const {
    if (b > last) return;
    const char* first = reinterpret_cast<const char*>(base + table[b] * block_stride);
    for (int64_t o = 0; o < block_size; ++o) {
      for (int64_t at = 0; at < row_bytes; at += 64) __builtin_prefetch(first + o * token_stride * sizeof(KV) + at);
    }
  }

  const KV* next() {
    if (offset == block_size) {  // looked up only when a row of the next block is wanted
      offset = 0;
      row = base + table[++block] * block_stride;
      prefetch(block + 1);
    }
    const KV* current = row;
    ++offset;
    row += token_stride;
    return current;
  }
};

// Scores (unscaled) of the partition's keys for the group's query heads, into
// scores[g * PARTITION + i]: each key read once for all of them.
template <typename T, typename KV, int64_t DIM>
void score_scalar(const T* q, Rows<KV> keys, int64_t count, int64_t group, int64_t dim, float* scores,
                  float* query) {
  const int64_t D = DIM > 0 ? DIM : dim;
  for (int64_t d = 0; d < group * dim; ++d) query[d] = widen(q[d]);
  for (int64_t i = 0; i < count; ++i) {
    const KV* key = keys.next();
    for (int64_t g = 0; g < group; ++g) {
      const float* qg = query + g * dim;
      float s = 0.0f;
#pragma omp simd reduction(+ : s)
      for (int64_t d = 0; d < D; ++d) s += qg[d] * widen(key[d]);
      scores[g * PARTITION + i] = s;
    }
  }
}

// acc[g * dim + d] = sum over the partition's values of weights[g * PARTITION + i] * V[i][d].
template <typename KV, int64_t DIM>
void weigh_scalar(Rows<KV> values, int64_t count, int64_t group, int64_t dim, const float* weights, float* acc) {
  const int64_t D = DIM > 0 ? DIM : dim;
  std::fill(acc, acc + group * dim, 0.0f);
  for (int64_t i = 0; i < count; ++i) {
    const KV* value = values.next();
    for (int64_t g = 0; g < group; ++g) {
      const float p = weights[g * PARTITION + i];
      float* ag = acc + g * dim;
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) ag[d] += p * widen(value[d]);
    }
  }
}

#ifdef __AVX512F__
constexpr bool VECTOR = true;

inline __m512 widen16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 widen16(const c10::BFloat16* p) {  // bf16 is float32's top half
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}
// e4m3fn's exponent and mantissa moved into float16's fields make that value times 2^-8
// (the exponent biases are 7 and 15), subnormals included; the conversion to float32 and
// the scaling back are exact.
inline __m512 widen16(const c10::Float8_e4m3fn* p) {
  const __m256i bytes = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m256i magnitude = _mm256_slli_epi16(_mm256_and_si256(bytes, _mm256_set1_epi16(0x7F)), 7);
  const __m256i sign = _mm256_slli_epi16(_mm256_and_si256(bytes, _mm256_set1_epi16(0x80)), 8);
  return _mm512_mul_ps(_mm512_cvtph_ps(_mm256_or_si256(magnitude, sign)), _mm512_set1_ps(256.0f));
}

// Lane j: the sum of the 16 floats at p + 16 * j. A transpose-and-add tree, 15 adds for
// 16 keys' scores instead of a horizontal sum per key.
inline __m512 sum16(const float* p) {
  __m512 v[16], w[8], x[4], y[2];
  for (int i = 0; i < 16; ++i) v[i] = _mm512_loadu_ps(p + 16 * i);
  for (int i = 0; i < 8; ++i)
    w[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {
    const __m512d a = _mm512_castps_pd(w[2 * i]), b = _mm512_castps_pd(w[2 * i + 1]);
    x[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  for (int i = 0; i < 2; ++i)
    y[i] = _mm512_add_ps(_mm512_shuffle_f32x4(x[2 * i], x[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(x[2 * i], x[2 * i + 1], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(y[0], y[1], 0x88), _mm512_shuffle_f32x4(y[0], y[1], 0xDD));
}

// A key row held in registers and dotted with each query head of its group: a vector of
// lane-wise partial sums per key and head, reduced 16 keys at a time by sum16.
template <typename T, typename KV, int64_t DIM>
struct KeyDot {
  using Query = float;
  __m512 k[(DIM > 0 ? DIM : MAX_DIM) / 16];
  int64_t chunks;

  explicit KeyDot(int64_t dim) : chunks((DIM > 0 ? DIM : dim) / 16) {}
  static const float* queries(const T* q, int64_t n, float* buffer) {
    for (int64_t d = 0; d < n; ++d) buffer[d] = widen(q[d]);
    return buffer;
  }
  void load(const KV* key) {
    for (int64_t c = 0; c < chunks; ++c) k[c] = widen16(key + 16 * c);
  }
  __m512 dot(const float* q) const {
    __m512 t = _mm512_mul_ps(_mm512_loadu_ps(q), k[0]);
    for (int64_t c = 1; c < chunks; ++c) t = _mm512_fmadd_ps(_mm512_loadu_ps(q + 16 * c), k[c], t);
    return t;
  }
};

#ifdef __AVX512BF16__
// bf16 queries and keys: VDPBF16PS multiplies bf16 pairs exactly (8-bit significands)
// and sums them in float32, so neither side is widened; the scale is applied to the
// scores, leaving the queries exact.
template <int64_t DIM>
struct KeyDot<c10::BFloat16, c10::BFloat16, DIM> {
  using Query = c10::BFloat16;
  __m512bh k[(DIM > 0 ? DIM : MAX_DIM) / 32];
  int64_t chunks;

  explicit KeyDot(int64_t dim) : chunks((DIM > 0 ? DIM : dim) / 32) {}
  static const c10::BFloat16* queries(const c10::BFloat16* q, int64_t, float*) { return q; }
  void load(const c10::BFloat16* key) {
    for (int64_t c = 0; c < chunks; ++c) k[c] = (__m512bh)_mm512_loadu_si512(key + 32 * c);
  }
  __m512 dot(const c10::BFloat16* q) const {
    __m512 t = _mm512_setzero_ps();
    for (int64_t c = 0; c < chunks; ++c) t = _mm512_dpbf16_ps(t, (__m512bh)_mm512_loadu_si512(q + 32 * c), k[c]);
    return t;
  }
};
#endif

// score_scalar's scores, 16 keys at a time (head dims a multiple of 32).
template <typename T, typename KV, int64_t DIM>
void score_vector(const T* q, Rows<KV> keys, int64_t count, int64_t group, int64_t dim, float* scores,
                  float* query, float* part) {
  KeyDot<T, KV, DIM> key(dim);
  const auto* qs = key.queries(q, group * dim, query);
  for (int64_t i = 0; i < count; i += TILE) {
    const int64_t n = std::min(TILE, count - i);
    for (int64_t j = 0; j < n; ++j) {
      key.load(keys.next());
      for (int64_t g = 0; g < group; ++g) _mm512_storeu_ps(part + (g * TILE + j) * 16, key.dot(qs + g * dim));
    }
    for (int64_t g = 0; g < group; ++g)  // lane j sums key j's row only: a short tile's stale rows are masked off
      _mm512_mask_storeu_ps(scores + g * PARTITION + i, static_cast<__mmask16>((1u << n) - 1),
                            sum16(part + g * TILE * 16));
  }
}

// Heads [g0, g0 + NH) and dims [c0, c0 + 16 * NC) of weigh_scalar's sums, held in
// registers: each value slice widened once for all NH heads.
template <int NH, int NC, typename KV>
void weigh_tile(Rows<KV> values, int64_t count, int64_t g0, int64_t c0, int64_t dim, const float* weights,
                float* acc) {
  __m512 sum[NH][NC];
  for (int h = 0; h < NH; ++h)
    for (int c = 0; c < NC; ++c) sum[h][c] = _mm512_setzero_ps();
  for (int64_t i = 0; i < count; ++i) {
    const KV* value = values.next() + c0;
    __m512 v[NC];
    for (int c = 0; c < NC; ++c) v[c] = widen16(value + 16 * c);
    for (int h = 0; h < NH; ++h) {
      const __m512 p = _mm512_set1_ps(weights[(g0 + h) * PARTITION + i]);
      for (int c = 0; c < NC; ++c) sum[h][c] = _mm512_fmadd_ps(p, v[c], sum[h][c]);
    }
  }
  for (int h = 0; h < NH; ++h)
    for (int c = 0; c < NC; ++c) _mm512_storeu_ps(acc + (g0 + h) * dim + c0 + 16 * c, sum[h][c]);
}

// weigh_scalar's sums in tiles of up to 4 heads by 64 dims (at most 16 accumulators and
// 4 value vectors: within the 32 registers); a slice of the partition's values read again
// per tile comes from cache, each head dim's bytes from memory once.
template <typename KV, int64_t DIM>
void weigh_vector(Rows<KV> values, int64_t count, int64_t group, int64_t dim, const float* weights, float* acc) {
  using Tile = void (*)(Rows<KV>, int64_t, int64_t, int64_t, int64_t, const float*, float*);
  static constexpr Tile tiles[4][2] = {{weigh_tile<1, 2, KV>, weigh_tile<1, 4, KV>},
                                       {weigh_tile<2, 2, KV>, weigh_tile<2, 4, KV>},
                                       {weigh_tile<3, 2, KV>, weigh_tile<3, 4, KV>},
                                       {weigh_tile<4, 2, KV>, weigh_tile<4, 4, KV>}};
  const int64_t D = DIM > 0 ? DIM : dim;
  for (int64_t c0 = 0; c0 < D; c0 += 64) {
    for (int64_t g0 = 0; g0 < group; g0 += 4) {  // head dims are multiples of 32: slices of 64 or 32
      tiles[std::min<int64_t>(4, group - g0) - 1][D - c0 >= 64](values, count, g0, c0, dim, weights, acc);
    }
  }
}
#else
constexpr bool VECTOR = false;
#endif

// One thread's buffers.
struct Scratch {
  std::vector<float> scores, query, part;  // part: per head and key of a tile, 16 partial sums of its score
  Scratch(int64_t group, int64_t dim) : scores(group * PARTITION), query(group * dim), part(VECTOR ? group * TILE * 16 : 0) {}
};

// One head's scores in place: scaled, capped, exponentiated less their max (returned
// with the sum of the exponentials).
inline std::pair<float, float> softmax(float* s, int64_t count, float scale, float cap) {
#pragma omp simd
  for (int64_t i = 0; i < count; ++i) s[i] *= scale;
  if (cap > 0.0f) {
    for (int64_t i = 0; i < count; ++i) s[i] = cap * std::tanh(s[i] / cap);
  }
  float m = s[0];
  for (int64_t i = 1; i < count; ++i) m = std::max(m, s[i]);
  float total = 0.0f;
#pragma omp simd reduction(+ : total)
  for (int64_t i = 0; i < count; ++i) {
    s[i] = std::exp(s[i] - m);
    total += s[i];
  }
  return {m, total};
}

// One work item: query row ``row``'s group of heads on KV head ``h``, over ``count``
// keys from position ``start``: partial maxes, sums and weighted values.
template <typename T, typename KV, int64_t DIM, bool VEC>
void attend(const Geometry& geo, const T* q, const KV* kp, const KV* vp, const int64_t* table, int64_t h,
            int64_t start, int64_t count, float* maxes, float* sums, float* acc, Scratch& scratch) {
  const int64_t group = geo.group, dim = geo.dim;
  if (count <= 0) {  // an empty context: nothing to attend (the merge gives zeros)
    std::fill(acc, acc + group * dim, 0.0f);
    std::fill(maxes, maxes + group, 0.0f);
    std::fill(sums, sums + group, 0.0f);
    return;
  }
  const Rows<KV> keys(kp + h * geo.kh, table, geo.kb, geo.kt, geo, start, count);
  float* scores = scratch.scores.data();
#ifdef __AVX512F__
  if constexpr (VEC) {
    score_vector<T, KV, DIM>(q, keys, count, group, dim, scores, scratch.query.data(), scratch.part.data());
  } else
#endif
  {
    score_scalar<T, KV, DIM>(q, keys, count, group, dim, scores, scratch.query.data());
  }
  for (int64_t g = 0; g < group; ++g) std::tie(maxes[g], sums[g]) = softmax(scores + g * PARTITION, count, geo.scale, geo.cap);
  const Rows<KV> values(vp + h * geo.vh, table, geo.vb, geo.vt, geo, start, count);  // after the keys: its prefetch too
#ifdef __AVX512F__
  if constexpr (VEC) {
    weigh_vector<KV, DIM>(values, count, group, dim, scores, acc);
  } else
#endif
  {
    weigh_scalar<KV, DIM>(values, count, group, dim, scores, acc);
  }
}

// Second pass: each (row, KV head)'s partitions merged by their maxes (flash-decoding).
template <typename T>
void merge(T* op, const Geometry& geo, int64_t rows, const std::vector<int64_t>& first_part,
           const std::vector<float>& part_max, const std::vector<float>& part_sum, const std::vector<float>& part_acc) {
  const int64_t kv_heads = geo.kv_heads, group = geo.group, dim = geo.dim;
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
        T* dst = op + (row * geo.heads + h * group + g) * dim;
        const float inv = total > 0.0f ? 1.0f / total : 0.0f;
        for (int64_t d = 0; d < dim; ++d) dst[d] = static_cast<T>(merged[d] * inv);
      }
    }
  });
}

// Keys a partition holds: PARTITION, halved (to whole blocks, at least MIN_PARTITION)
// while the rows' partitions are fewer than two a thread, so that a step of few short
// rows still keeps every thread busy.
// Partitions of ``len`` keys that ``keys`` keys take (one at least: an empty row merges to zeros).
inline int64_t partitions(int64_t keys, int64_t len) { return std::max<int64_t>(1, (keys + len - 1) / len); }

int64_t partition_length(int64_t rows, const int64_t* lens, const std::vector<int64_t>& first_key, int64_t block_size) {
  const int64_t wanted = 2 * at::get_num_threads();
  int64_t len = PARTITION;
  auto parts = [&](int64_t l) {
    int64_t n = 0;
    for (int64_t r = 0; r < rows; ++r) n += partitions(lens[r] - first_key[r], l);
    return n;
  };
  while (len / 2 >= std::max(MIN_PARTITION, block_size) && (len / 2) % block_size == 0 && parts(len) < wanted) len /= 2;
  return len;
}

// T: the queries' and output's dtype; KV: the caches' (T, or float8_e4m3fn). DIM: the
// head dim when known at compile time (64, 128: fully unrolled loops), else 0. VEC: the
// AVX-512 loops (head dims a multiple of 32), else the scalar ones.
template <typename T, typename KV, int64_t DIM, bool VEC>
void decode_attention(at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                      const at::Tensor& block_tables, const at::Tensor& context_lens, double scale,
                      int64_t window, double softcap) {
  const int64_t rows = q.size(0), heads = q.size(1), dim = q.size(2), kv_heads = k_cache.size(2);
  const Geometry geo{heads, dim, heads / kv_heads, kv_heads, k_cache.size(1), block_tables.stride(0),
                     k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
                     v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
                     static_cast<float>(scale), static_cast<float>(softcap)};
  const int64_t group = geo.group;
  const T* qp = q.data_ptr<T>();
  const int64_t q_row_stride = q.stride(0);  // q may be a view into the fused projection's rows
  const KV* kp = k_cache.data_ptr<KV>();
  const KV* vp = v_cache.data_ptr<KV>();
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t* lens = context_lens.data_ptr<int64_t>();

  std::vector<int64_t> first_key(rows);  // row r attends to positions [first_key[r], lens[r])
  for (int64_t r = 0; r < rows; ++r) first_key[r] = window > 0 ? std::max<int64_t>(0, lens[r] - window) : 0;
  const int64_t part_len = partition_length(rows, lens, first_key, geo.block_size);
  std::vector<int64_t> first_part(rows + 1, 0);  // partitions of row r: [first_part[r], first_part[r + 1])
  for (int64_t r = 0; r < rows; ++r)
    first_part[r + 1] = first_part[r] + partitions(lens[r] - first_key[r], part_len);
  const int64_t parts = first_part[rows];
  std::vector<float> part_max(parts * kv_heads * group), part_sum(parts * kv_heads * group);
  std::vector<float> part_acc(parts * kv_heads * group * dim);

  // A work item is a partition with all its KV heads: a block's rows of every head lie
  // side by side, so the item reads them whole rather than a head's slice of each line.
  at::parallel_for(0, parts, 1, [&](int64_t begin, int64_t end) {
    Scratch scratch(group, dim);
    for (int64_t part = begin; part < end; ++part) {
      const int64_t row = std::upper_bound(first_part.begin(), first_part.end(), part) - first_part.begin() - 1;
      const int64_t start = first_key[row] + (part - first_part[row]) * part_len;
      for (int64_t h = 0; h < kv_heads; ++h) {
        const int64_t item = part * kv_heads + h;
        attend<T, KV, DIM, VEC>(geo, qp + row * q_row_stride + h * group * dim, kp, vp,
                                tables + row * geo.table_stride, h, start, std::min(part_len, lens[row] - start),
                                &part_max[item * group], &part_sum[item * group], &part_acc[item * group * dim],
                                scratch);
      }
    }
  });
  merge(out.data_ptr<T>(), geo, rows, first_part, part_max, part_sum, part_acc);
}


using DecodeFn = void (*)(at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                         const at::Tensor&, double, int64_t, double);

// The instance for head dim ``dim``: unrolled for 64 and 128, vectorised for multiples of
// 32 where AVX-512 is there.
template <typename T, typename KV, bool VEC>
DecodeFn unrolled(int64_t dim) {
  return dim == 64 ? decode_attention<T, KV, 64, VEC> : dim == 128 ? decode_attention<T, KV, 128, VEC>
                                                                   : decode_attention<T, KV, 0, VEC>;
}

template <typename T, typename KV>
DecodeFn dispatch_dim(int64_t dim) {
  return VECTOR && dim % 32 == 0 ? unrolled<T, KV, true>(dim) : unrolled<T, KV, false>(dim);
}

void paged_decode_attention(at::Tensor out, const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                            const at::Tensor& block_tables, const at::Tensor& context_lens, double scale,
                            int64_t window, double softcap) {
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1 && q.stride(1) == q.size(2) && out.is_contiguous() &&
                  out.sizes() == q.sizes(), "q [rows, heads, dim] with contiguous heads, out contiguous of its shape");
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
