"""A draft LM behind a Suffix Decoding front: free drafts where the text repeats, the model elsewhere.
The back may also be CoSine's routed specialist draft LMs (cosine-suffix, specops.drafters.cosine): the
suffix tries are then one more specialist, model-free, routed to by their own confidence each step.

Model-free drafting wins where an answer repeats what was written before (the prompt, earlier
answers, a template): its drafts cost nothing and, on a long match, are long and mostly accepted. A
draft LM wins on new text, at a price per drafted token (the quickstart's 2-layer draft spends 6-7 ms
a step on this CPU, a third of a target pass). SAM-Decoding (arXiv 2411.10666) combines the two by
match length; here the suffix tries' own estimate decides: when the draft they propose is expected
to have at least `min_score` tokens accepted (the sum of their tokens' estimated probabilities,
specops.drafters.suffix), it is drafted and the draft LM is not run; otherwise the draft LM drafts,
with its SpecDec++ stop rule when it has an acceptance head. Either drafter's cache catches up with
the context when it next drafts.

Lossless: which drafter drafts a step is decided from the context alone, before anything is drawn,
and each draft comes with the distribution it was drawn from (the suffix draft is deterministic:
q one-hot), so every verifier's rule holds step by step (tests/core/test_loop_distribution.py).
"""

from __future__ import annotations

import copy

from specops.core.drafter import Draft, DrafterBase, TokenStop
from specops.core.kv import CachedLM, StaticLM
from specops.core.sampling import Randomness
from specops.core.types import SamplingParams
from specops.drafters.cosine import CosineDrafter
from specops.drafters.draft_lm import DraftLMDrafter
from specops.drafters.suffix import SuffixDrafter


class SuffixFrontDrafter(DrafterBase):
    def __init__(self, front: SuffixDrafter, back: DraftLMDrafter | CosineDrafter, min_score: float) -> None:
        """`back`: a draft LM (draft-lm-suffix) or CoSine's routed specialists (cosine-suffix), drafting chains."""
        self.name = "cosine-suffix" if isinstance(back, CosineDrafter) else "draft-lm-suffix"
        back_tree = back.settings.tree_nodes if isinstance(back, CosineDrafter) else back.tree_nodes
        if front.tree_nodes or back_tree:
            raise ValueError(f"The {self.name} drafter drafts chains: give it a chain suffix drafter and draft LM.")
        if min_score <= 0:
            raise ValueError(f"suffix_front_min_score must be > 0 (the expected accepted tokens of a suffix draft), "
                             f"got {min_score}.")
        self.front, self.back, self.min_score = front, back, min_score
        self.front_steps = 0  # steps drafted by the front since the last reset, and by the draft LM
        self.back_steps = 0
        self._declined: int | None = None  # the context length at which free_draft last declined

    def __copy__(self) -> SuffixFrontDrafter:
        """A fork (one per server generation slot) has its own per-request state in both drafters; the
        suffix drafter's global cache stays shared, as for a plain suffix drafter's forks."""
        twin = object.__new__(SuffixFrontDrafter)
        twin.__dict__.update(self.__dict__)
        twin.front, twin.back = copy.copy(self.front), copy.copy(self.back)
        return twin

    @property
    def predicts_acceptance(self) -> bool:  # type: ignore[override]  # DrafterBase's is a plain False
        return self.back.predicts_acceptance

    @property
    def remembers(self) -> int:  # type: ignore[override]
        return self.front.remembers

    @property
    def peak_kv_bytes(self) -> int:  # type: ignore[override]
        return self.back.peak_kv_bytes  # the suffix tries are no KV cache

    def reset(self) -> None:
        self.front.reset()
        self.back.reset()
        self.front_steps = self.back_steps = 0
        self._declined = None

    def share_runtime(self, lm: CachedLM | StaticLM) -> None:
        self.back.share_runtime(lm)  # the draft LM batches its passes with the target's when they are batched

    def propose(self, context: list[int], k: int, sampling: SamplingParams, generator: Randomness,
                stop: TokenStop | None = None) -> Draft:
        # Under load the loop offers the free draft first at a longer length; once declined there it would be
        # declined at k too (a shorter draft of the tries scores no more), so the tries are not walked again.
        declined, self._declined = self._declined == len(context), None
        draft = None if declined else self.free_draft(context, k)
        if draft is not None:
            return draft
        self.back_steps += 1
        return self.back.propose(context, k, sampling, generator, stop)

    def free_draft(self, context: list[int], k: int) -> Draft | None:
        """The suffix tries' draft when they expect at least min_score of its tokens accepted."""
        draft, score = self.front.scored(context, k)
        if draft.tokens and score >= self.min_score:
            self.front_steps += 1
            return draft
        self._declined = len(context)
        return None

    def finish(self, context: list[int]) -> None:
        self.front.finish(context)

    def remember(self, responses: list[list[int]]) -> None:
        self.front.remember(responses)
