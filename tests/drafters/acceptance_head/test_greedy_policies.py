"""Every policy only changes how much is drafted: greedy output stays token-identical to the target's."""

from __future__ import annotations

import pytest
import torch

from specops.core.cost_model import CostModel
from specops.core.loop import GREEDY, SpeculativeGenerator
from specops.core.policies import (
    HEAD_POLICIES,
    POLICIES,
    FixedPolicy,
    GoodputPolicy,
    HeadGoodputPolicy,
    HeuristicPolicy,
    SpecDecPPPolicy,
)
from specops.drafters.acceptance_head import (
    HEAD_COMPONENT,
    AcceptanceHead,
    AcceptanceHeadConfig,
    acceptance_features,
)
from specops.drafters.draft_lm import DraftLMDrafter
from specops.drafters.prompt_lookup import PromptLookupDrafter
from specops.eval.benchmark import BenchConfig, run_benchmark
from specops.server.bundle import write_bundle
from specops.server.generator import generator_from_bundle
from specops.train.train_acceptance import TrainAcceptanceConfig, sequence_examples
from tests.core.test_greedy_equality import PROMPTS, reference
from tests.drafters.acceptance_head.conftest import random_head

# Cheap drafts, a flat target pass: the best k goes from 1 at low acceptance to the bound at full acceptance.
COST = CostModel(draft_token_s=0.05, verify_s=((1, 1.0), (16, 1.0)))
# For goodput_head, whose drafts at the random head's ~1/2 per token would stop near 3 tokens with COST.
CHEAP_DRAFTS = CostModel(draft_token_s=0.005, verify_s=((1, 1.0), (16, 1.0)))


def make_policy(name: str):
    # A random head predicts about 1/2 per token: at threshold 0.97 drafts end after ~5 of at most 8 tokens.
    return {"fixed": lambda: FixedPolicy(4), "heuristic": lambda: HeuristicPolicy(2),
            "specdecpp": lambda: SpecDecPPPolicy(8, threshold=0.97), "goodput": lambda: GoodputPolicy(8, COST),
            "goodput_head": lambda: HeadGoodputPolicy(8, CHEAP_DRAFTS)}[name]()


def make_drafters(target, draft_model, policy: str):
    """Chain drafters the policy applies to; with heads for specdecpp."""
    vocab = target.vocab_size
    drafters = {
        "draft-lm": DraftLMDrafter(draft_model, vocab, random_head(draft_model.config.hidden_size)),
        # The target drafting for itself: every draft is accepted, so lengths grow to their bounds.
        "self-draft": DraftLMDrafter(target.model, vocab, random_head(target.model.config.hidden_size, seed=1)),
    }
    if policy not in HEAD_POLICIES:
        drafters["prompt-lookup"] = PromptLookupDrafter(max_ngram=3)
    return drafters


@pytest.mark.parametrize("policy", list(POLICIES))
def test_every_policy_matches_target_greedy(target, draft_model, policy):
    """The greedy verifier only: the others' temperature-0 equality with variable lengths is the serving tests' job."""
    lengths: set[int] = set()
    for name, drafter in make_drafters(target, draft_model, policy).items():
        generator = SpeculativeGenerator(target, drafter, policy=make_policy(policy))
        for prompt in PROMPTS:
            for n in (1, 7, 40):
                result = generator.generate(prompt, n)
                assert result.token_ids == reference(target.model, prompt, n), (policy, name, prompt, n)
                lengths |= {drafted for drafted, _ in result.stats.per_step}
    # Each policy varied its lengths, beyond what a fixed k of 4 drafts (the budget only ever shortens a draft).
    assert policy == "fixed" or (max(lengths) > 4 and len(lengths - {0}) > 2)


def test_heuristic_restarts_on_every_request(target):
    """The schedule is per request, so a request's drafts do not depend on the ones before it."""
    generator = SpeculativeGenerator(target, DraftLMDrafter(target.model, target.vocab_size), policy=HeuristicPolicy(2))
    first = generator.generate(PROMPTS[2], 30).stats.per_step
    assert max(drafted for drafted, _ in first) > 2  # the self-draft is always accepted: k grew
    assert generator.generate(PROMPTS[2], 30).stats.per_step == first


