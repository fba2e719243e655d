"""Arbitrage, step-level lossy speculation (arXiv 2512.05033): keep a draft step unless the target's is better.

A step is the text up to a delimiter (a newline by default) or `max_step_tokens`. Each round:
  1. the draft writes a whole step greedily;
  2. a decision (a learned router, or the scorer-based oracle of specops/train/mine_arbitrage.py) predicts
     whether the target's own step would be meaningfully better;
  3. no: the draft step is committed as is, with no target pass at all (verification-free);
     yes: the target regenerates the step greedily. The draft step is its free proposal: one target
     pass checks it (greedy verification) and the target decodes on from the first disagreement.
The target's KV cache lags behind kept draft steps and catches up in its next pass, so a kept step
costs the target nothing until the router next escalates.

Router features of a draft step of n tokens (the same in mining, specops/train/mine_arbitrage.py):
    [ h_1 ; mean(h_1..h_n) ; mean(log q) ; min(log q) ]     [2 H_draft + 2]
h_j is the draft's last-layer state that chose token j and log q its log-probability: where the
step starts, what it says on average, and how sure the draft was.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Protocol

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from specops.core.kv import CachedLM
from specops.core.loop import (
    GREEDY,
    Cancelled,
    GenerationRequestError,
    GenerationStream,
    SpeculativeGenerator,
    prefill,
)
from specops.core.target import Target
from specops.core.types import Generation, SamplingParams
from specops.core.verify import verify_greedy
from specops.lossy.greedy_lm import GreedyLM, GreedyRun
from specops.lossy.router import LinearRouter

MODE = "arbitrage"
DEFAULT_DELIMITER = "\n"
DEFAULT_MAX_STEP_TOKENS = 32


def step_features(hidden: torch.Tensor, logprobs: torch.Tensor) -> torch.Tensor:
    """hidden [n, H], logprobs [n] of one draft step (n >= 1) -> features [2H + 2] float32."""
    hidden, logprobs = hidden.float(), logprobs.float()
    return torch.cat([hidden[0], hidden.mean(0), logprobs.mean()[None], logprobs.min()[None]])


def boundary_ids(tokenizer: PreTrainedTokenizerBase, delimiter: str) -> frozenset[int]:
    """Ids of the tokens whose text contains `delimiter` (with a byte-level BPE a newline hides in
    many tokens, like ':\\n' or '\\n\\n'); a step ends after the first of them."""
    if not delimiter:
        raise ValueError("The step delimiter must be a non-empty string.")
    texts = tokenizer.batch_decode([[i] for i in range(len(tokenizer))])
    return frozenset(i for i, text in enumerate(texts) if delimiter in text)


class StepDecision(Protocol):
    """Decides whether a draft step is kept. `threshold` and `mode` are reported in the stats."""

    threshold: float
    mode: str

    def __call__(self, context: list[int], step: GreedyRun) -> bool:
        """True keeps the draft step; False has the target regenerate it. `context`: prompt + committed."""


class RouterDecision:
    """Keep the draft step when the router's P(the target's step is better) is below the threshold.
    Threshold 0 never keeps one: every step is the target's, so the output is the target's greedy output."""

    mode = MODE

    def __init__(self, router: LinearRouter, threshold: float) -> None:
        self.router = router
        self.threshold = threshold

    def __call__(self, context: list[int], step: GreedyRun) -> bool:
        if self.threshold <= 0:  # nothing is below 0: skip the router
            return False
        return float(self.router(step_features(step.hidden, step.logprobs)[None])[0]) < self.threshold


class ArbitrageGenerator(SpeculativeGenerator):
    """Step-level draft/target arbitration (greedy decoding only)."""

    def __init__(self, target: Target, draft_model: PreTrainedModel, decision: StepDecision,
                 boundaries: frozenset[int], max_step_tokens: int = DEFAULT_MAX_STEP_TOKENS,
                 vocab: torch.Tensor | None = None) -> None:
        """`vocab`: the draft's draft vocabulary, if it was trained with one (specops.drafters.draft_lm)."""
        if max_step_tokens < 1:
            raise ValueError(f"max_step_tokens must be >= 1, got {max_step_tokens}")
        super().__init__(target, None, "greedy", 0)
        self.draft = GreedyLM(draft_model, vocab)
        self.decision = decision
        self.stop = boundaries | self.eos  # a step also ends at the end of the text
        self.max_step_tokens = max_step_tokens

    def stream(self, prompt_ids: list[int], max_new_tokens: int, sampling: SamplingParams = GREEDY,
               seed: int | None = None, cancelled: Cancelled | None = None,
               logprobs: int | None = None) -> GenerationStream:
        if logprobs is not None:  # its tokens are not the target's own choices: their logprobs would mislead
            raise GenerationRequestError("The lossy modes do not report logprobs; ask without a lossy mode.")
        if not sampling.greedy:
            raise GenerationRequestError("The arbitrage lossy mode decodes greedily: use temperature 0.")
        stream = super().stream(prompt_ids, max_new_tokens, sampling, seed, cancelled)
        stats = stream.generation.stats
        stats.lossy, stats.lossy_mode, stats.lossy_threshold = True, self.decision.mode, self.decision.threshold
        return stream

    def _steps(self, context: list[int], max_new_tokens: int, sampling: SamplingParams,
               generator: torch.Generator, out: Generation, cancelled: Cancelled | None,
               top_logprobs: int = 0) -> Iterator[list[int]]:
        stats = out.stats
        start = time.perf_counter()
        with torch.inference_mode():
            lm = CachedLM(self.target.model)
            if not prefill(lm, context[:-1], self.prefill_chunk, cancelled):
                out.finish_reason = "cancelled"
                return
            self.draft.reset()
            stats.prefill_s = time.perf_counter() - start
            while stats.new_tokens < max_new_tokens:
                limit = min(self.max_step_tokens, max_new_tokens - stats.new_tokens)
                tick = time.perf_counter()
                run = self.draft.greedy(context, limit, self.stop)
                keep = self.decision(context, run)
                tock = time.perf_counter()
                stats.draft_s += tock - tick
                if keep:
                    new = run.tokens
                    stats.lossy_accepted += 1
                else:
                    new = self._target_step(lm, context, run.tokens, limit, out)
                    stats.verify_s += time.perf_counter() - tock
                new, stopped = self._commit(new, context, out, start)
                yield new
                if stopped:
                    break

    def _target_step(self, lm: CachedLM, context: list[int], proposal: list[int], limit: int,
                     out: Generation) -> list[int]:
        """The target's greedy step after `context`, checking the draft's step as a proposal first.

        The cache holds a prefix of `context` (it lags behind kept draft steps); on return it holds
        context + step minus the step's last token, as the next pass expects.
        """
        fed = lm.length
        logits = lm.forward(context[fed:] + proposal)[len(context) - 1 - fed:]  # [len(proposal) + 1, V]
        n, next_token = verify_greedy(torch.tensor(proposal), None, logits)
        out.stats.record_step(len(proposal), n, len(proposal))
        step = proposal[:n]
        if step and (len(step) == limit or step[-1] in self.stop):  # the target wrote the draft's step
            lm.crop(len(context) + n - 1)
            return step
        lm.crop(len(context) + n)
        step.append(next_token)
        while len(step) < limit and step[-1] not in self.stop:
            step.append(int(lm.forward(step[-1:])[-1].argmax()))
            out.stats.record_step(0, 0, 0)
        return step
