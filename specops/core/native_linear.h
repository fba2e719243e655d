// bf16 products of a few rows against weights packed once (native_linear.cpp).
#pragma once

#include <torch/extension.h>

namespace specops {

// Whether this CPU runs linear_packed: AVX-512 with its bf16 dot products (and the extension compiled for x86).
bool linear_supported();

// Whether this CPU runs the tiles' kernel too: AMX with bf16 (and Linux granted the process the tiles' state).
bool amx_supported();

// weight [N, K] bf16 (N a multiple of 16, K even) packed for linear_packed: for the dot products (amx false)
// [N / 16, K / 2, 16, 2], each 16 outputs' weights for two inputs in one AVX-512 register; for the tiles
// [N / 16, ceil(K / 32), 16, 16, 2], each [16 pairs, 16 outputs, 2] one tile, K padded with zeros.
at::Tensor pack_linear(const at::Tensor& weight, bool amx);

// x [..., K] @ weight.T -> [..., N] in bf16 for `packed` = pack_linear(weight, amx), on the kernel the
// packing is for. Each output is one float32 sum over K in a fixed order, rounded once: a row's result depends
// on its own inputs only, not on the other rows, their count or the thread count.
at::Tensor linear_packed(const at::Tensor& x, const at::Tensor& packed);

}  // namespace specops
