"""The step-time model SmartSpec weighs under load, against plain references: the decayed pass fit against
numpy's weighted least squares, the decayed ratio against its sums, and the out-of-phase rounds of
`step_seconds` against an enumeration of every phase the batch's sequences can be in."""

from __future__ import annotations

import itertools
import random
from dataclasses import replace

import numpy as np
import pytest

from specops.core.cost_model import CostModel, DecayedRatio, PassFit, PlaneFit, StepCosts
from specops.core.policies import batch_draft_length, expected_tokens, step_seconds


def reference_line(passes: list[tuple[int, float]], decay: float) -> tuple[float, float]:
    """Weighted least squares, pass i weighted decay ** (passes after it); numpy weights residuals by w,
    so w is the square root of the weight."""
    rows, seconds = np.array(passes, dtype=float).T
    weights = decay ** np.arange(len(passes) - 1, -1, -1)
    slope, intercept = np.polyfit(rows, seconds, 1, w=np.sqrt(weights))
    return float(intercept), float(slope)


def test_the_fit_is_decayed_weighted_least_squares():
    rng = random.Random(0)
    passes = [(rows, 0.02 + 0.0006 * rows + rng.uniform(-0.002, 0.002)) for rows in
              (rng.randint(1, 80) for _ in range(200))]
    fit = PassFit(decay=0.97)
    for rows, seconds in passes:
        fit.add(rows, seconds)
    assert fit.line() == pytest.approx(reference_line(passes, 0.97), rel=1e-6)


def test_the_fit_follows_recent_passes():
    """Passes that got four times as expensive per row: the decayed fit moves to the new slope; an undecayed
    one (the control) stays in between."""
    old = [(rows, 0.02 + 0.0005 * rows) for rows in range(1, 41)] * 5
    new = [(rows, 0.02 + 0.002 * rows) for rows in range(1, 41)] * 5
    decayed, undecayed = PassFit(decay=0.97), PassFit(decay=1.0)
    for rows, seconds in old + new:
        decayed.add(rows, seconds)
        undecayed.add(rows, seconds)
    assert decayed.line() == pytest.approx((0.02, 0.002), rel=1e-2)  # 0.97 ** 200 of the old passes left
    assert undecayed.line()[1] == pytest.approx(0.00125, rel=1e-3)


def test_the_fit_waits_for_enough_passes_of_more_than_one_size():
    fit = PassFit()
    for _ in range(50):
        fit.add(8, 0.03)
    assert fit.line(10) is None  # one row count: no slope to see
    fit.add(16, 0.04)
    assert fit.line(100) is None  # too few passes
    assert fit.line(10) is not None


def test_the_fit_never_goes_negative():
    falling = PassFit(decay=1.0)  # noise that makes more rows look cheaper: flat instead
    for rows, seconds in ((4, 0.030), (8, 0.029), (16, 0.028)):
        falling.add(rows, seconds)
    assert falling.line() == pytest.approx((0.029, 0.0))
    steep = PassFit(decay=1.0)  # a line that would cross zero above no rows: through the origin instead
    for rows, seconds in ((10, 0.001), (20, 0.030)):
        steep.add(rows, seconds)
    intercept, slope = steep.line()
    assert intercept == 0.0 and slope == pytest.approx((10 * 0.001 + 20 * 0.030) / (10**2 + 20**2))


def test_a_wait_slope_returns_to_its_prior_once_drafts_stop():
    """Waits that grew 4 ms a verified row, then waits after batches that verified none: with the ridge the
    slope is back near its prior (0) within 300 batches, so free drafts are tried again; without it (the
    control) it stays at 4 ms, since waits at 0 rows say nothing of the slope, which held drafts off."""
    ridge, plain = PlaneFit(), PlaneFit(prior_weight=0.0)
    for i in range(100):
        for fit in (ridge, plain):
            fit.add(1.0, i % 5, 0.001 + 0.004 * (i % 5))
    for _ in range(300):
        for fit in (ridge, plain):
            fit.add(1.0, 0.0, 0.001)
    assert ridge.coefficients(0.0)[2] < 0.0005
    assert plain.coefficients(0.0)[2] == pytest.approx(0.004)


def test_the_wait_after_a_draft_pass_is_told_apart_from_a_verified_row():
    """Sequences that take 1 ms after each target pass (streaming, stop checks) whatever it verified, and
    0.2 ms after a draft pass: verified rows cost nothing. Fitted on the share of the batch that ran the
    target and the rows it verified, the rows' slope is ~0; the control, a line in the verified rows alone
    (the wait fit before), charges the per-step work to them, ~0.2 ms a row, which held drafts off."""
    plane, line = PlaneFit(), PassFit()
    for i in range(300):
        target, rows = (1.0, 1 + i % 4) if i % 3 == 0 else (0.0, 0)  # a draft LM: k draft passes a step
        wait = 0.0002 + 0.0008 * target
        plane.add(target, rows, wait)
        line.add(rows, wait)
    assert plane.coefficients(0.0) == pytest.approx((0.0002, 0.0008, 0.0), abs=1e-6)
    assert line.line()[1] > 0.0002


