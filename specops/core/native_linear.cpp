// bf16 products of a few rows against weights packed once (see native_linear.h).
//
// A decoding or verification pass multiplies 1 to a few dozen rows by every weight, so it is as fast as the
// weights stream from memory. oneDNN's bf16 products (specops/core/packed_linear.py) streamed SmolLM2's at
// 15-20 GB/s for 1 to 8 rows on this repo's 2-core CPU, where the memory streams 29.8 (docs/results.md).
// Here the weight is laid out once so that one 64-byte load holds 16 outputs' weights for two inputs, the
// operand of AVX-512's bf16 dot product (vdpbf16ps); a tile of up to 6 rows x 64 outputs keeps its 24 sums in
// registers, so each load serves every row of the tile, and the threads split the outputs, never the sum.
// Output n of row m is one float32 accumulator over K in input order, rounded to bf16 once: the same
// operations whatever else is in the pass, so batched passes are exact by construction, as native
// attention's are.
//
// On a CPU with AMX (Intel Sapphire Rapids and later) the same products run on its tile unit instead
// (tdpbf16ps: a 16-row tile of inputs times 16 input pairs of 16 outputs per instruction), several times the
// dot products' rate once a pass has more than a few rows (prefills, batched verification). Its sums are the
// hardware's: measured on this repo's Xeon, a lone pair's two products are summed and rounded, then added to
// the accumulator, and a tile's 16 pairs are combined in an order Intel does not document, so they round
// otherwise than the dot products' (tests/core/test_packed_linear.py checks the tiles against an fp64 bound).
// Each row is still its own: output n of row m takes row m's inputs alone, 16 pairs at a time in input order,
// whatever the tile's other rows hold or how many there are, so a process that runs every product on the tiles
// is batch-invariant too. A process runs one kernel for every weight (the packing says which: a 5-d weight is
// the tiles'), never the tiles for large passes and the dot products for small ones: a row would round
// otherwise alone than in a prefill.

#include "native_linear.h"

#include <ATen/Parallel.h>
#if defined(__x86_64__)
#include <immintrin.h>
#define SPECOPS_X86 1
#endif

