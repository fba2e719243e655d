"""Greedy speculative output must be token-identical to the target's own greedy decoding."""

from __future__ import annotations

import pytest
import torch

from specops.core.loop import SpeculativeGenerator
from specops.core.verify import VERIFIERS
from specops.drafters.cosine import CosineDrafter, CosineSettings
from specops.drafters.del_exit import DELDrafter, ExitHeads
from specops.drafters.draft_lm import DraftLMDrafter
from specops.drafters.prompt_lookup import PromptLookupDrafter
from specops.drafters.recycling import RecyclingDrafter, merge_chain
from specops.drafters.suffix import SuffixCache, SuffixDrafter
from specops.drafters.suffix_front import SuffixFrontDrafter

PROMPTS = [[5, 17, 33, 17, 33, 40], [9, 9, 9, 9], list(range(10, 40)), [7]]


def reference(model, prompt: list[int], n: int) -> list[int]:
    out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, attention_mask=None)
    return out[0, len(prompt):].tolist()


def make_drafters(target, draft_model):
    vocab = target.vocab_size
    heads = ExitHeads.from_target(target.model, [1], torch.arange(vocab))  # the target's own head after layer 1 of 2
    heads.config.prior_acceptance = [1.0]  # drafts every step
    return {
        "none": None,
        "prompt-lookup": PromptLookupDrafter(max_ngram=3),
        "recycling": RecyclingDrafter(vocab, num_nodes=12),
        "hybrid": RecyclingDrafter(vocab, num_nodes=6, lookup=PromptLookupDrafter(max_ngram=2)),
        "draft-lm": DraftLMDrafter(draft_model, vocab),
        "self-draft": DraftLMDrafter(target.model, vocab),  # every draft accepted: exercises the bonus path
        # A draft window of 12 (2 sinks) evicts within these prompts plus 40 tokens: positions move, the
        # long prompt is prefilled as its sinks and last tokens. As a self-draft it shares the target model.
        "draft-lm-window": DraftLMDrafter(draft_model, vocab, window=12, sinks=2),
        "self-draft-window": DraftLMDrafter(target.model, vocab, window=12, sinks=2),
        "draft-lm-tree": DraftLMDrafter(draft_model, vocab, tree_nodes=8, tree_top_k=3),
        "self-draft-tree": DraftLMDrafter(target.model, vocab, tree_nodes=6, tree_top_k=2),
        # Learns from every earlier generation: repeated prompts draft their earlier output.
        "suffix": SuffixDrafter(SuffixCache(8, 64), 0, 1.0, 0.1),
        "suffix-tree": SuffixDrafter(SuffixCache(8, 64), 6, 1.0, 0.1),
        "draft-lm-suffix": SuffixFrontDrafter(SuffixDrafter(SuffixCache(8, 64), 0, 1.0, 0.1),
                                              DraftLMDrafter(draft_model, vocab), 1.0),
        # DEL on the dynamic runtime: its own early-layer cache, filled from the committed tokens.
        "del": DELDrafter(target.model, heads),
        # CoSine: a weak and a perfect specialist, routed (chains) and fused (trees).
        "cosine": CosineDrafter(cosine_specialists(target, draft_model), ["weak", "self"], CosineSettings(0.9, 0.1, 0)),
        "cosine-tree": CosineDrafter(cosine_specialists(target, draft_model), ["weak", "self"],
                                     CosineSettings(0.9, 0.1, 8)),
        "cosine-suffix": SuffixFrontDrafter(SuffixDrafter(SuffixCache(8, 64), 0, 1.0, 0.1), CosineDrafter(
            cosine_specialists(target, draft_model), ["weak", "self"], CosineSettings(0.9, 0.1, 0)), 1.0),
    }


def cosine_specialists(target, draft_model) -> list[DraftLMDrafter]:
    return [DraftLMDrafter(draft_model, target.vocab_size), DraftLMDrafter(target.model, target.vocab_size)]


@pytest.mark.parametrize("verifier", list(VERIFIERS))
def test_every_drafter_matches_target_greedy(target, draft_model, verifier):
    for name, drafter in make_drafters(target, draft_model).items():
        generator = SpeculativeGenerator(target, drafter, verifier=verifier, draft_tokens=4)
        for prompt in PROMPTS:
            for n in (1, 7, 40):
                got = generator.generate(prompt, n).token_ids
                assert got == reference(target.model, prompt, n), (name, verifier, prompt, n)


