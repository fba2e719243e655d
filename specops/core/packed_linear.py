"""bf16 matrix products on weights packed once: our kernel's (native_linear.cpp) where this CPU runs it, else
oneDNN's layout with F.linear's sums; either about twice as fast as F.linear here.

Eager bf16 `F.linear` on a CPU hands oneDNN the weight in torch's row-major layout, and oneDNN reorders
it into its own blocked layout on every call, so a decoding pass, whose products are a few rows against
every weight, streams each weight twice and writes it once more. Reordering once, when the weights are
loaded (what inductor's `freezing` does for a compiled graph), leaves one read per pass. The products of
SmolLM2-135M's 30 layers and LM head, 2 threads on this repo's 2-core CPU (one-off timing, 20 runs): 15.4
ms over 1 to 5 rows through F.linear, 6.4-7.7 ms packed; 8 rows 17.3 against 8.4; 40 rows 28.8 against
17.8. A whole 5-row pass, attention and the rest included: 15.7 ms against 19.4 (benchmarks/packed_linear.py).

Our kernel (specops.core.native, native_linear.cpp; AVX-512 with bf16 dot products) streams the weights
faster still for a few rows: oneDNN's read them at 15-20 GB/s where this machine's memory streams 29.8
(docs/results.md). Each output is one float32 sum in a fixed order, so a row's result depends on its own
inputs only: batch-invariant by construction, at any shape. It rounds otherwise than F.linear (its sums
are ordered otherwise), so a process packs every weight one way (ours wherever it runs), as it runs one
attention kernel.

oneDNN's packed product runs its inner-product primitive on the reordered weight where F.linear runs its
matmul primitive; on an AVX-512 bf16 CPU without AMX (the EPYC this was measured on) the two sum alike: the
output equals F.linear's bit for bit at any row count wherever F.linear itself runs on oneDNN, which for a
CPU bf16 product is when rows x out x in exceeds 16**3 (`types.ONEDNN_MIN_WORK`), so for a weight with out x
in above it at every row count (measured for every pair of 12 sizes from 16 to 1536, 1 to 130 rows, 1 and 2
threads; tests/core/test_packed_linear.py checks the shapes the tests and SmolLM2 use, up to 512 rows). On a
Xeon with AMX they agree up to 32 rows, where F.linear switches primitives (its rows then round otherwise
than alone). That is a measured fact of a CPU and torch build, not a guarantee, so `pack` checks each weight
against F.linear once and leaves any that disagrees (or that oneDNN would not run in bf16) to F.linear. A
row's result then does not depend on the other rows of its pass either (specops.core.batching).

Where the CPU has AMX tiles (Sapphire Rapids and later), our kernel runs its products on them (`tiles`):
as fast as the dot products for a row and 2-3x faster for a prefill's hundreds (benchmarks/batched_pass.py
--dot-products). They round otherwise than the dot products, so `pack` packs every weight of a process for
one of the two (SPECOPS_AMX=0 keeps the dot products).

Packed weights are a second copy (counted by specops.core.memory), made only for bf16 weights on a CPU
above ONEDNN_MIN_WORK elements (smaller ones stay on F.linear with either packing, so the two pack the same
weights), and used only outside autograd and outside torch.compile (which packs the plain weights itself).
A packed copy does not follow its weight: whoever packs rebuilds it on a change.
"""

from __future__ import annotations

import functools
import os
from typing import Any

import torch
import torch.nn.functional as F

from specops.core import native
from specops.core.types import ONEDNN_MIN_WORK

AMX_ENV = "SPECOPS_AMX"  # "0": our dot-product kernel even where this CPU has AMX tiles
PACK_ROWS_HINT = 1  # the row count oneDNN picks the packed layout for: decoding passes are a few rows
CHECK_ROWS = 3  # rows of the one product each packed weight is checked on against F.linear


def pack(weight: torch.Tensor, ours: bool = True, on_tiles: bool | None = None) -> torch.Tensor | None:
    """`weight` [out, in] packed for `linear`, or None where F.linear stays (not bf16 on a CPU, or not above
    ONEDNN_MIN_WORK elements): for our kernel where it runs (`native_kernel`; `ours` False: never, an A/B of
    the kernels) and the weight's shape fits it (out a multiple of 16, in even), on its AMX tiles where
    `on_tiles` (None: this process's choice, `tiles()`; True only where the CPU has them), else in oneDNN's
    layout, or None there too where oneDNN does not run bf16 (AVX-512; torch.backends.mkldnn enabled) or its
    product differs from F.linear's on a check."""
    if (weight.dtype != torch.bfloat16 or weight.device.type != "cpu" or weight.dim() != 2
            or weight.shape[0] * weight.shape[1] <= ONEDNN_MIN_WORK):
        return None
    weight = weight.detach().contiguous()
    kernel = native_kernel()
    if ours and kernel is not None and weight.shape[0] % 16 == 0 and weight.shape[1] % 2 == 0:
        return kernel.pack_linear(weight, tiles() if on_tiles is None else on_tiles and kernel.amx_supported())
    if (not torch.backends.mkldnn.is_available() or not torch.backends.mkldnn.enabled
            or not torch.ops.mkldnn._is_mkldnn_bf16_supported()):
        return None
    packed = torch.ops.mkldnn._reorder_linear_weight(weight, PACK_ROWS_HINT)
    probe = torch.randn(CHECK_ROWS, weight.shape[1], generator=torch.Generator().manual_seed(0)).to(weight.dtype)
    with torch.no_grad():
        agrees = torch.equal(_packed_product(probe, packed), F.linear(probe, weight))
    return packed if agrees else None


def native_kernel() -> Any:
    """The extension, where it runs our kernel: built (specops.core.native) on a CPU with AVX-512 bf16."""
    built = native.extension()
    return built if built is not None and built.linear_supported() else None


@functools.cache
def tiles() -> bool:
    """Whether our kernel runs on AMX tiles in this process (the CPU has them and SPECOPS_AMX is not "0"): one
    choice for every weight, as a row must round alike in a pass of one row and in a prefill."""
    kernel = native_kernel()
    return kernel is not None and os.environ.get(AMX_ENV, "1") != "0" and kernel.amx_supported()


def _packed_product(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    if not packed.is_mkldnn:  # ours (pack_linear's plain tensor); oneDNN's packed weights are opaque
        return native_kernel().linear_packed(x, packed)
    return torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")


def linear(x: torch.Tensor, weight: torch.Tensor, packed: torch.Tensor | None) -> torch.Tensor:
    """x [..., in] @ weight.T: through `packed` (from `pack(weight)`) when there is one and neither autograd
    nor torch.compile is tracing, else F.linear; the same values either way for oneDNN's packing, rounded
    otherwise for ours."""
    tracked = torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)
    if packed is not None and not tracked and not torch.compiler.is_compiling():
        return _packed_product(x, packed)
    return F.linear(x, weight)
