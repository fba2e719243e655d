"""The generation worker: one thread runs one generation at a time, fed by a bounded queue.

Drafters keep per-sequence state (a draft LM has its own KV cache), so a TextGenerator serves one
request at a time. Requests wait in a bounded queue, and a full queue is refused (429) instead of
letting latency grow without bound. A hot reload is applied on this same thread between two
requests, after a warm-up of the new model, so no request ever sees a half-swapped model.
"""

from __future__ import annotations

import logging
import queue
import sqlite3
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from specops.core.loop import GenerationRequestError
from specops.core.target import Target
from specops.core.types import GenerationStats, SamplingParams
from specops.server.feedback import FeedbackLog, FeedbackRecord
from specops.server.generator import TextGenerator
from specops.server.metrics import ServerMetrics
from specops.server.textstream import TextStream

log = logging.getLogger(__name__)

IDLE_POLL_S = 0.1  # how often an idle worker looks for a pending hot swap or a stop request
FEEDBACK_RETRY_S = 1.0  # while the feedback log cannot be written, how often the worker tries a write again
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


def warm_up(model: ServedModel) -> None:
    """Short greedy and sampled generations: the first calls pay one-off costs that a request should not see."""
    for sampling in WARMUP_SAMPLINGS:
        model.generator.generate_text(WARMUP_PROMPT, max_new_tokens=WARMUP_TOKENS, **sampling)


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
    arrived: float = field(default_factory=time.perf_counter)
    cancelled: threading.Event = field(default_factory=threading.Event)  # set when nobody awaits the result


def _feedback_refusal(failure: str) -> Failed:
    return Failed(503, f"The feedback log cannot be written ({failure}), and every answer must be logged: retry "
                  "later.", "server_error", "feedback_unavailable")


class QueueFullError(RuntimeError):
    """Every queue slot is taken; the client should retry later."""


