"""Chunked prefill: a prompt longer than the chunk is fed in several passes, between which a cancelled
request stops. Plain and speculative decoding share the chunking, so on the static runtime speculative
output stays bitwise plain decoding's (bf16); in fp32 chunks match one pass up to kernel rounding.
Mutants that must fail: features of the last chunk alone, chunk rows that see later slots, and (checked
by hand on a copy of the tree) a loop that ignores the cancel callable."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from specops.core import loop
from specops.core.kv import CachedLM, StaticLM
from specops.core.llama import LlamaForward
from specops.core.loop import SpeculativeGenerator, prefill
from specops.core.target import target_from_model
from specops.core.verify import VERIFIERS
from specops.drafters.draft_lm import DraftLMDrafter
from specops.drafters.prompt_lookup import PromptLookupDrafter
from tests.conftest import tiny_llama, tiny_tokenizer
from tests.core.test_static_runtime import WIDTH, aligned

CHUNK = 8
PROMPT = [5, 17, 33, 17, 33, 40] * 4 + list(range(10, 40))  # 54 tokens: 7 chunks of at most CHUNK


def layers(model) -> list[int]:
    return list(range(model.config.num_hidden_layers))


def test_a_prompt_shorter_than_the_chunk_is_one_pass(target, monkeypatch):
    passes = []
    monkeypatch.setattr(CachedLM, "prefill", lambda self, ids: passes.append(len(ids)))
    prefill(CachedLM(target.model), PROMPT[:CHUNK], CHUNK)
    prefill(CachedLM(target.model), PROMPT, 0)
    prefill(CachedLM(target.model), PROMPT, CHUNK)
    assert passes == [CHUNK, len(PROMPT), *[CHUNK] * (len(PROMPT) // CHUNK), len(PROMPT) % CHUNK]


def test_bf16_chunked_speculation_is_bitwise_plain_decoding():
    model = tiny_llama(0, dtype=torch.bfloat16, hidden=64)
    target = target_from_model(model, tiny_tokenizer(), "t")
    draft = tiny_llama(1, layers=1, hidden=32, dtype=torch.bfloat16)
    plain = SpeculativeGenerator(target, None, "greedy", 0, static_width=WIDTH, prefill_chunk=CHUNK)
    drafters = {"prompt-lookup": PromptLookupDrafter(3), "draft-lm": DraftLMDrafter(draft, target.vocab_size),
                "aligned_head": aligned(model)}  # reads the prompt's features, gathered over the chunks
    expected = plain.generate(PROMPT, 24).token_ids
    for name, drafter in drafters.items():
        for verifier in VERIFIERS:
            spec = SpeculativeGenerator(target, drafter, verifier, WIDTH - 1, static_width=WIDTH, prefill_chunk=CHUNK)
            assert spec.generate(PROMPT, 24).token_ids == expected, (name, verifier)


def test_chunk_rows_that_see_later_slots_break_the_equality(monkeypatch):
    """Mutant: causal visibility is what keeps a chunk from reading slots not yet written, and the later
    passes from reading rejected drafts; without it speculative output leaves plain decoding's."""
    monkeypatch.setattr(LlamaForward, "visible_ends", lambda self, pos, length: torch.full_like(pos, length))
    with pytest.raises(AssertionError):
        test_bf16_chunked_speculation_is_bitwise_plain_decoding()


@pytest.mark.parametrize("runtime", ["dynamic", "static"])
def test_fp32_chunks_match_one_pass(runtime):
    model = tiny_llama(0, hidden=64)
    target = target_from_model(model, tiny_tokenizer(), "t")

    def make() -> CachedLM | StaticLM:
        return CachedLM(model, layers(model)) if runtime == "dynamic" else StaticLM(model, WIDTH, 256, layers(model))

    one, chunked = make(), make()
    prefill(one, PROMPT[:-1], 0)
    prefill(chunked, PROMPT[:-1], CHUNK)
    # The chunks' products and attention reduce over other shapes than one pass: equal up to rounding.
    torch.testing.assert_close(chunked.features, one.features, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(chunked.forward([PROMPT[-1]]), one.forward([PROMPT[-1]]), rtol=1e-5, atol=1e-5)
    width = WIDTH if runtime == "static" else 0
    tokens = [SpeculativeGenerator(target, None, "greedy", 0, static_width=width, prefill_chunk=chunk)
              .generate(PROMPT, 24).token_ids for chunk in (0, CHUNK)]
    assert tokens[0] == tokens[1]


def test_features_of_the_last_chunk_alone_fail(monkeypatch):
    """Mutant: without gathering the chunks' features, a drafter would observe only the prompt's tail."""
    model = tiny_llama(0, hidden=64)
    one, chunked = CachedLM(model, layers(model)), CachedLM(model, layers(model))
    prefill(one, PROMPT[:-1], 0)
    # prefill's one use of torch is to gather the chunks' features: keep the last chunk's instead.
    monkeypatch.setattr(loop, "torch", SimpleNamespace(cat=lambda tensors: tensors[-1]))
    prefill(chunked, PROMPT[:-1], CHUNK)
    assert chunked.features.shape != one.features.shape


class CountingPrefill:
    """Counts prefill passes; cancels once `after` of them have run."""

    def __init__(self, after: int) -> None:
        self.after = after
        self.passes = 0

    def cancelled(self) -> bool:
        return self.passes >= self.after


@pytest.mark.parametrize("static_width", [0, WIDTH])
def test_a_cancelled_prefill_stops_within_one_chunk(target, monkeypatch, static_width):
    spy = CountingPrefill(after=1)
    lm_class = StaticLM if static_width else CachedLM
    original = lm_class.prefill

    def counted(self, ids):
        spy.passes += 1
        original(self, ids)

    monkeypatch.setattr(lm_class, "prefill", counted)
    generator = SpeculativeGenerator(target, PromptLookupDrafter(3), "greedy", 3, static_width=static_width,
                                     prefill_chunk=CHUNK)
    stream = generator.stream(PROMPT, 8, cancelled=spy.cancelled)
    assert list(stream) == []  # the worker sees a stream that ends without a token
    assert spy.passes == 1 < len(PROMPT) // CHUNK
    assert stream.generation.finish_reason == "cancelled" and stream.generation.token_ids == []

    spy.after = 10**6  # never cancelled: the whole prompt is prefilled, then decoding runs
    spy.passes = 0
    result = generator.generate(PROMPT, 8, cancelled=spy.cancelled)
    assert spy.passes == -(-(len(PROMPT) - 1) // CHUNK) and len(result.token_ids) == 8


def test_prefill_chunk_must_not_be_negative(target):
    with pytest.raises(ValueError, match="prefill_chunk must be >= 0"):
        SpeculativeGenerator(target, None, prefill_chunk=-1)
