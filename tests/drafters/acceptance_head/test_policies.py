"""Draft length policies on their own: exact stop points, k schedules and goodput choices by hand."""

from __future__ import annotations

import pytest
import torch

from specops.cli import build_parser
from specops.core.cost_model import CostModel
from specops.core.loop import GREEDY, SpeculativeGenerator
from specops.core.policies import (
    POLICIES,
    GoodputPolicy,
    HeadGoodputPolicy,
    HeuristicPolicy,
    SpecDecPPPolicy,
    best_draft_length,
    expected_tokens,
    prefix_goodput,
    rejection_probability,
)
from specops.drafters.acceptance_head import AcceptanceHead, AcceptanceHeadConfig
from specops.drafters.draft_lm import DraftLMDrafter
from specops.drafters.factory import build_policy
from specops.drafters.kinds import DecodingConfig, MethodSpec
from specops.drafters.prompt_lookup import PromptLookupDrafter
from specops.drafters.recycling import RecyclingDrafter
from tests.core.test_greedy_equality import reference

CONTEXT = [5, 17, 33, 17, 33, 40]


class ScriptedHead(AcceptanceHead):
    """Returns the given acceptance probabilities, one per drafted token, in order."""

    def __init__(self, hidden_size: int, outputs: list[float]) -> None:
        super().__init__(AcceptanceHeadConfig(hidden_size=hidden_size))
        self.outputs = list(outputs)

    def accept_prob(self, hidden: torch.Tensor, logits: torch.Tensor, token: int) -> float:
        return self.outputs.pop(0)


def test_rejection_probability_crosses_the_threshold_strictly():
    # Powers of 1/2 are exact in binary, so the equality case is really tested.
    assert rejection_probability([0.5, 0.5]) == 0.75
    policy = SpecDecPPPolicy(max_tokens=8, threshold=0.75)
    assert [policy.should_stop([0.5] * n) for n in (1, 2, 3)] == [False, False, True]
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        SpecDecPPPolicy(max_tokens=4, threshold=1.5)


# P(accept) 0.9, 0.8, 0.7, 0.6, 0.9, 0.9 -> P(some rejection) 0.1, 0.28, 0.496, 0.6976, 0.7278, 0.7550.
SCRIPT = [0.9, 0.8, 0.7, 0.6, 0.9, 0.9]


@pytest.mark.parametrize(("threshold", "expected"), [(0.05, 1), (0.25, 2), (0.5, 4), (0.7, 5), (0.75, 6), (0.99, 6)])
def test_drafter_stops_after_the_token_that_crosses_the_threshold(draft_model, target, threshold, expected):
    hidden = draft_model.config.hidden_size
    full = reference(draft_model, CONTEXT, 6)  # the draft LM's own greedy continuation
    drafter = DraftLMDrafter(draft_model, target.vocab_size, head=ScriptedHead(hidden, SCRIPT))
    with torch.inference_mode():
        draft = drafter.propose(CONTEXT, 6, GREEDY, None, stop=SpecDecPPPolicy(6, threshold).stop)
    assert len(draft.tokens) == expected and draft.tokens == full[:expected]  # stopping only truncates the draft


def test_a_stop_policy_needs_a_drafter_with_a_head(target, draft_model):
    policy = SpecDecPPPolicy(4, 0.5)
    for drafter in (DraftLMDrafter(draft_model, target.vocab_size), PromptLookupDrafter(3), None):
        with pytest.raises(ValueError, match="acceptance head"):
            SpeculativeGenerator(target, drafter, policy=policy)
    with pytest.raises(ValueError, match="needs an acceptance head"):
        DraftLMDrafter(draft_model, target.vocab_size).propose(CONTEXT, 2, GREEDY, None, stop=policy.stop)


def test_heuristic_follows_hf_schedule():
    policy = HeuristicPolicy(start=4)
    ks = []
    for drafted, accepted in [(4, 4), (6, 6), (8, 3), (7, 0), (0, 0), (6, 5), (5, 0), (4, 0), (3, 1), (2, 0), (1, 0)]:
        policy.update(drafted, accepted)
        ks.append(policy.draft_length())
    # +2 on a fully accepted draft, -1 otherwise, floor 1; an empty draft (no budget) changes nothing.
    assert ks == [6, 8, 7, 6, 6, 5, 4, 3, 2, 1, 1]
    policy.reset()
    assert policy.draft_length() == 4


