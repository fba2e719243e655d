"""Fit a LinearRouter (logistic regression) on mined examples and sweep its acceptance threshold.

Label 1 means accepting the draft there costs quality (an important mismatch, a better target step).
The serving rule accepts when P(label 1) < threshold, so for each threshold the sweep reports what
share of all cases, of the harmless ones and of the harmful ones would be accepted.
"""

from __future__ import annotations

import hashlib
import math
from typing import Any

import torch

from specops.lossy.router import LinearRouter, RouterConfig


def fit_router(features: torch.Tensor, labels: torch.Tensor, config: RouterConfig, l2: float = 1.0,
               max_iter: int = 200) -> LinearRouter:
    """features [n, D], labels [n] in {0, 1} -> a router fitted by L-BFGS on class-balanced BCE + l2 |w|^2 / n.

    Balanced because harmful cases are usually the rare class, and missing them is what costs quality.
    With one class only, the weights stay 0 and P = (positives + 0.5) / (n + 1), the smoothed base rate:
    there is nothing to separate, and a diverging bias would only hide that.
    """
    if features.ndim != 2 or features.shape[0] != labels.shape[0] or features.shape[0] == 0:
        raise ValueError(f"Need features [n, D] and labels [n] with n >= 1, got {tuple(features.shape)} and "
                         f"{tuple(labels.shape)}.")
    x, y = features.float(), labels.float()
    router = LinearRouter(config)
    with torch.no_grad():
        router.mean.copy_(x.mean(0))
        router.scale.copy_(x.std(0, unbiased=False).clamp_min(1e-6))  # constant features stay at 0
        router.linear.weight.zero_()
        positives, n = float(y.sum()), y.shape[0]
        router.linear.bias.fill_(math.log((positives + 0.5) / (n - positives + 0.5)))
    if 0 < positives < n:
        pos_weight = torch.tensor((n - positives) / positives)
        params = list(router.linear.parameters())
        optimizer = torch.optim.LBFGS(params, max_iter=max_iter, line_search_fn="strong_wolfe")

        def closure() -> torch.Tensor:
            optimizer.zero_grad()
            loss = torch.nn.functional.binary_cross_entropy_with_logits(router.logits(x), y, pos_weight=pos_weight)
            loss = loss + l2 * router.linear.weight.pow(2).sum() / n
            loss.backward()
            return loss

        optimizer.step(closure)
    return router.eval()


def threshold_sweep(probs: torch.Tensor, labels: torch.Tensor, thresholds: list[float]) -> list[dict[str, Any]]:
    """Per threshold: accepted share of all cases, of harmless (label 0) and of harmful (label 1) ones.
    A share over an empty class is None."""
    harmful = labels.bool()
    rows = []
    for t in thresholds:
        accepted = probs < t

        def share(mask: torch.Tensor, accepted: torch.Tensor = accepted) -> float | None:
            return round(float(accepted[mask].float().mean()), 4) if bool(mask.any()) else None

        rows.append({"threshold": t, "accepted": share(torch.ones_like(harmful)),
                     "accepted_harmless": share(~harmful), "accepted_harmful": share(harmful)})
    return rows


def choose_threshold(sweep: list[dict[str, Any]], max_harmful_accept: float) -> float:
    """The largest threshold accepting at most max_harmful_accept of the harmful cases; 0 (lossless)
    when none qualifies or nothing harmful was seen to measure the risk on."""
    ok = [row["threshold"] for row in sweep
          if row["accepted_harmful"] is not None and row["accepted_harmful"] <= max_harmful_accept]
    return max(ok, default=0.0)


def in_holdout(group: str, fraction: float) -> bool:
    """Deterministic split by group (a prompt id): all examples of one prompt land on the same side,
    so the sweep measures prompts the router never saw."""
    return int(hashlib.sha256(group.encode()).hexdigest()[:8], 16) / 16**8 < fraction
