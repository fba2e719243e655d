"""Verification rules: pure functions over tensors. The loop owns model calls and cache positions.

Chain rules share one signature:
    rule(draft [k] long, q [k, V] | None, p [k+1, V], generator) -> (n_accepted, next_token)
Row i of q is the draft distribution that X_{i+1} was drawn from; row i of p is the target's
distribution after the prefix and X_1..X_i (so p has one extra row for the bonus token).
q = None means the drafter is deterministic: q is the one-hot of each drafted token.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from specops.core.sampling import PositionNoise, Randomness, argmax, draw, sample

ChainRule = Callable[[torch.Tensor, torch.Tensor | None, torch.Tensor, Randomness], tuple[int, int]]


def _draft_probs(draft: torch.Tensor, q: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    """q as a dense [k, V] tensor; one-hot rows when the drafter gave no probabilities."""
    if q is not None:
        return q.to(like.dtype)
    return torch.zeros(draft.shape[0], like.shape[-1], dtype=like.dtype).scatter_(1, draft[:, None], 1.0)


def _sample_positive_part(scaled_p: torch.Tensor, q_row: torch.Tensor, fallback: torch.Tensor,
                          generator: torch.Generator | None) -> int:
    """Sample from norm(max(scaled_p - q, 0)); if that mass is zero (p == q), the residual is undefined
    and the event has probability zero, so any valid choice keeps the rule exact: use `fallback`."""
    residual = (scaled_p - q_row).clamp_min(0)
    total = residual.sum()
    return sample(residual / total if total > 0 else fallback, generator)


def verify_greedy(draft: torch.Tensor, q: torch.Tensor | None, p: torch.Tensor,
                  generator: torch.Generator | None = None) -> tuple[int, int]:
    """Accept while the draft equals the target's argmax. p may be logits or probabilities."""
    target = argmax(p)  # [k+1]
    matches = (draft == target[:-1]).long()
    n = int(matches.cumprod(0).sum())
    return n, int(target[n])


def verify_rejection(draft: torch.Tensor, q: torch.Tensor | None, p: torch.Tensor,
                     generator: torch.Generator | None = None) -> tuple[int, int]:
    """Token-wise speculative sampling (Leviathan et al. 2023, Chen et al. 2023).

    Accept X_i with probability min(1, p(X_i)/q(X_i)); at the first rejection resample from
    norm(max(p - q, 0)); when all k are accepted, draw a bonus token from p's last row.
    """
    k = draft.shape[0]
    q_dense = _draft_probs(draft, q, p)
    rows = torch.arange(k)
    ratio = p[rows, draft] / q_dense[rows, draft]  # [k]
    u = torch.rand(k, generator=generator, dtype=p.dtype)
    accepted = (u < ratio).long()  # P(u < r) = min(1, r) for u ~ U[0, 1)
    n = int(accepted.cumprod(0).sum())
    if n == k:
        return n, sample(p[k], generator)
    return n, _sample_positive_part(p[n], q_dense[n], p[n], generator)


def verify_block(draft: torch.Tensor, q: torch.Tensor | None, p: torch.Tensor,
                 generator: torch.Generator | None = None) -> tuple[int, int]:
    """Block verification (Sun et al. 2024, arXiv 2403.10444, Algorithm 2).

    With P[j] = p(.|X_<=j), Q[j] = q(.|X_<=j) (0-based rows, j = tokens already in the draft):
      1. w_0 = 1; w_i = min(1, w_{i-1} * P[i-1](X_i) / Q[i-1](X_i))            (the paper's p_i)
      2. h_i = Z_i / (Z_i + 1 - w_i), Z_i = sum_x max(w_i P[i](x) - Q[i](x), 0)  for 1 <= i < k;  h_k = w_k
      3. tau = the last i in 0..k with eta_i <= h_i (h_0 = 1, so tau >= 0)
      4. emit X_1..X_tau, then Y ~ P[k] if tau = k else norm(max(w_tau P[tau] - Q[tau], 0))
    Note Z_i uses the *next* rows P[i], Q[i] (the distributions after X_i), not P[i-1].
    """
    k = draft.shape[0]
    q_dense = _draft_probs(draft, q, p)
    rows = torch.arange(k)
    ratio = p[rows, draft] / q_dense[rows, draft]  # [k]
    w = torch.ones(k + 1, dtype=p.dtype)
    for i in range(1, k + 1):
        w[i] = torch.clamp(w[i - 1] * ratio[i - 1], max=1.0)
    h = block_continue_probs(w, p, q_dense)
    eta = torch.rand(k, generator=generator, dtype=p.dtype)
    passed = torch.nonzero(eta <= h[1:]).flatten()
    tau = int(passed[-1]) + 1 if passed.numel() else 0
    if tau == k:
        return tau, sample(p[k], generator)
    return tau, _sample_positive_part(w[tau] * p[tau], q_dense[tau], p[tau], generator)


