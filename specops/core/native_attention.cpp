// Attention of decoding, verification and prompt rows over each sequence's own cache (see native_attention.h).
//
// ATen's attention for a batch of sequences (LlamaForward.attention) stacks their caches into one tensor
// padded to the longest, every layer, and multiplies and masks the padded whole: in a batched SmolLM2 pass on
// a 2-core CPU the stacking alone took 3 ms of 28 and the small bf16 matmuls 3 more (docs/results.md). Here
// each (sequence, kv head) is one work item that reads its cache in place, only the slots its rows see: the
// scores of 16 keys at a time against each query (fp32), a softmax in fp32, and the weighted sum of the
// values in fp32, rounded once to the output's dtype. A row's result is a fixed sequence of operations on
// its query and its visible slots, so it is the same alone or beside any other rows, whatever the pass's
// shape, the cache's length or what lies in the slots it does not see. On a CPU with AMX, bf16 rows take the
// tile unit instead (attend_item_amx, below): the same rows alone, another rounding.

#include "native_attention.h"
#include "native_elementwise.h"
#include "native_linear.h"

#include <ATen/Parallel.h>
#if defined(__x86_64__)
#include <immintrin.h>
#define SPECOPS_X86 1  // the AVX-512 loops are compiled in, and taken where the CPU has AVX-512
#endif

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>

