"""Arbitrage serving: threshold 0 (always the target) is the target's greedy output; a router that never
escalates gives the draft's greedy output without one target pass; the oracle decision is wired the same way."""

from __future__ import annotations

import pytest
import torch

from specops.lossy.arbitrage import ArbitrageGenerator, RouterDecision, boundary_ids
from specops.lossy.greedy_lm import GreedyLM
from specops.lossy.router import LinearRouter
from specops.train.mine_arbitrage import OracleDecision, StepOracle
from tests.lossy.conftest import DELIMITER

PROMPTS = [[5, 17, 33, 17, 33, 40], [9, 9, 9, 9], list(range(10, 40)), [7]]
EOS = 2


def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, attention_mask=None)
    return out[0, len(prompt):].tolist()


@pytest.fixture(scope="module")
def router(router_dir) -> LinearRouter:
    return LinearRouter.load(router_dir / "arbitrage", kind="arbitrage")


@pytest.fixture(scope="module")
def boundaries(tokenizer) -> frozenset[int]:
    return boundary_ids(tokenizer, DELIMITER)


def test_boundary_ids_are_the_tokens_containing_the_delimiter(tokenizer, boundaries):
    expected = {tokenizer.convert_tokens_to_ids(w) for w in ["w1"] + [f"w1{i}" for i in range(10)]}
    assert boundaries == expected


@pytest.mark.parametrize("max_step_tokens", [1, 3, 32])
def test_always_target_equals_target_greedy(target, draft_model, router, boundaries, max_step_tokens):
    generator = ArbitrageGenerator(target, draft_model, RouterDecision(router, 0.0), boundaries, max_step_tokens)
    for prompt in PROMPTS:
        for n in (1, 9, 40):
            result = generator.generate(prompt, n)
            assert result.token_ids == hf_greedy(target.model, prompt, n), (prompt, n, max_step_tokens)
            stats = result.stats
            assert stats.lossy and stats.lossy_mode == "arbitrage" and stats.lossy_threshold == 0.0
            assert stats.lossy_accepted == 0 and stats.steps >= 1


def test_never_escalating_gives_the_draft_greedy_output_without_the_target(target, draft_model, router, boundaries):
    generator = ArbitrageGenerator(target, draft_model, RouterDecision(router, 2.0), boundaries, 5)
    for prompt in PROMPTS:
        stream = generator.stream(prompt, 30)
        chunks = list(stream)
        assert stream.generation.token_ids == hf_greedy(draft_model, prompt, 30)
        assert stream.generation.stats.steps == 0  # verification-free: no target pass after the prefill
        assert stream.generation.stats.lossy_accepted == len(chunks)
        for chunk in chunks[:-1]:  # every step but the last ends at a boundary or at the step cap
            assert chunk[-1] in boundaries or len(chunk) == 5


def test_mixed_routing_commits_whole_draft_or_target_steps(target, draft_model, router, boundaries):
    """A random router escalates some steps: each committed step is exactly the draft's or the target's."""
    generator = ArbitrageGenerator(target, draft_model, RouterDecision(router, 0.5), boundaries, 6)
    draft, oracle_target = GreedyLM(draft_model), GreedyLM(target.model)
    stop = boundaries | {EOS}
    kinds = set()
    for prompt in PROMPTS:
        context = list(prompt)
        stream = generator.stream(prompt, 40)
        for chunk in stream:
            limit = min(6, 40 - (len(context) - len(prompt)))
            drafted = draft.greedy(context, limit, stop).tokens
            targeted = oracle_target.greedy(context, limit, stop).tokens
            assert chunk in (drafted, targeted)
            kinds.add("draft" if chunk == drafted else "target")
            context += chunk
    assert kinds == {"draft", "target"}  # the router really mixed them


def test_oracle_decision_keeps_or_escalates_by_the_scorer(target, draft_model, boundaries):
    """A stub scorer: with a margin no advantage can exceed, every draft step is kept; with a margin every
    step exceeds (advantages lie in [-1, 1] > -2), the target writes every step."""
    score = lambda reply, reference: float(sum(reply) % 2)  # noqa: E731

    def run(margin: float, prompt: list[int]) -> list[int]:
        oracle = StepOracle(GreedyLM(target.model), boundaries, {EOS}, 30, 6, margin)
        decision = OracleDecision(oracle)
        decision.start(prompt, score, hf_greedy(target.model, prompt, 30))
        return ArbitrageGenerator(target, draft_model, decision, boundaries, 6).generate(prompt, 30).token_ids

    for prompt in PROMPTS[:2]:
        assert run(2.0, prompt) == hf_greedy(draft_model, prompt, 30)
        assert run(-2.0, prompt) == hf_greedy(target.model, prompt, 30)
