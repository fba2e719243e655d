"""The generation worker: generation slots, fed by a bounded queue, decoding side by side.

Each slot is a thread that takes a request from the queue and runs its whole generation with a fork of
the served generator (drafters keep per-sequence state, so each concurrent generation has its own).
When the model can batch exactly (the eager static runtime in bf16: specops.core.batching), the slots'
target passes run batched: requests join and leave the batch between passes, and a request's output is
bitwise what it would be alone. Otherwise one fork exists and requests run one at a time. A full queue
is refused (429) instead of letting latency grow without bound. A hot reload warms the new model up on
the caller's thread and swaps it in atomically: generations already running finish on the old one.
"""

from __future__ import annotations

import gc
import logging
import queue
import sqlite3
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from specops.core import native
from specops.core.batching import DEFAULT_WINDOW_S, PassBatcher, on_short_thread
from specops.core.cost_model import measure_cost_model
from specops.core.loop import GenerationRequestError, prompt_logprobs
from specops.core.prefix_cache import PrefixCache
from specops.core.target import Target
from specops.core.types import Generation, GenerationStats, SamplingParams, TokenLogprob
from specops.server.feedback import FeedbackGate, FeedbackLog, FeedbackRecord, Refusal
from specops.server.generator import TextGenerator
from specops.server.metrics import ServerMetrics
from specops.server.textstream import TextStream

log = logging.getLogger(__name__)

IDLE_POLL_S = 0.1  # how often an idle worker looks for a pending hot swap or a stop request
WARMUP_PROMPT = "Hello"
WARMUP_TOKENS = 4
# One request of each kind the server accepts, so a model that would refuse one is refused before it serves.
WARMUP_SAMPLINGS = ({"temperature": 0.0}, {"temperature": 1.0, "top_p": 0.9, "seed": 0})


@dataclass(frozen=True)
class ServedModel:
    """A generator and where it came from, as /v1/models, /metrics and the feedback log show it."""

    generator: TextGenerator
    drafter: str
    bundle_version: str | None = None  # the bundle's hash; None without a bundle
    model_version: str | None = None  # the MLflow registry version; None without a registry
    source: str = "plain"  # a bundle folder, a models:/ URI, or "plain"

    @property
    def target(self) -> Target:
        return self.generator.target

    def describe(self) -> dict[str, Any]:
        return {"drafter": self.drafter, "bundle_version": self.bundle_version, "model_version": self.model_version,
                "source": self.source, "target": self.target.fingerprint.name}


def freeze_heap() -> None:
    """Move every object alive now out of the cyclic collector's reach (gc.freeze), as vLLM does after its
    warm-up and SGLang's freeze_gc. A full collection walks every tracked object while holding the GIL:
    ~250 ms here over the ~400k objects of torch, transformers and the models, which stalls every
    generation and the pass thread, and serving triggered one every second or so under load (Suffix
    Decoding's tries allocate thousands of nodes a request). Frozen objects are still freed by reference
    counting (a swapped-out model is: tests/server/test_worker_gc.py); only cycles among them would stay."""
    gc.collect()  # the garbage alive now would otherwise be frozen with the rest
    gc.freeze()


def warm_up(model: ServedModel) -> None:
    """Short greedy and sampled generations: the first calls pay one-off costs that a request should not see.

    The last asks for one token, so the target runs a one-row pass (a step without a draft): in float32 that
    builds SmallBatchLinear's transposed weights, which would otherwise appear at the first such step of
    some request, hours into serving. The memory plan (specops/server/budget.py) counts them from the start."""
    for sampling in WARMUP_SAMPLINGS:
        model.generator.generate_text(WARMUP_PROMPT, max_new_tokens=WARMUP_TOKENS, **sampling)
    model.generator.generate_text(WARMUP_PROMPT, max_new_tokens=1)


@dataclass(frozen=True)
class Completion:
    """A finished generation; its text is the concatenation of the Delta events that preceded it."""

    finish_reason: str  # "stop" (EOS or a stop string) or "length"
    prompt_tokens: int
    output_ids: list[int]
    stats: GenerationStats
    model: ServedModel


@dataclass(frozen=True)
class Delta:
    text: str
    logprobs: tuple[TokenLogprob, ...] = ()  # the tokens committed since the last delta, when the job asked


@dataclass(frozen=True)
class Finished:
    completion: Completion


@dataclass(frozen=True)
class Failed:
    status: int
    message: str
    type: str
    code: str | None = None