namespace specops {
namespace {

constexpr int64_t kKeys = 16;  // keys scored together
constexpr int64_t kLanes = 16;  // floats in an AVX-512 register
constexpr size_t kItemRows = 32;  // rows of one sequence attending in one work item at most

// One kv head of one sequence (of one branch, for a tree) and the pass rows that attend in it.
struct Item {
  const void* keys;    // [length, D] of this kv head
  const void* values;
  int64_t kv_head;
  std::vector<int64_t> rows, ends;
};

struct Shape {
  int64_t heads, groups, n, d, padded_d;  // padded_d: D rounded up to kLanes
  bool bf16;
  float scale;
};

inline float load_one(const void* base, int64_t i, bool bf16) {
  return bf16 ? static_cast<float>(static_cast<const at::BFloat16*>(base)[i]) : static_cast<const float*>(base)[i];
}

// An item's working memory, fp32: its queries [R, padded_d] (scaled; R = groups x rows, query (g, r) at
// g * rows + r), scores [R, keys rounded up to 16]; for the plain loops its keys and values [keys, padded_d],
// for the vector loops one block of 16 keys or values and the queries' accumulators [R, padded_d]. Zero past D
// and past the last key, so the vector loops need no masks there.
struct Buffers {
  std::vector<float> queries, keys, values, scores, block, acc;
  std::vector<uint16_t> tile_queries, weights;  // the tiles' queries and weights (bf16), AMX only
  std::vector<uint32_t> value_pairs;
  std::vector<int64_t> reach;
};

void fill(const Item& item, const void* q, const Shape& s, int64_t keys, Buffers& b) {
  const int64_t rows = static_cast<int64_t>(item.rows.size()), padded_keys = (keys + kKeys - 1) / kKeys * kKeys;
  b.queries.assign(s.groups * rows * s.padded_d, 0.0f);
  for (int64_t g = 0; g < s.groups; ++g) {
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t from = ((item.kv_head * s.groups + g) * s.n + item.rows[r]) * s.d;
      float* to = &b.queries[(g * rows + r) * s.padded_d];
      for (int64_t x = 0; x < s.d; ++x) to[x] = load_one(q, from + x, s.bf16) * s.scale;
    }
  }
  b.keys.assign(padded_keys * s.padded_d, 0.0f);
  b.values.assign(padded_keys * s.padded_d, 0.0f);
  for (int64_t j = 0; j < keys; ++j) {
    for (int64_t x = 0; x < s.d; ++x) {
      b.keys[j * s.padded_d + x] = load_one(item.keys, j * s.d + x, s.bf16);
      b.values[j * s.padded_d + x] = load_one(item.values, j * s.d + x, s.bf16);
    }
  }
  b.scores.assign(s.groups * rows * padded_keys, 0.0f);
}

void store(void* out, int64_t index, float value, bool bf16) {
  if (bf16) {
    static_cast<at::BFloat16*>(out)[index] = at::BFloat16(value);
  } else {
    static_cast<float*>(out)[index] = value;
  }
}

// ---- plain loops: CPUs without AVX-512 ----

void attend_item_plain(const Item& item, const void* q, void* out, const Shape& s, Buffers& b) {
  const int64_t rows = static_cast<int64_t>(item.rows.size());
  const int64_t keys = *std::max_element(item.ends.begin(), item.ends.end());
  fill(item, q, s, keys, b);
  const int64_t padded_keys = (keys + kKeys - 1) / kKeys * kKeys;
  std::vector<float> acc(s.padded_d);
  for (int64_t i = 0; i < s.groups * rows; ++i) {
    const int64_t end = item.ends[i % rows];
    const float* query = &b.queries[i * s.padded_d];
    float* score = &b.scores[i * padded_keys];
    float top = -std::numeric_limits<float>::infinity();
    for (int64_t j = 0; j < end; ++j) {
      float dot = 0.0f;
      for (int64_t x = 0; x < s.padded_d; ++x) dot += query[x] * b.keys[j * s.padded_d + x];
      score[j] = dot;
      top = std::max(top, dot);
    }
    float total = 0.0f;
    for (int64_t j = 0; j < end; ++j) {
      score[j] = std::exp(score[j] - top);
      total += score[j];
    }
    std::fill(acc.begin(), acc.end(), 0.0f);
    for (int64_t j = 0; j < end; ++j) {
      for (int64_t x = 0; x < s.padded_d; ++x) acc[x] += score[j] * b.values[j * s.padded_d + x];
    }
    const float inverse = 1.0f / total;
    const int64_t head = item.kv_head * s.groups + i / rows, row = item.rows[i % rows];
    for (int64_t x = 0; x < s.d; ++x) store(out, (head * s.n + row) * s.d + x, acc[x] * inverse, s.bf16);
  }
}

#ifdef SPECOPS_X86
// ---- AVX-512 ----

#define SPECOPS_AVX512 __attribute__((target("avx512f")))

// Lane j of the result: the sum of v[j]'s lanes, for 16 vectors (a transposing tree of adds, fixed order).
SPECOPS_AVX512 inline __m512 sum16(const __m512* v) {
  __m512 t[8], u[4];
  for (int k = 0; k < 8; ++k) {
    t[k] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * k], v[2 * k + 1]), _mm512_unpackhi_ps(v[2 * k], v[2 * k + 1]));
  }
  for (int k = 0; k < 4; ++k) {
    const __m512d a = _mm512_castps_pd(t[2 * k]), c = _mm512_castps_pd(t[2 * k + 1]);
    u[k] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, c)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, c)));
  }
  // u[k]'s 128-bit lane L holds lane L's partial sums of v[4k..4k+3]; add the four lanes of each.
  const __m512 s01 = _mm512_add_ps(_mm512_shuffle_f32x4(u[0], u[1], 0x44), _mm512_shuffle_f32x4(u[0], u[1], 0xEE));
  const __m512 s23 = _mm512_add_ps(_mm512_shuffle_f32x4(u[2], u[3], 0x44), _mm512_shuffle_f32x4(u[2], u[3], 0xEE));
  return _mm512_add_ps(_mm512_shuffle_f32x4(s01, s23, 0x88), _mm512_shuffle_f32x4(s01, s23, 0xDD));
}

