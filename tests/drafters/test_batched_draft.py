"""The draft LM on the static runtime, batched on the target's pass thread when the target's passes are
(StaticDraftLM, specops/drafters/draft_lm.py).

Whether batched drafting changes any request's output is checked with the target's batching
(tests/core/test_batching.py and tests/server/test_batching.py: greedy and sampled requests alone vs
together, with the draft LM's passes batched). Here: the batched draft drafts what the draft LM drafts on
its own dynamic cache, through rollbacks and while its static cache is rebuilt as the sequence grows
(must-fail: a rebuild that loses the cache), and it is used only where it can be.
"""

from __future__ import annotations

import random

import torch

from specops.core.batching import PassBatcher
from specops.core.kv import CachedLM, StaticLM
from specops.core.types import SamplingParams
from specops.drafters.draft_lm import DraftLMDrafter, StaticDraftLM
from specops.drafters.suffix import SuffixCache, SuffixDrafter
from specops.drafters.suffix_front import SuffixFrontDrafter
from tests.conftest import VOCAB, tiny_llama

HIDDEN = 96  # wide enough for every product to run on oneDNN (specops.core.batching.batch_invariant)


def agreement(monkeypatch, steps: int = 40) -> float:
    """Fraction of drafted tokens on which the batched draft and the dynamic-cache draft agree, over a
    sequence that grows by 1-3 tokens a step and is sometimes rolled back (a rejected draft)."""
    monkeypatch.setattr(StaticDraftLM, "ROOM", 8)  # rebuild the static cache every few steps
    target = tiny_llama(0, hidden=HIDDEN, dtype=torch.bfloat16)
    draft = tiny_llama(1, layers=2, hidden=HIDDEN, dtype=torch.bfloat16)
    batcher = PassBatcher(target)
    batched, own = DraftLMDrafter(draft, VOCAB), DraftLMDrafter(draft, VOCAB)
    batched.reset()
    batched.share_runtime(StaticLM(target, 5, 256, batcher=batcher))
    own.reset()
    assert isinstance(batched.lm, StaticDraftLM) and isinstance(own.lm, CachedLM)
    rng = random.Random(0)
    context = [rng.randrange(3, VOCAB) for _ in range(20)]
    same = total = 0
    with torch.inference_mode():
        for _ in range(steps):
            a = batched.propose(context, 3, SamplingParams(), None).tokens
            b = own.propose(context, 3, SamplingParams(), None).tokens
            same += sum(x == y for x, y in zip(a, b, strict=True))
            total += len(b)
            context = context + b[: rng.randrange(0, 3)] + [rng.randrange(3, VOCAB)]
    return same / total


def test_batched_drafts_are_the_draft_lms_drafts(monkeypatch):
    # Not bitwise (another forward, another kernel order in bf16), but the same argmax almost everywhere.
    assert agreement(monkeypatch) > 0.9


def test_a_rebuilt_cache_keeps_what_it_held(monkeypatch):
    """Must fail: a rebuild that starts empty drafts from a cache without the sequence's start."""
    monkeypatch.setattr(StaticLM, "restore", lambda self, state: None)
    assert agreement(monkeypatch) < 0.9


def test_the_static_draft_is_used_only_where_it_can_be():
    target = tiny_llama(0, hidden=HIDDEN, dtype=torch.bfloat16)
    batcher = PassBatcher(target)
    unsupported = tiny_llama(1, hidden=HIDDEN, dtype=torch.bfloat16)
    unsupported.config.attention_bias = True  # an architecture the lean forward refuses
    cases = [(DraftLMDrafter(tiny_llama(1, hidden=HIDDEN, dtype=torch.bfloat16), VOCAB), True),
             (DraftLMDrafter(tiny_llama(1, hidden=48, dtype=torch.bfloat16), VOCAB), False),  # too small to batch
             (DraftLMDrafter(tiny_llama(1, hidden=HIDDEN, dtype=torch.bfloat16), VOCAB, tree_nodes=6), False),
             (DraftLMDrafter(tiny_llama(1, hidden=HIDDEN, dtype=torch.bfloat16), VOCAB, window=32, sinks=4), False),
             (DraftLMDrafter(unsupported, VOCAB), False)]
    for drafter, expected in cases:
        # Batched or not, the same draft path: a sampled request drafts alike in every server.
        for runtime in (StaticLM(target, 5, 128, batcher=batcher), StaticLM(target, 5, 128)):
            drafter.reset()
            drafter.share_runtime(runtime)
            assert isinstance(drafter.lm, StaticDraftLM) == expected
            assert not expected or drafter.lm.batcher is runtime.batcher
        drafter.reset()
        drafter.share_runtime(CachedLM(target))  # the dynamic runtime: the draft's own dynamic cache
        assert isinstance(drafter.lm, CachedLM)


def test_a_suffix_front_passes_the_runtime_to_its_draft_lm():
    target = tiny_llama(0, hidden=HIDDEN, dtype=torch.bfloat16)
    drafter = SuffixFrontDrafter(SuffixDrafter(SuffixCache(8, 64), 0, 1.0, 0.1), DraftLMDrafter(tiny_llama(1, hidden=HIDDEN, dtype=torch.bfloat16), VOCAB),
                                 min_score=1.0)
    drafter.reset()
    drafter.share_runtime(StaticLM(target, 5, 128, batcher=PassBatcher(target)))
    assert isinstance(drafter.back.lm, StaticDraftLM)
