"""The OpenAI-compatible HTTP server: `create_app(config)` builds it, `serve(config)` runs it.

Endpoints: POST /v1/completions and /v1/chat/completions (JSON or SSE with `stream: true`),
GET /v1/models, /health (liveness, never authenticated), /ready (the model is warm) and /metrics, and
vLLM's POST /tokenize, POST /detokenize and GET /version. Handlers validate and tokenize on the event
loop, then hand the request (one job per choice) to the generation worker's slots
(specops/server/worker.py) and relay its events. Every error is an OpenAI error object; bad input
is a 4xx, never a 500.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import secrets
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from importlib.metadata import version as package_version
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.types import Receive, Scope, Send
from transformers import PreTrainedTokenizerBase

from specops.core.batching import on_short_thread
from specops.core.memory import parse_bytes
from specops.core.planner import MemoryPlan
from specops.core.target import Target, encode_prompt, load_target
from specops.core.types import SamplingParams
from specops.server.budget import describe, memory_plan, planned
from specops.server.config import ServerConfig
from specops.server.feedback import FeedbackLog
from specops.server.guards import STATUS_KEY, RequestRecorder, install_guards
from specops.server.logprobs import TokenText
from specops.server.metrics import CONTENT_TYPE, ServerMetrics
from specops.server.protocol import (
    ApiError,
    ChatRequest,
    Choice,
    CompletionRequest,
    DetokenizeRequest,
    ResponseBuilder,
    SamplingFields,
    TokenizeRequest,
    error_body,
)
from specops.server.reload import RegistryWatcher, bundle_model, plain_model
from specops.server.transport import uvicorn_config
from specops.server.worker import (
    Completion,
    Delta,
    Event,
    Failed,
    GenerationWorker,
    Job,
    QueueFullError,
    ServedModel,
)

log = logging.getLogger(__name__)

COMPLETION_PATHS = ("/v1/completions", "/v1/chat/completions")
DISCONNECT_POLL_S = 0.5  # how often a request waiting for its result checks that its client is still there
SEED_BITS = 63


class ClientGone(Exception):
    """The client disconnected before its response was complete."""


class EventStream(StreamingResponse):
    """Server-sent events whose generator is closed as soon as the response ends, disconnect included,
    so the generation is cancelled at once instead of whenever the generator is garbage-collected."""

    media_type = "text/event-stream"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()  # type: ignore[attr-defined]


def sse(data: dict[str, Any]) -> str:
    return f"data: {json.dumps(data, separators=(',', ':'))}\n\n"


@dataclass(frozen=True)
class Ask:
    """What a request asks the worker for, once validated and tokenized."""

    prompt_ids: list[int]
    prompt_text: str | None  # for the feedback log
    max_tokens: int | None
    chat: bool
    logprobs: int | None = None  # None: none; k: each token's logprob and its k most likely alternatives
    echo: str | None = None  # completions' echo: the prompt's text, sent back first


@dataclass
class Pending:
    """The submitted jobs of one request (one per choice), as its handler waits for them; their events
    arrive on one queue, tagged with the choice's index."""

    jobs: list[Job]
    events: asyncio.Queue[tuple[int, Event]]
    request: Request
    deadline: float  # time.monotonic()
    timeout_s: float
    next_check: float = 0.0  # time.monotonic() of the next disconnect check

    def cancel(self) -> None:
        for job in self.jobs:
            job.cancelled.set()

    async def next(self, watch_disconnect: bool) -> tuple[int, Event]:
        """The next worker event and its choice; a 504 Failed past the deadline. Raises ClientGone if the
        client left (only checked with watch_disconnect: once a stream has started, Starlette watches instead)."""
        while True:
            remaining = self.deadline - time.monotonic()
            if remaining <= 0:
                self.cancel()
                return 0, Failed(504, f"The request did not complete within {self.timeout_s:g} s; try a smaller "
                                 "max_tokens or retry later.", "timeout_error", "timeout")
            event = None
            with contextlib.suppress(TimeoutError):  # asyncio's is this class from Python 3.11, the oldest supported
                event = await asyncio.wait_for(self.events.get(), min(remaining, DISCONNECT_POLL_S))
            # Checked on a clock, not only while idle: a non-streamed answer whose tokens keep coming would
            # otherwise run to its end after its client (or a proxy that timed out) has left.
            if watch_disconnect and time.monotonic() >= self.next_check:
                self.next_check = time.monotonic() + DISCONNECT_POLL_S
                if await self.request.is_disconnected():
                    self.cancel()
                    raise ClientGone()
            if event is not None:
                return event