# Draft forward 1 s; target pass 10 s up to 4 tokens, then +2.5 s per token (20 s at 8).
COST = CostModel(draft_token_s=1.0, verify_s=((1, 10.0), (2, 10.0), (4, 10.0), (8, 20.0)))


def test_cost_model_interpolates_and_extrapolates():
    assert [COST.verify_time(n) for n in (1, 3, 5, 8, 9, 16)] == [10.0, 10.0, 12.5, 20.0, 22.5, 40.0]
    assert COST.step_time(3) == 3.0 + 10.0
    with pytest.raises(ValueError, match="ascending"):
        CostModel(draft_token_s=1.0, verify_s=((4, 1.0), (2, 1.0)))


def test_goodput_picks_the_hand_computed_k():
    # acceptance 0.8: expected tokens (1 - 0.8^(k+1)) / 0.2 over step time k + verify(k + 1):
    #   k=1: 1.8 / 11 = 0.164   k=2: 2.44 / 12 = 0.203   k=3: 2.952 / 13 = 0.227   k=4: 3.362 / 16.5 = 0.204
    assert expected_tokens(0.8, 3) == pytest.approx(2.952)
    assert best_draft_length(0.8, COST, max_tokens=8) == 3
    assert best_draft_length(0.8, COST, max_tokens=2) == 2  # the bound
    assert best_draft_length(0.2, COST, max_tokens=8) == 1  # k=1: 1.2 / 11 = 0.109 > k=2: 1.24 / 12 = 0.103
    assert best_draft_length(1.0, CostModel(0.0, ((1, 1.0),)), max_tokens=5) == 5  # free drafts, all accepted


def test_goodput_tracks_the_acceptance_rate():
    policy = GoodputPolicy(8, COST, prior_acceptance=0.6, prior_tokens=4.0, decay=0.95)
    assert policy.acceptance == pytest.approx(0.6)
    policy.update(4, 2)  # 2 accepted, then 1 rejection
    assert policy.acceptance == pytest.approx((0.95 * 2.4 + 2) / (0.95 * 4 + 3))
    policy.update(3, 3)  # all accepted: no rejection observed
    assert policy.acceptance == pytest.approx((0.95 * 4.28 + 3) / (0.95 * 6.8 + 3))
    policy.update(0, 0)
    assert policy.acceptance == pytest.approx(7.066 / 9.46)
    assert GoodputPolicy(8, COST, prior_acceptance=0.8).draft_length() == 3


# Draft forward 1 s; the target pass 10 s for 1 token, 15 s for 2 to 4, +2.5 s per token after.
STEEP = CostModel(draft_token_s=1.0, verify_s=((1, 10.0), (2, 15.0), (4, 15.0), (8, 25.0)))


def test_prefix_goodput_is_expected_tokens_over_step_time():
    # Two tokens drafted (2 s) with P(accept) 0.5 then 0.8: verifying j commits 1, 1.5, 1.9 tokens.
    assert prefix_goodput([0.5, 0.8], STEEP, drafted=2) == pytest.approx([1 / 12, 1.5 / 17, 1.9 / 17])


@pytest.mark.parametrize(("probs", "keep"), [
    ([0.2], 0),  # 1 / 11 = 0.091 beats 1.2 / 16 = 0.075: do not verify a token this unlikely
    ([0.9], 1),  # 1.9 / 16 = 0.119 beats 1 / 11 = 0.091
    ([0.9, 0.9, 0.9, 0.05], 3),  # the fourth needs a 5-token pass: 3.472 / 21.5 = 0.161 < 3.439 / 19 = 0.181
    ([0.9, 0.9, 0.9, 0.9], 4),  # at 0.9 the 5-token pass pays: 4.095 / 21.5 = 0.190 > 0.181
])
def test_goodput_head_verifies_the_best_prefix(probs, keep):
    goodputs = prefix_goodput(probs, STEEP, len(probs))
    assert HeadGoodputPolicy(8, STEEP).best_prefix(probs) == keep == goodputs.index(max(goodputs))


