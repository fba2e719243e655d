"""PEARL (specops/core/pearl.py): the drafter thread drafts while the target verifies, and the output is
still bitwise plain decoding's through the same runtime. Mutants that must fail: committing a draft the
target rejected, appending a token drafted from a context a rejection replaced, keeping drafts that do
not continue the committed tokens, and a drafter thread left running."""

from __future__ import annotations

import itertools
import threading

import pytest
import torch

from specops.core.loop import SpeculativeGenerator
from specops.core.pearl import PearlGenerator
from specops.core.target import target_from_model
from specops.core.types import SamplingParams
from specops.drafters.draft_lm import DraftLMDrafter
from tests.conftest import tiny_llama, tiny_tokenizer
from tests.core.test_greedy_equality import PROMPTS, reference

WIDTH = 5
LENGTHS = (1, 9, 40)
COUPLED = SamplingParams(temperature=0.8, top_p=0.95)


def drafter_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "pearl-drafter"]


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def static_pair(request):
    """A tiny target and draft in one dtype: drafters from the draft and from the target itself (every
    draft accepted: the post-verify path keeps drafts across passes)."""
    dtype = getattr(torch, request.param)
    target = target_from_model(tiny_llama(0, dtype=dtype, hidden=64), tiny_tokenizer(), "t")
    draft = tiny_llama(1, layers=1, hidden=32, dtype=dtype)
    return target, {"draft": DraftLMDrafter(draft, target.vocab_size),
                    "self": DraftLMDrafter(target.model, target.vocab_size)}


@pytest.mark.parametrize("min_drafts", [1, WIDTH - 1])
def test_static_greedy_and_coupled_are_bitwise_plain_decoding(static_pair, min_drafts):
    target, drafters = static_pair
    plain = {v: SpeculativeGenerator(target, None, v, 0, static_width=WIDTH) for v in ("greedy", "coupled")}
    for name, drafter in drafters.items():
        for verifier, sampling in (("greedy", SamplingParams()), ("coupled", COUPLED)):
            pearl = PearlGenerator(target, drafter, verifier, min_drafts=min_drafts, static_width=WIDTH)
            for prompt in PROMPTS:
                for n in LENGTHS:
                    want = plain[verifier].generate(prompt, n, sampling, seed=3).token_ids
                    assert pearl.generate(prompt, n, sampling, seed=3).token_ids == want, (name, verifier, prompt, n)
    assert not drafter_threads()


def test_dynamic_fp32_is_hf_greedy(target, draft_model):
    drafters = {"draft": DraftLMDrafter(draft_model, target.vocab_size),
                "self": DraftLMDrafter(target.model, target.vocab_size)}
    # min_drafts 0: passes never wait; lookahead 1: the drafter holds one draft, only pre-verify passes
    for (name, drafter), (min_drafts, lookahead) in itertools.product(drafters.items(), ((0, None), (1, None), (1, 1))):
        pearl = PearlGenerator(target, drafter, draft_tokens=4, min_drafts=min_drafts, lookahead=lookahead)
        for prompt in PROMPTS:
            for n in LENGTHS:
                assert pearl.generate(prompt, n).token_ids == reference(target.model, prompt, n), (name, min_drafts, prompt, n)


def test_every_pass_verifies_the_drafters_own_chain_from_the_committed_tokens(target, draft_model):
    """What each pass verifies is the draft model's greedy continuation of exactly the committed tokens:
    no token drafted from a context that a rejection replaced, none kept past a mismatch."""
    pearl = PearlGenerator(target, DraftLMDrafter(draft_model, target.vocab_size), draft_tokens=4)
    passes: list[tuple[int, list[int]]] = []
    verify = pearl._verify

    def spy(lm, last, draft, sampling, generator):
        passes.append((lm.length + 1, list(draft.tokens)))  # committed tokens: the cache plus `last`
        return verify(lm, last, draft, sampling, generator)

    pearl._verify = spy
    check = DraftLMDrafter(draft_model, target.vocab_size)
    for prompt in PROMPTS:
        passes.clear()
        sequence = prompt + pearl.generate(prompt, 40).token_ids
        drafted = 0
        for committed, tokens in passes:
            check.reset()
            assert tokens == check.propose(sequence[:committed], len(tokens), SamplingParams(), None).tokens
            drafted += len(tokens)
        assert drafted > 0


def test_drafts_the_target_accepts_all_go_through(target):
    """A self-draft waiting for full passes: every pass verifies 4 drafts, all accepted."""
    pearl = PearlGenerator(target, DraftLMDrafter(target.model, target.vocab_size), draft_tokens=4, min_drafts=4)
    stats = pearl.generate(PROMPTS[2], 30).stats
    assert stats.drafted == stats.accepted == 4 * (stats.steps - 1) + stats.per_step[-1][0]
    assert stats.mean_accepted_length == 5.0


class FailingDrafter(DraftLMDrafter):
    def __init__(self, model, vocab: int, after: int) -> None:
        super().__init__(model, vocab)
        self.calls, self.after = 0, after

    def propose(self, *args, **kwargs):
        self.calls += 1
        if self.calls > self.after:
            raise RuntimeError("draft model failed")
        return super().propose(*args, **kwargs)


def test_no_drafter_thread_outlives_a_generation(target, draft_model):
    threads = torch.get_num_threads()
    pearl = PearlGenerator(target, DraftLMDrafter(draft_model, target.vocab_size), draft_tokens=4)
    pearl.generate(PROMPTS[0], 20)
    assert not drafter_threads()
    stream = pearl.stream(PROMPTS[2], 40)
    next(iter(stream))
    assert drafter_threads()  # it drafts while the caller holds the stream
    stream.close()  # a client went away
    assert not drafter_threads()
    assert pearl.generate(PROMPTS[2], 40, cancelled=lambda: True).finish_reason == "cancelled"
    failing = PearlGenerator(target, FailingDrafter(draft_model, target.vocab_size, after=3), draft_tokens=4)
    with pytest.raises(RuntimeError, match="draft model failed"):
        failing.generate(PROMPTS[2], 40)
    assert not drafter_threads()
    assert torch.get_num_threads() == threads  # the caller's intra-op setting is restored


def test_settings_pearl_cannot_serve_are_refused(target, draft_model):
    drafter = DraftLMDrafter(draft_model, target.vocab_size)
    with pytest.raises(ValueError, match="greedy or coupled, not 'rejection'"):
        PearlGenerator(target, drafter, "rejection")
    with pytest.raises(ValueError, match="drafts from tokens alone"):
        PearlGenerator(target, None)
    with pytest.raises(ValueError, match=r"min_drafts must be between 0 and the drafts a pass takes \(4\)"):
        PearlGenerator(target, drafter, draft_tokens=6, min_drafts=5, static_width=WIDTH)
    with pytest.raises(ValueError, match=r"lookahead must be >= 1 and >= min_drafts \(2\), got 1"):
        PearlGenerator(target, drafter, draft_tokens=4, min_drafts=2, lookahead=1)
