"""How long one speculative step takes on this machine: the step-time model of SmartSpec's goodput.

SmartSpec (Liu et al., arXiv 2406.14066) picks the draft length from predicted step times. A step
that drafts k tokens costs k draft forwards plus one target pass over k + 1 tokens (the last
committed token and the draft). `measure_cost_model` times both at start-up; `CostModel` is plain
data so tests build one by hand.

A server that batches its passes (specops.core.batching) learns its costs while serving instead:
`PlaneFit` and `PassFit` follow what its passes take, and `StepCosts` is what SmartSpec's goodput under load needs
(specops.core.policies.batch_draft_length), from those fits or, until they exist, from the start-up model.
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


@dataclass
class PassFit:
    """The seconds of a pass as a line in its rows, fitted by least squares to the passes recorded so far,
    each weighted `decay` ** (passes recorded after it), so the fit follows roughly the last
    1 / (1 - decay) passes: cache lengths grow, and other work on the machine comes and goes.

    A line because on a CPU a pass reads every weight once whatever its rows (the intercept: a fixed cost
    per pass, which one more drafted token per sequence adds again when it costs a pass of its own) and
    computes each row's products (the slope, which makes long drafts expensive once a batch has many
    rows). The running sums are all it keeps."""

    decay: float = 0.98
    weight: float = 0.0  # decayed count of passes, then decayed sums of rows, seconds, rows**2, rows * seconds
    rows: float = 0.0
    seconds: float = 0.0
    rows2: float = 0.0
    rows_seconds: float = 0.0
    added: int = 0  # passes recorded (the decayed weight stops changing once it converges)

    def add(self, rows: int, seconds: float) -> None:
        self.added += 1
        d = self.decay
        self.weight = d * self.weight + 1.0
        self.rows = d * self.rows + rows
        self.seconds = d * self.seconds + seconds
        self.rows2 = d * self.rows2 + rows * rows
        self.rows_seconds = d * self.rows_seconds + rows * seconds

    def line(self, min_weight: float = 1.0) -> tuple[float, float] | None:
        """(intercept, slope): seconds = intercept + slope * rows; None before `min_weight` passes or while
        every pass had the same rows (no slope to see). Neither is negative: timing noise can tilt the line,
        but no pass takes less than no time, nor less for more rows."""
        if self.weight < min_weight:
            return None
        mean_rows, mean_s = self.rows / self.weight, self.seconds / self.weight
        spread = self.rows2 / self.weight - mean_rows**2
        if spread < 1e-6:
            return None
        slope = max(0.0, (self.rows_seconds / self.weight - mean_rows * mean_s) / spread)
        intercept = mean_s - slope * mean_rows
        if intercept < 0:  # through the origin instead
            return 0.0, self.rows_seconds / self.rows2
        return intercept, slope


@dataclass
class PlaneFit:
    """seconds = fixed + u_slope * u + v_slope * v, fitted by least squares with PassFit's decayed weights,
    v's slope leaning on a prior through a ridge of `prior_weight` (as many observations' worth of v = 1).

    A batcher fits two planes (specops.core.batching). A batched target pass: u its sequences, v its drafted
    rows (each sequence's rows past its last committed token). Two slopes, not a line in rows: a sequence
    that joins the batch brings a row and attention over its own cache, a drafted row only a row. A line
    in rows fitted while nobody drafted (rows equal sequences, 12-16 sequences coming and going) priced a
    drafted row at a whole sequence's cost, 1.7-2.5 ms at 16 users against 0.9-1.2 ms seen while they
    drafted (benchmarks/batched_serving.py, 2026-11-28), which kept the drafts off, so the fit never saw a
    drafted row again. While drafted rows are few, their slope leans on a
    prior (the start-up model's seconds per row, one sequence's passes of 1 to 40 rows) through a ridge of
    `prior_weight`; passes with drafts soon outweigh it, and once the drafts stop it returns to the prior as
    they decay, so drafts come back to be measured again.

    The wait between two batches, per sequence: u the share of the batch before it that ran the target
    (its sequences then stream, stop-check and verify; after a draft pass they only take a draft token),
    v the rows per sequence it verified, which the sequences check (and then draft again: a suffix front's
    walks). A line in v alone would charge any work done after every target pass to the drafted rows,
    since only target passes verify any. (On the serving data of 2026-11-28 the u slope came out 0: the
    sequences took as long after a draft pass as after a target pass, and the two fits priced alike.)"""

    decay: float = 0.98
    prior_weight: float = 10.0
    weight: float = 0.0  # decayed count of observations, then decayed sums of u, v, t and their products
    u: float = 0.0
    v: float = 0.0
    t: float = 0.0
    uu: float = 0.0
    uv: float = 0.0
    vv: float = 0.0
    ut: float = 0.0
    vt: float = 0.0
    added: int = 0

    def add(self, u: float, v: float, seconds: float) -> None:
        self.added += 1
        t, k = seconds, self.decay
        self.weight, self.u, self.v, self.t = k * self.weight + 1.0, k * self.u + u, k * self.v + v, k * self.t + t
        self.uu, self.uv, self.vv = k * self.uu + u * u, k * self.uv + u * v, k * self.vv + v * v
        self.ut, self.vt = k * self.ut + u * t, k * self.vt + v * t

    def coefficients(self, v_prior: float, min_weight: float = 1.0) -> tuple[float, float, float] | None:
        """(fixed, u_slope, v_slope) seconds; None before `min_weight` observations. The v slope is the ridge
        estimate toward `v_prior`; none is negative (noise can tilt the fit, but more work never takes less
        time)."""
        if self.weight < min_weight:
            return None
        w = self.weight
        ms, md, mt = self.u / w, self.v / w, self.t / w
        css, csd, cdd = self.uu - w * ms * ms, self.uv - w * ms * md, self.vv - w * md * md  # centred sums
        cst, cdt = self.ut - w * ms * mt, self.vt - w * md * mt
        css += 1e-9  # one u only (one batch size): its slope is then 0 and `fixed` holds its part
        cdd += self.prior_weight
        cdt += self.prior_weight * v_prior
        det = css * cdd - csd * csd
        u_slope, v_slope = (cst * cdd - csd * cdt) / det, (css * cdt - csd * cst) / det
        # A slope that noise tilts below 0 is 0, and the other is then fitted alone: the joint solution
        # had leant on the clamped one (the two are correlated when sequences that join the batch draft).
        if u_slope < 0:
            u_slope, v_slope = 0.0, max(0.0, cdt / cdd)
        elif v_slope < 0:
            u_slope, v_slope = max(0.0, cst / css), 0.0
        return max(0.0, mt - u_slope * ms - v_slope * md), u_slope, v_slope


@dataclass
class DecayedRatio:
    """sum(decay ** age * numerator) / sum(decay ** age * denominator) over the recorded pairs: a rate that
    follows roughly the last 1 / (1 - decay) records."""

    decay: float = 0.98
    numerator: float = 0.0
    denominator: float = 0.0
    added: int = 0  # pairs recorded

    def add(self, numerator: float, denominator: float) -> None:
        self.added += 1
        self.numerator = self.decay * self.numerator + numerator
        self.denominator = self.decay * self.denominator + denominator

    def value(self, min_denominator: float = 1.0) -> float | None:
        """None until the decayed denominator reaches `min_denominator`."""
        return self.numerator / self.denominator if self.denominator >= min_denominator else None


@dataclass(frozen=True)
class StepCosts:
    """What one step of a batch of sequences takes (SmartSpec under load: specops.core.policies.step_seconds)."""

    target: tuple[float, float]  # a target pass: (fixed seconds, seconds per drafted row)
    sequence_s: float = 0.0  # what a sequence adds to its target pass: its committed row, attention over its cache
    draft: tuple[float, float] = (0.0, 0.0)  # a batched draft-LM pass: (fixed seconds, seconds per row)
    draft_passes: float = 0.0  # batched draft passes per drafted token (1: a draft LM; 0: drafts on threads)
    # The waits between passes: the sequences' own work, one at a time under the GIL. A step's, drafting
    # nothing (every sequence's after its target pass: verifying, streaming), and one sequence's after each of
    # its draft passes (taking the draft token).
    gap_s: float = 0.0
    draft_gap_s: float = 0.0
    thread_token_s: float = 0.0  # a drafted token's seconds on a generation thread (start-up model only: the
    # batcher's observed costs hold it in gap_row_s, whose prior it is)
    gap_row_s: float = 0.0  # the wait per row a sequence's target pass verified: checking it, drafting again

    @classmethod
    def from_startup(cls, cost: CostModel, batched_drafts: bool) -> StepCosts:
        """The start-up model's: its target times (one sequence's passes) as a line, each row at its slope;
        a drafted token as one batched draft pass of its time, or as its time on a generation thread."""
        fit = PassFit(decay=1.0)
        for tokens, seconds in cost.verify_s:
            fit.add(tokens, seconds)
        fixed, per_row = fit.line() or (cost.verify_s[0][1], 0.0)  # one measured size: no slope
        if batched_drafts:
            return cls((fixed, per_row), per_row, (cost.draft_token_s, 0.0), draft_passes=1.0)
        return cls((fixed, per_row), per_row, thread_token_s=cost.draft_token_s)


def timing_ids(n: int) -> list[int]:
    """n token ids for timing passes: their values do not matter, and low ids exist in every vocabulary."""
    return [(i % 50) + 10 for i in range(n)]


def median_seconds(run: Callable[[], object], reset: Callable[[], object], repeats: int) -> float:
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
    other processes on a shared CPU add one-sided noise.
    """
    if context_tokens < 1 or repeats < 1:
        raise ValueError("context_tokens and repeats must be >= 1.")
    context = timing_ids(context_tokens)
    with torch.inference_mode():
        lm = CachedLM(target)
        lm.prefill(context)
        verify = tuple((n, median_seconds(lambda n=n: lm.forward(timing_ids(n)), lambda: lm.crop(context_tokens), repeats))
                       for n in sizes)
        draft_s = 0.0
        if drafter is not None:
            drafter.reset()
            draft_s = median_seconds(lambda: drafter.propose(context, 1, GREEDY, None), lambda: None, repeats)
            drafter.reset()
    return CostModel(draft_token_s=draft_s, verify_s=verify)