#include <algorithm>
#include <cstdint>
#if defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace specops {
namespace {

constexpr int64_t kBlock = 16;  // outputs in one register
constexpr int kRows = 6;        // rows of a full tile (6 x 4 blocks: 24 of the 32 registers hold sums)
constexpr int kTileRows = 16;   // AMX: rows of an input tile, pairs of a weight tile
constexpr int64_t kChunk = 32;  // AMX: inputs per tile product (16 pairs)

#ifdef SPECOPS_X86
#define SPECOPS_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))

// Rows 0..R-1 of x (row stride ldx) times NB blocks of packed weights (each K2 pairs of 16 outputs' weights,
// stride `block`) into y (row stride ldy).
template <int R, int NB>
SPECOPS_TARGET void tile(const uint16_t* x, int64_t ldx, const uint16_t* w, int64_t block, int64_t pairs,
                         uint16_t* y, int64_t ldy) {
  __m512 acc[R][NB];
  for (int r = 0; r < R; ++r)
    for (int b = 0; b < NB; ++b) acc[r][b] = _mm512_setzero_ps();
  for (int64_t p = 0; p < pairs; ++p) {
    __m512bh weights[NB];
    for (int b = 0; b < NB; ++b) weights[b] = (__m512bh)_mm512_loadu_si512(w + b * block + p * 2 * kBlock);
    for (int r = 0; r < R; ++r) {
      // Row r's inputs 2p and 2p+1 in every lane: lane j adds x[2p] w[j, 2p] + x[2p+1] w[j, 2p+1].
      const __m512bh in = (__m512bh)_mm512_set1_epi32(*reinterpret_cast<const int32_t*>(x + r * ldx + 2 * p));
      for (int b = 0; b < NB; ++b) acc[r][b] = _mm512_dpbf16_ps(acc[r][b], in, weights[b]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int b = 0; b < NB; ++b)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + r * ldy + b * kBlock), (__m256i)_mm512_cvtneps_pbh(acc[r][b]));
}

// All m rows against NB blocks: full tiles of kRows, then one tile of the rest.
template <int NB>
SPECOPS_TARGET void rows(const uint16_t* x, int64_t ldx, const uint16_t* w, int64_t block, int64_t pairs, uint16_t* y,
                         int64_t ldy, int64_t m) {
  int64_t r = 0;
  for (; r + kRows <= m; r += kRows) tile<kRows, NB>(x + r * ldx, ldx, w, block, pairs, y + r * ldy, ldy);
  x += r * ldx;
  y += r * ldy;
  switch (m - r) {
    case 1: tile<1, NB>(x, ldx, w, block, pairs, y, ldy); break;
    case 2: tile<2, NB>(x, ldx, w, block, pairs, y, ldy); break;
    case 3: tile<3, NB>(x, ldx, w, block, pairs, y, ldy); break;
    case 4: tile<4, NB>(x, ldx, w, block, pairs, y, ldy); break;
    case 5: tile<5, NB>(x, ldx, w, block, pairs, y, ldy); break;
    default: break;
  }
  static_assert(kRows == 6, "the switch covers 1..kRows-1 rows");
}

// --- AMX tiles (SPECOPS_AMX_TARGET and TileConfig: native_linear.h) ------------------------------------------

// Sums 0-3 (rows r0 of blocks 0 and 1, rows r1 of blocks 0 and 1), inputs 4-5, weights 6-7.
SPECOPS_AMX_TARGET void configure(int r0, int r1) {
  TileConfig config;
  const int rows[8] = {r0, r0, r1, r1, r0, r1, kTileRows, kTileRows};
  for (int t = 0; t < 8; ++t) {
    config.rows[t] = static_cast<uint8_t>(rows[t]);
    config.colsb[t] = 64;
  }
  _tile_loadconfig(&config);
}

// A sum tile stored to scratch -> rows of bf16 outputs, rounded as the dot products' tiles round theirs
// (cvtneps). (_tile_stored names its register in the instruction's text: a literal, not a parameter.)
SPECOPS_AMX_TARGET void convert(const float* scratch, int rows, uint16_t* y, int64_t ldy) {
  for (int r = 0; r < rows; ++r)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + r * ldy),
                        (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(scratch + r * kBlock)));
}

// Rows [0, r0 + r1) of x (row stride ldx, `chunks` x 32 inputs) times one or two blocks of 16 outputs, w0 and
// w1 (each `chunks` tiles of 16 pairs x 16 outputs x 2; w1 null: one), into y. r1 may be 0 (one input tile).
// Every tile product is the same instruction on the same chunks in the same order for every row.
SPECOPS_AMX_TARGET void amx_tile(const uint16_t* x, int64_t ldx, int r0, int r1, const uint16_t* w0,
                                 const uint16_t* w1, int64_t chunks, uint16_t* y, int64_t ldy, float* scratch) {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  const uint16_t* x1 = x + r0 * ldx;
  for (int64_t c = 0; c < chunks; ++c) {
    const int64_t tile = c * kTileRows * 2 * kBlock;
    _tile_loadd(4, x + c * kChunk, ldx * 2);
    _tile_loadd(6, w0 + tile, 64);
    _tile_dpbf16ps(0, 4, 6);
    if (r1) {
      _tile_loadd(5, x1 + c * kChunk, ldx * 2);
      _tile_dpbf16ps(2, 5, 6);
    }
    if (w1) {
      _tile_loadd(7, w1 + tile, 64);
      _tile_dpbf16ps(1, 4, 7);
      if (r1) _tile_dpbf16ps(3, 5, 7);
    }
  }
  _tile_stored(0, scratch, 64);
  convert(scratch, r0, y, ldy);
  if (w1) {
    _tile_stored(1, scratch, 64);
    convert(scratch, r0, y + kBlock, ldy);
  }
  if (r1) {
    _tile_stored(2, scratch, 64);
    convert(scratch, r1, y + r0 * ldy, ldy);
  }
  if (r1 && w1) {
    _tile_stored(3, scratch, 64);
    convert(scratch, r1, y + r0 * ldy + kBlock, ldy);
  }
}