// Keys j0..j0+15 (those below `keys`; zeros past them and past D) as fp32 rows of padded_d.
SPECOPS_AVX512 void load_block(const void* base, int64_t j0, int64_t keys, const Shape& s, float* block) {
  for (int64_t k = 0; k < kKeys; ++k) {
    float* to = block + k * s.padded_d;
    const int64_t j = j0 + k;
    if (j >= keys) {
      std::fill(to, to + s.padded_d, 0.0f);
      continue;
    }
    int64_t x = 0;
    if (s.bf16) {
      const uint16_t* from = static_cast<const uint16_t*>(base) + j * s.d;
      for (; x + kLanes <= s.d; x += kLanes) {  // bf16 -> fp32 is the 16 bits shifted up
        const __m256i half = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(from + x));
        _mm512_storeu_ps(to + x, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16)));
      }
    } else {
      const float* from = static_cast<const float*>(base) + j * s.d;
      for (; x + kLanes <= s.d; x += kLanes) _mm512_storeu_ps(to + x, _mm512_loadu_ps(from + x));
    }
    for (; x < s.d; ++x) to[x] = load_one(base, j * s.d + x, s.bf16);
    std::fill(to + s.d, to + s.padded_d, 0.0f);
  }
}

// Chunks: padded_d / 16, a constant so that a query's chunks and the accumulators stay in registers.
template <int Chunks>
SPECOPS_AVX512 void attend_item_avx512(const Item& item, const void* q, void* out, const Shape& s, Buffers& b) {
  const int64_t rows = static_cast<int64_t>(item.rows.size()), queries = s.groups * rows;
  const int64_t keys = *std::max_element(item.ends.begin(), item.ends.end());
  const int64_t padded_keys = (keys + kKeys - 1) / kKeys * kKeys;
  b.queries.assign(queries * s.padded_d, 0.0f);
  for (int64_t i = 0; i < queries; ++i) {
    const int64_t from = ((item.kv_head * s.groups + i / rows) * s.n + item.rows[i % rows]) * s.d;
    for (int64_t x = 0; x < s.d; ++x) b.queries[i * s.padded_d + x] = load_one(q, from + x, s.bf16) * s.scale;
  }
  b.scores.assign(queries * padded_keys, 0.0f);
  b.block.resize(kKeys * s.padded_d);
  // Scores, 16 keys at a time (converted once for every query): per key, the lane-wise products summed over
  // the chunks of D, then the 16 keys' lanes summed at once.
  for (int64_t j0 = 0; j0 < keys; j0 += kKeys) {
    load_block(item.keys, j0, keys, s, b.block.data());
    for (int64_t i = 0; i < queries; ++i) {
      if (j0 >= item.ends[i % rows]) continue;
      __m512 query[Chunks], dots[kKeys];
      for (int c = 0; c < Chunks; ++c) query[c] = _mm512_loadu_ps(&b.queries[i * s.padded_d + c * kLanes]);
      for (int k = 0; k < kKeys; ++k) {
        const float* key = &b.block[k * s.padded_d];
        __m512 dot = _mm512_mul_ps(query[0], _mm512_loadu_ps(key));
        for (int c = 1; c < Chunks; ++c) dot = _mm512_fmadd_ps(query[c], _mm512_loadu_ps(key + c * kLanes), dot);
        dots[k] = dot;
      }
      _mm512_storeu_ps(&b.scores[i * padded_keys + j0], sum16(dots));
    }
  }
  // Softmax over each row's visible slots 0..end-1 (16 at a time, the last block masked); 1/sum kept apart.
  std::vector<float> inverse(queries);
  for (int64_t i = 0; i < queries; ++i) {
    const int64_t end = item.ends[i % rows];
    float* score = &b.scores[i * padded_keys];
    __m512 top = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
    for (int64_t j = 0; j < end; j += kLanes) {
      const __mmask16 live = end - j >= kLanes ? 0xFFFF : static_cast<__mmask16>((1u << (end - j)) - 1);
      top = _mm512_mask_max_ps(top, live, top, _mm512_loadu_ps(score + j));
    }
    const __m512 max = _mm512_set1_ps(_mm512_reduce_max_ps(top));
    __m512 total = _mm512_setzero_ps();
    for (int64_t j = 0; j < padded_keys; j += kLanes) {  // slots past `end` weigh 0
      const __mmask16 live = j >= end ? 0 : end - j >= kLanes ? 0xFFFF : static_cast<__mmask16>((1u << (end - j)) - 1);
      const __m512 e = _mm512_maskz_mov_ps(live, exp_nonpositive(_mm512_sub_ps(_mm512_loadu_ps(score + j), max)));
      _mm512_storeu_ps(score + j, e);
      total = _mm512_add_ps(total, e);
    }
    inverse[i] = 1.0f / _mm512_reduce_add_ps(total);
  }
  // The weighted sum of the values, 16 keys at a time (converted once for every query).
  b.acc.assign(queries * s.padded_d, 0.0f);
  for (int64_t j0 = 0; j0 < keys; j0 += kKeys) {
    load_block(item.values, j0, keys, s, b.block.data());
    for (int64_t i = 0; i < queries; ++i) {
      const int64_t live = std::min(kKeys, item.ends[i % rows] - j0);
      if (live <= 0) continue;
      float* acc = &b.acc[i * s.padded_d];
      const float* weights = &b.scores[i * padded_keys + j0];
      // The chunks of D are independent sums, so they run side by side, key after key (one chain per chunk).
      __m512 sums[Chunks];
      for (int c = 0; c < Chunks; ++c) sums[c] = _mm512_loadu_ps(acc + c * kLanes);
      for (int64_t k = 0; k < live; ++k) {
        const __m512 weight = _mm512_set1_ps(weights[k]);
        const float* value = &b.block[k * s.padded_d];
        for (int c = 0; c < Chunks; ++c) sums[c] = _mm512_fmadd_ps(weight, _mm512_loadu_ps(value + c * kLanes), sums[c]);
      }
      for (int c = 0; c < Chunks; ++c) _mm512_storeu_ps(acc + c * kLanes, sums[c]);
    }
  }
  for (int64_t i = 0; i < queries; ++i) {
    const int64_t head = item.kv_head * s.groups + i / rows, row = item.rows[i % rows];
    for (int64_t x = 0; x < s.d; ++x) {
      store(out, (head * s.n + row) * s.d + x, b.acc[i * s.padded_d + x] * inverse[i], s.bf16);
    }
  }
}