class GenerationWorker:
    def __init__(self, model: ServedModel, queue_size: int, metrics: ServerMetrics,
                 feedback: FeedbackLog | None) -> None:
        self._model = model
        self._queue: queue.Queue[Job] = queue.Queue(maxsize=queue_size)
        self._metrics = metrics
        self._feedback = feedback
        self._pending: tuple[ServedModel, Future[None]] | None = None
        self._pending_lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="specops-generation", daemon=True)
        self.ready = threading.Event()
        self.failure: str | None = None  # why the worker could not start, for /ready
        # Why the feedback log cannot be written; requests are refused meanwhile, since the log promises a row
        # for every answer. The worker retries a write every FEEDBACK_RETRY_S until one succeeds.
        self.feedback_failure: str | None = None
        self._next_feedback_retry = 0.0
        metrics.watch_queue(self._queue.qsize)
        metrics.set_serving(model.bundle_version, model.model_version, model.drafter)

    @property
    def model(self) -> ServedModel:
        return self._model

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        self._stop.set()
        self._thread.join(timeout)

    def submit(self, job: Job) -> None:
        try:
            self._queue.put_nowait(job)
        except queue.Full as error:
            raise QueueFullError(f"All {self._queue.maxsize} queue slots are taken.") from error

    def swap(self, model: ServedModel, timeout: float) -> None:
        """Warm `model` up on the worker thread, then serve it from the next request on.

        Blocks until done; raises whatever the warm-up raised, and then the old model keeps serving.
        """
        done: Future[None] = Future()
        with self._pending_lock:
            self._pending = (model, done)
        try:
            done.result(timeout)
        except TimeoutError:
            if done.cancel():  # not started: the worker will skip it
                raise TimeoutError(f"The worker did not take the new model within {timeout:.0f} s.") from None
            done.result()  # the warm-up already started: its outcome decides

    def _run(self) -> None:
        try:
            warm_up(self._model)
        except Exception as error:  # any failure here means the model cannot serve; /ready reports it
            log.exception("Warm-up of the model failed; the server will not become ready.")
            self.failure = f"warm-up failed: {error}"
            return
        self.ready.set()
        while not self._stop.is_set():
            self._apply_pending_swap()
            self._retry_feedback()
            try:
                job = self._queue.get(timeout=IDLE_POLL_S)
            except queue.Empty:
                continue
            self._serve(job)

    def _apply_pending_swap(self) -> None:
        with self._pending_lock:
            pending, self._pending = self._pending, None
        if pending is None:
            return
        model, done = pending
        if not done.set_running_or_notify_cancel():  # the caller stopped waiting
            return
        try:
            warm_up(model)
        except Exception as error:  # a reload must never take the serving model down with it
            done.set_exception(error)
            return
        self._model = model
        self._metrics.set_serving(model.bundle_version, model.model_version, model.drafter)
        done.set_result(None)

    def feedback_refusal(self) -> Failed | None:
        """The 503 for requests while the feedback log cannot be written; None when it can."""
        failure = self.feedback_failure  # read once: the worker thread may clear it meanwhile
        return None if failure is None else _feedback_refusal(failure)

    def _retry_feedback(self) -> None:
        if self._feedback is None or self.feedback_failure is None or time.monotonic() < self._next_feedback_retry:
            return
        try:
            self._feedback.probe()
        except sqlite3.Error as error:
            self._feedback_failed(error)
            return
        log.info("The feedback log can be written again; serving resumes.")
        self.feedback_failure = None

    def _feedback_failed(self, error: sqlite3.Error) -> None:
        self.feedback_failure = str(error)
        self._next_feedback_retry = time.monotonic() + FEEDBACK_RETRY_S

    def _serve(self, job: Job) -> None:
        if job.cancelled.is_set():  # the client left or timed out while queued
            return
        if (refusal := self.feedback_refusal()) is not None:  # queued before the log failed
            job.emit(refusal)
            return
        model = self._model
        try:
            completion = self._generate(job, model)
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

    def _generate(self, job: Job, model: ServedModel) -> Completion | None:
        """Run one generation, emitting text deltas; None when the job was cancelled midway."""
        text = TextStream(model.target.tokenizer, job.stop)
        # The loop polls the job between prefill chunks, so an abandoned long prompt frees the worker within one.
        stream = model.generator.generator(job.sampling).stream(job.prompt_ids, job.max_tokens, job.sampling, job.seed,
                                                                job.cancelled.is_set)
        first = True
        try:
            for ids in stream:
                if first:
                    self._metrics.ttft.observe(time.perf_counter() - job.arrived)
                    first = False
                delta = text.push(ids)
                if delta:
                    job.emit(Delta(delta))
                if text.stopped or job.cancelled.is_set():
                    break
        finally:
            stream.close()  # stops the loop and frees its KV cache when we left early
        if job.cancelled.is_set():
            return None
        tail = text.finish()
        if tail:
            job.emit(Delta(tail))
        generation = stream.generation
        finish = "stop" if text.stopped or generation.finish_reason == "stop" else "length"
        return Completion(finish_reason=finish, prompt_tokens=len(job.prompt_ids),
                          output_ids=list(generation.token_ids), stats=generation.stats, model=model)

    def _record(self, job: Job, completion: Completion) -> Failed | None:
        """Count the generation and log its row; the 503 to answer instead when the row could not be written."""
        self._metrics.observe_generation(completion.prompt_tokens, completion.stats)
        if self._feedback is None:
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
            dropped = self._feedback.append(record)
        except sqlite3.Error as error:  # disk full, ...: refuse requests until a write succeeds again
            log.exception("Could not write the feedback row of request %s; refusing requests until it can.",
                          job.request_id)
            self._metrics.feedback_errors.inc()
            self._feedback_failed(error)
            return _feedback_refusal(str(error))
        self._metrics.feedback_rows.inc()
        self._metrics.feedback_dropped.inc(dropped)
        return None
