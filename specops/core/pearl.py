"""PEARL: the drafter and the target run at the same time (arXiv 2408.11850, ICLR 2025).

Draft-then-verify makes each side wait for the other: the target idles while the drafter drafts, the
drafter while the target verifies. PEARL overlaps them. Here a drafter thread drafts one token at a
time, continuously, from the sequence it assumes (the committed tokens plus its own drafts so far),
while the generator's thread runs target passes over the last committed token plus the drafts ready:

- pre-verify: when the drafter is behind (after a rejection it restarts from the corrected context),
  the target waits for only `min_drafts` drafts (1 by default, the paper's pre-verify of the first
  draft token) and verifies them while the drafter drafts the rest;
- post-verify: while the target verifies a pass, the drafter drafts on beyond it, assuming every
  token is accepted. When the committed tokens are a prefix of its drafts it keeps the rest for the
  next pass; otherwise it is told to restart from the committed context, and a token it was drafting
  from the old one is dropped (a stale draft never reaches a pass).

So the draft length adapts by itself, as in the paper: long while the drafts are accepted (the drafter
gets ahead), short after a rejection. The paper places the two models on separate GPUs; here each
side gets one intra-op thread of a 2-core CPU (torch releases the GIL inside its ops, so the two
threads' ops run in parallel; what is left is their Python overhead and the memory bandwidth both
need).

Measured on the 2-core CPU (benchmarks/pearl.py, bf16 static width 5, 2026-11-25) it is slower than
draft-then-verify with the same draft (0.72x on HumanEval, 0.75x on ShareGPT): a target pass on one
core takes 26 ms against 17 ms on two, more than the drafting it hides (4 drafts, ~9 ms a pass), and
a drafter drafting at the same time slows it to ~32 ms (they share memory bandwidth, caches, and the
GIL between ops). Holding one draft ahead (lookahead 1) removes most of that slowdown: 0.81x. So it
only pays where the two sides get their own compute (the paper's separate GPUs).

It stays exact as the other generators are: every pass goes through the same runtime (on the static
one, every pass is the same width as plain decoding's), and the greedy and coupled verifiers emit the
target's own token at every position whatever was drafted. Rejection and block sampling are refused:
the drafter thread would draw from the shared random stream in an order set by thread timing.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from specops.core import native
from specops.core.drafter import Draft, Drafter
from specops.core.kv import CachedLM, StaticLM
from specops.core.loop import Cancelled, SpeculativeGenerator, prefill
from specops.core.sampling import PositionNoise, token_logprobs
from specops.core.target import Target
from specops.core.types import DEFAULT_DRAFT_TOKENS, DEFAULT_PREFILL_CHUNK, Generation, SamplingParams

PEARL_VERIFIERS = ("greedy", "coupled")  # the verifiers whose output cannot depend on thread timing


@contextlib.contextmanager
def intra_op_threads(n: int) -> Iterator[None]:
    """Run this thread's torch ops on `n` intra-op threads, then restore its setting.

    With the OpenMP backend the setting belongs to the calling thread (OpenMP's nthreads ICV): a
    thread that sets 1 leaves the others at theirs, so each side sets its own and restores it."""
    before = torch.get_num_threads()
    native.set_threads(n)
    try:
        yield
    finally:
        native.set_threads(before)


@dataclass
class PearlTimings:
    """Where one generation's decoding time went, per thread (seconds after the prefill)."""

    target_pass_s: float = 0.0  # the generator's thread inside target passes
    target_wait_s: float = 0.0  # the generator's thread waiting for drafts
    draft_busy_s: float = 0.0  # the drafter thread computing draft tokens
    draft_idle_s: float = 0.0  # the drafter thread waiting (far enough ahead, or starting)
    decode_s: float = 0.0  # wall time from the first pass to the last commit
    passes: int = 0  # target passes
    drafted: int = 0  # draft tokens computed and kept
    discarded: int = 0  # draft tokens computed from a context a rejection had already replaced


class DraftAhead:
    """A drafter thread keeping a queue of draft tokens that continue the committed tokens.

    `assumed` is the sequence the drafter drafts from: the committed tokens, then its drafts. A token
    drafted from a snapshot of it is appended only if no rejection replaced the sequence meanwhile
    (the epoch counts replacements)."""

    def __init__(self, drafter: Drafter, context: list[int], sampling: SamplingParams,
                 noise: PositionNoise | None, lookahead: int, timings: PearlTimings) -> None:
        self._drafter = drafter
        self._sampling = sampling
        self._noise = noise
        self._lookahead = lookahead
        self._timings = timings
        self._cond = threading.Condition()
        self._assumed = list(context)
        self._committed = len(context)
        self._epoch = 0
        self._closed = False
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="pearl-drafter", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            with intra_op_threads(1), torch.inference_mode():  # inference mode is per thread too
                while (job := self._next_job()) is not None:
                    tick = time.perf_counter()
                    token = self._draft(job[0])
                    self._timings.draft_busy_s += time.perf_counter() - tick
                    self._append(token, job[1])
        except BaseException as error:  # handed to the generator's thread, which raises it
            with self._cond:
                self._error = error
                self._cond.notify_all()

    def _next_job(self) -> tuple[list[int], int] | None:
        """Wait until there is a token worth drafting: (the sequence to continue, its epoch); None once closed."""
        tick = time.perf_counter()
        with self._cond:
            while not self._closed and len(self._assumed) - self._committed >= self._lookahead:
                self._cond.wait()
            self._timings.draft_idle_s += time.perf_counter() - tick
            return None if self._closed else (list(self._assumed), self._epoch)

    def _draft(self, sequence: list[int]) -> int:
        # Coupled: the noise of the position this token would fill, from the drafter's own PositionNoise
        # (same seed, its own cache: the generator's thread prunes the other one's while this runs).
        noise = self._noise.shifted(len(sequence)) if self._noise is not None else None
        draft = self._drafter.propose(sequence, 1, self._sampling, noise)
        if len(draft.tokens) != 1 or draft.is_tree:
            raise ValueError(f"PEARL drafts chains token by token; the {self._drafter.name} drafter gave "
                             f"{'a tree' if draft.is_tree else f'{len(draft.tokens)} tokens'} for one.")
        return draft.tokens[0]

    def _append(self, token: int, epoch: int) -> None:
        with self._cond:
            if epoch == self._epoch:
                self._assumed.append(token)
                self._timings.drafted += 1
                self._cond.notify_all()
            else:
                self._timings.discarded += 1

    def take(self, most: int, least: int) -> list[int]:
        """Up to `most` drafts continuing the committed tokens, once at least `least` are ready."""
        with self._cond:
            while self._error is None and len(self._assumed) - self._committed < least:
                self._cond.wait()
            if self._error is not None:
                raise self._error
            return self._assumed[self._committed: self._committed + most]

    def commit(self, tokens: list[int]) -> None:
        """The target committed `tokens`. Drafts that continue them stay (post-verify); otherwise the
        drafter restarts from the committed sequence."""
        with self._cond:
            if self._assumed[self._committed: self._committed + len(tokens)] != tokens:
                self._assumed[self._committed:] = tokens
                self._epoch += 1
            self._committed += len(tokens)
            self._cond.notify_all()

    def close(self) -> None:
        """Stop the thread and wait for it: it has ended when this returns."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join()


class PearlGenerator(SpeculativeGenerator):
    def __init__(self, target: Target, drafter: Drafter, verifier: str = "greedy",
                 draft_tokens: int = DEFAULT_DRAFT_TOKENS, min_drafts: int = 1, lookahead: int | None = None,
                 static_width: int = 0, compiled: bool = False, prefill_chunk: int = DEFAULT_PREFILL_CHUNK) -> None:
        """A pass verifies at most `draft_tokens` drafts (static_width - 1 on the static runtime) and
        waits for `min_drafts` of them (0: never waits; 1: PEARL's pre-verify). The drafter holds at
        most `lookahead` drafts beyond the committed tokens; by default a pass's drafts, the bonus
        position and the next pass's (post-verify across a fully accepted pass). Fewer draft less in
        vain: every draft token takes memory bandwidth and cache the target's pass needs at the same
        time. Other arguments as SpeculativeGenerator's."""
        if verifier not in PEARL_VERIFIERS:
            raise ValueError(f"PEARL verifies with {' or '.join(PEARL_VERIFIERS)}, not '{verifier}': the drafter "
                             "thread would draw from the shared random stream in an order set by thread timing.")
        if drafter is None or drafter.hidden_layers is not None:
            raise ValueError("PEARL needs a drafter that drafts from tokens alone (e.g. draft-lm), not "
                             f"{'none' if drafter is None else 'one that reads the target features'}.")
        super().__init__(target, drafter, verifier, draft_tokens, static_width=static_width, compiled=compiled,
                         prefill_chunk=prefill_chunk)
        self.max_drafts = min(draft_tokens, static_width - 1) if static_width else draft_tokens
        if not 0 <= min_drafts <= self.max_drafts:
            raise ValueError(f"min_drafts must be between 0 and the drafts a pass takes ({self.max_drafts}), "
                             f"got {min_drafts}.")
        self.min_drafts = min_drafts
        self.lookahead = lookahead if lookahead is not None else 2 * self.max_drafts + 1
        if self.lookahead < max(min_drafts, 1):
            raise ValueError(f"lookahead must be >= 1 and >= min_drafts ({min_drafts}), got {self.lookahead}.")
        self.timings: list[PearlTimings] = []  # one per generation, in order

    def _steps(self, context: list[int], max_new_tokens: int, sampling: SamplingParams,
               generator: torch.Generator | PositionNoise, out: Generation,
               cancelled: Cancelled | None, top_logprobs: int = 0) -> Iterator[list[int]]:
        stats, timings = out.stats, PearlTimings()
        self.timings.append(timings)
        start = time.perf_counter()
        with torch.inference_mode():
            lm = self._target_lm(len(context), max_new_tokens)
            # At the caller's intra-op threads: a prefill is compute-bound, and the drafter has nothing to do yet.
            if not prefill(lm, context[:-1], self.prefill_chunk, cancelled):
                out.finish_reason = "cancelled"
                return
            stats.prefill_s = time.perf_counter() - start
            self.drafter.reset()
            noise = PositionNoise(generator.seed, generator.vocab) if isinstance(generator, PositionNoise) else None
            with intra_op_threads(1):  # one core each: the drafter thread sets its own
                ahead = DraftAhead(self.drafter, context, sampling, noise, self.lookahead, timings)
                try:
                    while stats.new_tokens < max_new_tokens:
                        if isinstance(generator, PositionNoise):
                            generator = generator.shifted(len(context))  # row 0: the next position to fill
                        new, stopped = self._pass(lm, ahead, context, max_new_tokens, sampling, generator, out, start,
                                                  top_logprobs)
                        yield new
                        if stopped:
                            break
                finally:  # also when the caller stops iterating or a pass raises: no drafter thread outlives it
                    ahead.close()
            self.drafter.finish(context)

    def _pass(self, lm: CachedLM | StaticLM, ahead: DraftAhead, context: list[int], max_new_tokens: int,
              sampling: SamplingParams, generator: torch.Generator | PositionNoise, out: Generation, start: float,
              top_logprobs: int) -> tuple[list[int], bool]:
        """One target pass over the last committed token and the drafts ready; commits its tokens."""
        stats, timings = out.stats, self.timings[-1]
        most = min(self.max_drafts, max_new_tokens - stats.new_tokens - 1)
        tick = time.perf_counter()
        draft = Draft(ahead.take(most, min(self.min_drafts, most)))
        tock = time.perf_counter()
        accepted, next_token, rows = self._verify(lm, context[-1], draft, sampling, generator)
        ahead.commit(accepted + [next_token])  # first: on a rejection the drafter restarts at once
        timings.target_wait_s += tock - tick
        timings.target_pass_s += time.perf_counter() - tock
        timings.passes += 1
        stats.draft_s, stats.verify_s = timings.target_wait_s, timings.target_pass_s
        stats.record_step(len(draft.tokens), len(accepted), len(draft.tokens))
        stats.bonus += int(len(accepted) == len(draft.tokens) > 0)
        new, stopped = self._commit(accepted + [next_token], context, out, start)
        timings.decode_s = time.perf_counter() - start - stats.prefill_s
        if out.logprobs is not None:
            out.logprobs.extend(token_logprobs(rows, new, top_logprobs))
        return new, stopped
