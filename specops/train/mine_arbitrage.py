"""Arbitrage step mining and its oracle (arXiv 2512.05033): when is the target's step meaningfully better?

The oracle label of a step: the draft and the target each write the step after the same committed
text; each step is completed by the target greedily to the reply budget and scored; the target is
better when score(target step) - score(draft step) > margin. Identical steps are labelled "not better"
without rollouts. The miner commits the oracle's choice and moves on, so it walks the trajectory the
oracle router produces; the oracle also serves as a StepDecision, the upper bound a learned router
can reach.
"""

from __future__ import annotations

import time
from collections.abc import Collection
from dataclasses import dataclass

import torch

from specops.lossy.arbitrage import step_features
from specops.lossy.greedy_lm import GreedyLM, GreedyRun
from specops.train.mine_autojudge import ReplyScorer


@dataclass
class StepPair:
    index: int  # step number in the reply
    draft_step: list[int]
    target_step: list[int]
    target_better: bool
    advantage: float  # score(target step) - score(draft step); 0 for identical steps
    features: torch.Tensor  # [2 H_draft + 2]


class StepOracle:
    """Compares a draft step with the target's step by scoring both after greedy target completion."""

    def __init__(self, target: GreedyLM, boundaries: Collection[int], eos: Collection[int], max_new_tokens: int,
                 max_step_tokens: int, margin: float) -> None:
        self.target = target
        self.stop = frozenset(boundaries) | frozenset(eos)
        self.eos = frozenset(eos)
        self.max_new_tokens = max_new_tokens
        self.max_step_tokens = max_step_tokens
        self.margin = margin
        self.rollouts = 0  # target completions run so far (the mining budget counts them)

    def limit(self, committed: list[int]) -> int:
        return min(self.max_step_tokens, self.max_new_tokens - len(committed))

    def target_step(self, prompt_ids: list[int], committed: list[int]) -> list[int]:
        return self.target.greedy(prompt_ids + committed, self.limit(committed), self.stop).tokens

    def complete(self, prompt_ids: list[int], reply: list[int]) -> list[int]:
        room = self.max_new_tokens - len(reply)
        if room <= 0 or (reply and reply[-1] in self.eos):
            return reply
        self.rollouts += 1
        return reply + self.target.greedy(prompt_ids + reply, room, self.eos).tokens

    def advantage(self, prompt_ids: list[int], committed: list[int], draft_step: list[int], target_step: list[int],
                  score: ReplyScorer, reference: list[int]) -> float:
        if draft_step == target_step:
            return 0.0
        with_target = score(self.complete(prompt_ids, committed + target_step), reference)
        with_draft = score(self.complete(prompt_ids, committed + draft_step), reference)
        return with_target - with_draft


def mine_steps(prompt_ids: list[int], reference: list[int], draft: GreedyLM, oracle: StepOracle, score: ReplyScorer,
               max_rollouts: int) -> list[StepPair]:
    """Label the steps of one prompt until the reply budget, an EOS or max_rollouts target completions."""
    pairs: list[StepPair] = []
    committed: list[int] = []
    start = oracle.rollouts
    while oracle.limit(committed) > 0 and oracle.rollouts - start < max_rollouts:
        context = prompt_ids + committed
        run = draft.greedy(context, oracle.limit(committed), oracle.stop)
        target_step = oracle.target_step(prompt_ids, committed)
        gain = oracle.advantage(prompt_ids, committed, run.tokens, target_step, score, reference)
        better = gain > oracle.margin
        pairs.append(StepPair(len(pairs), run.tokens, target_step, better, gain, step_features(run.hidden, run.logprobs)))
        committed += target_step if better else run.tokens
        if committed[-1] in oracle.eos:
            break
    return pairs


class OracleDecision:
    """The oracle as a serving StepDecision (specops/lossy/arbitrage.py) for one prompt at a time: keeps the draft
    step unless the scorer says the target's is better by more than the margin. It needs the scorer and
    the target's reference reply, so it exists only in evaluation: the upper bound for a learned router.
    Its own rollouts are timed in `seconds`, so an evaluation can report the speed without them."""

    mode = "arbitrage-oracle"

    def __init__(self, oracle: StepOracle) -> None:
        self.oracle = oracle
        self.threshold = oracle.margin
        self.seconds = 0.0
        self._prompt: list[int] = []
        self._score: ReplyScorer | None = None
        self._reference: list[int] = []

    def start(self, prompt_ids: list[int], score: ReplyScorer, reference: list[int]) -> None:
        self._prompt, self._score, self._reference = list(prompt_ids), score, reference

    def __call__(self, context: list[int], step: GreedyRun) -> bool:
        if self._score is None or context[: len(self._prompt)] != self._prompt:
            raise RuntimeError("OracleDecision.start(prompt, score, reference) must be called for each prompt.")
        tick = time.perf_counter()
        committed = context[len(self._prompt):]
        target_step = self.oracle.target_step(self._prompt, committed)
        gain = self.oracle.advantage(self._prompt, committed, step.tokens, target_step, self._score, self._reference)
        self.seconds += time.perf_counter() - tick
        return gain <= self.oracle.margin
