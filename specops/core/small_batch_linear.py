"""Faster float32 linear layers on a CPU for the passes speculative decoding makes: 1 to a few rows.

A decoder step at batch 1 reads every weight once for very little arithmetic, so on a CPU its time
is the time to stream the weights from memory. `F.linear` (x @ W^T, MKL sgemm) streams them well
for one row, but for 2 to 5 rows it takes a path that costs about one pass over W per row: with
torch 2.13's MKL on this repo's 2-core AVX-512 machine, SmolLM2-135M's target pass over 2 tokens
took 62 ms and over 3 tokens 77 ms, against 38 ms for one token and 55 ms for four
(benchmarks/linear_kernels.py; with these layers: 33, 51, 59 and 54 ms, and `generate` 1.2x faster). That is exactly the pass that verifies a draft,
and it made drafting 1 to 2 tokens a loss whatever the acceptance.

The same products in other layouts take other MKL kernels:
  1 row        x @ W^T computed as x @ Wt, from a transposed contiguous copy Wt of W;
  2..MAX rows  (W @ x^T)^T, which reads W once for all rows;
  more         F.linear, which is best once the product is compute-bound (prompt prefill).
These are the same sums in another order, so results match F.linear to float rounding (tests check
1e-5), not bit for bit; greedy decoding stays identical to `generate` on the same model, which uses
these layers too, so every method in a benchmark runs on the same kernels.

The copy Wt costs the weights' memory once more. It is rebuilt when the weight changes (its version
counter), and the fast paths run only without autograd, so training never sees them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

MAX_ROWS = 4  # benchmarks/results/linear_kernels.json: at 5 and 6 rows (W @ x^T)^T lost to F.linear


class SmallBatchLinear(nn.Module):
    """An nn.Linear replacement sharing the original's parameters (tied weights stay tied)."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        self.weight = linear.weight
        self.bias = linear.bias
        self._transposed: torch.Tensor | None = None
        self._transposed_key: tuple[int, int] | None = None

    def transposed_weight(self) -> torch.Tensor:
        key = (self.weight.data_ptr(), self.weight._version)
        if self._transposed is None or key != self._transposed_key:
            self._transposed = self.weight.detach().t().contiguous()
            self._transposed_key = key
        return self._transposed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // self.in_features
        if (torch.is_grad_enabled() or rows > MAX_ROWS or x.device.type != "cpu" or x.dtype != torch.float32
                or self.weight.dtype != torch.float32):
            return F.linear(x, self.weight, self.bias)
        flat = x.reshape(rows, self.in_features)
        out = flat @ self.transposed_weight() if rows == 1 else (self.weight @ flat.T).T
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def use_small_batch_linear(model: nn.Module) -> int:
    """Swap every nn.Linear of `model` for a SmallBatchLinear in place; returns how many were swapped."""
    swaps = [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
             if type(child) is nn.Linear]
    for parent, name, child in swaps:
        setattr(parent, name, SmallBatchLinear(child))
    return len(swaps)
