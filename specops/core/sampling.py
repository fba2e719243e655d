"""Turn logits into the distribution we sample from. Applied identically to target (p) and draft (q)."""

from __future__ import annotations

import torch

from specops.core.types import SamplingParams


def logits_to_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """logits [..., V] -> probabilities [..., V] after temperature, top-k and top-p.

    Temperature 0 is the limit of the softmax: a one-hot at the argmax. Verification rules then
    reduce to greedy matching without a special case.
    """
    if params.greedy:
        return torch.zeros_like(logits).scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
    dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
    scores = logits.to(dtype) / params.temperature
    if params.top_k and params.top_k < scores.shape[-1]:
        kth = scores.topk(params.top_k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_scores, order = scores.sort(dim=-1, descending=True)
        sorted_probs = sorted_scores.softmax(-1)
        # Drop a token when the mass strictly before it already reaches top_p; the top token always stays.
        drop_sorted = (sorted_probs.cumsum(-1) - sorted_probs) >= params.top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        scores = scores.masked_fill(drop, float("-inf"))
    return scores.softmax(-1)


def expand_draft_vocab(logits: torch.Tensor, draft_to_target: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Draft-vocabulary logits [..., N] (column i is target id draft_to_target[i]) -> [..., vocab_size], -inf
    elsewhere: a drafter over a reduced vocabulary gives the other tokens probability 0, so q stays a
    distribution over the target's vocabulary and every verifier stays lossless."""
    full = logits.new_full((*logits.shape[:-1], vocab_size), float("-inf"))
    return full.index_copy(-1, draft_to_target, logits)


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """One token id from a distribution [V]."""
    return int(torch.multinomial(probs, 1, generator=generator))
