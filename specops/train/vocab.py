"""The reduced draft vocabulary of EAGLE-3 and FR-Spec: the most frequent response tokens of the traces.

A drafter that proposes only these N tokens runs its LM head on N rows instead of the target's whole
vocabulary; the verifiers stay lossless because the other tokens simply have draft probability 0.
"""

from __future__ import annotations

import torch

from specops.core.target import Target
from specops.data.traces import TraceShards


def draft_vocabulary(counts: torch.Tensor, size: int, always: set[int]) -> torch.Tensor:
    """The `size` most frequent token ids (ties: lower id first) including `always`, ascending [size]."""
    if size > counts.numel():
        raise ValueError(f"draft_vocab_size {size} exceeds the target's vocabulary ({counts.numel()}).")
    if len(always) > size:
        raise ValueError(f"draft_vocab_size {size} cannot hold the {len(always)} EOS tokens.")
    order = sorted(range(counts.numel()), key=lambda t: (t not in always, -int(counts[t]), t))
    return torch.tensor(sorted(order[:size]), dtype=torch.long)


def response_token_counts(shards: TraceShards, vocab_size: int) -> torch.Tensor:
    """How often each target id occurs as a response token (what the head learns to predict) [V]."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for item in (shards[i] for i in range(len(shards))):
        counts += torch.bincount(item["input_ids"][item["loss_mask"]], minlength=vocab_size)
    return counts


def target_to_draft(draft_to_target: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[V] long: each target id's draft id, or -1 outside the draft vocabulary (the inverse of draft_to_target [N])."""
    inverse = torch.full((vocab_size,), -1, dtype=torch.long)
    inverse[draft_to_target] = torch.arange(len(draft_to_target))
    return inverse


def frequent_vocabulary(shards: TraceShards, size: int, target: Target) -> tuple[torch.Tensor, float]:
    """The `size` most frequent response tokens of `shards` plus the target's EOS ids (ascending [size]),
    and the fraction of response tokens they cover."""
    counts = response_token_counts(shards, target.vocab_size)
    ids = draft_vocabulary(counts, size, target.eos_token_ids)
    return ids, float(counts[ids].sum() / counts.sum().clamp_min(1))
