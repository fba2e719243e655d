// bf16 products of a few rows against weights packed once (native_linear.cpp).
#pragma once

#include <torch/extension.h>

namespace specops {

// Whether this CPU runs linear_packed: AVX-512 with its bf16 dot products (and the extension compiled for x86).
bool linear_supported();

// Whether this CPU runs the tiles' kernel too: AMX with bf16 (and Linux granted the process the tiles' state).
bool amx_supported();

// What code on the tiles is compiled for (the products here, attention in native_attention.cpp).
#define SPECOPS_AMX_TARGET __attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512vl,avx512bf16")))

// The tile registers' shapes (ldtilecfg's 64-byte palette 1 layout), loaded by each kernel for its own tiles.
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// weight [N, K] bf16 (N a multiple of 16, K even) packed for linear_packed: for the dot products (amx false)
// [N / 16, K / 2, 16, 2], each 16 outputs' weights for two inputs in one AVX-512 register; for the tiles
// [N / 16, ceil(K / 32), 16, 16, 2], each [16 pairs, 16 outputs, 2] one tile, K padded with zeros.
at::Tensor pack_linear(const at::Tensor& weight, bool amx);

// x [..., K] @ weight.T -> [..., N] in bf16 for `packed` = pack_linear(weight, amx), on the kernel the
// packing is for. Each output is one float32 sum over K in a fixed order, rounded once: a row's result depends
// on its own inputs only, not on the other rows, their count or the thread count.
at::Tensor linear_packed(const at::Tensor& x, const at::Tensor& packed);

}  // namespace specops
