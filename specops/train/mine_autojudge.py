"""AutoJudge mining (Garipov et al., arXiv 2504.20039, Algorithm 1): which draft/target mismatches matter?

Semi-greedy search over one prompt:
  1. reply = the target's greedy reply; its score under the chosen scorer is the reference score.
  2. Find the earliest position j (at or after the last one examined) where the draft's greedy
     choice d, given prompt + reply[:j], differs from reply[j].
  3. Swap d in and let the target continue greedily: swapped = reply[:j] + [d] + continuation.
  4. The mismatch is *important* when the swapped reply's score differs from the reference score by
     more than `margin`. An unimportant swap is kept (reply = swapped), so later mismatches are
     searched on the sequence a judge that accepts it would really produce; an important one is not.
  5. Go on after j until the reply is exhausted or the rollout budget is spent.
The features of each mismatch are specops.lossy.autojudge.mismatch_features, computed here exactly as the
serving loop sees them.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

from specops.drafters.draft_lm import draft_head
from specops.lossy.autojudge import mismatch_features
from specops.lossy.greedy_lm import GreedyLM

# (reply token ids, reference reply token ids) -> score in [0, 1] (specops/train/scorers.py reply_scorer)
ReplyScorer = Callable[[list[int], list[int]], float]


@dataclass
class Mismatch:
    position: int  # index in the reply
    target_token: int
    draft_token: int
    important: bool
    reference_score: float
    swapped_score: float
    features: torch.Tensor  # [H_draft + H_target]


@torch.inference_mode()
def teacher_forced(model: PreTrainedModel, ids: list[int], start: int,
                   vocab: torch.Tensor | None = None) -> tuple[list[int], torch.Tensor]:
    """The model's greedy choice (over its draft vocabulary `vocab`, if any) for each of ids[start:]
    given the tokens before it, and the last-layer states that chose them [len(ids) - start, H]: one
    pass, no cache."""
    hidden = model.base_model(torch.tensor([ids])).last_hidden_state[0, start - 1:len(ids) - 1]
    return draft_head(model, vocab)(hidden).argmax(-1).tolist(), hidden


def mine_mismatches(prompt_ids: list[int], reference: list[int], target: GreedyLM, draft_model: PreTrainedModel,
                    score: ReplyScorer, eos: Collection[int], max_new_tokens: int, margin: float,
                    max_rollouts: int, vocab: torch.Tensor | None = None) -> list[Mismatch]:
    """Label up to max_rollouts mismatches of one prompt. `reference` is the target's greedy reply of at
    most max_new_tokens (ending early at EOS); swapped replies are completed to the same budget."""
    reference_score = score(reference, reference)
    reply = list(reference)
    found: list[Mismatch] = []
    position = 0
    predicted, draft_hidden = teacher_forced(draft_model, prompt_ids + reply, len(prompt_ids), vocab)
    while len(found) < max_rollouts:
        j = next((i for i in range(position, len(reply)) if predicted[i] != reply[i]), None)
        if j is None:
            break
        swapped = reply[:j] + [predicted[j]]
        room = max_new_tokens - len(swapped)
        if predicted[j] in eos or room <= 0:
            target_hidden = target.hidden_after(prompt_ids + swapped)
        else:
            run = target.greedy(prompt_ids + swapped, room, eos)
            target_hidden = run.hidden[0]  # the state at the draft token, which chose the continuation
            swapped += run.tokens
        swapped_score = score(swapped, reference)
        important = abs(swapped_score - reference_score) > margin
        features = mismatch_features(draft_hidden[j][None], target_hidden[None])[0]
        found.append(Mismatch(j, reply[j], predicted[j], important, reference_score, swapped_score, features))
        if not important:
            reply = swapped  # the draft's view of the new suffix changes; its prefix stays the same
            predicted, draft_hidden = teacher_forced(draft_model, prompt_ids + reply, len(prompt_ids), vocab)
        position = j + 1
    return found
