"""AutoJudge verification: threshold 0 is greedy verification token for token; larger thresholds accept mismatches."""

from __future__ import annotations

import pytest
import torch

from specops.core.drafter import Draft, DrafterBase
from specops.core.loop import GREEDY, SpeculativeGenerator
from specops.core.verify import verify_greedy
from specops.drafters.draft_lm import DraftLMDrafter
from specops.lossy.autojudge import JudgeGenerator, verify_judge
from specops.lossy.router import LinearRouter

PROMPTS = [[5, 17, 33, 17, 33, 40], [9, 9, 9, 9], list(range(10, 40)), [7]]


def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, attention_mask=None)
    return out[0, len(prompt):].tolist()


@pytest.fixture(scope="module")
def router(router_dir) -> LinearRouter:
    return LinearRouter.load(router_dir / "autojudge", kind="autojudge")


def test_verify_judge_at_threshold_zero_is_verify_greedy():
    gen = torch.Generator().manual_seed(0)
    for _ in range(300):
        k = int(torch.randint(0, 7, (1,), generator=gen))
        p = torch.randn(k + 1, 11, generator=gen)
        draft = torch.randint(0, 11, (k,), generator=gen)
        agree = torch.rand(k, generator=gen) < 0.6  # many drafts with long matching prefixes
        draft[agree] = p[:-1].argmax(-1)[agree]
        importance = torch.rand(k, generator=gen)
        assert verify_judge(draft, p, importance, 0.0) == verify_greedy(draft, None, p)


def test_verify_judge_accepts_exactly_the_unimportant_mismatches():
    p = torch.eye(6)[[1, 2, 3, 4, 5]] * 5  # target argmax per row: 1, 2, 3, 4, 5
    draft = torch.tensor([1, 0, 3, 0])  # mismatches at positions 1 and 3
    importance = torch.tensor([0.9, 0.2, 0.9, 0.6])  # a match is accepted whatever its score
    assert verify_judge(draft, p, importance, 0.5) == (3, 4)  # 0.2 < 0.5 accepted, 0.6 stops: target's 4 next
    assert verify_judge(draft, p, importance, 0.7) == (4, 5)  # everything accepted: the bonus row's argmax
    assert verify_judge(draft, p, importance, 0.1) == (1, 2)  # greedy: stop at the first mismatch


def test_judge_accepting_nothing_equals_greedy_verification(target, draft_model, router):
    judge = JudgeGenerator(target, draft_model, router, threshold=0.0, draft_tokens=4)
    greedy = SpeculativeGenerator(target, DraftLMDrafter(draft_model, target.vocab_size), "greedy", 4)
    for prompt in PROMPTS:
        for n in (1, 9, 40):
            ours, theirs = judge.generate(prompt, n), greedy.generate(prompt, n)
            assert ours.token_ids == theirs.token_ids == hf_greedy(target.model, prompt, n), (prompt, n)
            assert ours.stats.per_step == theirs.stats.per_step  # the same verification, step by step
            assert ours.stats.lossy and ours.stats.lossy_mode == "autojudge" and ours.stats.lossy_threshold == 0.0
            assert ours.stats.lossy_accepted == 0


def test_judge_accepting_everything_commits_every_draft_token(target, draft_model, router):
    """Above every probability the judge takes all k draft tokens per step, then the target's next token."""
    k, n = 3, 24
    result = JudgeGenerator(target, draft_model, router, threshold=1.01, draft_tokens=k).generate(PROMPTS[0], n)
    expected, context = [], list(PROMPTS[0])
    while len(expected) < n:
        step = hf_greedy(draft_model, context, min(k, n - len(expected) - 1))
        step += hf_greedy(target.model, context + step, 1)
        expected += step
        context += step
        if 2 in step:  # the tiny models' EOS
            expected = expected[: expected.index(2) + 1]
            break
    assert result.token_ids == expected[:n]
    assert result.stats.accepted == result.stats.drafted > 0
    assert result.stats.lossy_accepted > 0  # random tiny models disagree: some accepted tokens were mismatches
    assert result.token_ids != hf_greedy(target.model, PROMPTS[0], n)


def test_judge_refuses_a_router_for_other_models(target, draft_model, router):
    with pytest.raises(ValueError, match="features"):
        JudgeGenerator(target, target.model, router, threshold=0.5)


def test_judge_is_greedy_only(target, draft_model, router):
    from specops.core.loop import GenerationRequestError
    from specops.core.types import SamplingParams

    with pytest.raises(GenerationRequestError, match="greedily"):
        JudgeGenerator(target, draft_model, router, 0.5).generate([5, 6], 4, SamplingParams(temperature=0.7))


def test_judge_never_accepts_a_draft_eos_the_target_does_not_choose(target, draft_model, router):
    """Accepting every mismatch, except a draft EOS: a draft that only proposes EOS leaves the target's reply."""
    k = 3
    judge = JudgeGenerator(target, draft_model, router, threshold=1.01, draft_tokens=k)
    eos = next(iter(target.eos_token_ids))

    class EndingDrafter(DrafterBase):
        name = "draft-lm"
        hidden = torch.zeros(k, draft_model.config.hidden_size)

        def propose(self, context, n, sampling, generator, stop=None):
            self.hidden = torch.zeros(n, draft_model.config.hidden_size)
            return Draft(tokens=[eos] * n)

    judge.drafter = EndingDrafter()
    for prompt in PROMPTS:
        assert judge.generate(prompt, 20).token_ids == hf_greedy(target.model, prompt, 20)


def test_judge_drafts_within_the_draft_vocabulary(target, draft_model, router):
    vocab = torch.tensor([2, 7, 11, 40, 41, 42])
    judge = JudgeGenerator(target, draft_model, router, threshold=1.01, draft_tokens=3, vocab=vocab)
    with torch.inference_mode():
        draft = judge.drafter.propose(PROMPTS[2], 3, GREEDY, None)
    assert draft.tokens and set(draft.tokens) <= set(vocab.tolist())
    assert draft.tokens == DraftLMDrafter(draft_model, target.vocab_size, vocab=vocab).propose(
        PROMPTS[2], 3, GREEDY, None).tokens
