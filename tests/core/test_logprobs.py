"""Logprobs are the target's own: each emitted token's log-probability read off the verification pass
row that emitted it. On the static runtime those rows are bitwise plain decoding's, so speculative
logprobs are bitwise plain decoding's too, greedy and sampled, in fp32 and bf16. Mutant that must
fail: rows shifted by one position (an off-by-one in which row scores which token)."""

from __future__ import annotations

import math

import pytest
import torch

from specops.core import loop
from specops.core.loop import GenerationRequestError, SpeculativeGenerator, prompt_logprobs
from specops.core.sampling import token_logprobs
from specops.core.target import target_from_model
from specops.core.types import SamplingParams
from specops.drafters.draft_lm import DraftLMDrafter
from specops.drafters.prompt_lookup import PromptLookupDrafter
from tests.conftest import tiny_llama, tiny_tokenizer

WIDTH = 4
PROMPTS = [[5, 17, 33, 17, 33, 40, 17, 33], list(range(10, 40)), [7, 7, 7, 7]]
SAMPLED = SamplingParams(temperature=0.9, top_p=0.95)


def reference(logits: list[float], token: int) -> float:
    """log softmax by hand, in float64."""
    top = max(logits)
    return logits[token] - top - math.log(sum(math.exp(x - top) for x in logits))


def test_token_logprobs_is_log_softmax():
    torch.manual_seed(0)
    logits = torch.randn(3, 11)
    entries = token_logprobs(logits, [4, 0, 10], top=3)
    for row, entry in zip(logits.double().tolist(), entries, strict=True):
        assert entry.logprob == pytest.approx(reference(row, entry.token), abs=1e-6)
        ranked = sorted(range(11), key=lambda t: -row[t])[:3]
        assert [t for t, _ in entry.top] == ranked
        assert [lp for _, lp in entry.top] == pytest.approx([reference(row, t) for t in ranked], abs=1e-6)
    assert all(e.top == () for e in token_logprobs(logits, [1, 2, 3]))


def logprobs_of(generator: SpeculativeGenerator, prompt: list[int], sampling: SamplingParams, top: int = 3):
    result = generator.generate(prompt, 20, sampling, seed=11, logprobs=top)
    assert result.logprobs is not None and len(result.logprobs) == len(result.token_ids)
    assert [e.token for e in result.logprobs] == result.token_ids
    return result.token_ids, [(e.logprob, e.top) for e in result.logprobs]


def speculation_matches_plain(dtype: torch.dtype) -> list[bool]:
    """For each drafter x verifier x prompt: are speculative logprobs (and tokens) plain decoding's?"""
    target = target_from_model(tiny_llama(0, dtype=dtype, hidden=64), tiny_tokenizer(), "t")
    draft = tiny_llama(1, layers=1, hidden=32, dtype=dtype)
    plain = SpeculativeGenerator(target, None, "greedy", 0, static_width=WIDTH)
    plain_sampled = SpeculativeGenerator(target, None, "coupled", 0, static_width=WIDTH)
    same, accepted = [], 0
    for drafter in (PromptLookupDrafter(3), DraftLMDrafter(draft, target.vocab_size)):
        for verifier, sampling, reference_run in (("greedy", SamplingParams(), plain),
                                                  ("coupled", SAMPLED, plain_sampled)):
            generator = SpeculativeGenerator(target, drafter, verifier, 3, static_width=WIDTH)
            for prompt in PROMPTS:
                accepted += generator.generate(prompt, 20, sampling, seed=11).stats.accepted
                same.append(logprobs_of(generator, prompt, sampling) == logprobs_of(reference_run, prompt, sampling))
    assert accepted > 20  # multi-row verification passes did emit tokens
    return same


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_speculative_logprobs_are_bitwise_plain_decodings(dtype):
    assert all(speculation_matches_plain(dtype))


def test_rows_shifted_by_one_differ(monkeypatch):
    """The mutant: score each emitted token with the row after the right one."""
    monkeypatch.setattr(loop, "token_logprobs", lambda rows, tokens, top: token_logprobs(rows.roll(-1, 0), tokens, top))
    assert not all(speculation_matches_plain(torch.float32))


def test_greedy_tokens_are_the_top_alternative(target):
    generator = SpeculativeGenerator(target, PromptLookupDrafter(3), "greedy", 3)
    result = generator.generate(PROMPTS[0], 12, logprobs=2)
    assert result.logprobs is not None
    for entry in result.logprobs:
        assert entry.top[0][0] == entry.token and entry.top[0][1] == entry.logprob
        assert entry.top[0][1] >= entry.top[1][1]


def test_prompt_logprobs_match_a_full_forward(target):
    prompt = list(range(10, 40))
    with torch.inference_mode():
        logits = target.model(torch.tensor([prompt])).logits[0, :-1].double()
    expected = [reference(row, token) for row, token in zip(logits.tolist(), prompt[1:], strict=True)]
    entries = prompt_logprobs(target, prompt, top=1)
    assert [e.token for e in entries] == prompt[1:]
    assert [e.logprob for e in entries] == pytest.approx(expected, abs=1e-4)


def test_negative_logprobs_are_refused(target):
    with pytest.raises(GenerationRequestError, match="logprobs must be >= 0"):
        SpeculativeGenerator(target).generate([1, 2, 3], 2, logprobs=-1)
