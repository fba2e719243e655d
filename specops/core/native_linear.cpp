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

#include "native_linear.h"

#include <ATen/Parallel.h>
#if defined(__x86_64__)
#include <immintrin.h>
#define SPECOPS_X86 1
#endif

#include <cstdint>

namespace specops {
namespace {

constexpr int64_t kBlock = 16;  // outputs in one register
constexpr int kRows = 6;        // rows of a full tile (6 x 4 blocks: 24 of the 32 registers hold sums)

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

at::Tensor pack_linear(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kBFloat16, "pack_linear: a 2-d bf16 weight");
  const int64_t n = weight.size(0), k = weight.size(1);
  TORCH_CHECK(n % kBlock == 0 && k % 2 == 0, "pack_linear: outputs a multiple of 16 and inputs even, not ", n,
              " x ", k);
  return weight.reshape({n / kBlock, kBlock, k / 2, 2}).permute({0, 2, 1, 3}).contiguous();
}

at::Tensor linear_packed(const at::Tensor& x, const at::Tensor& packed) {
  TORCH_CHECK(linear_supported(), "linear_packed: this CPU has no AVX-512 bf16 dot product");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && packed.scalar_type() == at::kBFloat16 && packed.dim() == 4 &&
                  packed.is_contiguous(), "linear_packed: bf16 rows and a weight from pack_linear");
  const int64_t blocks = packed.size(0), pairs = packed.size(1), k = 2 * pairs, n = blocks * kBlock;
  TORCH_CHECK(x.size(-1) == k, "linear_packed: rows of ", x.size(-1), " inputs against a weight of ", k);
  const at::Tensor rows_in = x.reshape({-1, k}).contiguous();
  const int64_t m = rows_in.size(0);
  std::vector<int64_t> shape = x.sizes().vec();
  shape.back() = n;
  at::Tensor out = at::empty({m, n}, x.options());
#ifdef SPECOPS_X86
  const auto* in = reinterpret_cast<const uint16_t*>(rows_in.data_ptr());
  const auto* w = reinterpret_cast<const uint16_t*>(packed.data_ptr());
  auto* y = reinterpret_cast<uint16_t*>(out.data_ptr());
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
  return out.view(shape);
}

}  // namespace specops
