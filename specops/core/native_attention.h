// Attention of decoding, verification and prompt rows over each sequence's own cache (native_attention.cpp).
#pragma once

#include <torch/extension.h>

#include <optional>
#include <vector>

namespace specops {

// One sequence's rows in a pass, as attention reads them: rows start..start+size of the pass, row r seeing
// cache slots 0..ends[r]-1 of keys/values [kv_heads, length, D], or, for a tree, of its branch owner[r] in
// caches [branches, kv_heads, length, D].
struct AttendRows {
  at::Tensor keys, values;
  int64_t start, size;
  at::Tensor ends;                    // int64 [size]
  std::optional<at::Tensor> owner;    // int64 [size], a tree's
};

// out[h, start + r, :] = softmax(q[h, start + r] . K[0:ends[r]] * D^-0.5) . V[0:ends[r]] for every query head h
// (grouped onto kv heads as h / (heads / kv_heads)) and every row r of every sequence in `rows`; q and out are
// [heads, n, D] contiguous, in the caches' dtype (bf16 or fp32). Each row reads only the slots it sees, in a
// fixed order, so its result depends on nothing but its query, its visible slots and the CPU's code path
// (bf16 on AMX tiles where the CPU has them, fp32 and CPUs without them on AVX-512, else plain loops): not on the
// other rows, sequences or the cache's length.
void attend_rows(const at::Tensor& q, at::Tensor& out, const std::vector<AttendRows>& rows);

// "amx", "avx512" or "plain": the code path attend_rows takes for bf16 rows on this CPU ("amx": fp32 rows take
// "avx512"). SPECOPS_AMX=0 keeps bf16 off the tiles; SPECOPS_NATIVE_PLAIN=1 forces "plain".
const char* attention_path();

}  // namespace specops
