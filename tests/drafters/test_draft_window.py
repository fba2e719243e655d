"""The draft LM's window (LongSpec; specops/drafters/draft_lm.py): a constant-memory draft KV cache of
attention sinks plus recent tokens, at positions below the window.

Exactness is checked with every other drafter in the shared suites (test_greedy_equality with a must-fail
mutant whose re-rotation moves the target's positions, test_static_runtime in fp32 and bf16,
test_loop_distribution with a must-fail mutant whose q is not the window's); here: the re-rotation
against a reference, the cache's layout, its memory as the context grows (must-fail: the full cache
grows), and the method spec that turns it on.
"""

from __future__ import annotations

import pytest
import torch

from specops.core.kv import CachedLM, rotary_frequencies, shift_positions
from specops.core.loop import SpeculativeGenerator
from specops.core.types import SamplingParams
from specops.drafters.draft_lm import EVICT_FRACTION, DraftLMDrafter
from specops.drafters.factory import build_drafter
from specops.drafters.kinds import DecodingConfig, MethodSpec
from tests.conftest import tiny_llama

GREEDY = SamplingParams()


def first_layer_keys(model, tokens: list[int]) -> torch.Tensor:
    """Layer 0's cached keys [kv_heads, n, head_dim] after a prefill: a function of each token and its
    position alone (the first layer's keys are computed before any attention)."""
    lm = CachedLM(model)
    lm.prefill(tokens)
    return lm.cache.layers[0].keys[0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_shifted_keys_are_the_keys_at_the_new_positions(dtype):
    model = tiny_llama(0, dtype=dtype, hidden=64)
    tokens = list(range(10, 50))
    sinks, dropped = 3, 11
    moved = shift_positions(first_layer_keys(model, tokens)[:, sinks + dropped:], -dropped, rotary_frequencies(model))
    reference = first_layer_keys(model, tokens[:sinks] + tokens[sinks + dropped:])[:, sinks:]
    tolerance = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 0.04, "rtol": 0.02}
    torch.testing.assert_close(moved, reference, **tolerance)
    # Must-fail: keys kept at their old positions are not the keys at the new ones.
    stale = first_layer_keys(model, tokens)[:, sinks + dropped:]
    assert not torch.allclose(stale.float(), reference.float(), **tolerance)


def test_a_long_context_is_fed_as_its_sinks_and_last_tokens():
    model = tiny_llama(1, layers=1, hidden=32)
    window, sinks, k = 24, 3, 4
    drafter = DraftLMDrafter(model, 96, window=window, sinks=sinks)
    context = [(7 * i) % 90 + 5 for i in range(200)]
    drafter.propose(context, k, GREEDY, None)
    held = drafter.cached  # the cache's tokens, in cache order (the drafted ones fed after the context)
    kept = len(held) - (k - 1)
    assert held[:sinks] == context[:sinks]
    assert held[sinks:kept] == context[sinks + drafter.skipped:]
    assert drafter.lm.length == len(held) <= window
    # The window made room for the draft and a quarter window more: no eviction at the next few steps.
    assert window - len(held) >= (window - sinks) // EVICT_FRACTION


class RecordingLengths(DraftLMDrafter):
    """Records the draft cache's length after each draft: every token it fed sat at a position below it."""

    lengths: list[int]

    def propose(self, context, k, sampling, generator, stop=None):
        draft = super().propose(context, k, sampling, generator, stop)
        self.lengths.append(self.lm.length)
        return draft


def test_draft_positions_stay_below_the_window_through_a_generation(target):
    drafter = RecordingLengths(tiny_llama(1, layers=1, hidden=32), target.vocab_size, window=16, sinks=2)
    drafter.lengths = []
    SpeculativeGenerator(target, drafter, draft_tokens=4).generate(list(range(10, 90)), 40)
    assert len(drafter.lengths) > 5 and max(drafter.lengths) <= 16
    assert drafter.skipped > 80 - 16  # the prompt's middle and the earlier answer were dropped


def peak_draft_bytes(target, window: int, prompt_tokens: int) -> int:
    drafter = DraftLMDrafter(tiny_llama(1, layers=1, hidden=32), target.vocab_size, window=window, sinks=4)
    prompt = [(5 * i) % 90 + 5 for i in range(prompt_tokens)]
    return SpeculativeGenerator(target, drafter, draft_tokens=4).generate(prompt, 24).stats.draft_kv_bytes


def test_the_windowed_draft_memory_stays_constant_as_the_context_grows(target):
    """Prompts of 60 to 220 tokens (the tiny target's context is 256): the windowed draft's KV bytes,
    measured from its tensors, stay within 32 tokens' worth; must-fail: the full draft's grow with them."""
    per_token = 1 * 2 * 2 * 8 * 4  # 1 layer, keys and values, 2 kv heads of 8 dims, float32
    lengths = (60, 140, 220)
    windowed = [peak_draft_bytes(target, 32, n) for n in lengths]
    assert all(0 < b <= 32 * per_token for b in windowed)
    full = [peak_draft_bytes(target, 0, n) for n in lengths]
    assert full[0] < full[1] < full[2] and full[2] >= 220 * per_token


def test_below_the_window_it_drafts_what_the_full_draft_drafts(target):
    model = tiny_llama(1, layers=1, hidden=32)
    prompt = list(range(10, 30))
    full = SpeculativeGenerator(target, DraftLMDrafter(model, target.vocab_size), draft_tokens=4).generate(prompt, 30)
    windowed = SpeculativeGenerator(target, DraftLMDrafter(model, target.vocab_size, window=64, sinks=4),
                                    draft_tokens=4).generate(prompt, 30)
    assert windowed.token_ids == full.token_ids and windowed.stats.per_step == full.stats.per_step


def test_the_method_spec_and_the_factory_set_the_window(target, draft_dir):
    method = MethodSpec.parse("draft-lm-suffix+specdecpp@4:window=384")
    assert (method.kind, method.policy, method.size, method.window) == ("draft-lm-suffix", "specdecpp", 4, 384)
    assert str(method) == "draft-lm-suffix+specdecpp@4:window=384"
    config = MethodSpec.parse("draft-lm@4:window=48").decoding()
    assert config.draft_window == 48 and config.draft_tokens == 4
    drafter = build_drafter("draft-lm", target, config, draft_dir)
    assert (drafter.window, drafter.sinks) == (48, DecodingConfig.draft_sinks)
    assert MethodSpec.parse("draft-lm@4").decoding().draft_window == 0  # off unless asked for


@pytest.mark.parametrize(("spec", "message"), [
    ("suffix@4:window=64", "applies to draft-lm"),
    ("draft-lm@4:win=64", "only option"),
    ("draft-lm@4:window=x", "only option"),
    ("draft-lm@4:window=3", "larger than draft_sinks"),
])
def test_bad_windows_are_refused_with_a_reason(spec, message):
    with pytest.raises(ValueError, match=message):
        MethodSpec.parse(spec).decoding()


def test_a_window_too_small_for_the_draft_is_refused():
    drafter = DraftLMDrafter(tiny_llama(1, layers=1, hidden=32), 96, window=8, sinks=4)
    with pytest.raises(ValueError, match="no room for 4 drafted tokens"):
        drafter.propose(list(range(10, 40)), 4, GREEDY, None)
    with pytest.raises(ValueError, match="larger than its 4 sink tokens"):
        DraftLMDrafter(tiny_llama(1, layers=1, hidden=32), 96, window=4, sinks=4)
