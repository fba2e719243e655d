// bf16 products of a few rows against weights packed once (native_linear.cpp).
#pragma once

#include <torch/extension.h>

namespace specops {

// Whether this CPU runs linear_packed: AVX-512 with its bf16 dot products (and the extension compiled for x86).
bool linear_supported();

// weight [N, K] bf16 (N a multiple of 16, K even) packed for linear_packed: [N / 16, K / 2, 16, 2], each 16
// outputs' weights for two inputs in one AVX-512 register.
at::Tensor pack_linear(const at::Tensor& weight);

// x [..., K] @ weight.T -> [..., N] in bf16 for `packed` = pack_linear(weight). Each output is one float32
// sum over K in a fixed order, rounded once: a row's result depends on its own inputs only, not on the other
// rows, their count or the thread count.
at::Tensor linear_packed(const at::Tensor& x, const at::Tensor& packed);

}  // namespace specops
