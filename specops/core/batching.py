"""Continuous batching for the static runtime: the target passes of concurrent generations run as one.

Each generation runs its own loop on its own thread (drafting, verification rules, its own KV cache) and
hands its target passes to a `PassBatcher`. The batcher's pass thread collects the passes that arrive
together and runs them as one `LlamaForward.forward_many`: the matrix products read the weights once for
every sequence's rows, and each sequence's rows attend over its own cache in place, up to each row's
visible end (the native decoder's kernel, specops.core.native; without it the sequences attend in one ATen
call, their caches padded to the longest on each side of 1024 slots where that changes no row:
LlamaForward.pads_exactly, else one call per cache length). Requests join and leave between passes; each
sequence keeps its own positions and cache length and brings only its real rows (the last committed token
and its draft), so no sequence's rows are padded to another's count (EMS-SD, arXiv 2405.07542: its point
is batching requests that accept different numbers of tokens without padding tokens; see
specops.core.kv.StaticLM.forward).

Exactness: a row's logits are bitwise the same alone or in any batch when neither the products nor
attention change a row with the pass's shape. bf16 `F.linear` agreed over 2 to 96 rows for every SmolLM2
weight shape at 1 and 2 threads (one row can take another kernel, hence `types.MIN_ROWS`), and later over
1 to 1024 rows on random weights of those shapes, a row anywhere in the pass; oneDNN's packed products are
F.linear's sums, and our product kernel (specops.core.packed_linear, native_linear.cpp, where this CPU runs
it) sums each output of a row in a fixed order, alone or beside any rows. The native attention kernel
computes a row from its query and its visible slots alone, whatever else is in the pass (a prompt's rows too,
so a prompt prefilled in any chunks is bitwise its one-pass prefill: specops.core.prefix_cache);
`LlamaForward.attention` (the Python loop's) agrees over query counts and batch sizes as measured (SDPA's
flash kernel did not: it changed rows with the query count on the real target). The measured ones hold only while every product
runs on oneDNN: torch sends a CPU matmul there when batch x m x n x k exceeds 16**3 and sums smaller ones
another way, so a model whose attention for one sequence and one row falls under that size rounds now and
then differently alone than beside others (`batch_invariant` refuses it; found on a 64-wide test model,
whose one-sequence attention products are 16**3 exactly). fp32 products are not invariant (MKL picks other
kernels for other row counts at 2 threads), so `batch_invariant` refuses fp32 targets too and a server
then runs one generation at a time. tests/core/test_batching.py checks this on small models;
benchmarks/load_test.py on the real target.

One pass thread runs every pass (prefills too, each as a pass of its own), with all the intra-op
threads; the generation threads run theirs (verification, streaming, model-free drafting) on one. Each
sets its count through specops.core.native.set_threads, or the pass thread can take a generation thread's
1 at its first op and run every pass on one core (as it did, for whole load-test phases). A draft
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

Draft lengths under load (`draft_caps`, SmartSpec): the pass thread records what its batches take (the
target's pass seconds against its sequences and their drafted rows apart, a draft model's against its
rows, the wait for the sequences between batches against the share of the batch before it that ran the
target and the rows it verified, the draft passes per verified draft token), and a greedy or coupled
sequence's draft is capped by the goodput those observations predict (specops.core.policies.step_seconds),
not the start-up cost model's, which times transformers' forward on one sequence and the drafter alone:
at 8 users a 16-row batched pass took ~35 ms and the drafts did not pay, which the start-up model could
not see. A drafted row is priced apart from a sequence (cost_model.PlaneFit) and the wait per drafted row
is priced too: a line in rows fitted while nobody drafted priced a drafted row at a whole sequence's
cost, and a constant wait hid what verifying and drafting on the sequences' threads add to it
(docs/results.md, 2026-11-28). Both slopes lean on priors
(the start-up model's row, a drafted token's seconds on a thread), so that once drafts stop, the slopes
they showed decay back to their priors and drafts are tried again, instead of resting on old evidence.
"""

from __future__ import annotations

import contextlib
import math
import os
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any, NamedTuple, TypeVar

import torch
from transformers import PreTrainedModel

from specops.core import native
from specops.core.cost_model import CostModel, DecayedRatio, PassFit, PlaneFit, StepCosts
from specops.core.llama import LlamaForward, Segment, llama_forward
from specops.core.policies import batch_draft_length
from specops.core.types import MIN_ROWS, ONEDNN_MIN_WORK, STATIC_BUCKET

DEFAULT_WINDOW_S = 0.002  # how long a pass waits for the other sequences' passes before running without them
IDLE_EXIT_S = 5.0  # the pass thread ends after this long without work (a swapped-out model's batcher goes quiet)
MIN_OBSERVED = 10.0  # passes (decayed) a fit needs before draft_caps trusts it over the start-up model
T = TypeVar("T")


