"""The prefix cache is exact: a prompt whose first blocks another prompt computed, copied from the cache and the
rest prefilled, leaves the cache, the features and the next logits bitwise as its own one-pass prefill; so does a
prompt prefilled in any chunks, which is what makes it so (the native decoder attends a prompt's rows through
its kernel). Must-fail controls: prompts attending through SDPA's flash kernel as before, and a cache that hands
back blocks one slot off. Where a prefill is not exact (fp32), the cache steps aside."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from unittest import mock

import pytest
import torch

from specops.core.kv import StaticLM
from specops.core.llama import MATH_ROWS, llama_forward
from specops.core.loop import SpeculativeGenerator, prefill
from specops.core.prefix_cache import PrefixCache
from specops.core.target import target_from_model
from specops.drafters.prompt_lookup import PromptLookupDrafter
from tests.conftest import tiny_llama, tiny_tokenizer

HIDDEN = 96  # wide enough that every product runs batch-invariant (specops.core.batching.batch_invariant)
LENGTH = 256
SHARED = [(7 * i) % 90 + 3 for i in range(40)]  # two whole blocks of 16 and 8 tokens more
FIRST = SHARED + [(5 * i) % 90 + 3 for i in range(60)]
# In one pass past MATH_ROWS rows, which attended through SDPA's flash kernel before; its rest after the shared
# blocks within them, which attended through the native kernel.
SECOND = SHARED + [(11 * i) % 90 + 3 for i in range(50)]


@pytest.fixture(scope="module")
def bf16():
    return tiny_llama(0, hidden=HIDDEN, dtype=torch.bfloat16, max_positions=2048)


def filled(model, prompt: list[int], through: PrefixCache | None = None, chunk: int = 512,
           hidden_layers: list[int] | None = None) -> tuple[StaticLM, torch.Tensor]:
    """A static cache with `prompt` prefilled (through the cache, or plainly in chunks) and the logits of one
    more token after it."""
    lm = StaticLM(model, 5, LENGTH, hidden_layers=hidden_layers)
    with torch.inference_mode():
        assert through.prefill(lm, prompt, chunk) if through is not None else prefill(lm, prompt, chunk)
        logits = lm.forward([prompt[-1]])
    return lm, logits


def same(a: tuple[StaticLM, torch.Tensor], b: tuple[StaticLM, torch.Tensor]) -> bool:
    (lm_a, logits_a), (lm_b, logits_b) = a, b
    end = lm_a.length
    caches = all(torch.equal(x[:, :end], y[:, :end]) for x, y in zip((*lm_a.keys, *lm_a.values),
                                                                     (*lm_b.keys, *lm_b.values), strict=True))
    features = (lm_a.features is None) == (lm_b.features is None) and (
        lm_a.features is None or torch.equal(lm_a.features, lm_b.features))
    return lm_a.length == lm_b.length and caches and features and torch.equal(logits_a, logits_b)


@contextlib.contextmanager
def sdpa_prompts(model) -> Iterator[None]:
    """The mutant: prompts' rows attend through SDPA's flash kernel, as before the native kernel took them (the
    Python loop, where they still do), and the cache is used anyway."""
    forward = llama_forward(model)[0]
    forward.use_native = False
    try:
        with mock.patch.object(PrefixCache, "exact", staticmethod(lambda lm: lm.length == 0)):
            yield
    finally:
        forward.use_native = True


def test_a_prompt_in_any_chunks_is_its_one_pass_prefill(bf16):
    whole = filled(bf16, SECOND)
    assert all(same(filled(bf16, SECOND, chunk=chunk), whole) for chunk in (1, 7, 16, 33, MATH_ROWS + 1))


def test_chunks_attending_through_sdpa_are_not(bf16):
    with sdpa_prompts(bf16):
        whole = filled(bf16, SECOND)
        assert not all(same(filled(bf16, SECOND, chunk=chunk), whole) for chunk in (16, 33, MATH_ROWS + 1))


@pytest.mark.parametrize("hidden_layers", [None, [0, 1]])
def test_a_prompt_reusing_another_s_first_blocks_is_its_own_prefill(bf16, hidden_layers):
    cache = PrefixCache(2**30)
    first = filled(bf16, FIRST, cache, hidden_layers=hidden_layers)
    assert first[0].reused == 0 and same(first, filled(bf16, FIRST, hidden_layers=hidden_layers))
    second = filled(bf16, SECOND, cache, hidden_layers=hidden_layers)
    assert second[0].reused == 32  # the two whole blocks the prompts share
    assert same(second, filled(bf16, SECOND, hidden_layers=hidden_layers))
    again = filled(bf16, SECOND, cache, hidden_layers=hidden_layers)  # every whole block of its own now
    assert again[0].reused == len(SECOND) // 16 * 16 and same(again, second)
    assert len(SECOND) > MATH_ROWS >= len(SECOND) - 32


def test_reused_blocks_of_prompts_that_attended_through_sdpa_are_not(bf16):
    with sdpa_prompts(bf16):
        cache = PrefixCache(2**30)
        filled(bf16, FIRST, cache)
        assert not same(filled(bf16, SECOND, cache), filled(bf16, SECOND))


def test_blocks_one_slot_off_are_not(bf16):
    cache = PrefixCache(2**30)
    filled(bf16, FIRST, cache)
    for block in cache._blocks():
        block.keys = [k.roll(1, 1) for k in block.keys]
    assert not same(filled(bf16, SECOND, cache), filled(bf16, SECOND))


def test_past_its_budget_the_least_recently_used_blocks_go(bf16):
    one = PrefixCache(2**30)
    filled(bf16, FIRST, one)
    block_bytes = one.bytes // (len(FIRST) // 16)
    cache = PrefixCache(7 * block_bytes)
    filled(bf16, FIRST, cache)  # 6 blocks
    filled(bf16, SECOND, cache)  # shares 2, adds 3: 9 blocks, over budget by 2
    assert cache.bytes <= cache.budget_bytes
    assert len(cache._blocks()) == 7
    # FIRST's last two blocks went (SECOND's were used later; the two shared ones have children).
    assert filled(bf16, SECOND, cache)[0].reused == len(SECOND) // 16 * 16
    first = filled(bf16, FIRST, cache)
    assert first[0].reused == len(FIRST) // 16 * 16 - 32 and same(first, filled(bf16, FIRST))


def test_blocks_evicted_while_a_prompt_reusing_them_prefills_leave_the_count_true(bf16, monkeypatch):
    """Another generation's eviction between a prompt's lookup and its insert (the prefill runs without the
    lock): the prompt's blocks go in from the trie's root again, and the bytes count what the trie holds."""
    from specops.core import prefix_cache

    cache = PrefixCache(2**30)
    filled(bf16, FIRST, cache)

    def evicting(lm, token_ids, chunk, cancelled=None):
        budget, cache.budget_bytes = cache.budget_bytes, 0
        cache._evict()  # everything, the blocks this prompt just copied too
        cache.budget_bytes = budget
        return prefill(lm, token_ids, chunk, cancelled)

    monkeypatch.setattr(prefix_cache, "prefill", evicting)
    second = filled(bf16, SECOND, cache)
    assert second[0].reused == 32
    assert cache.bytes == sum(b.bytes for b in cache._blocks()) > 0
    monkeypatch.setattr(prefix_cache, "prefill", prefill)
    again = filled(bf16, SECOND, cache)
    assert again[0].reused == len(SECOND) // 16 * 16 and same(again, second)


def test_where_a_prefill_is_not_exact_the_cache_steps_aside():
    fp32 = tiny_llama(0, hidden=HIDDEN, dtype=torch.float32, max_positions=2048)
    cache = PrefixCache(2**30)
    filled(fp32, FIRST, cache)
    lm, _ = filled(fp32, SECOND, cache)
    assert lm.reused == 0 and cache.bytes == 0 and not cache._blocks()


def test_generations_report_the_prompt_tokens_they_reused(bf16):
    target = target_from_model(bf16, tiny_tokenizer(), "tiny-bf16")
    cache = PrefixCache(2**30)
    runs = []
    for through in (None, cache, cache):
        generator = SpeculativeGenerator(target, PromptLookupDrafter(3), "greedy", 4, static_width=5,
                                         prefill_cache=through)
        runs.append(generator.generate(SECOND, 24))
    assert [r.token_ids for r in runs[1:]] == [runs[0].token_ids] * 2
    # The prompt's last token is the first pass's, not the prefill's.
    assert [r.stats.cached_prompt_tokens for r in runs] == [0, 0, (len(SECOND) - 1) // 16 * 16]
