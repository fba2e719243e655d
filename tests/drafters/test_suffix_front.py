"""The draft LM behind a Suffix Decoding front (specops/drafters/suffix_front.py).

Exactness is checked with every other drafter in the shared suites (test_greedy_equality,
test_static_runtime, test_loop_distribution, with a must-fail mutant that picks the drafter after
drawing); here: which drafter drafts a step, that both do in those runs, and that forks are independent.
"""

from __future__ import annotations

import copy

import pytest

from specops.core.drafter import Draft
from specops.core.loop import SpeculativeGenerator
from specops.core.types import SamplingParams
from specops.drafters.draft_lm import DraftLMDrafter
from specops.drafters.factory import build_drafter
from specops.drafters.kinds import DecodingConfig
from specops.drafters.suffix import SuffixCache, SuffixDrafter
from specops.drafters.suffix_front import SuffixFrontDrafter
from tests.conftest import tiny_llama

GREEDY = SamplingParams()


class CountingDraftLM(DraftLMDrafter):
    calls = 0

    def propose(self, context, k, sampling, generator, stop=None) -> Draft:
        self.calls += 1
        return super().propose(context, k, sampling, generator, stop)


def front_drafter(min_score: float, vocab: int = 128) -> SuffixFrontDrafter:
    back = CountingDraftLM(tiny_llama(1, layers=1, hidden=32, vocab=vocab), vocab)
    return SuffixFrontDrafter(SuffixDrafter(SuffixCache(8, 64), 0, 1.0, 0.1), back, min_score)


def test_a_confident_suffix_match_drafts_without_the_draft_lm():
    drafter = front_drafter(min_score=1.0)
    drafter.remember([[1, 2, 3, 4, 5, 6, 7, 8]])  # a served response: "1 2 3" continues "4 5 6 ..."
    draft = drafter.propose([9, 1, 2, 3], 4, GREEDY, None)
    assert draft.tokens == [4, 5, 6] and draft.q is None  # a 3-token match drafts 3 (suffix_factor 1)
    assert drafter.back.calls == 0 and drafter.front_steps == 1


def test_no_match_or_a_weak_one_goes_to_the_draft_lm():
    drafter = front_drafter(min_score=2.5)
    drafter.remember([[1, 2, 3, 4, 5, 6, 7, 8]])
    drafter.propose([9, 10, 11], 4, GREEDY, None)  # no match at all
    drafter.propose([9, 1, 2, 3], 2, GREEDY, None)  # a 2-token draft scores at most 2 < 2.5
    assert drafter.back.calls == 2 and drafter.front_steps == 0 and drafter.back_steps == 2



def test_a_free_draft_declined_under_load_is_not_scored_again(monkeypatch):
    """Under load the loop offers the free draft at a longer length first (free_draft), then asks for the
    paid one (propose): the tries, walked once, would decline the shorter draft too."""
    drafter = front_drafter(min_score=2.5)
    drafter.remember([[1, 2, 3, 4, 5, 6, 7, 8]])
    walks = []
    scored = drafter.front.scored
    monkeypatch.setattr(drafter.front, "scored", lambda context, k: walks.append(k) or scored(context, k))
    assert drafter.free_draft([9, 1, 2, 3], 2) is None  # a 2-token draft scores at most 2 < 2.5
    drafter.propose([9, 1, 2, 3], 1, GREEDY, None)
    assert walks == [2] and drafter.back.calls == 1
    drafter.propose([9, 1, 2, 3, 4], 1, GREEDY, None)  # the next step scores its own draft
    assert walks == [2, 1]


def test_both_drafters_draft_in_one_generation_and_the_output_is_plain_decodings(target):
    vocab = target.vocab_size
    drafter = SuffixFrontDrafter(SuffixDrafter(SuffixCache(8, 64), 0, 1.0, 0.1),
                                 DraftLMDrafter(tiny_llama(1, layers=1, hidden=32, vocab=vocab), vocab), 1.0)
    spec = SpeculativeGenerator(target, drafter, "greedy", 4)
    plain = SpeculativeGenerator(target, None, "greedy", 4)
    prompt = [5, 17, 33, 17, 33, 40, 5, 17]
    for _ in range(2):  # the second time, the first answer is in the global trie
        assert spec.generate(prompt, 40).token_ids == plain.generate(prompt, 40).token_ids
    assert drafter.front_steps > 0 and drafter.back_steps > 0


def test_forks_keep_their_own_request_state_and_share_the_served_responses():
    drafter = front_drafter(min_score=1.0)
    twin = copy.copy(drafter)
    assert twin.front is not drafter.front and twin.back is not drafter.back
    assert twin.front.cache is drafter.front.cache  # what one slot served, the others draft from
    twin.reset()
    twin.propose([1, 2, 3, 4], 2, GREEDY, None)
    assert drafter.front.fed == 0 and drafter.back.cached == []


def test_bad_settings_are_refused_with_a_reason():
    back = DraftLMDrafter(tiny_llama(1, layers=1, hidden=32, vocab=128), 128)
    with pytest.raises(ValueError, match="min_score must be > 0"):
        SuffixFrontDrafter(SuffixDrafter(SuffixCache(8, 64), 0, 1.0, 0.1), back, 0.0)
    with pytest.raises(ValueError, match="chains"):
        SuffixFrontDrafter(SuffixDrafter(SuffixCache(8, 64), 4, 1.0, 0.1), back, 1.0)


def test_the_factory_builds_it_from_a_method_spec(target, tmp_path):
    draft = tiny_llama(1, layers=1, hidden=32, vocab=target.vocab_size)
    draft.save_pretrained(tmp_path)
    config = DecodingConfig(drafter="draft-lm-suffix", suffix_front_min_score=1.5)
    drafter = build_drafter("draft-lm-suffix", target, config, tmp_path)
    assert isinstance(drafter, SuffixFrontDrafter) and drafter.min_score == 1.5
    assert drafter.name == "draft-lm-suffix" and not drafter.predicts_acceptance
