"""Long prompts (LongSpec, issue #26): the static runtime stays bitwise plain decoding at a long-ish length
with a chunked prefill, with windowed and full draft LMs, and its rows are bitwise alike alone or among
others there (must-fail: rows that see every slot, stale or not yet written); a
prefill shared between generators is the prefill itself (must-fail: a cache keyed without the prompt);
the long-context prompt sets fill their length with earlier questions and answers."""

from __future__ import annotations

import pytest
import torch

from specops.core import loop
from specops.core.kv import StaticLM
from specops.core.llama import LlamaForward
from specops.core.loop import PrefillCache, SpeculativeGenerator
from specops.core.target import target_from_model
from specops.core.types import static_cache_length
from specops.core.verify import VERIFIERS
from specops.data.datasets import long_context_prompts
from specops.drafters.draft_lm import DraftLMDrafter
from specops.drafters.prompt_lookup import PromptLookupDrafter
from specops.drafters.suffix import SuffixCache, SuffixDrafter
from specops.drafters.suffix_front import SuffixFrontDrafter
from tests.conftest import tiny_llama, tiny_tokenizer
from tests.core.test_static_runtime import rows_equal

WIDTH, CHUNK, NEW = 4, 256, 24
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def long_prompt(tokens: int, seed: int = 0) -> list[int]:
    """Random ids with repeats (so prompt lookup and the suffix front draft too)."""
    ids = torch.randint(5, 96, (tokens // 2,), generator=torch.Generator().manual_seed(seed)).tolist()
    return (ids * 2 + ids)[:tokens]


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_a_long_prompt_is_bitwise_plain_decoding_with_every_draft(dtype):
    """1,500 prompt tokens in 6 chunks, a static cache of 1,600 slots, drafts with a window of 48 (positions
    far below the prompt's) and a full draft (positions past 1,500)."""
    model = tiny_llama(0, dtype=DTYPES[dtype], hidden=64, max_positions=2048)
    target = target_from_model(model, tiny_tokenizer(), "t")
    draft = tiny_llama(1, layers=1, hidden=32, dtype=DTYPES[dtype], max_positions=2048)
    prompt = long_prompt(1500)
    assert static_cache_length(len(prompt), NEW, WIDTH) == 1600
    plain = SpeculativeGenerator(target, None, "greedy", 0, static_width=WIDTH, prefill_chunk=CHUNK)
    expected = plain.generate(prompt, NEW).token_ids
    drafters = {"draft-lm": DraftLMDrafter(draft, target.vocab_size),
                "draft-lm-window": DraftLMDrafter(draft, target.vocab_size, window=48, sinks=4),
                "self-draft-window": DraftLMDrafter(model, target.vocab_size, window=48, sinks=4),
                "draft-lm-suffix-window": SuffixFrontDrafter(SuffixDrafter(SuffixCache(8, 64), 0, 1.0, 0.1),
                                                             DraftLMDrafter(draft, target.vocab_size, window=48,
                                                                            sinks=4), 1.0),
                "prompt-lookup": PromptLookupDrafter(3)}
    for name, drafter in drafters.items():
        for verifier in VERIFIERS:
            spec = SpeculativeGenerator(target, drafter, verifier, WIDTH - 1, static_width=WIDTH, prefill_chunk=CHUNK)
            result = spec.generate(prompt, NEW)
            assert result.token_ids == expected, (name, verifier)
    assert drafters["draft-lm-window"].skipped > 1400  # the window held the sinks and the last tokens only
    assert drafters["draft-lm"].lm.length > 1500


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_long_rows_are_bitwise_plain_decoding(dtype):
    """The property the test above rests on, at 1,500 tokens: each token's logits fed alone (plain decoding)
    are bitwise those fed among others (verification passes); must-fail: rows that see every slot."""
    model = tiny_llama(0, dtype=DTYPES[dtype], hidden=64, max_positions=2048)
    prompt = long_prompt(1500)
    assert all(rows_equal(lambda: StaticLM(model, WIDTH, 1536), prompt))
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(LlamaForward, "visible_ends", lambda self, pos, length: torch.full_like(pos, length))
        assert not all(rows_equal(lambda: StaticLM(model, WIDTH, 1536), prompt))


def shared_run(cache: PrefillCache) -> tuple[list[list[int]], list[list[int]], int]:
    """Two prompts, each decoded plainly then speculatively, all generators sharing `cache`; the outputs of
    both and the number of prefills computed."""
    target = target_from_model(tiny_llama(0, dtype=torch.bfloat16, hidden=64, max_positions=1024),
                               tiny_tokenizer(), "t")
    draft = tiny_llama(1, layers=1, hidden=32, dtype=torch.bfloat16)
    computed = []
    real = loop.prefill

    def counting(lm, ids, chunk, cancelled=None):
        computed.append(len(ids))
        return real(lm, ids, chunk, cancelled)

    plain, spec = [], []
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(loop, "prefill", counting)
        for seed in (1, 2):
            prompt = long_prompt(600, seed)
            ours = SpeculativeGenerator(target, None, "greedy", 0, static_width=WIDTH, prefill_chunk=CHUNK,
                                        prefill_cache=cache)
            plain.append(ours.generate(prompt, NEW).token_ids)
            drafting = SpeculativeGenerator(target, DraftLMDrafter(draft, target.vocab_size, window=32, sinks=4),
                                            "greedy", WIDTH - 1, static_width=WIDTH, prefill_chunk=CHUNK,
                                            prefill_cache=cache)
            spec.append(drafting.generate(prompt, NEW).token_ids)
    return plain, spec, len(computed)


def test_a_shared_prefill_is_the_prefill_itself():
    plain, spec, computed = shared_run(PrefillCache())
    assert spec == plain and computed == 2  # one prefill per prompt, restored for the second generator
    alone, _, _ = shared_run_without_cache()
    assert plain == alone


def shared_run_without_cache() -> tuple[list[list[int]], list[list[int]], int]:
    class NoCache(PrefillCache):
        def prefill(self, lm, token_ids, chunk, cancelled=None):
            return loop.prefill(lm, token_ids, chunk, cancelled)

    return shared_run(NoCache())


def test_a_prefill_cache_keyed_without_the_prompt_is_caught():
    """Mutant: the second prompt gets the first prompt's cache; its output leaves plain decoding's."""

    class PromptBlind(PrefillCache):
        def prefill(self, lm: StaticLM, token_ids, chunk, cancelled=None):
            if self.state is not None:
                lm.restore(self.state)
                lm.length = len(token_ids)
                return True
            return super().prefill(lm, token_ids, chunk, cancelled)

    plain, spec, _ = shared_run(PromptBlind())
    alone, _, _ = shared_run_without_cache()
    assert plain != alone


def test_a_prefill_cache_needs_the_static_runtime(target):
    with pytest.raises(ValueError, match="static_width > 0"):
        SpeculativeGenerator(target, None, prefill_cache=PrefillCache())


def words(chat: list[dict[str, str]]) -> int:
    return sum(len(m["content"].split()) for m in chat)


@pytest.mark.parametrize("dataset", ["humaneval", "sharegpt"])
def test_long_context_prompts_fill_their_length_and_end_with_an_unanswered_question(dataset):
    short = long_context_prompts(dataset, 0, 2, words)
    for length in (1000, 4000):
        prompts = long_context_prompts(dataset, length, 2, words)
        for question, prompt in zip(short, prompts, strict=True):
            assert prompt[-1] == question[0] and prompt[-1]["role"] == "user"  # the same last questions
            assert length * 0.8 < words(prompt) <= length
            roles = [m["role"] for m in prompt[:-1]]
            assert roles == ["user", "assistant"] * (len(roles) // 2)
            assert question[0]["content"] not in [m["content"] for m in prompt[:-1]]
    with pytest.raises(ValueError, match="built from"):
        long_context_prompts("prompts.jsonl", 1000, 1, words)