// ---- AMX tiles (bf16) ----
//
// The products of attention on Intel's tile unit, for bf16 rows of any D up to 128 (zero-padded to whole tiles).
// Scores: each 16 queries x 16 keys tile is one sum over D per entry, in the same order for every entry
// (queries [16, 32 dims] times the keys' dims in pairs, transposed from the cache's rows). Softmax in fp32 as
// above. Weighted sum: the softmax weights rounded to bf16 (as flash attention multiplies them) times the values,
// 32 keys at a time, in key order. A row's keys past its own end weigh exactly 0, so the other rows of its tile
// (which may see further) add only zeros to its sums: its result is its own query and visible slots' alone.

constexpr int64_t kTile = 16;       // queries per tile; keys per scores tile; pairs per weights tile
constexpr int64_t kPairKeys = 32;   // keys per weighted-sum tile product
constexpr int64_t kMaxDims = 128;   // D up to 4 tiles of 32 dims

// Every tile 16 rows of 64 bytes. Scores: tile 0 the sums, 1 the queries, 2 the keys. Weighted sum: tiles 0-3 the
// sums of 4 chunks of 16 dims, 4 the weights, 5 the values.
SPECOPS_AMX_TARGET void configure_attention_tiles() {
  TileConfig config;
  for (int t = 0; t < 8; ++t) {
    config.rows[t] = kTile;
    config.colsb[t] = 64;
  }
  _tile_loadconfig(&config);
}