// m rows against the pairs of blocks [first, last) (of `blocks`; the last pair may be one block): input tiles
// two at a time, each pair's weights read once for both. Pairs outer, rows inner: a pair's weights come from
// memory once and from the core's cache for each further 32 rows (rows outer streamed every weight again for
// each 32 rows of a batched verification or a prompt: SmolLM2's products over 64 rows took 12.2 ms, now 10.5).
SPECOPS_AMX_TARGET void amx_rows(const uint16_t* x, int64_t ldx, int64_t m, const uint16_t* w, int64_t block,
                                 int64_t blocks, int64_t chunks, int64_t first, int64_t last, uint16_t* y,
                                 int64_t ldy) {
  alignas(64) float scratch[kTileRows * kBlock];
  int shape = -1;  // the tiles' rows as configured, r0 * 256 + r1: configured again only where a group's differ
  for (int64_t g = first; g < last; ++g) {
    for (int64_t r = 0; r < m; r += 2 * kTileRows) {
      const int r0 = static_cast<int>(std::min<int64_t>(kTileRows, m - r));
      const int r1 = static_cast<int>(std::min<int64_t>(kTileRows, std::max<int64_t>(0, m - r - kTileRows)));
      if (r0 * 256 + r1 != shape) {
        configure(r0, r1 ? r1 : kTileRows);
        shape = r0 * 256 + r1;
      }
      amx_tile(x + r * ldx, ldx, r0, r1, w + 2 * g * block, 2 * g + 1 < blocks ? w + (2 * g + 1) * block : nullptr,
               chunks, y + r * ldy + 2 * g * kBlock, ldy, scratch);
    }
  }
  _tile_release();
}
#endif

}  // namespace

bool linear_supported() {
#ifdef SPECOPS_X86
  static const bool supported = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                                __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512bf16");
  return supported;
#else
  return false;
#endif
}

bool amx_supported() {
#if defined(SPECOPS_X86) && defined(__linux__)
  // Linux hands out the tiles' state to a process that asks first (ARCH_REQ_XCOMP_PERM for XTILEDATA).
  static const bool supported = linear_supported() && __builtin_cpu_supports("amx-tile") &&
                                __builtin_cpu_supports("amx-bf16") && syscall(SYS_arch_prctl, 0x1023, 18) == 0;
  return supported;
#else
  return false;
#endif
}

at::Tensor pack_linear(const at::Tensor& weight, bool amx) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kBFloat16, "pack_linear: a 2-d bf16 weight");
  const int64_t n = weight.size(0), k = weight.size(1);
  TORCH_CHECK(n % kBlock == 0 && k % 2 == 0, "pack_linear: outputs a multiple of 16 and inputs even, not ", n,
              " x ", k);
  if (!amx) return weight.reshape({n / kBlock, kBlock, k / 2, 2}).permute({0, 2, 1, 3}).contiguous();
  // Inputs padded with zeros to whole tiles of 32 (linear_packed pads the rows alike): zero products.
  const int64_t chunks = (k + kChunk - 1) / kChunk;
  const at::Tensor padded = at::constant_pad_nd(weight, {0, chunks * kChunk - k});
  return padded.reshape({n / kBlock, kBlock, chunks, kTileRows, 2}).permute({0, 2, 3, 1, 4}).contiguous();
}

