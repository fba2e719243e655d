"""Continuous batching for the static runtime: the target passes of concurrent generations run as one.

Each generation runs its own loop on its own thread (drafting, verification rules, its own KV cache)
and hands its target passes to a `PassBatcher`. The batcher's pass thread collects the passes that
arrive together and runs them as one `LlamaForward.forward_many`: the matrix products read the
weights once for every sequence's rows, and sequences whose caches have the same length attend in one
call. Requests join and leave between passes; each sequence keeps its own positions and cache length
and brings only its real rows (the last committed token and its draft), so no sequence is padded to
another's length or width (EMS-SD, arXiv 2405.07542: its point is batching requests that accept
different numbers of tokens without padding tokens; see specops.core.kv.StaticLM.forward).

Exactness: a row's logits are bitwise the same alone or in any batch when neither the products nor
attention change a row with the pass's shape. bf16 `F.linear` agreed over 2 to 96 rows for every
SmolLM2 weight shape at 1 and 2 threads (one row can take another kernel, hence `types.MIN_ROWS`);
`LlamaForward.attention` agrees over query counts and batch sizes (SDPA's flash kernel did not: it
changed rows with the query count on the real target). Both hold only while every product runs on
oneDNN: torch sends a CPU matmul there when batch x m x n x k exceeds 16**3 and sums smaller ones
another way, so a model whose attention for one sequence and one row falls under that size rounds now
and then differently alone than beside others (`batch_invariant` refuses it; found on a 64-wide test
model, whose one-sequence attention products are 16**3 exactly). fp32 products are not invariant (MKL
picks other kernels for other row counts at 2 threads), so `batch_invariant` refuses fp32 targets too
and a server then runs one generation at a time. tests/core/test_batching.py checks this on small
models; benchmarks/load_test.py on the real target.

One pass thread runs every pass (prefills too, each as a pass of its own), with all the intra-op
threads; the generation threads run theirs (verification, streaming, model-free drafting) on one. A draft
LM's passes can join (`forward_of`, specops.drafters.draft_lm.StaticDraftLM): each batch then runs one
pass per model, the target's and the draft's. With OpenMP, every Python
thread that runs a parallel op owns a team of worker threads, and once they outnumber the cores libgomp
stops spinning between parallel regions, so each op paid a wake-up: a batched pass took 50-60 ms on a
generation thread against 23 ms on the main thread (SmolLM2 bf16, 8 sequences, 2 cores).

When a batch runs: as soon as every registered sequence's pass is in; else a pass waits up to one pass
time for the sequences of the last batch (they are preparing their next pass: verifying, streaming,
drafting, one thread at a time under the GIL; not waiting split 8 sequences into two half-size batches
that alternated), and up to `window_s` for anyone else (a sequence that just joined may be drafting).

The team a thread gets lives as long as the thread, and every team counts. So no long-lived thread but
the pass thread may run parallel torch work: a server's event loop that loaded the model (or a registry
watcher that loaded a new version) kept a team, and the same 8-sequence pass took 52 ms on the pass
thread against 23 ms (28 ms once the loading thread's team was gone). Such work goes through
`on_short_thread`, whose team ends with it.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch
from transformers import PreTrainedModel

from specops.core.cost_model import CostModel
from specops.core.llama import LlamaForward, Segment, llama_forward
from specops.core.policies import batch_draft_length
from specops.core.types import MIN_ROWS, STATIC_BUCKET

DEFAULT_WINDOW_S = 0.002  # how long a pass waits for the other sequences' passes before running without them
IDLE_EXIT_S = 5.0  # the pass thread ends after this long without work (a swapped-out model's batcher goes quiet)
T = TypeVar("T")


def on_short_thread(work: Callable[[], T], name: str = "specops-setup") -> T:
    """`work()` on a thread that ends with it, with the caller's intra-op threads; its result or its error.
    For parallel torch work (loading or warming up a model) asked for by a long-lived thread, which would
    otherwise keep an OpenMP team for good and slow every pass after (see the module docstring)."""
    threads = torch.get_num_threads()  # the caller's: a new thread starts with the last value any thread set

    def run() -> T:
        torch.set_num_threads(threads)
        return work()

    with ThreadPoolExecutor(1, thread_name_prefix=name) as pool:
        return pool.submit(run).result()


# torch's CPU matmuls run on oneDNN only above this many multiply-adds (batch x m x n x k; `checksize` in
# aten/src/ATen/native/mkldnn/Matmul.cpp); smaller ones take a kernel that sums in another order.
ONEDNN_MIN_WORK = 16**3


def batch_invariant(model: PreTrainedModel) -> bool:
    """Whether passes of this model may share a batch without changing any row (see the module docstring):
    bf16, and its smallest products large enough for oneDNN. The smallest are one sequence's attention at
    one query row over the shortest static cache (every query head x STATIC_BUCKET keys x head_dim), and
    the output projection over MIN_ROWS rows."""
    config = model.config
    heads = config.num_attention_heads
    width = heads * (getattr(config, "head_dim", None) or config.hidden_size // heads)  # query heads x head_dim
    smallest = min(width * STATIC_BUCKET, MIN_ROWS * config.hidden_size * width)
    return model.dtype == torch.bfloat16 and smallest > ONEDNN_MIN_WORK


def _invariant_forward(model: PreTrainedModel) -> LlamaForward:
    if not batch_invariant(model):
        raise ValueError(f"Batched passes are bitwise exact only in bfloat16 and for models whose products all "
                         f"run on oneDNN; this model is {model.dtype} (see specops.core.batching).")
    return llama_forward(model)[0]


@dataclass(eq=False)  # passes are compared by identity
class _Pass:
    work: Segment | Callable[[], Any]  # a segment to batch, or a call to run alone on the pass thread
    forward: LlamaForward | None = None  # a segment's model (the target's or a draft's)
    head: bool = True  # a segment's logits, or its final hidden states (a draft applies its own head)
    thread: int = field(default_factory=threading.get_ident)  # the submitting sequence's
    result: Any = None
    error: BaseException | None = None
    done: bool = False
    queued: float = field(default_factory=time.monotonic)

    @property
    def alone(self) -> bool:
        return not isinstance(self.work, Segment)


class PassBatcher:
    """Batches the passes of the sequences registered with it on one pass thread (one batcher per target)."""

    def __init__(self, model: PreTrainedModel, window_s: float = DEFAULT_WINDOW_S,
                 on_batch: Callable[[int], None] | None = None, cost: CostModel | None = None,
                 threads: int | None = None) -> None:
        """`cost` (the target's pass times by rows, the drafter's per token) lets each sequence shrink its
        draft as the batch grows (`draft_cap`); without it drafts keep their policy's length. `threads`:
        the pass thread's intra-op threads (default: every core)."""
        self.forward = _invariant_forward(model)  # the target's eager forward, which its sequences' StaticLMs run
        self.batched_drafts = False  # whether a draft model's passes are batched here too (forward_of)
        self.window_s = window_s
        self.on_batch = on_batch  # called with each batch's size (metrics)
        self.cost = cost
        self.cores = os.cpu_count() or 1
        self.threads = threads or self.cores
        self._cond = threading.Condition()
        self._pending: list[_Pass] = []
        self._members: set[int] = set()  # threads of the sequences in their decode loop: a pass of theirs may come
        self._cohort: set[int] = set()  # threads whose passes ran in the last batch
        self._pass_s = window_s  # the last batch's duration: how long a pass waits for the last batch's sequences
        self._worker: threading.Thread | None = None

    @contextlib.contextmanager
    def sequence(self) -> Iterator[None]:
        """A sequence's decode loop: while inside, a batch waits for its pass too (see the module docstring)."""
        me = threading.get_ident()  # one sequence decodes per thread at a time
        with self._cond:
            self._members.add(me)
        try:
            yield
        finally:
            with self._cond:
                self._members.discard(me)
                self._cond.notify_all()  # the waiting passes may now be the whole set

    def forward_of(self, model: PreTrainedModel) -> LlamaForward:
        """The eager forward of `model` (the target, or a draft LM whose passes are batched here too), once
        checked that its rows do not depend on the batch: a sampled request's draft must not depend on what
        else is running, or its output would not be reproducible."""
        forward = _invariant_forward(model)
        if forward is not self.forward:
            self.batched_drafts = True
        return forward

    def draft_cap(self, acceptance: float, max_tokens: int) -> int:
        """The longest draft that still pays at the current batch size (SmartSpec: specops.core.policies).
        Drafting costs one batched draft pass a token once a draft LM batches here (a server's slots all
        draft alike), else each sequence's own drafting shares the cores."""
        if self.cost is None:
            return max_tokens
        batch = max(1, len(self._members))
        # Drafts on the generation threads share the cores; batched here, one draft pass serves every sequence.
        return batch_draft_length(acceptance, self.cost, batch, max_tokens, batch if self.batched_drafts else self.cores)

    def run(self, segment: Segment, forward: LlamaForward | None = None, head: bool = True,
            ) -> tuple[torch.Tensor, torch.Tensor]:
        """The logits (without `head`: the final hidden states) and layer outputs of `segment`'s rows through
        `forward` (default: the target's), computed in a batch with whatever other passes are waiting."""
        return self._submit(_Pass(segment, forward or self.forward, head))

    def call(self, work: Callable[[], Any]) -> Any:
        """`work()` run alone on the pass thread, between batches (a prompt's prefill, timing the target)."""
        return self._submit(_Pass(work))

    def _submit(self, mine: _Pass) -> Any:
        with self._cond:
            if threading.current_thread() is self._worker:
                raise RuntimeError("A pass submitted from the pass thread would wait for itself.")
            self._pending.append(mine)
            if self._worker is None:
                worker = threading.Thread(target=self._loop, name="specops-passes", daemon=True)
                try:
                    worker.start()
                except BaseException:
                    self._pending.remove(mine)
                    raise
                self._worker = worker
            self._cond.notify_all()
            while not mine.done:
                self._cond.wait()
        if mine.error is not None:
            raise mine.error
        return mine.result

    def _loop(self) -> None:
        """The pass thread: runs whatever is due, or ends after IDLE_EXIT_S without work."""
        with self._cond:
            idle_since = time.monotonic()
            try:
                # This thread's OpenMP team size (torch also makes it the default of threads started later;
                # the server's slots set theirs per request).
                torch.set_num_threads(self.threads)
                while True:
                    due, wait = self._due()
                    if due:
                        self._execute(due)
                        idle_since = time.monotonic()
                    elif self._pending:
                        self._cond.wait(timeout=wait)
                    elif time.monotonic() - idle_since > IDLE_EXIT_S:
                        return
                    else:
                        self._cond.wait(timeout=IDLE_EXIT_S)
            except BaseException as error:  # a bug here must not leave sequences waiting forever
                for p in self._pending:
                    p.error, p.done = error, True
                self._pending = []
                raise
            finally:
                self._worker = None  # a later pass starts a new thread
                self._cond.notify_all()

    def _due(self) -> tuple[list[_Pass], float]:
        """The passes to run now (a batch, or one pass alone), else none and how long to wait (holding the lock)."""
        batch, wait = [p for p in self._pending if not p.alone], IDLE_EXIT_S
        if batch:
            here = {p.thread for p in batch}
            oldest = min(p.queued for p in batch)
            patience = self._pass_s if (self._cohort & self._members) - here else self.window_s
            wait = 0.0 if here >= self._members else oldest + max(patience, self.window_s) - time.monotonic()
            if wait <= 0:
                return batch, 0.0
        alone = [p for p in self._pending if p.alone]
        if alone:  # runs while the batch gathers: the stragglers arrive meanwhile
            return alone[:1], 0.0
        return [], wait

    def _execute(self, due: list[_Pass]) -> None:
        """Run `due` (called holding the lock, which it releases meanwhile)."""
        self._pending = [p for p in self._pending if p not in due]
        batched = not due[0].alone
        if batched:
            self._cohort = {p.thread for p in due}
        self._cond.release()
        began = time.monotonic()
        try:
            with torch.inference_mode():
                if batched:  # one pass per model (and head): the target's, and a draft LM's when batched here
                    groups: dict[tuple[int, bool], list[_Pass]] = {}
                    for p in due:
                        groups.setdefault((id(p.forward), p.head), []).append(p)
                    for members in groups.values():
                        forward = members[0].forward
                        assert forward is not None
                        if self.on_batch is not None and forward is self.forward:
                            self.on_batch(len(members))
                        results = forward.forward_many([p.work for p in members], members[0].head)  # type: ignore[misc]
                        for p, result in zip(members, results, strict=True):
                            p.result = result
                else:
                    due[0].result = due[0].work()  # type: ignore[operator]
        except BaseException as error:  # every waiting sequence gets it, not only one
            for p in due:
                p.error = error
        finally:
            self._cond.acquire()
            if batched:
                self._pass_s = time.monotonic() - began
            for p in due:
                p.done = True
            self._cond.notify_all()