@functools.lru_cache(maxsize=4)  # one per tokenizer served (a hot reload may bring another)
def token_text(tokenizer: PreTrainedTokenizerBase) -> TokenText:
    return TokenText(tokenizer)


class Server:
    """The state behind one app: the worker, its metrics and feedback log, and the optional watcher."""

    def __init__(self, config: ServerConfig, model: ServedModel, metrics: ServerMetrics,
                 watcher: RegistryWatcher | None, plan: MemoryPlan | None = None) -> None:
        """`plan` (a --memory-budget's) sets the generation slots and the longest request."""
        self.config = config
        self.metrics = metrics
        self.plan = plan
        self.feedback = (FeedbackLog(config.feedback_db, config.feedback_max_rows, config.log_prompt_text)
                         if config.feedback else None)
        slots = plan.max_batch if plan is not None else config.max_batch
        self.worker = GenerationWorker(model, config.queue_size, metrics, self.feedback, slots,
                                       config.batch_window_ms / 1000, config.prefix_cache_bytes)
        if plan is not None:
            metrics.set_plan(plan.to_dict())
        self.watcher = watcher
        self.started = int(time.time())

    def start(self) -> None:
        self.worker.start()
        if self.watcher is not None and self.config.poll_s > 0:
            self.watcher.start(self.worker.swap)

    def stop(self) -> None:
        if self.watcher is not None:
            self.watcher.stop()
        self.worker.stop()
        if self.feedback is not None:
            self.feedback.close()

    def model_card(self) -> dict[str, Any]:
        # root and parent as vLLM reports them: the weights the model serves, and no base model it adapts.
        model = self.worker.model
        return {"id": self.config.model_name, "object": "model", "created": self.started, "owned_by": "specops",
                "root": model.target.fingerprint.name, "parent": None, "max_model_len": model.target.max_context,
                **model.describe()}

    def check_model(self, name: str | None) -> None:
        """A request's `model` must be this server's (None: the one it serves)."""
        if name is not None and name != self.config.model_name:
            raise ApiError(404, f"The model '{name}' does not exist; this server serves "
                           f"'{self.config.model_name}'.", param="model", code="model_not_found")

    async def complete(self, request: Request, body: SamplingFields, ask: Ask) -> Response:
        """Validate against the model, queue one job per choice, and answer with JSON or an event stream."""
        self.check_model(body.model)
        if not self.worker.ready.is_set():
            raise ApiError(503, "The model is still loading; retry shortly.", "server_error", code="not_ready",
                           headers={"Retry-After": str(self.config.retry_after_s)})
        if (refusal := self.worker.feedback_refusal()) is not None:
            raise ApiError(refusal.status, refusal.message, refusal.type, code=refusal.code,
                           headers={"Retry-After": str(self.config.retry_after_s)})
        max_tokens = self._check_budget(len(ask.prompt_ids), ask.max_tokens, "messages" if ask.chat else "prompt")
        request_id = f"{'chatcmpl' if ask.chat else 'cmpl'}-{uuid.uuid4().hex}"
        pending = self._submit(request, body, request_id, ask, max_tokens)
        text_of = token_text(self.worker.model.target.tokenizer) if ask.logprobs is not None else None
        builder = ResponseBuilder(ask.chat, request_id, self.config.model_name, text_of)
        headers = {"X-Request-Id": request_id}
        try:
            first = await pending.next(watch_disconnect=True)
            if isinstance(first[1], Failed):
                raise _failure(first[1])
            if body.stream:
                headers.update({"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
                return EventStream(self._stream(pending, builder, first, body.include_usage), headers=headers)
            choices = [Choice() for _ in pending.jobs]
            index, event = first
            while True:
                if isinstance(event, Failed):
                    raise _failure(event)
                if isinstance(event, Delta):
                    choices[index].text += event.text
                    choices[index].logprobs += event.logprobs
                else:
                    choices[index].completion = event.completion
                    if all(c.completion is not None for c in choices):
                        return JSONResponse(builder.response(choices), headers=headers)
                index, event = await pending.next(watch_disconnect=True)
        except ApiError:
            pending.cancel()  # the other choices are of no use now
            raise
        except ClientGone:
            setattr(request.state, STATUS_KEY, 499)
            return Response(status_code=499)

    def _check_budget(self, prompt_tokens: int, max_tokens: int | None, prompt_param: str) -> int:
        if prompt_tokens > self.config.max_prompt_tokens:
            raise ApiError(400, f"The prompt has {prompt_tokens} tokens; this server accepts at most "
                           f"{self.config.max_prompt_tokens} (max_prompt_tokens).", param=prompt_param,
                           code="prompt_too_long")
        limit = self.worker.model.target.max_context
        if self.plan is not None and self.plan.max_context < limit:
            return self._check_planned(prompt_tokens, max_tokens, prompt_param, self.plan)
        if prompt_tokens >= limit:
            raise ApiError(400, f"This model's maximum context length is {limit} tokens, but the prompt has "
                           f"{prompt_tokens} tokens.", param=prompt_param, code="context_length_exceeded")
        if max_tokens is None:
            return min(self.config.default_max_tokens, limit - prompt_tokens)
        if prompt_tokens + max_tokens > limit:
            raise ApiError(400, f"This model's maximum context length is {limit} tokens; the prompt has "
                           f"{prompt_tokens} tokens, so max_tokens can be at most {limit - prompt_tokens}, not "
                           f"{max_tokens}.", param="max_tokens", code="context_length_exceeded")
        return max_tokens

    def _check_planned(self, prompt_tokens: int, max_tokens: int | None, prompt_param: str, plan: MemoryPlan) -> int:
        """The context the memory plan gives each generation slot: longer requests do not fit the budget."""
        limit, budget = plan.max_context, f"{plan.budget_bytes / 2**20:.0f} MiB"
        if prompt_tokens >= limit:
            raise ApiError(400, f"The prompt has {prompt_tokens} tokens; under this server's memory budget ({budget}) "
                           f"a request holds at most {limit} tokens, prompt and max_tokens together.",
                           param=prompt_param, code="memory_budget_exceeded")
        if max_tokens is None:
            return min(self.config.default_max_tokens, limit - prompt_tokens)
        if prompt_tokens + max_tokens > limit:
            raise ApiError(400, f"Under this server's memory budget ({budget}) a request holds at most {limit} "
                           f"tokens; the prompt has {prompt_tokens}, so max_tokens can be at most "
                           f"{limit - prompt_tokens}, not {max_tokens}.", param="max_tokens",
                           code="memory_budget_exceeded")
        return max_tokens

    def _submit(self, request: Request, body: SamplingFields, request_id: str, ask: Ask, max_tokens: int) -> Pending:
        loop = asyncio.get_running_loop()
        events: asyncio.Queue[tuple[int, Event]] = asyncio.Queue()

        def emitter(index: int) -> Callable[[Event], None]:
            def emit(event: Event) -> None:
                # A closed event loop (shutdown) raises RuntimeError: nobody is left to read the event then.
                with contextlib.suppress(RuntimeError):
                    loop.call_soon_threadsafe(events.put_nowait, (index, event))
            return emit

        seed = body.seed if body.seed is not None else secrets.randbits(SEED_BITS)
        jobs = [Job(request_id=request_id if body.n == 1 else f"{request_id}-{index}",
                    endpoint="chat" if ask.chat else "completions", prompt_ids=ask.prompt_ids, max_tokens=max_tokens,
                    sampling=SamplingParams(body.temperature, body.top_p, body.top_k), seed=seed + index,
                    stop=body.stop_list(), prompt_text=ask.prompt_text if self.config.log_prompt_text else None,
                    emit=emitter(index), logprobs=ask.logprobs, echo=ask.echo)
                for index in range(body.n)]
        pending = Pending(jobs, events, request, time.monotonic() + self.config.timeout_s, self.config.timeout_s)
        try:
            for job in jobs:
                self.worker.submit(job)
        except QueueFullError as error:
            pending.cancel()  # the choices already queued: the worker skips cancelled jobs
            raise ApiError(429, f"The server is busy: {error} Retry later.", "rate_limit_error", code="queue_full",
                           headers={"Retry-After": str(self.config.retry_after_s)}) from error
        return pending

    async def _stream(self, pending: Pending, builder: ResponseBuilder, first: tuple[int, Event],
                      include_usage: bool) -> AsyncIterator[str]:
        finished: dict[int, Completion] = {}
        try:
            if builder.chat:
                for index in range(len(pending.jobs)):
                    yield sse(builder.chunk(index, role=True))
            index, event = first
            while len(finished) < len(pending.jobs):
                if isinstance(event, Failed):
                    setattr(pending.request.state, STATUS_KEY, event.status)
                    yield sse(error_body(event.message, event.type, None, event.code))
                    return
                if isinstance(event, Delta):
                    yield sse(builder.chunk(index, text=event.text, logprobs=event.logprobs))
                else:
                    finished[index] = event.completion
                    yield sse(builder.chunk(index, finish_reason=event.completion.finish_reason))
                if len(finished) < len(pending.jobs):
                    index, event = await pending.next(watch_disconnect=False)
            if include_usage:
                yield sse(builder.usage_chunk([finished[i] for i in sorted(finished)]))
            yield "data: [DONE]\n\n"
        finally:
            if len(finished) < len(pending.jobs):  # a failure, or the client went away mid-stream
                pending.cancel()
                if getattr(pending.request.state, STATUS_KEY, None) is None:
                    setattr(pending.request.state, STATUS_KEY, 499)


def _failure(event: Failed) -> ApiError:
    return ApiError(event.status, event.message, event.type, code=event.code)


def _tokenize(target: Target, prompt: str | list[dict[str, str]], raw: bool, param: str) -> list[int]:
    try:
        ids = encode_prompt(target.tokenizer, prompt, raw=raw)
    except ValueError as error:
        raise ApiError(400, str(error), param=param, code="invalid_value") from error
    if not ids:
        raise ApiError(400, "The prompt encodes to no tokens.", param=param, code="invalid_value")
    return ids


def _validation_error(error: RequestValidationError) -> ApiError:
    first = error.errors()[0]
    loc = [str(part) for part in first.get("loc", ()) if part != "body"]
    path = ".".join(loc)
    kind = first.get("type", "invalid")
    if kind == "json_invalid":
        message = f"We could not parse the JSON body of your request ({first.get('ctx', {}).get('error', 'invalid')})."
    elif not loc:
        message = "The request body must be a JSON object, sent with Content-Type: application/json."
    elif kind == "extra_forbidden":
        message = f"Unrecognized request argument supplied: {path}"
    elif kind == "missing":
        message = f"Missing required parameter: '{path}'."
    else:
        message = f"Invalid value for '{path}': {first.get('msg', 'invalid')}."
    param = loc[0] if loc and kind != "json_invalid" else None  # a JSON error's loc is a character offset
    return ApiError(400, message, param=param, code=kind)


def _error_response(error: ApiError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status, headers=error.headers)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def api_error(request: Request, error: ApiError) -> JSONResponse:
        return _error_response(error)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, error: RequestValidationError) -> JSONResponse:
        return _error_response(_validation_error(error))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, error: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if error.status_code == 404 else "invalid_request_error"
        return _error_response(ApiError(error.status_code, str(error.detail), kind, headers=error.headers))

    @app.exception_handler(Exception)
    async def unexpected(request: Request, error: Exception) -> JSONResponse:
        log.exception("Unhandled error on %s", request.url.path)
        return _error_response(ApiError(500, "Internal server error; the details are in the server log.",
                                        "server_error"))


def _install_routes(app: FastAPI, server: Server) -> None:
    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        target = server.worker.model.target
        if isinstance(body.prompt, str):
            ids = _tokenize(target, body.prompt, raw=True, param="prompt")
            text: str | None = body.prompt
        else:
            if not body.prompt:
                raise ApiError(400, "The prompt is empty.", param="prompt", code="invalid_value")
            if not all(0 <= t < target.vocab_size for t in body.prompt):
                raise ApiError(400, f"Prompt token ids must be in [0, {target.vocab_size}).", param="prompt",
                               code="invalid_value")
            ids, text = list(body.prompt), None
        echo = (text if text is not None else target.tokenizer.decode(ids)) if body.echo else None
        return await server.complete(request, body, Ask(ids, text, body.max_tokens, chat=False, logprobs=body.top_logprobs_asked(),
                                                        echo=echo))

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatRequest, request: Request) -> Response:
        if body.max_tokens is not None and body.max_completion_tokens is not None:
            raise ApiError(400, "Give max_tokens or max_completion_tokens, not both.", param="max_tokens",
                           code="invalid_value")
        messages = [message.as_template_message() for message in body.messages]
        if not any(m["content"].strip() for m in messages):
            raise ApiError(400, "Every message is empty.", param="messages", code="invalid_value")
        ids = _tokenize(server.worker.model.target, messages, raw=False, param="messages")
        return await server.complete(request, body, Ask(ids, json.dumps(messages, ensure_ascii=False),
                                                        body.max_tokens or body.max_completion_tokens, chat=True,
                                                        logprobs=body.top_logprobs_asked()))

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> dict[str, Any]:
        server.check_model(body.model)
        target = server.worker.model.target
        if body.messages is not None:
            ids = _tokenize(target, [m.as_template_message() for m in body.messages], raw=False, param="messages")
        else:
            ids = encode_prompt(target.tokenizer, body.prompt or "", raw=True)
        return {"count": len(ids), "max_model_len": target.max_context, "tokens": ids}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict[str, str]:
        server.check_model(body.model)
        target = server.worker.model.target
        if not all(0 <= t < target.vocab_size for t in body.tokens):
            raise ApiError(400, f"Token ids must be in [0, {target.vocab_size}).", param="tokens", code="invalid_value")
        return {"prompt": target.tokenizer.decode(body.tokens)}

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": package_version("specops")}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [server.model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> dict[str, Any]:
        if model_id != server.config.model_name:
            raise ApiError(404, f"The model '{model_id}' does not exist.", param="model", code="model_not_found")
        return server.model_card()

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/ready")
    async def ready() -> JSONResponse:
        if (refusal := server.worker.feedback_refusal()) is not None:
            return JSONResponse({"status": "degraded", "reason": refusal.message}, status_code=503)
        if server.worker.ready.is_set():
            plan = {"memory_plan": server.plan.to_dict()} if server.plan is not None else {}
            return JSONResponse({"status": "ready", **server.worker.model.describe(), **plan})
        status = "failed" if server.worker.failure else "starting"
        return JSONResponse({"status": status, "reason": server.worker.failure}, status_code=503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(server.metrics.render(), media_type=CONTENT_TYPE)


def load_model(config: ServerConfig, metrics: ServerMetrics, target: Target | None = None,
               ) -> tuple[ServedModel, RegistryWatcher | None]:
    """What `config` says to serve; `target` (already loaded) replaces --target, e.g. in tests."""
    if target is None and config.target is not None and (config.bundle or config.model_uri):
        target = load_target(config.target, config.dtype)
    if config.bundle:
        return bundle_model(config.bundle, target), None
    if config.model_uri:
        watcher = RegistryWatcher(config.model_uri, config.tracking_uri, config.poll_s, metrics)
        return watcher.load_initial(target), watcher
    return plain_model(config, target), None


def create_app(config: ServerConfig, model: ServedModel | None = None, target: Target | None = None) -> FastAPI:
    """Build the app; the worker starts with its lifespan. `model` serves as given (no registry polling);
    otherwise it is loaded as `config` says, with `target` instead of loading --target."""
    metrics = ServerMetrics()

    def load() -> tuple[ServedModel, RegistryWatcher | None, MemoryPlan | None]:
        served, watcher = (model, None) if model is not None else load_model(config, metrics, target)
        if config.memory_budget is None:
            return served, watcher, None
        plan = memory_plan(config, served, parse_bytes(config.memory_budget))  # refuses when one request cannot fit
        return planned(served, plan), watcher, plan  # a goodput policy times passes here too

    # Loading and planning run parallel torch work; on this thread (the event loop's, for good) it would
    # leave an OpenMP team that slows every batched pass (specops.core.batching).
    served, watcher, plan = on_short_thread(load, "specops-load")
    if plan is not None:
        log.warning(describe(plan))  # warning: `specops serve` logs at that level and the plan must show
    server = Server(config, served, metrics, watcher, plan)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        server.start()
        try:
            yield
        finally:
            server.stop()

    app = FastAPI(title="specops", summary="OpenAI-compatible speculative decoding server", lifespan=lifespan)
    app.state.server = server
    install_error_handlers(app)
    _install_routes(app, server)
    install_guards(app, config)
    app.add_middleware(RequestRecorder, metrics=metrics, paths=COMPLETION_PATHS)  # added last: counts every request first
    return app


def serve(config: ServerConfig) -> None:
    """Run the server in the foreground until interrupted."""
    uvicorn.Server(uvicorn_config(create_app(config), config, log_level="info")).run()
