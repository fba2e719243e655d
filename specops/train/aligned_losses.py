"""Losses and masks for training an aligned head, as pure tensor functions.

Shapes: B sequences, T positions, K stored teacher entries, N draft-vocabulary size, H hidden size.
Position t of the head reads the target's features at t and the token x_{t+1}, and predicts x_{t+2}.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def teacher_in_draft_vocab(topk_ids: torch.Tensor, topk_logprobs: torch.Tensor, target_to_draft: torch.Tensor
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """Map the target's top-K [..., K] into the draft vocabulary.

    target_to_draft [V] long gives each target id its draft id, or -1 outside the draft vocabulary.
    Returns (draft ids [..., K], probabilities [..., K]) renormalized over the entries inside the draft
    vocabulary, as EAGLE-3 renormalizes the target over it: the head can only ever propose those
    tokens. Entries outside get id 0 and probability 0; a row with none inside is all zeros.
    """
    draft_ids = target_to_draft[topk_ids]  # [..., K]
    inside = draft_ids >= 0
    probs = topk_logprobs.float().exp() * inside  # [..., K]
    total = probs.sum(-1, keepdim=True)
    return draft_ids.clamp_min(0), torch.where(total > 0, probs / total.clamp_min(1e-30), probs)


def soft_cross_entropy(logits: torch.Tensor, teacher_ids: torch.Tensor, teacher_probs: torch.Tensor,
                       mask: torch.Tensor) -> torch.Tensor:
    """Mean over masked positions of -sum_k p_k log softmax(logits)[id_k].

    logits [..., N], teacher_ids/probs [..., K], mask [...] bool. 0 (attached) when nothing is masked.
    """
    mask = mask & (teacher_probs.sum(-1) > 0)  # rows whose teacher mass lies outside the draft vocabulary teach nothing
    log_q = logits[mask].float().log_softmax(-1)  # [M, N]
    per_position = -(teacher_probs[mask] * log_q.gather(-1, teacher_ids[mask])).sum(-1)  # [M]
    return per_position.sum() / max(per_position.numel(), 1)


def feature_regression(predicted: torch.Tensor, target: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """SmoothL1 between features [..., H], averaged over H and then over masked positions (as EAGLE and
    GRIFFIN); the target is detached. 0 (attached) when nothing is masked."""
    per_position = F.smooth_l1_loss(predicted[mask].float(), target[mask].detach().float(), reduction="none").mean(-1)
    return per_position.sum() / max(per_position.numel(), 1)


def topk_hits(logits: torch.Tensor, labels: torch.Tensor, k: int) -> torch.Tensor:
    """[..., N] logits, [...] draft-vocabulary labels (-1: outside it) -> [...] bool: label among the top k."""
    top = logits.topk(min(k, logits.shape[-1]), dim=-1).indices  # [..., k]
    return (top == labels.unsqueeze(-1)).any(-1) & (labels >= 0)


def next_alignment(aligned: torch.Tensor, hits: torch.Tensor) -> torch.Tensor:
    """GRIFFIN's token-alignment mask, one unrolled step further: [B, T] bool x 2 -> [B, T] bool.

    Step j+1 at position t continues the draft that step j made at t-1, and it reads the true
    token x_{t+1} where a drafter would read its own draft. That matches inference only if x_{t+1}
    was among step j's top-k candidates at t-1 and the draft up to there was aligned too:
        A_0[t] = 1,   A_{j+1}[t] = A_j[t-1] and hit_j[t-1]   (A_{j+1}[0] = 0: no draft reaches it).
    So A_j[t] = AND_{i<j} hit_i[t-j+i]: the true token was in the top-k at every earlier step.
    (GRIFFIN's released trainer tests hit_j at t instead of t-1, i.e. the same target token one
    position later; we follow the chain that produced the input, which is what a draft tree holds.)
    """
    both = aligned & hits
    shifted = torch.zeros_like(both)
    shifted[..., 1:] = both[..., :-1]
    return shifted
