"""Continuous batching for the static runtime: the target passes of concurrent generations run as one.

Each generation runs its own loop on its own thread (drafting, verification rules, its own KV cache)
and hands its fixed-width target passes to a `PassBatcher`. The batcher collects the passes that
arrive together and runs them as one `LlamaForward.forward_many`: the matrix products read the
weights once for every sequence's rows, attention runs per sequence over its own cache. Requests
join and leave between passes, and each keeps its own positions, cache length and width, so no
sequence is padded to another's length (EMS-SD's point, arXiv 2405.07542, reached here by packing
each sequence's rows and attending per sequence rather than with a padded batch).

Exactness: a row's logits are bitwise the same alone or in any batch when the products do not depend
on the pass's row count and each sequence's attention call keeps its shape. bf16 `F.linear` agreed
over 2 to 96 rows for every SmolLM2 weight shape at 1 and 2 threads (one row can take another kernel,
hence `types.MIN_ROWS`); SDPA rows changed with the query count on the real target, hence the fixed
width per sequence. fp32 products are not invariant (MKL picks other kernels for other row counts at
2 threads), so `batch_invariant` refuses fp32 targets and a server then runs one generation at a time.
tests/core/test_batching.py checks this on small models; benchmarks/load_test.py on the real target.

Who runs a batch: the thread whose pass completes the set of registered sequences, or the first whose
wait exceeds `window_s` (a sequence still drafting does not hold the others back longer than that).
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch

from specops.core.cost_model import CostModel
from specops.core.llama import LlamaForward, Segment
from specops.core.policies import batch_draft_length

DEFAULT_WINDOW_S = 0.002  # how long a pass waits for the other sequences' passes before running without them


def batch_invariant(dtype: torch.dtype) -> bool:
    """Whether passes of this dtype may share a batch without changing any row (see the module docstring)."""
    return dtype == torch.bfloat16


@dataclass
class _Pass:
    segment: Segment
    result: tuple[torch.Tensor, torch.Tensor] | None = None
    error: BaseException | None = None
    done: bool = False
    queued: float = field(default_factory=time.monotonic)


class PassBatcher:
    """Batches the fixed-width passes of the sequences registered with it (one batcher per target)."""

    def __init__(self, forward: LlamaForward, window_s: float = DEFAULT_WINDOW_S,
                 on_batch: Callable[[int], None] | None = None, cost: CostModel | None = None) -> None:
        """`cost` (the target's pass times by rows, the drafter's per token) lets each sequence shrink its
        draft as the batch grows (`draft_cap`); without it drafts keep their policy's length."""
        if not batch_invariant(forward.dtype):
            raise ValueError(f"Batched passes are bitwise exact in bfloat16 only; this target is {forward.dtype}.")
        self.forward = forward
        self.window_s = window_s
        self.on_batch = on_batch  # called with each batch's size (metrics)
        self.cost = cost
        self.cores = os.cpu_count() or 1
        self._cond = threading.Condition()
        self._pending: list[_Pass] = []
        self._sequences = 0  # sequences registered: in their decode loop, so a pass of theirs may come
        self._running = False

    @contextlib.contextmanager
    def sequence(self) -> Iterator[None]:
        """A sequence's decode loop: while inside, a batch waits (up to the window) for its pass too."""
        with self._cond:
            self._sequences += 1
        try:
            yield
        finally:
            with self._cond:
                self._sequences -= 1
                self._cond.notify_all()  # the waiting passes may now be the whole set

    def draft_cap(self, acceptance: float, max_tokens: int) -> int:
        """The longest draft that still pays at the current batch size (SmartSpec: specops.core.policies)."""
        if self.cost is None:
            return max_tokens
        return batch_draft_length(acceptance, self.cost, max(1, self._sequences), max_tokens, self.cores)

    def run(self, segment: Segment) -> tuple[torch.Tensor, torch.Tensor]:
        """The logits and layer outputs of `segment`'s rows, computed in a batch with whatever other
        sequences' passes are waiting."""
        mine = _Pass(segment)
        with self._cond:
            self._pending.append(mine)
            self._cond.notify_all()
            while not mine.done:
                oldest = min(p.queued for p in self._pending) if self._pending else time.monotonic()
                wait = oldest + self.window_s - time.monotonic()
                if not self._running and self._pending and (len(self._pending) >= self._sequences or wait <= 0):
                    self._execute()
                else:
                    self._cond.wait(timeout=max(wait, 1e-4) if self._pending and not self._running else None)
        if mine.error is not None:
            raise mine.error
        assert mine.result is not None
        return mine.result

    def _execute(self) -> None:
        """Run the pending passes as one (called holding the lock, which it releases meanwhile)."""
        batch, self._pending = self._pending, []
        self._running = True
        self._cond.release()
        try:
            if self.on_batch is not None:
                self.on_batch(len(batch))
            with torch.inference_mode():
                results = self.forward.forward_many([p.segment for p in batch])
            for p, result in zip(batch, results, strict=True):
                p.result = result
        except BaseException as error:  # every waiting sequence gets it, not only the thread that ran it
            for p in batch:
                p.error = error
        finally:
            self._cond.acquire()
            self._running = False
            for p in batch:
                p.done = True
            self._cond.notify_all()