namespace {

// A product's rows and output: x [..., k] as contiguous rows [m, width] (padded with zeros past k), the output
// [m, n] they fill, and that output in x's shape with n last.
struct Product {
  at::Tensor rows, out;
  std::vector<int64_t> shape;
  Product(const at::Tensor& x, int64_t k, int64_t width, int64_t n)
      : rows(width > k ? at::constant_pad_nd(x.reshape({-1, k}), {0, width - k}) : x.reshape({-1, k}).contiguous()),
        out(at::empty({rows.size(0), n}, x.options())), shape(x.sizes().vec()) {
    shape.back() = n;
  }
  int64_t m() const { return rows.size(0); }
  const uint16_t* in() const { return reinterpret_cast<const uint16_t*>(rows.data_ptr()); }
  uint16_t* y() const { return reinterpret_cast<uint16_t*>(out.data_ptr()); }
  at::Tensor result() const { return out.view(shape); }
};

const uint16_t* weights(const at::Tensor& packed) { return reinterpret_cast<const uint16_t*>(packed.data_ptr()); }

// linear_packed for a weight packed for the tiles: [N / 16, chunks, 16, 16, 2].
at::Tensor linear_tiles(const at::Tensor& x, const at::Tensor& packed) {
  TORCH_CHECK(amx_supported(), "linear_packed: a weight packed for AMX tiles, on a CPU (or kernel) without them");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && packed.scalar_type() == at::kBFloat16 && packed.is_contiguous(),
              "linear_packed: bf16 rows and a weight from pack_linear");
  const int64_t blocks = packed.size(0), chunks = packed.size(1), n = blocks * kBlock, k = x.size(-1);
  TORCH_CHECK(k <= chunks * kChunk && k > (chunks - 1) * kChunk && k % 2 == 0, "linear_packed: rows of ", k,
              " inputs against a weight of ", chunks * kChunk, " (padded)");
  // A tile reads 32 inputs a row: rows whose inputs end mid-tile are padded with zeros, as the weight is.
  const Product p(x, k, chunks * kChunk, n);
#ifdef SPECOPS_X86
  const int64_t block = chunks * kTileRows * 2 * kBlock;
  if (p.m() > 0) {
    // The threads take pairs of blocks; each configures its own tiles (the configuration is a thread's).
    at::parallel_for(0, (blocks + 1) / 2, 1, [&](int64_t first, int64_t last) {
      amx_rows(p.in(), chunks * kChunk, p.m(), weights(packed), block, blocks, chunks, first, last, p.y(), n);
    });
  }
#endif
  return p.result();
}

}  // namespace

at::Tensor linear_packed(const at::Tensor& x, const at::Tensor& packed) {
  if (packed.dim() == 5) return linear_tiles(x, packed);
  TORCH_CHECK(linear_supported(), "linear_packed: this CPU has no AVX-512 bf16 dot product");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && packed.scalar_type() == at::kBFloat16 && packed.dim() == 4 &&
                  packed.is_contiguous(), "linear_packed: bf16 rows and a weight from pack_linear");
  const int64_t blocks = packed.size(0), pairs = packed.size(1), k = 2 * pairs, n = blocks * kBlock;
  TORCH_CHECK(x.size(-1) == k, "linear_packed: rows of ", x.size(-1), " inputs against a weight of ", k);
  const Product p(x, k, k, n);
#ifdef SPECOPS_X86
  const uint16_t* in = p.in();
  const uint16_t* w = weights(packed);
  uint16_t* y = p.y();
  const int64_t m = p.m();
  const int64_t block = pairs * 2 * kBlock;  // one block's packed weights
  // Groups of 4 blocks (64 outputs), or of 2 or 1 where the outputs do not divide so: the threads take groups.
  const int64_t group = blocks % 4 == 0 ? 4 : blocks % 2 == 0 ? 2 : 1;
  if (m > 0) {
    at::parallel_for(0, blocks / group, 1, [&](int64_t first, int64_t last) {
      for (int64_t g = first; g < last; ++g) {
        const uint16_t* wg = w + g * group * block;
        uint16_t* yg = y + g * group * kBlock;
        if (group == 4) rows<4>(in, k, wg, block, pairs, yg, n, m);
        else if (group == 2) rows<2>(in, k, wg, block, pairs, yg, n, m);
        else rows<1>(in, k, wg, block, pairs, yg, n, m);
      }
    });
  }
#endif
  return p.result();
}

}  // namespace specops
