"""benchmarks/ceiling.py: the oracle drafter accepts what it is told to, stays lossless, and the grid is read right."""

from __future__ import annotations

import pytest

from benchmarks.ceiling import OracleDrafter, ceiling_grid, greedy_references, method_name, plot_ceiling
from specops.core.loop import SpeculativeGenerator
from specops.eval.benchmark import BenchConfig, run_benchmark_ids
from tests.conftest import VOCAB

PROMPTS = [[3, 10, 11, 12, 4], [3, 20, 21, 4]]
NEW = 24


@pytest.fixture(scope="module")
def references(target):
    return greedy_references(target, PROMPTS, NEW)


def generate(target, references, acceptance, k):
    generator = SpeculativeGenerator(target, OracleDrafter(references, acceptance, VOCAB), "greedy", k)
    return [generator.generate(ids, NEW) for ids in PROMPTS]


def test_references_continue_their_prompts(references):
    assert [r[:len(p)] for r, p in zip(references, PROMPTS, strict=True)] == PROMPTS
    assert all(len(r) > len(p) for r, p in zip(references, PROMPTS, strict=True))


@pytest.mark.parametrize("k", [1, 3])
def test_a_perfect_oracle_has_every_token_accepted(target, references, k):
    for result, reference, prompt in zip(generate(target, references, 1.0, k), references, PROMPTS, strict=True):
        assert result.token_ids == reference[len(prompt):]
        assert result.stats.drafted > 0 and result.stats.accepted == result.stats.drafted
        assert result.stats.steps <= -(-len(result.token_ids) // (k + 1)) + 1


def test_a_useless_oracle_has_nothing_accepted(target, references):
    for result, reference, prompt in zip(generate(target, references, 0.0, 3), references, PROMPTS, strict=True):
        assert result.token_ids == reference[len(prompt):]
        assert result.stats.drafted > 0 and result.stats.accepted == 0


def test_a_partial_oracle_accepts_a_fraction(target, references):
    results = generate(target, references, 0.5, 2)
    drafted = sum(r.stats.drafted for r in results)
    accepted = sum(r.stats.accepted for r in results)
    assert 0 < accepted < drafted


def test_unknown_context_gets_no_draft(references):
    assert OracleDrafter(references, 1.0, VOCAB).propose([5, 5, 5], 4, None, None).tokens == []


def test_acceptance_out_of_range_is_refused(references):
    with pytest.raises(ValueError, match="acceptance"):
        OracleDrafter(references, 1.5, VOCAB)


def test_grid_and_plot_from_a_benchmark(target, references, tmp_path):
    acceptances, ks = [1.0, 0.0], [1, 3]
    extra = {method_name(a, k): SpeculativeGenerator(target, OracleDrafter(references, a, VOCAB), "greedy", k)
             for a in acceptances for k in ks}
    cfg = BenchConfig(n=2, max_new_tokens=NEW, drafters=[], hf_assisted=False, hf_prompt_lookup_tokens=0)
    report = run_benchmark_ids(target, PROMPTS, cfg, extra=extra)
    grid = ceiling_grid(report, acceptances, ks)
    assert [(row["acceptance"], row["draft_tokens"]) for row in grid] == [(1.0, 1), (1.0, 3), (0.0, 1), (0.0, 3)]
    assert all(row["identical_to_ar"] for row in grid)
    by_cell = {(row["acceptance"], row["draft_tokens"]): row["mean_accepted_length"] for row in grid}
    assert by_cell[(0.0, 1)] == by_cell[(0.0, 3)] == 1.0
    assert by_cell[(1.0, 3)] > by_cell[(1.0, 1)] > 1.0
    plot_ceiling(grid, 1.8, tmp_path / "ceiling.png")
    assert (tmp_path / "ceiling.png").stat().st_size > 0
