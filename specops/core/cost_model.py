"""How long one speculative step takes on this machine: the step-time model of SmartSpec's goodput.

SmartSpec (Liu et al., arXiv 2406.14066) picks the draft length from predicted step times. A step
that drafts k tokens costs k draft forwards plus one target pass over k + 1 tokens (the last
committed token and the draft). `measure_cost_model` times both at start-up; `CostModel` is plain
data so tests build one by hand.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

from specops.core.drafter import Drafter
from specops.core.kv import CachedLM
from specops.core.loop import GREEDY

VERIFY_SIZES = (1, 2, 4, 8, 16)  # tokens per target pass to time; others are interpolated


@dataclass(frozen=True)
class CostModel:
    draft_token_s: float  # seconds of one draft forward that yields one token (0 for weightless drafters)
    verify_s: tuple[tuple[int, float], ...]  # (tokens in one target pass, seconds), ascending in tokens

    def __post_init__(self) -> None:
        sizes = [n for n, _ in self.verify_s]
        if not sizes or sizes != sorted(set(sizes)) or sizes[0] < 1:
            raise ValueError(f"verify_s needs distinct token counts >= 1 in ascending order, got {sizes}.")
        if self.draft_token_s < 0 or any(s < 0 for _, s in self.verify_s):
            raise ValueError("Cost model times must be >= 0.")

    def verify_time(self, tokens: int) -> float:
        """Seconds of a target pass over `tokens`, linear between measured sizes.

        Past the largest size it extrapolates the last segment's slope: there the pass is
        compute-bound and grows linearly with tokens. Below the smallest size, or with a single
        measured size, it is the first measured time.
        """
        points = self.verify_s
        if tokens <= points[0][0] or len(points) == 1:
            return points[0][1]
        for (n0, s0), (n1, s1) in zip(points[:-1], points[1:], strict=True):
            if tokens <= n1:
                return s0 + (s1 - s0) * (tokens - n0) / (n1 - n0)
        (n0, s0), (n1, s1) = points[-2], points[-1]
        slope = max(0.0, (s1 - s0) / (n1 - n0))  # timing noise can make the last segment fall; a pass never gets cheaper
        return s1 + slope * (tokens - n1)

    def step_time(self, k: int) -> float:
        """Seconds of one step drafting k tokens: k draft forwards, one target pass over k + 1 tokens."""
        return k * self.draft_token_s + self.verify_time(k + 1)


def _ids(n: int) -> list[int]:
    return [(i % 50) + 10 for i in range(n)]


def _median_s(run: Callable[[], object], reset: Callable[[], object], repeats: int) -> float:
    """Median seconds of `run` (after one warm-up run: allocator and kernel selection), `reset` after each."""
    run()
    reset()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
        reset()
    return statistics.median(times)


def measure_cost_model(target: PreTrainedModel, drafter: Drafter | None = None, context_tokens: int = 64,
                       sizes: tuple[int, ...] = VERIFY_SIZES, repeats: int = 5) -> CostModel:
    """Time the target's cached pass over each size in `sizes` and the drafter's step of one token,
    after a shared context.

    The drafter is timed through its own `propose`, so whatever one drafted token costs it (a reduced
    draft vocabulary, an acceptance head) is what gets measured. Medians of `repeats` runs, since
    other processes on a shared CPU add one-sided noise. The token ids do not matter for timing; low
    ids exist in every vocabulary.
    """
    if context_tokens < 1 or repeats < 1:
        raise ValueError("context_tokens and repeats must be >= 1.")
    context = _ids(context_tokens)
    with torch.inference_mode():
        lm = CachedLM(target)
        lm.prefill(context)
        verify = tuple((n, _median_s(lambda n=n: lm.forward(_ids(n)), lambda: lm.crop(context_tokens), repeats))
                       for n in sizes)
        draft_s = 0.0
        if drafter is not None:
            drafter.reset()
            draft_s = _median_s(lambda: drafter.propose(context, 1, GREEDY, None), lambda: None, repeats)
            drafter.reset()
    return CostModel(draft_token_s=draft_s, verify_s=verify)
