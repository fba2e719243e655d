"""The miners' labels on a stub scorer equal those of plain reference implementations of the same searches
(HF generate for every rollout, full forward passes for every feature), so caching and bookkeeping are exact."""

from __future__ import annotations

import torch

from specops.lossy.arbitrage import boundary_ids, step_features
from specops.lossy.greedy_lm import GreedyLM
from specops.train.mine_arbitrage import StepOracle, mine_steps
from specops.train.mine_autojudge import mine_mismatches
from tests.lossy.conftest import DELIMITER

PROMPTS = [[5, 17, 33, 17, 33, 40], [9, 9, 9, 9], list(range(10, 40)), [7, 8]]
EOS = 2
MAX_NEW = 24


def stub_score(reply: list[int], reference: list[int]) -> float:
    """Changes with most token swaps, as a pass/fail scorer would with some."""
    return float(sum(reply) % 2)


def hf_greedy(model, prompt: list[int], n: int, stop: set[int] = frozenset({EOS})) -> list[int]:
    if n <= 0:
        return []
    out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, attention_mask=None,
                         eos_token_id=sorted(stop), pad_token_id=0)
    return out[0, len(prompt):].tolist()


def last_hidden(model, ids: list[int]) -> torch.Tensor:
    return model(torch.tensor([ids]), output_hidden_states=True).hidden_states[-1][0, -1]


@torch.inference_mode()
def reference_autojudge(prompt, target, draft, margin, budget):
    """AutoJudge's semi-greedy search, written plainly."""
    reference = hf_greedy(target, prompt, MAX_NEW)
    reply, base, found, position = list(reference), stub_score(reference, reference), [], 0
    while len(found) < budget:
        logits = draft(torch.tensor([prompt + reply])).logits[0]
        predicted = [int(logits[len(prompt) - 1 + i].argmax()) for i in range(len(reply))]
        j = next((i for i in range(position, len(reply)) if predicted[i] != reply[i]), None)
        if j is None:
            break
        swapped = reply[:j] + [predicted[j]]
        features = torch.cat([last_hidden(draft, prompt + reply[:j]), last_hidden(target, prompt + swapped)])
        if predicted[j] != EOS:
            swapped += hf_greedy(target, prompt + swapped, MAX_NEW - len(swapped))
        important = abs(stub_score(swapped, reference) - base) > margin
        found.append(((j, reply[j], predicted[j], important), features))
        reply = reply if important else swapped
        position = j + 1
    return reference, found


def test_autojudge_mining_labels_are_exact(target, draft_model):
    labels = set()
    for prompt in PROMPTS:
        reference, expected = reference_autojudge(prompt, target.model, draft_model, 0.5, budget=8)
        got = mine_mismatches(prompt, reference, GreedyLM(target.model), draft_model, stub_score, {EOS}, MAX_NEW,
                              0.5, max_rollouts=8)
        assert [(m.position, m.target_token, m.draft_token, m.important) for m in got] == [e for e, _ in expected]
        for m, (_, features) in zip(got, expected, strict=True):
            # Cached incremental passes vs one full pass: the same maths in another order, float32 rounding only.
            torch.testing.assert_close(m.features, features, atol=1e-4, rtol=1e-4)
        labels |= {m.important for m in got}
    assert labels == {True, False}  # the stub really exercised both branches of the search


def test_autojudge_mining_respects_the_budget(target, draft_model):
    reference = hf_greedy(target.model, PROMPTS[2], MAX_NEW)
    got = mine_mismatches(PROMPTS[2], reference, GreedyLM(target.model), draft_model, stub_score, {EOS}, MAX_NEW,
                          0.5, max_rollouts=2)
    assert len(got) == 2


@torch.inference_mode()
def reference_arbitrage(prompt, target, draft, stop, margin, max_step):
    """Arbitrage step labelling with the oracle's choice committed, written plainly (no budget)."""
    reference = hf_greedy(target, prompt, MAX_NEW)
    committed, pairs = [], []
    while len(committed) < MAX_NEW:
        limit = min(max_step, MAX_NEW - len(committed))
        context = prompt + committed
        drafted, targeted = hf_greedy(draft, context, limit, stop), hf_greedy(target, context, limit, stop)
        gain = 0.0
        if drafted != targeted:
            def complete(reply):
                done = reply[-1] == EOS or len(reply) >= MAX_NEW
                return reply if done else reply + hf_greedy(target, prompt + reply, MAX_NEW - len(reply))
            gain = (stub_score(complete(committed + targeted), reference)
                    - stub_score(complete(committed + drafted), reference))
        better = gain > margin
        logits = draft(torch.tensor([context + drafted]), output_hidden_states=True)
        rows = slice(len(context) - 1, len(context) + len(drafted) - 1)
        logprobs = logits.logits[0, rows].log_softmax(-1).max(-1).values
        features = step_features(logits.hidden_states[-1][0, rows], logprobs)
        pairs.append(((drafted, targeted, better), features))
        committed += targeted if better else drafted
        if committed[-1] == EOS:
            break
    return reference, pairs


def test_arbitrage_mining_labels_are_exact(target, draft_model, tokenizer):
    boundaries = boundary_ids(tokenizer, DELIMITER)
    labels = set()
    for prompt in PROMPTS:
        reference, expected = reference_arbitrage(prompt, target.model, draft_model, set(boundaries) | {EOS}, 0.5, 6)
        oracle = StepOracle(GreedyLM(target.model), boundaries, {EOS}, MAX_NEW, 6, 0.5)
        got = mine_steps(prompt, reference, GreedyLM(draft_model), oracle, stub_score, max_rollouts=1000)
        assert [(p.draft_step, p.target_step, p.target_better) for p in got] == [e for e, _ in expected]
        for p, (_, features) in zip(got, expected, strict=True):
            torch.testing.assert_close(p.features, features, atol=1e-4, rtol=1e-4)
        labels |= {p.target_better for p in got}
    assert labels == {True, False}