def test_specdecpp_ends_drafts_early(target, draft_model):
    """A random head predicts about 1/2 per token, so at threshold 0.5 drafts end after one or two tokens."""
    drafter = DraftLMDrafter(draft_model, target.vocab_size, random_head(draft_model.config.hidden_size))
    generator = SpeculativeGenerator(target, drafter, policy=SpecDecPPPolicy(6, threshold=0.5))
    stats = generator.generate(PROMPTS[2], 40).stats
    assert stats.accepted == 0  # a random draft: one token per step, so the first 30 steps have budget for 6
    assert all(1 <= drafted < 6 for drafted, _ in stats.per_step[:30])


class RecordingHead(AcceptanceHead):
    """Records the features of every token it scores and never asks to stop."""

    def __init__(self, hidden_size: int) -> None:
        super().__init__(AcceptanceHeadConfig(hidden_size=hidden_size))
        self.seen: list[torch.Tensor] = []

    def accept_prob(self, hidden: torch.Tensor, logits: torch.Tensor, token: int) -> float:
        self.seen.append(acceptance_features(hidden[None], logits[None], torch.tensor([token]))[0])
        return 1.0


def test_head_features_match_the_training_path(target, draft_model):
    """The drafter scores each token from its cached state; training reads the features from one
    uncached pass over the whole sequence. They must agree up to float32 summation order."""
    head = RecordingHead(draft_model.config.hidden_size)
    drafter = DraftLMDrafter(draft_model, target.vocab_size, head)
    prompt = PROMPTS[2]
    with torch.inference_mode():
        drafter.propose(prompt[:10], 3, GREEDY, None)  # a stale cache to roll back, as in a real loop
        tokens = drafter.propose(prompt, 5, GREEDY, None, stop=lambda probs: False).tokens
        # The drafted tokens as a trace's response: training's argmax proposals are then these tokens.
        ids = torch.tensor(prompt + tokens)
        item = {"input_ids": ids, "loss_mask": torch.arange(len(ids)) >= len(prompt),
                "topk_ids": ids[:, None], "topk_logprobs": torch.zeros(len(ids), 1)}
        expected = sequence_examples(draft_model, item, TrainAcceptanceConfig(), torch.Generator()).features
    assert len(head.seen) == len(tokens) == len(expected) == 5
    torch.testing.assert_close(torch.stack(head.seen), expected, rtol=1e-4, atol=1e-5)


BENCH_PROMPTS = [[{"role": "user", "content": "w1 w2 w3 w1 w2 w3"}], [{"role": "user", "content": "w9 w8 w7"}]]


def test_bench_runs_policy_methods_losslessly(target, draft_dir, head_dir):
    methods = ["draft-lm@3", "draft-lm+heuristic", "draft-lm+specdecpp@5", "draft-lm+goodput", "prompt-lookup+goodput"]
    cfg = BenchConfig(n=2, max_new_tokens=12, drafters=methods, draft_model=str(draft_dir), hf_assisted=False,
                      acceptance_head=str(head_dir), stop_threshold=0.6)
    report = run_benchmark(target, BENCH_PROMPTS, cfg)
    for name in methods:
        assert report["methods"][name]["identical_to_ar"], name
    assert report["config"]["acceptance_head"] == str(head_dir)


def test_bundle_serves_its_policy_and_head(tmp_path, target, draft_dir, head_dir):
    serving = {"verifier": "greedy", "draft_tokens": 5, "policy": "specdecpp", "stop_threshold": 0.6}
    bundle = write_bundle(tmp_path / "bundle", drafter_dir=draft_dir, drafter_kind="draft-lm", serving=serving,
                          target_source="in-memory", target_dtype="float32", fingerprint=target.fingerprint,
                          metrics={}, extra_dirs={HEAD_COMPONENT: head_dir})
    text_generator = generator_from_bundle(bundle, target=target)
    policy = text_generator.policy
    assert isinstance(policy, SpecDecPPPolicy) and (policy.max_tokens, policy.threshold) == (5, 0.6)
    assert text_generator.drafter.head is not None
    result = text_generator.generator(GREEDY).generate(PROMPTS[2], 20)
    assert result.token_ids == reference(target.model, PROMPTS[2], 20)