Event = Delta | Finished | Failed


@dataclass
class Job:
    request_id: str
    endpoint: str
    prompt_ids: list[int]
    max_tokens: int
    sampling: SamplingParams
    seed: int
    stop: list[str]
    prompt_text: str | None
    emit: Callable[[Event], None]  # called on the worker thread, so it must be thread-safe
    logprobs: int | None = None  # None: no logprobs; k: each token's and its k most likely alternatives'
    echo: str | None = None  # the prompt as text, sent first (with its tokens' logprobs when asked for)
    arrived: float = field(default_factory=time.perf_counter)
    cancelled: threading.Event = field(default_factory=threading.Event)  # set when nobody awaits the result


def _unsent(generation: Generation, text: TextStream, sent: int) -> tuple[TokenLogprob, ...]:
    """Logprob entries not yet emitted; after a stop string, none past the token that completed it (the
    text ends before the stop string, and the tokens after it were never part of the answer)."""
    if generation.logprobs is None:
        return ()
    end = text.stop_tokens if text.stop_tokens is not None else len(generation.logprobs)
    return tuple(generation.logprobs[sent:end])


def _refused(refusal: Refusal) -> Failed:
    return Failed(refusal.status, refusal.message, refusal.type, refusal.code)


class QueueFullError(RuntimeError):
    """Every queue slot is taken; the client should retry later."""


@dataclass(frozen=True)
class Serving:
    """A served model and the generator forks its slots take, one per generation decoding at a time."""

    model: ServedModel
    forks: list[TextGenerator]  # the idle ones; taken and given back under the worker's lock
    batcher: PassBatcher | None


