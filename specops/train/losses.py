"""Distillation losses between a student's logits and the teacher's stored top-k log-probabilities.

Every loss takes student_logits [B, T, V], topk_ids [B, T, K], topk_logprobs [B, T, K] and a mask
[B, T], and returns the mean divergence over the masked positions (a scalar; 0 when nothing is masked).

Top-k truncation. Both distributions are compared over K + 1 outcomes: the teacher's K tokens and one
bucket for "any other token":

    p = [exp(topk_logprobs), 1 - sum]                 the teacher; its log-probs come from the full softmax,
                                                      so the mass of its tail is known exactly
    q = [softmax(student_logits)[topk_ids], 1 - sum]  the student's full softmax, gathered on the support

Why this and not a renormalization:
  * renormalizing the student on the teacher's support would let it put mass outside the top-k for
    free, and every such token is a likely rejection at verification;
  * renormalizing the teacher would throw its real tail mass away and push the student's tail to 0.
Merging outcomes can only shrink a divergence (data-processing inequality), so each loss is a lower
bound of its full-vocabulary value, equal to it when K = V; it is 0 exactly when the student matches
the teacher on the K tokens and on the tail mass. So `tvd` is a lower bound of 1 - the acceptance rate.

Numerics: computed in float32 (or float64 if given). The teacher's buckets are floored at TAIL_FLOOR
so reverse KL stays finite when rounding leaves its tail at 0; the student's tail is floored only
(its top-k entries keep their gradient however small they are).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

TAIL_FLOOR = 1e-6  # above the fp32 rounding noise of 1 - (sum of K probabilities), so noise never sets a tail
Loss = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def _with_tail(log_top: torch.Tensor) -> torch.Tensor:
    """[M, K] log-probs of K outcomes -> [M, K+1] normalized log-probs, the last being 'any other token'."""
    tail = (1 - log_top.exp().sum(-1, keepdim=True)).clamp_min(TAIL_FLOOR)  # [M, 1]
    log_buckets = torch.cat([log_top, tail.log()], dim=-1)  # [M, K+1]
    return log_buckets - log_buckets.logsumexp(-1, keepdim=True)


def bucket_logprobs(student_logits: torch.Tensor, topk_ids: torch.Tensor, topk_logprobs: torch.Tensor,
                    mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(log p, log q), each [M, K+1], at the M masked positions (see the module docstring)."""
    mask = mask.bool()
    dtype = torch.promote_types(student_logits.dtype, torch.float32)
    logits = student_logits[mask].to(dtype)  # [M, V]; selecting first keeps the softmax off padding
    log_q_top = logits.gather(-1, topk_ids[mask]) - logits.logsumexp(-1, keepdim=True)  # [M, K]
    log_p_top = topk_logprobs[mask].to(dtype).clamp_min(math.log(TAIL_FLOOR))  # [M, K]
    return _with_tail(log_p_top).detach(), _with_tail(log_q_top)


def _kl(log_a: torch.Tensor, log_b: torch.Tensor) -> torch.Tensor:
    """KL(a || b) per row: [M, K+1] x 2 -> [M]."""
    return (log_a.exp() * (log_a - log_b)).sum(-1)


def _mean(per_position: torch.Tensor) -> torch.Tensor:
    """[M] -> scalar mean; 0 (still attached to the graph) when M = 0."""
    return per_position.sum() / max(per_position.numel(), 1)


def forward_kl(student_logits: torch.Tensor, topk_ids: torch.Tensor, topk_logprobs: torch.Tensor,
               mask: torch.Tensor) -> torch.Tensor:
    """KL(teacher || student): mass-covering, the usual distillation loss."""
    log_p, log_q = bucket_logprobs(student_logits, topk_ids, topk_logprobs, mask)
    return _mean(_kl(log_p, log_q))


def reverse_kl(student_logits: torch.Tensor, topk_ids: torch.Tensor, topk_logprobs: torch.Tensor,
               mask: torch.Tensor) -> torch.Tensor:
    """KL(student || teacher): mode-seeking; a small student concentrates on the teacher's top tokens."""
    log_p, log_q = bucket_logprobs(student_logits, topk_ids, topk_logprobs, mask)
    return _mean(_kl(log_q, log_p))


def jsd(student_logits: torch.Tensor, topk_ids: torch.Tensor, topk_logprobs: torch.Tensor,
        mask: torch.Tensor) -> torch.Tensor:
    """Jensen-Shannon divergence, symmetric and bounded by log 2."""
    log_p, log_q = bucket_logprobs(student_logits, topk_ids, topk_logprobs, mask)
    log_m = torch.logaddexp(log_p, log_q) - math.log(2)  # [M, K+1], the mixture (p + q) / 2
    return _mean(0.5 * _kl(log_p, log_m) + 0.5 * _kl(log_q, log_m))


def tvd(student_logits: torch.Tensor, topk_ids: torch.Tensor, topk_logprobs: torch.Tensor,
        mask: torch.Tensor) -> torch.Tensor:
    """Total variation distance in [0, 1]; over full distributions, 1 - TVD is speculative sampling's acceptance rate."""
    log_p, log_q = bucket_logprobs(student_logits, topk_ids, topk_logprobs, mask)
    return _mean(0.5 * (log_p.exp() - log_q.exp()).abs().sum(-1))


LOSSES: dict[str, Loss] = {"forward_kl": forward_kl, "reverse_kl": reverse_kl, "jsd": jsd, "tvd": tvd}
