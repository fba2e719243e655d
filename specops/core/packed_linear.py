"""bf16 matrix products on weights packed once into oneDNN's layout: F.linear's sums, twice as fast here.

Eager bf16 `F.linear` on a CPU hands oneDNN the weight in torch's row-major layout, and oneDNN reorders
it into its own blocked layout on every call, so a decoding pass, whose products are a few rows against
every weight, streams each weight twice and writes it once more. Reordering once, when the weights are
loaded (what inductor's `freezing` does for a compiled graph), leaves one read per pass. SmolLM2-135M's
30 layers and LM head, 2 threads on this repo's 2-core CPU (one-off timing, 20 runs): 15.4 ms a pass
over 1 to 5 rows through F.linear, 6.4-7.7 ms packed; 8 rows 17.3 against 8.4; 40 rows 28.8 against 17.8.

It is the same oneDNN kernel, so the same sums in the same order: the output equals F.linear's bit for
bit at any row count wherever F.linear itself runs on oneDNN, which for a CPU bf16 product is when
rows x out x in exceeds 16**3 (`types.ONEDNN_MIN_WORK`), so for a weight with out x in above it at every
row count (checked on this CPU for every pair of 12 sizes from 16 to 1536, 1 to 130 rows, 1 and 2
threads; tests/core/test_packed_linear.py checks the model shapes the tests use). Smaller weights are
left to F.linear. So eager logits still equal transformers' forward bitwise, and a row's result still
does not depend on the other rows of its pass (specops.core.batching).

Packed weights are a second copy (oneDNN's opaque tensors, counted by specops.core.memory), made only for
bf16 on a CPU with oneDNN, and used only outside autograd and outside torch.compile (which packs the
plain weights itself). A packed copy does not follow its weight: whoever packs rebuilds it on a change.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from specops.core.types import ONEDNN_MIN_WORK

PACK_ROWS_HINT = 1  # the row count oneDNN picks the packed layout for: decoding passes are a few rows


def pack(weight: torch.Tensor) -> torch.Tensor | None:
    """`weight` [out, in] in oneDNN's layout for `linear`, or None where F.linear stays (not bf16 on a CPU
    with oneDNN, or too small for F.linear to run on oneDNN at every row count)."""
    if (weight.dtype != torch.bfloat16 or weight.device.type != "cpu" or weight.dim() != 2
            or not torch.backends.mkldnn.is_available() or weight.shape[0] * weight.shape[1] <= ONEDNN_MIN_WORK):
        return None
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), PACK_ROWS_HINT)


def linear(x: torch.Tensor, weight: torch.Tensor, packed: torch.Tensor | None) -> torch.Tensor:
    """x [..., in] @ weight.T: through `packed` (from `pack(weight)`) when there is one and neither autograd
    nor torch.compile is tracing, else F.linear; the same values either way."""
    tracked = torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)
    if packed is not None and not tracked and not torch.compiler.is_compiling():
        return torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
    return F.linear(x, weight)