def reference_plane(passes: list[tuple[int, int, float]], decay: float, row_prior: float, prior_weight: float
                    ) -> tuple[float, float, float]:
    """Weighted least squares of seconds on (1, sequences, drafted rows), with the drafted rows' ridge toward
    `row_prior` (and PlaneFit's tiny one on the sequences' slope) as extra rows of the system."""
    sequences, rows, seconds = np.array(passes, dtype=float).T
    root = np.sqrt(decay ** np.arange(len(passes) - 1, -1, -1))
    design = np.stack([np.ones_like(sequences), sequences, rows - sequences], 1) * root[:, None]
    design = np.vstack([design, [0.0, np.sqrt(1e-9), 0.0], [0.0, 0.0, np.sqrt(prior_weight)]])
    target = np.concatenate([seconds * root, [0.0, np.sqrt(prior_weight) * row_prior]])
    return tuple(float(x) for x in np.linalg.lstsq(design, target, rcond=None)[0])


def test_the_batch_fit_is_ridge_weighted_least_squares():
    rng = random.Random(1)
    passes = []
    for _ in range(300):
        sequences, drafted = rng.randint(1, 16), rng.randint(0, 30)
        passes.append((sequences, sequences + drafted,
                       0.015 + 0.0012 * sequences + 0.0008 * drafted + rng.uniform(-0.002, 0.002)))
    fit = PlaneFit(decay=0.97, prior_weight=10.0)
    for sequences, rows, seconds in passes:
        fit.add(sequences, rows - sequences, seconds)
    assert fit.coefficients(0.0005) == pytest.approx(reference_plane(passes, 0.97, 0.0005, 10.0), rel=1e-6)
    assert fit.coefficients(0.0005, min_weight=100) is None  # ~33 passes' decayed weight


def test_a_slope_below_zero_leaves_the_other_fitted_alone():
    """Sequences that join the batch drafting (drafted rows rise with them) and passes that got cheaper with
    more sequences: the joint fit puts the sequences' slope below 0; clamped, the drafted rows' slope is the
    ridge fit of seconds on drafted rows alone (numpy), not the joint solution's, which leant on the other."""
    passes = [(s, s + 3 * s + s % 3, 0.02 - 0.0008 * s + 0.0011 * (3 * s + s % 3)) for s in range(2, 14)] * 3
    fit = PlaneFit(decay=1.0, prior_weight=10.0)
    for sequences, rows, seconds in passes:
        fit.add(sequences, rows - sequences, seconds)
    _, per_sequence, per_row = fit.coefficients(0.0005)
    sequences, rows, seconds = np.array(passes, dtype=float).T
    design = np.vstack([np.stack([np.ones_like(rows), rows - sequences], 1), [0.0, np.sqrt(10.0)]])
    alone = np.linalg.lstsq(design, np.concatenate([seconds, [np.sqrt(10.0) * 0.0005]]), rcond=None)[0]
    assert per_sequence == 0.0 and per_row == pytest.approx(alone[1], rel=1e-6)
    assert reference_plane(passes, 1.0, 0.0005, 10.0)[1] < 0  # the joint fit really went below 0


def test_a_drafted_row_is_priced_apart_from_a_sequence():
    """Passes without drafts, 10 to 16 sequences at 2 ms each: a line in rows prices a drafted row at 2 ms (the
    control: what kept drafts off for good), the batch fit at its prior. Passes with drafts at 0.9 ms a row
    then move it there; once the drafts stop, it returns to the prior as they decay."""
    def passes(fit: PlaneFit, line: PassFit, drafted: range, count: int) -> None:
        for i in range(count):
            sequences, extra = 10 + i % 7, drafted[i % len(drafted)]
            seconds = 0.015 + 0.002 * sequences + 0.0009 * extra
            fit.add(sequences, extra, seconds)
            line.add(sequences + extra, seconds)

    fit, line = PlaneFit(), PassFit()
    passes(fit, line, range(1), 200)
    assert line.line()[1] == pytest.approx(0.002)
    assert fit.coefficients(0.0006)[1:] == pytest.approx((0.002, 0.0006), rel=1e-3)
    passes(fit, line, range(0, 20, 3), 100)
    assert fit.coefficients(0.0006)[2] == pytest.approx(0.0009, rel=0.02)
    passes(fit, line, range(1), 800)
    assert fit.coefficients(0.0006)[2] == pytest.approx(0.0006, rel=0.02)