class GenerationWorker:
    def __init__(self, model: ServedModel, queue_size: int, metrics: ServerMetrics,
                 feedback: FeedbackLog | None, slots: int = 1, window_s: float = DEFAULT_WINDOW_S,
                 prefix_cache_bytes: int = 0) -> None:
        """`prefix_cache_bytes`: the budget of the prefix cache each served model's generations share (0: none;
        none either for a model whose runtime could not use one: TextGenerator.batchable)."""
        self._serving = Serving(model, [], None)  # forks come with the warm-up, in start()
        self._idle = threading.Condition()  # a slot waits on it for a job and a free fork, together
        self._queue: queue.Queue[Job] = queue.Queue(maxsize=queue_size)
        self._metrics = metrics
        # Requests are refused while the log cannot be written, since it promises a row for every answer; a slot
        # retries a write between requests (FeedbackGate).
        self._gate = FeedbackGate(feedback) if feedback is not None else None
        self._slots = slots
        self._window_s = window_s
        self._prefix_cache_bytes = prefix_cache_bytes
        self._cores = torch.get_num_threads()  # as the server was started (--threads); slots set theirs per job
        self._stop = threading.Event()
        self._boot = threading.Thread(target=self._start_slots, name="specops-warm-up", daemon=True)
        self._threads = [threading.Thread(target=self._run, name=f"specops-generation-{i}", daemon=True)
                         for i in range(slots)]
        self.ready = threading.Event()
        self.failure: str | None = None  # why the worker could not start, for /ready
        metrics.watch_queue(self._queue.qsize)
        metrics.set_serving(model.bundle_version, model.model_version, model.drafter)

    @property
    def model(self) -> ServedModel:
        return self._serving.model

    @property
    def batched(self) -> bool:
        return self._serving.batcher is not None

    def start(self) -> None:
        self._boot.start()

    def stop(self, timeout: float = 30.0) -> None:
        self._stop.set()
        for thread in (self._boot, *self._threads):
            if thread.is_alive():
                thread.join(timeout)
        gc.unfreeze()  # what the process keeps running (tests start many servers) is collected again

    def submit(self, job: Job) -> None:
        self._metrics.queue_depth_seen.observe(self._queue.qsize())
        try:
            self._queue.put_nowait(job)
        except queue.Full as error:
            raise QueueFullError(f"All {self._queue.maxsize} queue slots are taken.") from error
        with self._idle:
            self._idle.notify()

    def _serving_of(self, model: ServedModel) -> Serving:
        """The forks of `model`'s generator: one per slot, batched, when it batches exactly; else one."""
        batcher = None
        if self._slots > 1 and model.generator.batchable:
            # Pass times up to a full batch's rows, so drafts shrink where rows stop being free (SmartSpec), until
            # the batcher has timed enough of its own passes (PassBatcher.step_costs).
            sizes = tuple(sorted({1, 2, 4, 8, 16, self._slots * model.generator.config.static_width}))
            batcher = PassBatcher(model.target.model, self._window_s,
                                  on_pass=self._metrics.observe_pass, threads=self._cores)
            drafter = model.generator.fork(None).drafter
            # Timed on the pass thread, where the passes will run (the drafter too, on all cores there,
            # while serving drafts on one: under load its steps take longer than this says).
            batcher.cost = batcher.call(lambda: measure_cost_model(model.target.model, drafter, sizes=sizes))
            self._metrics.watch_step_costs(batcher.observed)
        elif self._slots > 1:
            log.warning("The model's runtime cannot batch passes exactly (it needs the eager static runtime in "
                        "bfloat16, static_width > 0 and compiled off, and a model large enough that every product "
                        "runs on oneDNN: specops.core.batching): serving one request at a time.")
        drafter = model.generator.drafter
        if drafter is not None and drafter.remembers and self._gate is not None:
            past = self._gate.log.recent_outputs(drafter.remembers)
            drafter.remember(past)  # before forking: forks share what it learned (Suffix Decoding's cache)
            log.info("The %s drafter learned the %d newest responses of the feedback log.", drafter.name, len(past))
        # A new model's prompts start from an empty cache: the old one's keys and values are no use to it.
        cache = PrefixCache(self._prefix_cache_bytes) if self._prefix_cache_bytes and model.generator.batchable else None
        self._metrics.watch_prefix_cache(lambda: cache.bytes if cache is not None else 0)
        if batcher is None:  # one generation at a time, on the model's own generator
            model.generator.prefix_cache = cache
            return Serving(model, [model.generator], None)
        forks = [model.generator.fork(batcher, cache) for _ in range(self._slots)]
        return Serving(model, forks, batcher)

    def _warmed(self, model: ServedModel) -> Serving:
        torch.set_num_threads(self._cores)  # a new thread starts with the last value any thread set (a slot's 1)
        warm_up(model)
        serving = self._serving_of(model)
        freeze_heap()  # the model and everything it built are here to stay
        return serving

    def _start_slots(self) -> None:
        model = self._serving.model
        try:
            self._serving = self._warmed(model)
        except Exception as error:  # any failure here means the model cannot serve; /ready reports it
            log.exception("Warm-up of the model failed; the server will not become ready.")
            self.failure = f"warm-up failed: {error}"
            return
        self.ready.set()
        for thread in self._threads:
            thread.start()

    def swap(self, model: ServedModel) -> None:
        """Warm `model` up, then serve it from the next request on; generations already running finish on
        the old model. Raises whatever the warm-up raised, and the old model keeps serving.

        The warm-up runs on a thread of its own that then ends: a long-lived thread (the caller's) that
        once ran parallel ops keeps an OpenMP team, which slows every pass after (specops.core.batching)."""
        serving = on_short_thread(lambda: self._warmed(model), "specops-warm-up")
        with self._idle:
            self._serving = serving
            self._idle.notify_all()
        self._metrics.set_serving(model.bundle_version, model.model_version, model.drafter)

    def _run(self) -> None:
        while not self._stop.is_set():
            if self._gate is not None:
                self._gate.retry()
            taken = self._take()
            if taken is None:
                continue
            serving, generator, job = taken
            # Batched, the passes run on the batcher's thread with every core; this thread's own ops
            # (drafting, verification) take one, so it holds no OpenMP team of its own (specops.core.batching).
            native.set_threads(1 if serving.batcher is not None else self._cores)
            self._metrics.active.inc()
            try:
                self._serve(job, serving.model, generator)
            finally:
                self._metrics.active.dec()
                with self._idle:
                    serving.forks.append(generator)
                    self._idle.notify()

    def _take(self) -> tuple[Serving, TextGenerator, Job] | None:
        """A queued job and a free fork of the model serving now, taken together (a request stays queued, and
        counted, until a fork can decode it); None after waiting IDLE_POLL_S for both."""
        with self._idle:
            serving = self._serving
            if not (serving.forks and self._queue.qsize()):
                self._idle.wait(IDLE_POLL_S)
                serving = self._serving
                if not (serving.forks and self._queue.qsize()):
                    return None
            try:
                job = self._queue.get_nowait()
            except queue.Empty:
                return None
            return serving, serving.forks.pop(), job

    def feedback_refusal(self) -> Failed | None:
        """The 503 for requests while the feedback log cannot be written; None when it can."""
        refusal = self._gate.refusal() if self._gate is not None else None
        return None if refusal is None else _refused(refusal)

    def _serve(self, job: Job, model: ServedModel, generator: TextGenerator) -> None:
        if job.cancelled.is_set():  # the client left or timed out while queued
            return
        if (refusal := self.feedback_refusal()) is not None:  # queued before the log failed
            job.emit(refusal)
            return
        try:
            completion = self._generate(job, model, generator)
        except GenerationRequestError as error:
            job.emit(Failed(400, str(error), "invalid_request_error"))
            return
        except Exception:  # the worker must outlive any one request's failure
            log.exception("Generation of request %s failed", job.request_id)
            job.emit(Failed(500, "The server failed while generating; the error is in its log.", "server_error"))
            return
        if completion is None:
            return
        # Committed before the last event, hence before the response ends; an answer without its row fails.
        job.emit(self._record(job, completion) or Finished(completion))

    def _generate(self, job: Job, model: ServedModel, generator: TextGenerator) -> Completion | None:
        """Run one generation, emitting text deltas; None when the job was cancelled midway."""
        text = TextStream(model.target.tokenizer, job.stop)
        if job.echo is not None:
            scored = (TokenLogprob(job.prompt_ids[0], None), *prompt_logprobs(model.target, job.prompt_ids, job.logprobs)) \
                if job.logprobs is not None else ()
            job.emit(Delta(job.echo, scored))
        # The loop polls the job between prefill chunks, so an abandoned long prompt frees the worker within one.
        stream = generator.generator(job.sampling).stream(job.prompt_ids, job.max_tokens, job.sampling, job.seed,
                                                          job.cancelled.is_set, job.logprobs)
        first: float | None = None  # when the first token came
        last = 0.0
        sent = 0  # logprob entries already emitted
        try:
            for ids in stream:
                now = time.perf_counter()
                if first is None:
                    self._metrics.ttft.observe(now - job.arrived)
                    first = now
                else:
                    self._metrics.inter_token.observe((now - last) / len(ids))
                last = now
                delta = text.push(ids)
                if delta:
                    scored = _unsent(stream.generation, text, sent)
                    sent += len(scored)
                    job.emit(Delta(delta, scored))
                if text.stopped or job.cancelled.is_set():
                    break
        finally:
            stream.close()  # stops the loop and frees its KV cache when we left early
        if job.cancelled.is_set():
            return None
        tail, scored = text.finish(), _unsent(stream.generation, text, sent)
        if tail or scored:
            job.emit(Delta(tail, scored))
        generation = stream.generation
        if first is not None and last > first:
            self._metrics.request_rate.observe((len(generation.token_ids) - 1) / (last - first))
        finish = "stop" if text.stopped or generation.finish_reason == "stop" else "length"
        return Completion(finish_reason=finish, prompt_tokens=len(job.prompt_ids),
                          output_ids=list(generation.token_ids), stats=generation.stats, model=model)

    def _record(self, job: Job, completion: Completion) -> Failed | None:
        """Count the generation and log its row; the 503 to answer instead when the row could not be written."""
        self._metrics.observe_generation(completion.prompt_tokens, completion.stats)
        if self._gate is None:
            return None
        model = completion.model
        sampling = {"temperature": job.sampling.temperature, "top_p": job.sampling.top_p,
                    "top_k": job.sampling.top_k, "seed": job.seed, "max_tokens": job.max_tokens, "stop": job.stop}
        record = FeedbackRecord(
            request_id=job.request_id, created_at=time.time(), bundle_version=model.bundle_version,
            model_version=model.model_version, drafter=model.drafter, endpoint=job.endpoint,
            prompt_ids=job.prompt_ids, output_ids=completion.output_ids, sampling=sampling,
            per_step=completion.stats.per_step, finish_reason=completion.finish_reason, prompt_text=job.prompt_text)
        try:
            dropped = self._gate.append([record])
        except sqlite3.Error as error:  # disk full, ...: the gate refuses requests until a write succeeds again
            log.exception("Could not write the feedback row of request %s; refusing requests until it can.",
                          job.request_id)
            self._metrics.feedback_errors.inc()
            return _refused(Refusal(str(error)))
        self._metrics.feedback_rows.inc()
        self._metrics.feedback_dropped.inc(dropped)
        return None