def test_goodput_head_stops_when_one_more_token_would_not_pay():
    policy = HeadGoodputPolicy(8, STEEP)
    # After [0.9, 0.9] a third token at 0.9 adds 0.729 tokens and 1 s of draft (same 15 s pass): go on.
    assert not policy.should_stop([0.9, 0.9])
    # After [0.9, 0.9, 0.9, 0.9] a fifth needs a 6-token pass (20 s): 4.686 / 25 = 0.187 < 4.095 / 21.5 = 0.190.
    assert policy.should_stop([0.9, 0.9, 0.9, 0.9])
    assert policy.should_stop([0.1])  # two tokens at 0.1: 1 / 12 at best, against 1 / 11 now


def test_goodput_head_can_verify_nothing_and_stays_exact(draft_model, target):
    """A step whose first drafted token scores low verifies no draft: a plain decoding step."""
    hidden = draft_model.config.hidden_size
    head = ScriptedHead(hidden, [0.05, 0.95, 0.95, 0.95] * 40)
    drafter = DraftLMDrafter(draft_model, target.vocab_size, head=head)
    generator = SpeculativeGenerator(target, drafter, policy=HeadGoodputPolicy(4, STEEP))
    result = generator.generate(CONTEXT, 12)
    assert result.token_ids == reference(target.model, CONTEXT, 12)
    assert result.stats.per_step[0][0] == 0  # P(accept) 0.05: verified alone
    assert any(drafted > 0 for drafted, _ in result.stats.per_step)


def test_cli_and_factory_accept_exactly_the_policies(target, draft_model):
    parser = build_parser()
    for name in POLICIES:
        assert parser.parse_args(["generate", "--prompt", "x", "--policy", name]).policy == name
    with pytest.raises(SystemExit):
        parser.parse_args(["generate", "--prompt", "x", "--policy", "oracle"])
    with pytest.raises(ValueError, match="Unknown policy 'oracle'"):
        build_policy(DecodingConfig(policy="oracle"), target, None)
    with pytest.raises(ValueError, match="not of the 'recycling' drafter"):
        build_policy(DecodingConfig(drafter="recycling", policy="heuristic"), target, RecyclingDrafter(target.vocab_size))
    for name in ("specdecpp", "goodput_head"):
        with pytest.raises(ValueError, match="acceptance head"):
            build_policy(DecodingConfig(drafter="draft-lm", policy=name), target,
                         DraftLMDrafter(draft_model, target.vocab_size))


def test_method_spec_keeps_sizes_and_adds_policies():
    spec = MethodSpec.parse("draft-lm@4")
    config = spec.decoding(DecodingConfig(verifier="greedy", draft_tokens=6))
    assert (spec.kind, config.policy, config.draft_tokens) == ("draft-lm", "fixed", 4)
    assert MethodSpec.parse("recycling@16").decoding().recycling_nodes == 16
    assert MethodSpec.parse("draft-lm-tree@8").decoding().tree_nodes == 8
    config = MethodSpec.parse("draft-lm+specdecpp@8").decoding()
    assert (config.drafter, config.policy, config.draft_tokens) == ("draft-lm", "specdecpp", 8)
    config = MethodSpec.parse("prompt-lookup+goodput").decoding(DecodingConfig(draft_tokens=5))
    assert (config.drafter, config.policy, config.draft_tokens) == ("prompt-lookup", "goodput", 5)
    for text in ("draft-lm+specdecpp@8", "recycling@16", "none", "prompt-lookup+goodput"):
        assert str(MethodSpec.parse(text)) == text
    for bad, message in [("draft-lm+oracle", "policy after \\+"), ("draft-lm+@4", "policy after \\+"),
                         ("recycling+heuristic", "apply to"), ("none+goodput", "apply to"),
                         ("hybrid+specdecpp", "apply to"), ("aligned_head_tree+goodput", "apply to"),
                         ("draft-lm+goodput@x", "positive integer"), ("draft-lm@0", "positive integer"),
                         ("medusa+goodput", "Unknown method")]:
        with pytest.raises(ValueError, match=message):
            MethodSpec.parse(bad)