@pytest.mark.parametrize("k", range(5))
def test_a_sequence_is_paid_for_once_a_step(k):
    """Each sequence is in one target pass a step, whatever the rounds its draft passes add: a step of 8
    sequences costs 8 * the change in sequence_s more. Pricing it in the target pass's fixed part (paid in
    every round where any sequence verifies, nearly all of them) fails at k > 0."""
    costs = StepCosts((0.015, 0.0009), 0.002, (0.0015, 0.0001), draft_passes=1.0, gap_s=0.002)
    dearer = replace(costs, sequence_s=0.003)
    assert step_seconds(dearer, 8, k, 2) - step_seconds(costs, 8, k, 2) == pytest.approx(8 * 0.001)


def test_decayed_ratio_is_its_decayed_sums():
    pairs = [(3, 4), (0, 2), (5, 5), (1, 3)]
    ratio = DecayedRatio(decay=0.5)
    for numerator, denominator in pairs:
        ratio.add(numerator, denominator)
    weights = [0.5**3, 0.5**2, 0.5, 1.0]
    assert ratio.value() == pytest.approx(sum(w * n for w, (n, _) in zip(weights, pairs, strict=True))
                                          / sum(w * d for w, (_, d) in zip(weights, pairs, strict=True)))
    assert ratio.value(min_denominator=100) is None


def enumerated_step_seconds(costs: StepCosts, batch: int, k: int, cores: int) -> float:
    """`step_seconds` by brute force, for draft_passes 0 or 1: every assignment of the sequences to a phase of
    their step (phase 0 verifies, the others draft), equally likely; a round pays the gap, and each model's
    fixed seconds when any sequence runs a pass of it."""
    rounds = 1 + int(costs.draft_passes) * k
    fixed = 0.0
    for phases in itertools.product(range(rounds), repeat=batch):
        fixed += costs.target[0] * any(p == 0 for p in phases) + costs.draft[0] * any(p for p in phases)
    fixed *= rounds / rounds**batch  # the mean round, `rounds` times
    rows = batch * (costs.sequence_s + k * costs.target[1] + costs.draft_passes * k * costs.draft[1])
    waits = costs.gap_s + batch * k * (costs.gap_row_s + costs.draft_passes * costs.draft_gap_s)  # each sequence's
    return fixed + rows + k * costs.thread_token_s * max(1.0, batch / cores) + waits


COSTS = [StepCosts((0.020, 0.0006), 0.0012, (0.0015, 0.0001), draft_passes=1.0, gap_s=0.002,  # a batched draft LM
                   draft_gap_s=0.0003, gap_row_s=0.0001),
         StepCosts((0.020, 0.0001), 0.0001, (0.0005, 0.0), draft_passes=1.0),  # flat passes, cheap draft passes
         StepCosts((0.020, 0.0020), 0.0030, gap_s=0.004, thread_token_s=0.001),  # drafts on the threads, costly rows
         StepCosts((0.020, 0.0001), 0.0001, gap_s=0.004, gap_row_s=0.002)]  # free rows, each drafted one waited for


@pytest.mark.parametrize("costs", COSTS)
def test_step_seconds_is_the_mean_over_the_sequences_phases(costs):
    for batch, k in itertools.product((1, 2, 3, 4), range(5)):
        assert step_seconds(costs, batch, k, cores=2) == pytest.approx(enumerated_step_seconds(costs, batch, k, 2))


@pytest.mark.parametrize("costs", COSTS)
def test_the_draft_length_maximizes_the_enumerated_goodput(costs):
    for batch, acceptance in itertools.product((1, 2, 3, 4), (0.3, 0.6, 0.9)):
        goodputs = [batch * expected_tokens(acceptance, k) / enumerated_step_seconds(costs, batch, k, 2)
                    for k in range(5)]
        assert batch_draft_length(acceptance, costs, batch, 4, cores=2) == goodputs.index(max(goodputs))


def test_one_sequence_pays_its_draft_passes_and_one_target_pass():
    costs = COSTS[0]
    k = 3
    passes = k * (costs.draft[0] + costs.draft[1]) + costs.target[0] + costs.sequence_s + k * costs.target[1]
    waits = costs.gap_s + k * (costs.draft_gap_s + costs.gap_row_s)  # after its target pass, each draft pass, each row
    assert step_seconds(costs, 1, k, cores=2) == pytest.approx(passes + waits)


def test_the_startup_model_is_a_line_through_its_times():
    cost = CostModel(draft_token_s=0.004, verify_s=((1, 0.021), (4, 0.024), (16, 0.036)))
    batched = StepCosts.from_startup(cost, batched_drafts=True)
    assert batched.target == pytest.approx((0.020, 0.001)) and batched.sequence_s == pytest.approx(0.001)
    assert (batched.draft, batched.draft_passes, batched.thread_token_s) == ((0.004, 0.0), 1.0, 0.0)
    threads = StepCosts.from_startup(cost, batched_drafts=False)
    assert (threads.draft_passes, threads.thread_token_s) == (0.0, 0.004)
