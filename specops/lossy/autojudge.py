"""AutoJudge lossy verification (Garipov et al., arXiv 2504.20039): accept unimportant mismatches.

Greedy verification stops at the first draft token that differs from the target's argmax. AutoJudge
asks a classifier whether that mismatch *matters* for the answer; an unimportant one is accepted and
verification goes on. The target's rows after it were computed with the draft token in the input,
so the accepted prefix and the KV cache stay consistent.

Features of a mismatch at draft position i (the same in mining, specops/train/mine_autojudge.py):
    [ h_draft(prefix)  ;  h_target(prefix + x_i) ]     [H_draft + H_target]
h_draft is the draft's last-layer state that chose x_i; h_target is the target's last-layer state
*at* x_i, i.e. the target reading the sequence with the draft token in it (the paper's classifier
also reads the target's state on the draft-token sequence). Both are free: the first comes out of
drafting, the second out of the verify pass.
"""

from __future__ import annotations

import torch
from transformers import PreTrainedModel

from specops.core.drafter import Draft, DrafterBase, TokenStop, refuse_stop
from specops.core.kv import CachedLM
from specops.core.loop import (
    GREEDY,
    Cancelled,
    GenerationRequestError,
    GenerationStream,
    SpeculativeGenerator,
)
from specops.core.sampling import Randomness
from specops.core.target import Target
from specops.core.types import DEFAULT_DRAFT_TOKENS, Generation, SamplingParams
from specops.lossy.greedy_lm import GreedyLM
from specops.lossy.router import LinearRouter

MODE = "autojudge"


def mismatch_features(draft_hidden: torch.Tensor, target_hidden: torch.Tensor) -> torch.Tensor:
    """[n, H_draft] and [n, H_target] -> [n, H_draft + H_target] float32."""
    return torch.cat([draft_hidden.float(), target_hidden.float()], dim=-1)


def verify_judge(draft: torch.Tensor, p: torch.Tensor, importance: torch.Tensor,
                 threshold: float) -> tuple[int, int]:
    """Greedy verification that also accepts a mismatching x_i when importance[i] < threshold.

    draft [k], p [k+1, V] (logits or probabilities), importance [k] = P(x_i's mismatch is important).
    Matching tokens are always accepted. Threshold 0 accepts no mismatch: exactly `verify_greedy`.
    Returns (n_accepted, next_token); next_token is the target's argmax after the accepted prefix.
    """
    target = p.argmax(-1)  # [k+1]
    ok = (draft == target[:-1]) | (importance < threshold)  # [k]
    n = int(ok.long().cumprod(0).sum())
    return n, int(target[n])


class JudgeDrafter(DrafterBase):
    """A greedy draft LM that keeps the hidden state behind each drafted token for the judge."""

    name = "draft-lm"

    def __init__(self, model: PreTrainedModel, vocab: torch.Tensor | None = None) -> None:
        self.runner = GreedyLM(model, vocab)
        self.hidden = torch.zeros(0, model.config.hidden_size)  # [k, H] of the last proposal

    def reset(self) -> None:
        self.runner.reset()

    def propose(self, context: list[int], k: int, sampling: SamplingParams,
                generator: Randomness, stop: TokenStop | None = None) -> Draft:
        refuse_stop(self, stop)
        run = self.runner.greedy(context, k)
        self.hidden = run.hidden
        return Draft(tokens=run.tokens)  # greedy: q is the one-hot of each token


class JudgeGenerator(SpeculativeGenerator):
    """The speculative loop with AutoJudge verification (greedy decoding only)."""

    def __init__(self, target: Target, draft_model: PreTrainedModel, router: LinearRouter, threshold: float,
                 draft_tokens: int = DEFAULT_DRAFT_TOKENS, vocab: torch.Tensor | None = None) -> None:
        """`vocab`: the draft's draft vocabulary, if it was trained with one (specops.drafters.draft_lm)."""
        expected = draft_model.config.hidden_size + target.model.config.hidden_size
        if router.config.input_dim != expected:
            raise ValueError(f"The autojudge router reads {router.config.input_dim} features but this draft and "
                             f"target give {expected}: it was trained for other models.")
        super().__init__(target, JudgeDrafter(draft_model, vocab), "greedy", draft_tokens)
        self.router = router
        self.threshold = threshold
        self._generation: Generation | None = None  # the stream being served (one at a time, like the drafter)

    def stream(self, prompt_ids: list[int], max_new_tokens: int, sampling: SamplingParams = GREEDY,
               seed: int | None = None, cancelled: Cancelled | None = None,
               logprobs: int | None = None) -> GenerationStream:
        if logprobs is not None:  # its tokens are not the target's own choices: their logprobs would mislead
            raise GenerationRequestError("The lossy modes do not report logprobs; ask without a lossy mode.")
        if not sampling.greedy:
            raise GenerationRequestError("The autojudge lossy mode decodes greedily: use temperature 0.")
        stream = super().stream(prompt_ids, max_new_tokens, sampling, seed, cancelled)
        stats = stream.generation.stats
        stats.lossy, stats.lossy_mode, stats.lossy_threshold = True, MODE, self.threshold
        self._generation = stream.generation
        return stream

    def _verify(self, lm: CachedLM, last: int, draft: Draft, sampling: SamplingParams,
                generator: torch.Generator) -> tuple[list[int], int, torch.Tensor]:
        past = lm.length
        tokens = torch.tensor(draft.tokens, dtype=torch.long)
        logits, hidden = lm.forward_hidden([last] + draft.tokens)  # [k+1, V], [k+1, H]
        mismatch = tokens != logits[:-1].argmax(-1)  # [k]
        importance = torch.ones(len(draft.tokens))
        if bool(mismatch.any()):  # the classifier only runs when there is something to judge
            features = mismatch_features(self.drafter.hidden, hidden[1:])  # row i+1 holds x_i
            importance = self.router(features)
            # A draft EOS where the target goes on would end the reply early: a change of length, not of
            # wording, which the mined mismatches rarely show. No threshold accepts it (thresholds are finite).
            ends = torch.tensor([t in self.eos for t in draft.tokens])
            importance = importance.masked_fill(ends & mismatch, float("inf"))
        n, next_token = verify_judge(tokens, logits, importance, self.threshold)
        lm.crop(past + 1 + n)
        if self._generation is not None:
            self._generation.stats.lossy_accepted += int(mismatch[:n].sum())
        return draft.tokens[:n], next_token, logits[: n + 1]