def block_continue_probs(w: torch.Tensor, p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Block verification's h [k+1] from w [k+1], p [k+1, V] and dense q [k, V] (steps 2 of verify_block):
    h_0 = 1, h_i = Z_i / (Z_i + 1 - w_i) with Z_i = sum_x max(w_i P[i](x) - Q[i](x), 0) for 0 < i < k, h_k = w_k."""
    k = q.shape[0]
    h = torch.ones(k + 1, dtype=p.dtype)
    if k > 1:
        z = (w[1:k, None] * p[1:k] - q[1:k]).clamp_min(0).sum(-1)  # [k-1]
        denom = z + 1 - w[1:k]
        # denom == 0 only when w_i = 1 and P[i] = Q[i]: nothing can be lost by continuing, so h_i = 1.
        h[1:k] = torch.where(denom > 0, z / denom.clamp_min(torch.finfo(p.dtype).tiny), torch.ones_like(z))
    if k > 0:
        h[k] = w[k]
    return h


def verify_coupled(draft: torch.Tensor, q: torch.Tensor | None, p: torch.Tensor,
                   generator: Randomness = None) -> tuple[int, int]:
    """Coupled verification: the target draws each position t as argmax(log p_t + g_t) with the noise
    keyed by t (specops.core.sampling.PositionNoise, row 0 = the first drafted position), and drafts
    are accepted while they equal those draws. The emitted tokens are exactly plain coupled decoding's,
    whatever was drafted, so q is not needed; each is an exact draw from p (Gumbel-max)."""
    if not isinstance(generator, PositionNoise):
        raise TypeError("Coupled verification draws with PositionNoise, not a generator stream.")
    k = draft.shape[0]
    target = (p.to(torch.float64).log() + generator.rows(k + 1)).argmax(-1)  # [k+1]: the target's draws
    n = int((draft == target[:-1]).long().cumprod(0).sum())
    return n, int(target[n])


VERIFIERS: dict[str, ChainRule] = {
    "greedy": verify_greedy,
    "rejection": verify_rejection,
    "block": verify_block,
    "coupled": verify_coupled,
}


def verify_tree(tokens: torch.Tensor, parents: list[int], p: torch.Tensor, greedy: bool,
                generator: Randomness = None) -> tuple[list[int], int]:
    """Walk a tree of deterministic drafts (one-hot q per candidate).

    tokens [n], parents[i] in -1..i-1 (-1 = the last committed token), p [n+1, V] with row 0 for the
    root and row i+1 for node i. At each node draw y from p (argmax when greedy) and descend into
    the child whose token is y. With one-hot candidates this equals recursive rejection sampling
    over siblings without replacement (RSD, arXiv 2402.14160): y ~ p exactly, so it is lossless.
    Returns (accepted node indices along the path, next token).
    """
    children: dict[int, dict[int, int]] = {}
    for node, (token, parent) in enumerate(zip(tokens.tolist(), parents, strict=True)):
        children.setdefault(parent, {}).setdefault(token, node)  # first sibling wins on duplicates
    path: list[int] = []
    current = -1
    while True:
        row = p[current + 1]
        y = int(argmax(row)) if greedy else draw(row, generator, len(path))  # coupled: the noise at this depth
        child = children.get(current, {}).get(y)
        if child is None:
            return path, y
        path.append(child)
        current = child