// 16 rows of 16 32-bit words, transposed in place: row x then holds word x of every input row.
SPECOPS_AMX_TARGET inline void transpose16(__m512i* r) {
  __m512i t[16], u[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  // u[4i + k]'s 128-bit lane L: word 4L + k of rows 4i..4i+3.
  for (int i = 0; i < 4; ++i) {
    u[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
    u[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
    u[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
    u[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
  }
  for (int k = 0; k < 4; ++k) {
    const __m512i a = _mm512_shuffle_i32x4(u[k], u[4 + k], 0x88), b = _mm512_shuffle_i32x4(u[k], u[4 + k], 0xDD);
    const __m512i c = _mm512_shuffle_i32x4(u[8 + k], u[12 + k], 0x88), e = _mm512_shuffle_i32x4(u[8 + k], u[12 + k], 0xDD);
    r[k] = _mm512_shuffle_i32x4(a, c, 0x88);
    r[4 + k] = _mm512_shuffle_i32x4(b, e, 0x88);
    r[8 + k] = _mm512_shuffle_i32x4(a, c, 0xDD);
    r[12 + k] = _mm512_shuffle_i32x4(b, e, 0xDD);
  }
}

// The bf16 elements [from, from + count) of a row (count <= 32) as 32 elements, zeros past them.
SPECOPS_AMX_TARGET inline __m512i load_dims(const uint16_t* row, int64_t count) {
  return _mm512_maskz_loadu_epi16(count >= 32 ? ~0u : (1u << count) - 1, row);
}

// Keys j0..j0+15 (zeros at and past `keys`), dims 32c..32c+31 of each: the scores' weight tile, whose row x
// holds dims 32c+2x and 32c+2x+1 of every key (the cache's rows transposed as pairs).
SPECOPS_AMX_TARGET void key_tile(const uint16_t* cache, int64_t d, int64_t j0, int64_t keys, int64_t c,
                                    uint16_t* tile) {
  __m512i r[kTile];
  for (int n = 0; n < kTile; ++n) {
    r[n] = j0 + n < keys ? load_dims(cache + (j0 + n) * d + 32 * c, std::min<int64_t>(32, d - 32 * c))
                         : _mm512_setzero_si512();
  }
  transpose16(r);
  for (int x = 0; x < kTile; ++x) _mm512_storeu_si512(tile + 32 * x, r[x]);
}

SPECOPS_AMX_TARGET void attend_item_amx(const Item& item, const void* q, void* out, const Shape& s, Buffers& b) {
  const int64_t rows = static_cast<int64_t>(item.rows.size()), queries = s.groups * rows;
  const int64_t tiles = (queries + kTile - 1) / kTile, d = s.d, chunks = (d + 31) / 32, dims = (d + 15) / 16;
  const int64_t keys = *std::max_element(item.ends.begin(), item.ends.end());
  const int64_t padded_keys = (keys + kPairKeys - 1) / kPairKeys * kPairKeys;
  const int64_t width = chunks * 32;  // a query's dims, zero-padded
  const uint16_t* query_rows = static_cast<const uint16_t*>(q);
  b.tile_queries.assign(tiles * kTile * width, 0);
  b.reach.assign(tiles, 0);  // the largest end of each tile's queries
  for (int64_t i = 0; i < queries; ++i) {
    const int64_t from = ((item.kv_head * s.groups + i / rows) * s.n + item.rows[i % rows]) * d;
    std::memcpy(&b.tile_queries[i * width], query_rows + from, d * sizeof(uint16_t));
    b.reach[i / kTile] = std::max(b.reach[i / kTile], item.ends[i % rows]);
  }
  b.scores.resize(tiles * kTile * padded_keys);
  configure_attention_tiles();
  alignas(64) uint16_t key_tiles[kMaxDims / 32][kTile * 32];
  const uint16_t* key_cache = static_cast<const uint16_t*>(item.keys);
  for (int64_t j0 = 0; j0 < keys; j0 += kTile) {
    for (int64_t c = 0; c < chunks; ++c) key_tile(key_cache, d, j0, keys, c, key_tiles[c]);
    for (int64_t t = 0; t < tiles; ++t) {
      if (j0 >= b.reach[t]) continue;  // no query of this tile sees these keys
      _tile_zero(0);
      for (int64_t c = 0; c < chunks; ++c) {
        _tile_loadd(1, &b.tile_queries[t * kTile * width + 32 * c], width * 2);
        _tile_loadd(2, key_tiles[c], 64);
        _tile_dpbf16ps(0, 1, 2);
      }
      _tile_stored(0, &b.scores[t * kTile * padded_keys + j0], padded_keys * 4);
    }
  }
  // Softmax over each row's visible slots, scaled here (the products summed the unscaled query); the weights
  // rounded to bf16, zero past the row's end and for the tiles' rows past the last query.
  b.weights.assign(tiles * kTile * padded_keys, 0);
  std::vector<float> inverse(queries);
  const __m512 scale = _mm512_set1_ps(s.scale);
  for (int64_t i = 0; i < queries; ++i) {
    const int64_t end = item.ends[i % rows];
    const float* score = &b.scores[i * padded_keys];
    __m512 top = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
    for (int64_t j = 0; j < end; j += kLanes) {
      const __mmask16 live = end - j >= kLanes ? 0xFFFF : static_cast<__mmask16>((1u << (end - j)) - 1);
      top = _mm512_mask_max_ps(top, live, top, _mm512_mul_ps(_mm512_maskz_loadu_ps(live, score + j), scale));
    }
    const __m512 max = _mm512_set1_ps(_mm512_reduce_max_ps(top));
    __m512 total = _mm512_setzero_ps();
    for (int64_t j = 0; j < end; j += kLanes) {
      const __mmask16 live = end - j >= kLanes ? 0xFFFF : static_cast<__mmask16>((1u << (end - j)) - 1);
      const __m512 x = _mm512_sub_ps(_mm512_mul_ps(_mm512_maskz_loadu_ps(live, score + j), scale), max);
      const __m512 e = _mm512_maskz_mov_ps(live, exp_nonpositive(x));
      total = _mm512_add_ps(total, e);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(&b.weights[i * padded_keys + j]), (__m256i)_mm512_cvtneps_pbh(e));
    }
    inverse[i] = 1.0f / _mm512_reduce_add_ps(total);
  }
  // The values as the weighted sum's weight tiles: row x of a tile holds keys 2x and 2x+1 of 16 dims, in pairs
  // [pair, chunk of 16 dims, 16]; zeros past `keys` and past D.
  const uint16_t* value_cache = static_cast<const uint16_t*>(item.values);
  b.value_pairs.resize(padded_keys / 2 * dims * kTile);
  alignas(64) uint16_t low[32], high[32];  // element e of a pair's 16 dims: key 2x's dim e / 2 (e even), else 2x+1's
  for (int e = 0; e < 32; ++e) {
    low[e] = static_cast<uint16_t>(e / 2 + (e % 2 ? 32 : 0));
    high[e] = static_cast<uint16_t>(low[e] + kTile);
  }
  const __m512i interleave_low = _mm512_load_si512(low), interleave_high = _mm512_load_si512(high);
  for (int64_t x = 0; x < padded_keys / 2; ++x) {
    for (int64_t c = 0; c < chunks; ++c) {  // 32 dims of both keys, two chunks of 16 of the tile's rows
      const int64_t count = std::min<int64_t>(32, d - 32 * c);
      const __m512i even = 2 * x < keys ? load_dims(value_cache + 2 * x * d + 32 * c, count) : _mm512_setzero_si512();
      const __m512i odd = 2 * x + 1 < keys ? load_dims(value_cache + (2 * x + 1) * d + 32 * c, count)
                                           : _mm512_setzero_si512();
      uint32_t* to = &b.value_pairs[(x * dims + 2 * c) * kTile];
      _mm512_storeu_si512(to, _mm512_permutex2var_epi16(even, interleave_low, odd));
      if (2 * c + 1 < dims) _mm512_storeu_si512(to + kTile, _mm512_permutex2var_epi16(even, interleave_high, odd));
    }
  }
  // The weighted sums, 32 keys at a time in key order, each tile's 16 queries over the keys its rows see
  // (rounded up to 32; the weights past a row's end are 0), 4 chunks of 16 dims per sweep.
  alignas(64) float scratch[kTile * kTile];
  const int64_t stride = dims * kTile * 4;
  for (int64_t t = 0; t < tiles; ++t) {
    const int64_t blocks = (b.reach[t] + kPairKeys - 1) / kPairKeys;
    for (int64_t c0 = 0; c0 < dims; c0 += 4) {
      const int64_t sweep = std::min<int64_t>(4, dims - c0);
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(2);
      _tile_zero(3);
      for (int64_t k = 0; k < blocks; ++k) {
        _tile_loadd(4, &b.weights[t * kTile * padded_keys + k * kPairKeys], padded_keys * 2);
        // (A tile instruction names its registers in its text: literals, not parameters.)
        const uint32_t* pairs = &b.value_pairs[(k * kTile * dims + c0) * kTile];
        _tile_loadd(5, pairs, stride);
        _tile_dpbf16ps(0, 4, 5);
        if (sweep > 1) {
          _tile_loadd(5, pairs + kTile, stride);
          _tile_dpbf16ps(1, 4, 5);
        }
        if (sweep > 2) {
          _tile_loadd(5, pairs + 2 * kTile, stride);
          _tile_dpbf16ps(2, 4, 5);
        }
        if (sweep > 3) {
          _tile_loadd(5, pairs + 3 * kTile, stride);
          _tile_dpbf16ps(3, 4, 5);
        }
      }
      for (int64_t c = c0; c < c0 + sweep; ++c) {
        switch (c - c0) {
          case 0: _tile_stored(0, scratch, 64); break;
          case 1: _tile_stored(1, scratch, 64); break;
          case 2: _tile_stored(2, scratch, 64); break;
          default: _tile_stored(3, scratch, 64); break;
        }
        const int64_t count = std::min<int64_t>(kTile, d - kTile * c);
        const __mmask16 live = count >= kTile ? 0xFFFF : static_cast<__mmask16>((1u << count) - 1);
        for (int64_t m = 0; m < kTile && t * kTile + m < queries; ++m) {
          const int64_t i = t * kTile + m;
          const int64_t head = item.kv_head * s.groups + i / rows, row = item.rows[i % rows];
          const __m512 result = _mm512_mul_ps(_mm512_loadu_ps(scratch + m * kTile), _mm512_set1_ps(inverse[i]));
          _mm256_mask_storeu_epi16(static_cast<uint16_t*>(out) + (head * s.n + row) * d + kTile * c, live,
                                   (__m256i)_mm512_cvtneps_pbh(result));
        }
      }
    }
  }
  _tile_release();
}
#endif  // SPECOPS_X86

// bf16 rows on the tiles: where the CPU has them, unless SPECOPS_AMX=0 (read at each call, as
// specops.core.packed_linear reads it for the products).
bool on_tiles() {
#ifdef SPECOPS_X86
  const char* setting = std::getenv("SPECOPS_AMX");
  return elementwise_vector() && amx_supported() && (setting == nullptr || std::strcmp(setting, "0") != 0);
#else
  return false;
#endif
}

}  // namespace

const char* attention_path() { return on_tiles() ? "amx" : elementwise_vector() ? "avx512" : "plain"; }

void attend_rows(const at::Tensor& q, at::Tensor& out, const std::vector<AttendRows>& sequences) {
  TORCH_CHECK(q.is_contiguous() && out.is_contiguous() && q.sizes() == out.sizes(), "attend_rows: q and out must be "
              "contiguous [heads, n, D] of one shape");
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 || q.scalar_type() == at::kFloat, "attend_rows: bf16 or fp32 only");
  std::vector<Item> items;
  int64_t kv_heads = 0;
  for (const AttendRows& s : sequences) {
    TORCH_CHECK(s.keys.is_contiguous() && s.values.is_contiguous() && s.keys.scalar_type() == q.scalar_type(),
                "attend_rows: caches must be contiguous and of q's dtype");
    const bool tree = s.owner.has_value();
    kv_heads = s.keys.size(tree ? 1 : 0);
    const int64_t length = s.keys.size(-2), d = s.keys.size(-1), item_size = length * d;
    const int64_t* ends = s.ends.data_ptr<int64_t>();
    const int64_t* owner = tree ? s.owner->data_ptr<int64_t>() : nullptr;
    const int64_t branches = tree ? *std::max_element(owner, owner + s.size) + 1 : 1;
    for (int64_t branch = 0; branch < branches; ++branch) {
      std::vector<int64_t> rows, row_ends;
      for (int64_t r = 0; r < s.size; ++r) {
        if (owner == nullptr || owner[r] == branch) {
          TORCH_CHECK(ends[r] >= 1 && ends[r] <= length, "attend_rows: a row sees 1 to length slots");
          rows.push_back(s.start + r);
          row_ends.push_back(ends[r]);
        }
      }
      // A prompt's rows go in blocks of kItemRows: more items for the threads to share, and each item's scores
      // [groups x rows, keys] stay small; a row's result does not depend on which item it is in.
      for (size_t first = 0; first < rows.size(); first += kItemRows) {
        const size_t last = std::min(rows.size(), first + kItemRows);
        const std::vector<int64_t> block(rows.begin() + first, rows.begin() + last);
        const std::vector<int64_t> block_ends(row_ends.begin() + first, row_ends.begin() + last);
        for (int64_t h = 0; h < kv_heads; ++h) {
          const int64_t offset = (branch * kv_heads + h) * item_size * s.keys.element_size();
          items.push_back({static_cast<const char*>(s.keys.data_ptr()) + offset,
                           static_cast<const char*>(s.values.data_ptr()) + offset, h, block, block_ends});
        }
      }
    }
  }
  if (items.empty()) return;
  const int64_t heads = q.size(0), d = q.size(2);
  TORCH_CHECK(heads % kv_heads == 0 && d <= 8 * kLanes, "attend_rows: query heads a multiple of kv heads, D <= 128");
  const Shape shape{heads, heads / kv_heads, q.size(1), d, (d + kLanes - 1) / kLanes * kLanes,
                    q.scalar_type() == at::kBFloat16, static_cast<float>(1.0 / std::sqrt(static_cast<double>(d)))};
  const void* queries = q.data_ptr();
  void* result = out.data_ptr();
  [[maybe_unused]] const bool vector = elementwise_vector();  // unused where only the plain loops are compiled in
  [[maybe_unused]] const bool tiles = shape.bf16 && on_tiles();
  at::parallel_for(0, static_cast<int64_t>(items.size()), 1, [&](int64_t begin, int64_t end) {
    Buffers buffers;
    for (int64_t i = begin; i < end; ++i) {
#ifdef SPECOPS_X86
      if (tiles) {
        attend_item_amx(items[i], queries, result, shape, buffers);
        continue;
      }
      if (vector) {
        switch (shape.padded_d / kLanes) {  // D <= 128
          case 1: attend_item_avx512<1>(items[i], queries, result, shape, buffers); break;
          case 2: attend_item_avx512<2>(items[i], queries, result, shape, buffers); break;
          case 3: attend_item_avx512<3>(items[i], queries, result, shape, buffers); break;
          case 4: attend_item_avx512<4>(items[i], queries, result, shape, buffers); break;
          case 5: attend_item_avx512<5>(items[i], queries, result, shape, buffers); break;
          case 6: attend_item_avx512<6>(items[i], queries, result, shape, buffers); break;
          case 7: attend_item_avx512<7>(items[i], queries, result, shape, buffers); break;
          default: attend_item_avx512<8>(items[i], queries, result, shape, buffers); break;
        }
        continue;
      }
#endif
      attend_item_plain(items[i], queries, result, shape, buffers);
    }
  });
}

}  // namespace specops