def on_short_thread(work: Callable[[], T], name: str = "specops-setup") -> T:
    """`work()` on a thread that ends with it, with the caller's intra-op threads; its result or its error.
    For parallel torch work (loading or warming up a model) asked for by a long-lived thread, which would
    otherwise keep an OpenMP team for good and slow every pass after (see the module docstring)."""
    threads = torch.get_num_threads()  # the caller's: a new thread starts with the last value any thread set

    def run() -> T:
        native.set_threads(threads)
        return work()

    with ThreadPoolExecutor(1, thread_name_prefix=name) as pool:
        return pool.submit(run).result()


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


class _Seen(NamedTuple):
    """What the batches run so far tell (PassBatcher._observed); None where not yet."""

    target: tuple[float, float, float] | None  # a target pass: fixed, per sequence, per drafted row (seconds)
    draft: tuple[float, float] | None  # a draft pass: fixed, per row
    passes: float | None  # draft passes per drafted token
    wait: tuple[float, float, float] | None  # the wait per sequence: after a draft pass, more after a target
    # pass, per row it verified


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
                 on_pass: Callable[[str, int, float], None] | None = None, cost: CostModel | None = None,
                 threads: int | None = None) -> None:
        """`on_pass(kind, sequences, seconds)` hears of every pass the pass thread ran (metrics): kind
        "target" or "draft" (a batched pass of the target or of a draft LM, over that many sequences),
        "target_alone" or "draft_alone" (a prompt's prefill or a draft's catch-up, run alone: `call` with its
        model's forward), or "other" (other work run alone, such as timing the target at start-up).
        `cost` (the target's pass times by rows, the drafter's per token, measured at start-up) lets each
        sequence shrink its draft as the batch grows (`draft_caps`) until the passes run here tell better;
        without it drafts keep their policy's length. `threads`: the pass thread's intra-op threads (default:
        every core)."""
        # The target's eager forward, which its sequences' StaticLMs run. Built on a short thread: building it
        # packs the weights, parallel work that would leave the caller's thread (a script's main thread) an
        # OpenMP team for good, and every pass after slower: a 192-token prefill through `call` took 120 ms
        # with the batcher made on the main thread, against 78-89 ms made here.
        self.forward = on_short_thread(lambda: _invariant_forward(model), "specops-pack")
        self.batched_drafts = False  # whether a draft model's passes are batched here too (forward_of)
        self.window_s = window_s
        self.on_pass = on_pass
        self.cost = cost
        self.cores = os.cpu_count() or 1
        self.threads = threads or self.cores
        self._cond = threading.Condition()
        self._pending: list[_Pass] = []
        self._members: set[int] = set()  # threads of the sequences in their decode loop: a pass of theirs may come
        self._cohort: set[int] = set()  # threads whose passes ran in the last batch
        self._pass_s = window_s  # the last batch's duration: how long a pass waits for the last batch's sequences
        # What draft_caps learns from the batches run here (step_costs): the target's pass times by sequences
        # and drafted rows, a draft model's by rows, the draft passes per drafted token (a suffix front's
        # drafts take none), and the wait between two batches per sequence (their own work: verification,
        # streaming, drafting on their threads) against the batch before it (PlaneFit: the share of it that
        # ran the target, and the rows per sequence it verified).
        self.target_fit, self.draft_fit = PlaneFit(), PassFit()
        self.draft_passes = DecayedRatio()
        self.wait_fit = PlaneFit()
        self._last_batch = (1.0, 0.0)  # its target pass's sequences and drafted rows, over all its sequences
        self._batch_end: float | None = None  # when the last batch ended; None once a pass alone ran since
        self._drafting: dict[int, int] = {}  # a sequence's draft passes since its last target pass
        self._startup: tuple[tuple[CostModel, bool], StepCosts] | None = None  # step_costs' start-up model, built once
        # step_costs per batch size, kept until the next observation: every sequence asks at every step, and
        # computing it takes the lock that the sequences waking from a batch are all taking too.
        self._costs: dict[tuple[int, bool], tuple[tuple[Any, ...], StepCosts | None]] = {}
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
                self._drafting.pop(me, None)  # a draft that was never verified (the request ended) counts for nothing
                self._cond.notify_all()  # the waiting passes may now be the whole set

    def forward_of(self, model: PreTrainedModel) -> LlamaForward:
        """The eager forward of `model` (the target, or a draft LM whose passes are batched here too), once
        checked that its rows do not depend on the batch: a sampled request's draft must not depend on what
        else is running, or its output would not be reproducible."""
        forward = _invariant_forward(model)
        if forward is not self.forward:
            self.batched_drafts = True
        return forward

    def _startup_costs(self) -> StepCosts | None:
        """The start-up model's step costs (StepCosts.from_startup), built once per model and draft mode."""
        if self.cost is None:
            return None
        if self._startup is None or self._startup[0] != (self.cost, self.batched_drafts):  # set after __init__
            self._startup = (self.cost, self.batched_drafts), StepCosts.from_startup(self.cost, self.batched_drafts)
        return self._startup[1]

    def _observed(self, row_prior: float, wait_prior: float) -> _Seen:
        """What the fits tell once each rests on MIN_OBSERVED observations (the draft's line: of more than one
        row count), the slopes of the target's drafted rows and of the wait leaning on their priors."""
        with self._cond:
            return _Seen(self.target_fit.coefficients(row_prior, MIN_OBSERVED), self.draft_fit.line(MIN_OBSERVED),
                         self.draft_passes.value(MIN_OBSERVED), self.wait_fit.coefficients(wait_prior, MIN_OBSERVED))

    def step_costs(self, batch: int, free: bool = False) -> StepCosts | None:
        """What a step costs at `batch` sequences (specops.core.policies.step_seconds): each part from the
        batches observed here once there are enough (`_observed`), else from the start-up model; None without
        a start-up model (drafts are then not capped). The start-up model times transformers' forward on one
        sequence and the drafter alone, not these batched passes nor the wait between them, which grow with
        the batch. `free`: for drafts that run no draft model (draft_caps)."""
        # Read before computing (a batch may end meanwhile): the observations so far and the start-up model.
        key = (self.target_fit.added, self.draft_fit.added, self.draft_passes.added, self.wait_fit.added, self.cost,
               self.batched_drafts)
        cached = self._costs.get((batch, free))
        if cached is not None and cached[0] == key:
            return cached[1]
        costs = self._step_costs(batch, free)
        self._costs[batch, free] = key, costs
        return costs

    def _step_costs(self, batch: int, free: bool) -> StepCosts | None:
        startup = self._startup_costs()
        if startup is None:
            return None
        if free:  # no draft pass, nor the drafter's seconds on a thread (nor in the wait's prior)
            startup = replace(startup, draft_passes=0.0, thread_token_s=0.0)
        # A token drafted on a generation thread (drafts not batched here) is in the wait: its thread's share
        # of the cores, per sequence. The wait's fit prices it once seen, and until then this prior does.
        wait_prior = startup.thread_token_s * max(1.0, batch / self.cores) / batch
        seen = self._observed(startup.target[1], wait_prior)
        if seen.target is None:
            return startup
        fixed, per_sequence, per_row = seen.target
        after_draft, target_share, verified_row = seen.wait or (0.0, 0.0, wait_prior)
        return StepCosts((fixed, per_row), per_sequence, seen.draft or startup.draft,
                         startup.draft_passes if seen.passes is None or free else seen.passes,
                         gap_s=(after_draft + target_share) * batch, draft_gap_s=after_draft, gap_row_s=verified_row)

    def draft_caps(self, acceptance: float, max_tokens: int, stopped: bool = False) -> tuple[int, int]:
        """The longest drafts that still pay at the current batch size (SmartSpec: specops.core.policies),
        from what this batcher's passes took lately (`step_costs`): one that runs a draft model, and one
        that costs no model pass (Drafter.free_draft), whose tokens cost only their rows in the target's pass.

        `stopped`: an acceptance head's stop rule ends the draft (SpecDec++, goodput_head). Alone in the batch
        neither cap applies, as without a batcher: the rule reads each drafted token's predicted acceptance,
        the cap only the request's average `acceptance`, and cut drafts the head would have gone on with
        (SmolLM2's champion at one user: 294 target passes against 277 for 16 requests, its server 3-4%
        slower; docs/results.md). Beside others the cap is the load's answer, which a rule blind to the batch
        cannot give."""
        batch = max(1, len(self._members))
        if stopped and batch == 1:
            return max_tokens, max_tokens
        costs, free = self.step_costs(batch), self.step_costs(batch, free=True)
        if costs is None or free is None:
            return max_tokens, max_tokens
        return (batch_draft_length(acceptance, costs, batch, max_tokens, self.cores),
                batch_draft_length(acceptance, free, batch, max_tokens, self.cores))

    def observed(self) -> dict[str, float]:
        """What the batches run here showed (NaN where not yet): a target pass's fixed seconds, seconds per
        sequence and per drafted row, a draft pass's seconds and seconds per row, the draft passes per drafted
        token, and the wait between batches per sequence: after a target pass, after a draft pass, and per
        row verified (its prior as one sequence sees it)."""
        startup = self._startup_costs()
        seen = self._observed(*((0.0, 0.0) if startup is None else (startup.target[1], startup.thread_token_s)))
        values = {"draft_passes_per_token": math.nan if seen.passes is None else seen.passes}
        values["target_pass_s"], values["target_sequence_s"], values["target_row_s"] = seen.target or (math.nan,) * 3
        values["draft_pass_s"], values["draft_row_s"] = seen.draft or (math.nan, math.nan)
        values["gap_draft_s"], share, values["gap_row_s"] = seen.wait or (math.nan,) * 3
        values["gap_sequence_s"] = values["gap_draft_s"] + share
        return values

    def run(self, segment: Segment, forward: LlamaForward | None = None, head: bool = True,
            ) -> tuple[torch.Tensor, torch.Tensor]:
        """The logits (without `head`: the final hidden states) and layer outputs of `segment`'s rows through
        `forward` (default: the target's), computed in a batch with whatever other passes are waiting."""
        return self._submit(_Pass(segment, forward or self.forward, head))

    def call(self, work: Callable[[], Any], forward: LlamaForward | None = None) -> Any:
        """`work()` run alone on the pass thread, between batches: a pass of `forward` (a prompt's prefill, a
        draft's catch-up), or other work (timing the target)."""
        return self._submit(_Pass(work, forward))

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
                native.set_threads(self.threads)
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

    def _kind(self, forward: LlamaForward | None, alone: bool = False) -> str:
        """A pass's kind for `on_pass`: its model's, and whether it ran alone; "other" for work of no model."""
        if forward is None:
            return "other"
        kind = "target" if forward is self.forward else "draft"
        return f"{kind}_alone" if alone else kind

    def _count_drafts(self, due: list[_Pass]) -> None:
        """Each sequence's draft passes since its last target pass, against the tokens that target pass
        verifies (its rows but the last committed token's), for drafts that ran a draft model (free drafts
        have their own cap: draft_caps); holding the lock."""
        for p in due:
            if p.forward is not self.forward:
                self._drafting[p.thread] = self._drafting.get(p.thread, 0) + 1
            elif passes := self._drafting.pop(p.thread, 0):
                self.draft_passes.add(passes, p.work.ids.shape[0] - 1)  # type: ignore[union-attr]

    def _execute(self, due: list[_Pass]) -> None:
        """Run `due` (called holding the lock, which it releases meanwhile)."""
        self._pending = [p for p in self._pending if p not in due]
        batched = not due[0].alone
        began = time.monotonic()
        if batched:
            cohort = {p.thread for p in due}
            if self._batch_end is not None and cohort <= self._cohort:  # the same sequences, back from their work
                self.wait_fit.add(*self._last_batch, (began - self._batch_end) / len(cohort))
            self._cohort = cohort
        timed: list[tuple[bool, int, int, float]] = []  # (the target's?, sequences, rows, seconds) of each pass
        self._cond.release()
        try:
            with torch.inference_mode():
                if batched:  # one pass per model (and head): the target's, and a draft LM's when batched here
                    groups: dict[tuple[int, bool], list[_Pass]] = {}
                    for p in due:
                        groups.setdefault((id(p.forward), p.head), []).append(p)
                    for members in groups.values():
                        forward = members[0].forward
                        assert forward is not None
                        # Checked once per model, on this thread and outside the timed pass, where the pass pads
                        # caches: the Python loop's attention (the native kernel reads each cache in place).
                        if len(members) > 1 and forward._native() is None:
                            forward.pads_exactly  # noqa: B018
                        start = time.monotonic()
                        results = forward.forward_many([p.work for p in members], members[0].head)  # type: ignore[misc]
                        rows = sum(p.work.ids.shape[0] for p in members)  # type: ignore[union-attr]
                        timed.append((forward is self.forward, len(members), rows, time.monotonic() - start))
                        for p, result in zip(members, results, strict=True):
                            p.result = result
                        if self.on_pass is not None:
                            self.on_pass(self._kind(forward), len(members), timed[-1][3])
                else:
                    due[0].result = due[0].work()  # type: ignore[operator]
                    if self.on_pass is not None:
                        self.on_pass(self._kind(due[0].forward, alone=True), 1, time.monotonic() - began)
        except BaseException as error:  # every waiting sequence gets it, not only one
            for p in due:
                p.error = error
        finally:
            self._cond.acquire()
            verified = (0, 0)  # the target pass's sequences and drafted rows
            for target, sequences, rows, seconds in timed:
                if target:
                    self.target_fit.add(sequences, rows - sequences, seconds)
                    verified = sequences, rows - sequences
                else:
                    self.draft_fit.add(rows, seconds)
            if batched:  # each sequence ran one pass: the wait after it is per sequence
                self._last_batch = verified[0] / len(due), verified[1] / len(due)
                self._count_drafts(due)
            end = time.monotonic()
            # A failed batch's sequences leave with its error: the wait after it would be no one's work.
            self._batch_end = end if batched and all(p.error is None for p in due) else None
            if batched:
                self._pass_s = end - began
            for p in due:
                p.done = True
            self._cond.notify_all()