def test_a_window_that_rotates_the_models_own_frequencies_is_caught(target, monkeypatch):
    """Must-fail: a window's re-rotation that computes its angles in place, in the rotary frequencies it was
    handed (the model's own buffer, not a copy), moves the target's positions too: the output is no longer
    greedy decoding's. The self-draft window shares the target model, as in the suite above."""
    import specops.core.kv as kv

    def shift_in_place(keys, shift, inv_freq):
        angle = inv_freq.mul_(shift)
        emb = torch.cat((angle, angle)).float()
        return kv.rotate(keys.float(), emb.cos(), emb.sin()).to(keys.dtype)

    expected = [reference(target.model, prompt, 40) for prompt in PROMPTS]
    saved = target.model.model.rotary_emb.inv_freq.clone()
    monkeypatch.setattr(kv, "shift_positions", shift_in_place)
    try:
        got = []
        for prompt in PROMPTS:  # a fresh drafter (and frequencies) per prompt: the first eviction corrupts them
            target.model.model.rotary_emb.inv_freq.copy_(saved)
            drafter = DraftLMDrafter(target.model, target.vocab_size, window=12, sinks=2)
            got.append(SpeculativeGenerator(target, drafter, draft_tokens=4).generate(prompt, 40).token_ids)
        assert got != expected  # (the tiny target's argmax ignores positions on some prompts, not on all)
    finally:
        target.model.model.rotary_emb.inv_freq.copy_(saved)


def test_self_draft_accepts_everything(target):
    generator = SpeculativeGenerator(target, DraftLMDrafter(target.model, target.vocab_size), draft_tokens=4)
    result = generator.generate(PROMPTS[2], 30)
    stats = result.stats
    assert result.finish_reason == "length"  # no EOS within 30 tokens, so every step drafted 4
    assert stats.accepted == stats.drafted > 0
    assert stats.mean_accepted_length > 4.0


def test_merge_chain_is_a_trie_insert():
    tokens, parents = [5, 6, 7], [-1, -1, 0]  # root -> 5 -> 7, root -> 6
    assert merge_chain(tokens, parents, [5, 7, 9, 1]) == ([5, 6, 7, 9, 1], [-1, -1, 0, 2, 3])
    assert merge_chain(tokens, parents, [6]) == (tokens, parents)
    assert merge_chain([], [], [3, 4]) == ([3, 4], [-1, 0])


def test_recycling_learns_and_accepts(target):
    drafter = RecyclingDrafter(target.vocab_size, num_nodes=16)
    generator = SpeculativeGenerator(target, drafter, draft_tokens=8)
    prompt = PROMPTS[2]
    generator.generate(prompt, 40)  # warms the adjacency matrix
    again = generator.generate(prompt, 40)
    assert again.stats.accepted > 0
    assert again.stats.mean_accepted_length > 1.0


def test_reduced_vocabulary_draft_proposes_only_its_tokens_and_stays_lossless(target):
    from specops.core.sampling import logits_to_probs
    from specops.core.types import SamplingParams

    vocab = torch.arange(0, target.vocab_size, 3)  # every third token
    drafter = DraftLMDrafter(target.model, target.vocab_size, vocab=vocab)
    prompt = PROMPTS[2]
    full = target.model(torch.tensor([prompt])).logits[0, -1]
    restricted = torch.full_like(full, float("-inf"))
    restricted[vocab] = full[vocab]
    assert drafter.propose(prompt, 1, SamplingParams(), None).tokens == [int(restricted.argmax())]
    drafter.reset()
    sampling = SamplingParams(temperature=1.0)
    q = drafter.propose(prompt, 1, sampling, torch.Generator().manual_seed(0)).q[0]
    torch.testing.assert_close(q, logits_to_probs(restricted, sampling))
    assert q[1::3].sum() == 0 and q[2::3].sum() == 0
    generator = SpeculativeGenerator(target, DraftLMDrafter(target.model, target.vocab_size, vocab=vocab), draft_tokens=4)
    for prompt in PROMPTS:
        assert generator.generate(prompt, 30).token_ids == reference(target.model, prompt, 30)
