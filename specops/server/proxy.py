"""`specops proxy`: an OpenAI-compatible reverse proxy that logs another server's answers for online retraining.

Put it in front of vLLM, SGLang or any OpenAI-compatible server, and its traffic lands in the same feedback log
`specops serve` writes (specops/server/feedback.py), so `specops retrain` distills on it unchanged.

- Forwarding. Every /v1/* request goes upstream with its path as the client sent it (percent-encoding kept; a
  path with a `.` or `..` segment is refused, so nothing outside the upstream's /v1 can be reached) and its body
  unchanged (unknown fields included), except with upstream_token_ids: then a logged request's JSON body is
  re-serialised with `return_token_ids: true` added, and its client gets the upstream's extra fields
  (`prompt_token_ids`, `token_ids`) back. The answer comes back with the upstream's status, headers (less the
  hop-by-hop ones, repeated ones kept) and body. Only a logged, non-streamed answer is read whole (up to
  MAX_ANSWER_BYTES) before it goes on; any other body is relayed as it comes, a logged stream event by event
  (each up to MAX_EVENT_BYTES). The proxy's own bearer key (SPECOPS_API_KEY) guards it and is never
  forwarded; SPECOPS_UPSTREAM_API_KEY, when set, is what the upstream gets. Upstream errors (4xx/5xx) pass
  through and log nothing; an upstream that cannot be reached is a 502, one that has not answered within
  timeout_s a 504, and past max_concurrent requests in flight the proxy answers 429 with Retry-After. A client
  that leaves closes the upstream request.
- Logging. /v1/chat/completions and /v1/completions log one row per choice (n > 1 gives n rows, named like the
  server's: `<id>-<index>`), drafter "upstream" and no steps (the upstream's drafting is invisible here; the
  target's distributions are recomputed at retrain time anyway). The row is committed before the response
  ends: before the JSON body goes out, or before a stream's final `data: [DONE]`. When it cannot be written,
  the request fails with 503 (a stream ends in an error event instead of [DONE]), and completion requests are
  refused until a probe write succeeds, as in the server.
- Token ids. Where the upstream reports them (vLLM's `return_token_ids`: `prompt_token_ids` and each choice's
  `token_ids`, EOS included), those are logged. Otherwise the prompt is rebuilt here with the target's
  tokenizer and chat template, as the server does (specops.core.target.encode_prompt), and the answer's text is
  re-tokenized, plus the EOS token when the answer ended on it, on one tokenizer thread off the event loop (a
  fast tokenizer's calls switch shared settings, so concurrent calls could tokenize with the wrong ones). A
  tokenizer can encode a text differently from how the model generated it, so these ids are the text's, not
  always the model's. A request whose prompt
  cannot be rebuilt here (tools, images, template arguments, echo, ...) is forwarded but not logged, with a
  warning once per reason. At start, the upstream's /tokenize (vLLM's and ours) is asked to tokenize a probe
  chat: a different answer means --target is not the upstream's model, and the proxy refuses to start.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import sqlite3
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from contextlib import aclosing, asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import quote, unquote

import httpx
import uvicorn
from fastapi import FastAPI, Request
from pydantic import ValidationError
from starlette.responses import JSONResponse, Response
from starlette.types import Receive, Scope, Send
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from specops.core.target import DEFAULT_TARGET, TargetLoadError, encode_prompt, load_tokenizer
from specops.server.app import DISCONNECT_POLL_S, ClientGone, EventStream, install_error_handlers, sse
from specops.server.bundle import load_bundle
from specops.server.config import ProxyConfig
from specops.server.feedback import FeedbackGate, FeedbackLog, FeedbackRecord, Refusal
from specops.server.guards import install_guards
from specops.server.protocol import ApiError, ChatMessage
from specops.server.transport import uvicorn_config

log = logging.getLogger(__name__)

DRAFTER = "upstream"  # the rows' drafter: whatever the upstream decodes with, which the proxy cannot see
LOGGED = {"/v1/chat/completions": "chat", "/v1/completions": "completions"}
# Headers for one connection only (RFC 9110 7.6.1), besides those a Connection header names.
HOP_BY_HOP = frozenset({"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "proxy-connection",
                        "te", "trailer", "transfer-encoding", "upgrade"})
# Not forwarded upstream: the proxy's own key, and what httpx sets itself. Bodies are asked for unencoded, since
# streams are read here.
REQUEST_DROP = HOP_BY_HOP | {"host", "content-length", "authorization", "accept-encoding"}
RESPONSE_DROP = HOP_BY_HOP | {"content-length", "content-encoding", "date", "server"}
DOT_SEGMENT = re.compile(r"(?:^|[/\\])\.\.?(?:[/\\]|$)")  # a `.` or `..` path segment (backslash: some servers' `/`)
MAX_EVENT_BYTES = 8 << 20  # a logged stream's event, read whole to be parsed: an upstream that never ends one is cut
MAX_ANSWER_BYTES = 64 << 20  # a logged answer, read whole to be parsed before it goes on
# Request fields that shape the prompt beyond the messages (or a completion's text), with the values that do
# not: with any other value the upstream's prompt cannot be rebuilt here.
PROMPT_SHAPERS = {
    "chat": {"tools": (None, []), "functions": (None, []), "chat_template": (None,), "chat_template_kwargs": (None, {}),
             "documents": (None, []), "continue_final_message": (None, False), "add_generation_prompt": (None, True),
             "echo": (None, False)},
    "completions": {"echo": (None, False), "suffix": (None, "")},
}
EVENT_END = re.compile(rb"\r\n\r\n|\n\n|\r\r")  # the blank line that ends a server-sent event
PROBE = [{"role": "user", "content": "Hello! Name three colours."}]  # the start-up tokenizer check's chat
PROBE_TIMEOUT_S = 10.0  # the check's own limit: an upstream that hangs at start must not hold the proxy's start
_warned: set[str] = set()  # reasons for unlogged requests already warned about: once each
T = TypeVar("T")


class Unloggable(Exception):
    """A request or answer the feedback log cannot represent faithfully; the message says why."""


def load_proxy_tokenizer(config: ProxyConfig) -> PreTrainedTokenizerBase:
    """The target's tokenizer (its chat template included), without its weights."""
    source = config.target or (load_bundle(config.bundle).target_source if config.bundle else DEFAULT_TARGET)
    path = Path(source).expanduser()
    if not path.is_dir():  # 'smollm2' or a .gguf file: the tokenizer is inside the weights file
        return load_tokenizer(source)[0]
    try:  # a folder needs only the tokenizer files
        return AutoTokenizer.from_pretrained(path)
    except Exception as error:  # the loaders raise many types; all mean "no usable tokenizer here"
        raise TargetLoadError(f"Could not load a tokenizer from {path} (--target): {error}") from error


def _warn_unlogged(reason: str) -> None:
    if reason not in _warned:
        _warned.add(reason)
        log.warning("Forwarding without a feedback row: %s (warned once per reason).", reason)


# 1. The request: its prompt token ids as the upstream saw them.

def _check_shapers(body: dict[str, Any], endpoint: str) -> None:
    for name, neutral in PROMPT_SHAPERS[endpoint].items():
        if body.get(name) not in neutral:
            raise Unloggable(f"the request field '{name}' shapes the prompt in a way not rebuilt here")


def chat_prompt(body: dict[str, Any], tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """The messages through the chat template, as `specops serve` tokenizes them."""
    _check_shapers(body, "chat")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise Unloggable("the request has no messages")
    try:  # null fields (a client echoing `tool_calls: null` back) say nothing
        parsed = [ChatMessage.model_validate({k: v for k, v in m.items() if v is not None}) for m in messages]
    except (ValidationError, AttributeError) as error:
        raise Unloggable("a message is not plain text for the chat template (tool calls, images, ...)") from error
    try:
        return encode_prompt(tokenizer, [m.as_template_message() for m in parsed])
    except ValueError as error:
        raise Unloggable(f"the messages do not tokenize: {error}") from error


def completion_prompts(body: dict[str, Any], tokenizer: PreTrainedTokenizerBase) -> list[list[int]]:
    """Each prompt of a completion request (a text, token ids, or a list of either), as token ids."""
    _check_shapers(body, "completions")
    prompt = body.get("prompt")
    batch = prompt if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int) else [prompt]
    out = []
    for one in batch:
        if isinstance(one, list) and one and all(isinstance(t, int) for t in one):
            out.append(list(one))
        elif isinstance(one, str) and one.strip():
            out.append(encode_prompt(tokenizer, one, raw=True))
        else:
            raise Unloggable("the prompt is neither text nor token ids")
    return out


# 2. The answer: each choice's text and ids, from the JSON body or the stream's chunks.

@dataclass
class ChoiceTally:
    text: str = ""
    token_ids: list[int] | None = None  # the upstream's (vLLM return_token_ids), when reported
    prompt_ids: list[int] | None = None  # the upstream's, per choice (completions)
    finish_reason: str | None = None
    stop_reason: Any = None  # vLLM's: None when the EOS ended it, the stop string or token otherwise
    stop_reason_known: bool = False
    opaque: bool = False  # part of the output is outside the text (tool calls, separate reasoning)


@dataclass
class Tally:
    """What the upstream answered a completion request, gathered as it goes by."""

    endpoint: str
    body: dict[str, Any]
    choices: dict[int, ChoiceTally] = field(default_factory=dict)
    prompt_ids: list[int] | None = None  # chat: the upstream's prompt_token_ids
    unusable: str | None = None  # why no row can be written (an error event, a chunk that is not JSON)

    def add(self, data: Any, streamed: bool) -> None:
        """One response body, or one stream chunk's data."""
        if not isinstance(data, dict) or "error" in data:
            self.unusable = "the upstream answered with an error" if isinstance(data, dict) else "an answer is not JSON"
            return
        if _is_ids(data.get("prompt_token_ids")):
            self.prompt_ids = data["prompt_token_ids"]
        for choice in data.get("choices") or ():
            if isinstance(choice, dict) and isinstance(choice.get("index", 0), int):
                self._add_choice(choice, streamed)

    def _add_choice(self, choice: dict[str, Any], streamed: bool) -> None:
        tally = self.choices.setdefault(choice.get("index", 0), ChoiceTally())
        if self.endpoint == "chat":
            part = choice.get("delta" if streamed else "message") or {}
            text = part.get("content") if isinstance(part, dict) else None
            if isinstance(part, dict) and any(part.get(k) for k in ("tool_calls", "function_call", "reasoning_content",
                                                                     "reasoning")):
                tally.opaque = True
        else:
            text = choice.get("text")
        if isinstance(text, str):
            tally.text += text
        if _is_ids(choice.get("token_ids")):
            tally.token_ids = (tally.token_ids or []) + choice["token_ids"]
        if _is_ids(choice.get("prompt_token_ids")):
            tally.prompt_ids = choice["prompt_token_ids"]
        if choice.get("finish_reason") is not None:
            tally.finish_reason = str(choice["finish_reason"])
            if "stop_reason" in choice:
                tally.stop_reason, tally.stop_reason_known = choice["stop_reason"], True


def _is_ids(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(t, int) for t in value)


# 3. The rows.

def _stops(body: dict[str, Any]) -> bool:
    """Whether anything but the EOS token can end the answer with finish_reason "stop"."""
    return bool(body.get("stop")) or bool(body.get("stop_token_ids"))


def output_ids(tally: ChoiceTally, body: dict[str, Any], tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """The upstream's ids when reported; else the text's, with the EOS when the answer ended on it (the server
    logs the EOS it generated, and retraining learns where answers end from it)."""
    if tally.token_ids is not None:
        return tally.token_ids
    if tally.opaque:
        raise Unloggable("part of the answer is outside its text (tool calls or separate reasoning)")
    ids = list(tokenizer(tally.text, add_special_tokens=False, split_special_tokens=True)["input_ids"]) \
        if tally.text else []
    ended_on_eos = tally.stop_reason is None if tally.stop_reason_known else not _stops(body)
    if tally.finish_reason == "stop" and ended_on_eos and tokenizer.eos_token_id is not None:
        ids.append(tokenizer.eos_token_id)
    return ids


def _sampling(body: dict[str, Any]) -> dict[str, Any]:
    """The request's settings as given; None where the upstream applied its own default, unknown here."""
    stop = body.get("stop")
    return {"temperature": body.get("temperature"), "top_p": body.get("top_p"), "top_k": body.get("top_k"),
            "seed": body.get("seed"), "max_tokens": body.get("max_tokens", body.get("max_completion_tokens")),
            "stop": [stop] if isinstance(stop, str) else [s for s in stop if isinstance(s, str)] if isinstance(stop, list)
            else []}


def records(tally: Tally, tokenizer: PreTrainedTokenizerBase) -> list[FeedbackRecord]:
    """One row per finished choice of a successful answer; Unloggable when none can be written faithfully."""
    if tally.unusable is not None:
        raise Unloggable(tally.unusable)
    finished = {index: c for index, c in sorted(tally.choices.items()) if c.finish_reason is not None}
    if not finished:
        raise Unloggable("the answer has no finished choice")
    body, chat = tally.body, tally.endpoint == "chat"
    n = body.get("n") if isinstance(body.get("n"), int) and body["n"] > 0 else 1
    prompts: list[list[int]] | None = None  # rebuilt here, once, if a choice lacks the upstream's prompt ids
    request_id = f"{'chatcmpl' if chat else 'cmpl'}-proxy-{uuid.uuid4().hex}"
    rows = []
    for index, choice in finished.items():
        prompt = tally.prompt_ids if chat else choice.prompt_ids
        if prompt is None:
            prompts = prompts or ([chat_prompt(body, tokenizer)] if chat else completion_prompts(body, tokenizer))
            which = 0 if chat else index // n  # a completion's choices come prompt by prompt, n each
            if which >= len(prompts):
                raise Unloggable("a choice's index is past the request's prompts")
            prompt = prompts[which]
        rows.append(FeedbackRecord(
            request_id=request_id if len(finished) == 1 else f"{request_id}-{index}", created_at=time.time(),
            bundle_version=None, model_version=None, drafter=DRAFTER, endpoint=tally.endpoint, prompt_ids=prompt,
            output_ids=output_ids(choice, body, tokenizer), sampling=_sampling(body), per_step=[],
            finish_reason=choice.finish_reason or "stop", prompt_text=_prompt_text(body, chat)))
    return rows


def _prompt_text(body: dict[str, Any], chat: bool) -> str | None:
    """As the server stores it (only with log_prompt_text, which FeedbackLog applies)."""
    prompt = body.get("messages") if chat else body.get("prompt")
    if prompt is None:  # the upstream reported the prompt's ids for a request without one: no text to keep
        return None
    return prompt if isinstance(prompt, str) else json.dumps(prompt, ensure_ascii=False)


# 4. Streams.

async def sse_events(chunks: AsyncIterator[bytes], max_bytes: int) -> AsyncIterator[bytes]:
    """Whole server-sent events, each with the blank line that ends it, from bytes cut anywhere; ApiError 502
    once max_bytes have come without an event ending (an upstream that never sends a blank line)."""
    buffer = b""
    async for chunk in chunks:
        buffer += chunk
        while (end := EVENT_END.search(buffer)) is not None:
            yield buffer[:end.end()]
            buffer = buffer[end.end():]
        if len(buffer) > max_bytes:
            raise ApiError(502, f"The upstream sent an event over {max_bytes} bytes long (MAX_EVENT_BYTES): the "
                           "stream is cut.", "server_error", code="upstream_too_large")
    if buffer.strip():
        yield buffer


def event_data(event: bytes) -> str | None:
    """An event's data (its `data:` lines joined, as the SSE spec says); None for comments and the like."""
    lines = [line[5:].removeprefix(" ") for line in event.decode("utf-8", "replace").splitlines()
             if line.startswith("data:")]
    return "\n".join(lines) if lines else None


# 5. The proxy.

def upstream_base(url: str) -> str:
    """The upstream's root: forwarded paths keep their /v1, so an OpenAI-style base URL's /v1 is dropped."""
    return url.rstrip("/").removesuffix("/v1")


def request_target(scope: Scope) -> str:
    """The request's path and query as the client sent them, percent-encoding kept (decoding would change what a
    path names: `/v1/models/org%2Fname`); a 400 for a path with a `.` or `..` segment, raw or percent-encoded,
    which the upstream URL would resolve outside /v1."""
    raw = scope.get("raw_path") or quote(scope["path"]).encode()  # raw_path is optional in ASGI
    path = raw.decode("latin-1")
    if DOT_SEGMENT.search(unquote(path)) or not path.isascii():
        raise ApiError(400, f"The path {path!r} has a '.' or '..' segment or is not ASCII: the proxy forwards "
                       "/v1 paths only as they are.", code="invalid_path")
    query = scope.get("query_string", b"").decode("latin-1")
    return path + (f"?{query}" if query else "")


def end_to_end(headers: Iterable[tuple[str, str]], drop: frozenset[str]) -> list[tuple[str, str]]:
    """The headers a proxy passes on, repeated ones kept in order: not hop-by-hop, not named by a Connection
    header (RFC 9110 7.6.1), not in `drop`."""
    headers = list(headers)
    named = {token.strip().lower() for name, value in headers if name.lower() == "connection"
             for token in value.split(",")}
    return [(name, value) for name, value in headers if name.lower() not in drop and name.lower() not in named]


def _refused(refusal: Refusal | None, retry_after_s: int) -> ApiError | None:
    if refusal is None:
        return None
    return ApiError(refusal.status, refusal.message, refusal.type, code=refusal.code,
                    headers={"Retry-After": str(retry_after_s)})


class Proxy:
    def __init__(self, config: ProxyConfig, tokenizer: PreTrainedTokenizerBase) -> None:
        self.config = config
        self.base = upstream_base(config.upstream or "")
        # What every forwarded URL's path starts with: a last check that no request leaves the upstream's /v1.
        self.prefix = httpx.URL(self.base + "/v1/").raw_path
        self.tokenizer = tokenizer
        # One thread owns the tokenizer: off the event loop (a long prompt would stall every relayed stream),
        # and one call at a time, since a fast tokenizer's calls switch shared settings (split_special_tokens).
        self.tokenizing = ThreadPoolExecutor(1, thread_name_prefix="specops-tokenize")
        self.feedback = FeedbackGate(FeedbackLog(config.feedback_db, config.feedback_max_rows, config.log_prompt_text))
        self.in_flight = 0
        self.client: httpx.AsyncClient | None = None  # opened with the app (it belongs to its event loop)

    def open(self) -> None:
        # trust_env=False: the upstream is addressed directly, never through an HTTP_PROXY meant for the internet.
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(self.config.timeout_s), trust_env=False,
                                        limits=httpx.Limits(max_connections=self.config.max_concurrent))

    async def close(self) -> None:
        if self.client is not None:
            await self.client.aclose()
        self.tokenizing.shutdown(cancel_futures=True)
        self.feedback.log.close()

    async def tokenized(self, call: Callable[..., T], *args: Any) -> T:
        """`call(*args)` on the tokenizer's thread."""
        return await asyncio.get_running_loop().run_in_executor(self.tokenizing, call, *args)

    def upstream_auth(self) -> list[tuple[str, str]]:
        """The upstream's key, when one is set (the client's own never goes upstream)."""
        key = self.config.upstream_api_key
        return [("authorization", f"Bearer {key}")] if key else []

    def headers(self, request: Request) -> list[tuple[str, str]]:
        return [*end_to_end(request.headers.items(), REQUEST_DROP), ("accept-encoding", "identity"),
                *self.upstream_auth()]

    async def check_tokenizer(self) -> None:
        """Refuse to start when the upstream tokenizes a probe chat differently (the wrong --target would log
        wrong ids); warn when it cannot tell (OpenAI itself has no /tokenize)."""
        assert self.client is not None
        theirs: Any = None
        try:
            response = await self.client.post(f"{self.base}/tokenize", json={"messages": PROBE},
                                              headers=self.upstream_auth(),
                                              timeout=min(PROBE_TIMEOUT_S, self.config.timeout_s))
            kind = response.headers.get("content-type", "")
            reason = f"HTTP {response.status_code}, {kind or 'no content type'}"
            if response.status_code == 200 and kind.startswith("application/json"):
                theirs = response.json().get("tokens")
        except (httpx.HTTPError, ValueError, AttributeError) as error:
            reason = f"{type(error).__name__}: {error}"
        if not _is_ids(theirs):
            log.warning("Could not check the tokenizer against the upstream's /tokenize (%s): make sure --target is "
                        "the upstream's model, or its rows hold wrong token ids.", reason)
            return
        ours = await self.tokenized(encode_prompt, self.tokenizer, PROBE)
        if theirs != ours:
            raise TargetLoadError(f"The upstream {self.base} tokenizes a probe chat as {len(theirs)} tokens "
                                  f"{theirs[:8]}..., the proxy's tokenizer as {len(ours)} tokens {ours[:8]}...: "
                                  "pass the upstream's model as --target (or --bundle), or the log gets wrong ids.")

    # The feedback log, by its gate's rule (specops/server/feedback.py).

    async def refusal(self) -> ApiError | None:
        """The 503 to answer while the log cannot be written; None when it can."""
        if self.feedback.retry_due():
            await asyncio.to_thread(self.feedback.retry)  # a probe write fsyncs: off the event loop
        return _refused(self.feedback.refusal(), self.config.retry_after_s)

    async def _record(self, tally: Tally) -> ApiError | None:
        """Commit the answer's rows; the 503 to answer instead when they could not be written."""
        try:
            rows = await self.tokenized(records, tally, self.tokenizer)
        except Unloggable as reason:
            _warn_unlogged(str(reason))
            return None
        try:
            await asyncio.to_thread(self.feedback.append, rows)  # fsync: off the event loop
        except sqlite3.Error as error:
            log.exception("Could not write a feedback row; refusing completion requests until it can.")
            return _refused(Refusal(str(error)), self.config.retry_after_s)
        return None

    # Requests.

    def _take_slot(self) -> None:
        if self.in_flight >= self.config.max_concurrent:
            raise ApiError(429, f"The proxy is busy: {self.config.max_concurrent} requests are in flight "
                           "(max_concurrent). Retry later.", "rate_limit_error", code="concurrency_limit",
                           headers={"Retry-After": str(self.config.retry_after_s)})
        self.in_flight += 1

    def _release_slot(self) -> None:
        self.in_flight -= 1

    async def handle(self, request: Request, endpoint: str | None) -> Response:
        """Forward a request and pass its answer on. A logged endpoint ("chat", "completions") commits each
        choice's row before the answer ends; None forwards any other /v1 endpoint and logs nothing."""
        target = request_target(request.scope)
        tally, content = None, await request.body()
        if endpoint is not None:
            if (refusal := await self.refusal()) is not None:
                raise refusal
            body = _json(content)
            tally = Tally(endpoint, body) if isinstance(body, dict) else None  # else the upstream says what is wrong
            if tally is not None and self.config.upstream_token_ids:
                content = json.dumps({**tally.body, "return_token_ids": True}).encode()
        deadline = asyncio.get_running_loop().time() + self.config.timeout_s
        self._take_slot()
        streaming = False
        try:
            response = await _unless_gone(request, self._upstream(self._send(request, target, content), deadline))
            if response.status_code != 200:
                tally = None  # an upstream error passes through and logs nothing
            if tally is not None and not _is_stream(response):
                return await _unless_gone(request, self._answer(response, tally, deadline))
            streaming = True  # the stream gives the slot back when it ends, however it ends

            async def cleanup() -> None:
                await response.aclose()  # when the client left, this closes the upstream request too
                self._release_slot()

            body = self._pass(response, deadline) if tally is None else self._relay(response, tally, deadline)
            return forwarded(UpstreamStream(body, cleanup, status_code=response.status_code), response)
        except ClientGone:
            return Response(status_code=499)
        finally:
            if not streaming:
                self._release_slot()

    async def _send(self, request: Request, target: str, content: bytes) -> httpx.Response:
        """The upstream's response once its headers are in; the body is read by the caller."""
        assert self.client is not None
        upstream = self.client.build_request(request.method, self.base + target, headers=self.headers(request),
                                             content=content)
        if not upstream.url.raw_path.startswith(self.prefix):  # request_target refused what could get here
            raise ApiError(400, f"The path {target!r} does not stay under /v1/.", code="invalid_path")
        return await self.client.send(upstream, stream=True)

    async def _upstream(self, call: Awaitable[T], deadline: float) -> T:
        """Await an upstream call by the request's deadline: 504 past it, 502 when the upstream cannot be reached
        or breaks off."""
        try:
            async with asyncio.timeout_at(deadline):
                return await call
        except (TimeoutError, httpx.TimeoutException) as error:
            raise ApiError(504, f"The upstream did not answer within {self.config.timeout_s:g} s (timeout_s).",
                           "timeout_error", code="timeout") from error
        except httpx.HTTPError as error:
            raise ApiError(502, f"The upstream {self.base} cannot be reached or broke off ({type(error).__name__}: "
                           f"{error or 'no details'}).", "server_error", code="upstream_unavailable") from error

    async def _body(self, response: httpx.Response, deadline: float) -> AsyncIterator[bytes]:
        """The upstream's body as it comes, each chunk by the request's deadline (ApiError past it, or when the
        upstream breaks off)."""
        async with aclosing(response.aiter_bytes()) as chunks:
            while True:
                try:
                    chunk = await self._upstream(anext(chunks), deadline)
                except StopAsyncIteration:
                    return
                yield chunk

    async def _answer(self, response: httpx.Response, tally: Tally, deadline: float) -> Response:
        """A logged, non-streamed answer: read it whole (up to MAX_ANSWER_BYTES), log it, pass it on."""
        body = bytearray()
        try:
            async with aclosing(self._body(response, deadline)) as chunks:
                async for chunk in chunks:
                    body += chunk
                    if len(body) > MAX_ANSWER_BYTES:
                        raise ApiError(502, f"The upstream's answer is over {MAX_ANSWER_BYTES} bytes "
                                       "(MAX_ANSWER_BYTES), too large to be logged.", "server_error",
                                       code="upstream_too_large")
        finally:
            await response.aclose()
        tally.add(_json(body), streamed=False)
        if (refusal := await self._record(tally)) is not None:
            raise refusal
        return forwarded(Response(bytes(body), status_code=response.status_code), response)

    async def _relay(self, response: httpx.Response, tally: Tally, deadline: float) -> AsyncIterator[bytes]:
        """A logged stream's events as they come, each parsed on the way; the rows are committed when [DONE]
        arrives and before it is passed on. An upstream that breaks off or sends an event over MAX_EVENT_BYTES,
        or the deadline, ends the stream in an error event and logs nothing."""
        async with aclosing(sse_events(self._body(response, deadline), MAX_EVENT_BYTES)) as events:
            try:
                async for event in events:
                    data = event_data(event)
                    if data == "[DONE]":
                        refusal = await self._record(tally)
                        yield event if refusal is None else sse(refusal.body()).encode()
                        return
                    if data is not None:
                        tally.add(_json(data.encode()), streamed=True)
                    yield event
            except ApiError as error:
                yield sse(error.body()).encode()
        # Ended without [DONE]: not a finished answer, nothing logged.

    async def _pass(self, response: httpx.Response, deadline: float) -> AsyncIterator[bytes]:
        """Any other answer (unlogged endpoints, upstream errors), chunk by chunk as it comes. When the upstream
        breaks off, an event stream ends in an error event; any other body is cut by raising, which drops the
        connection, so the client sees it incomplete rather than a shorter body that looks whole."""
        async with aclosing(self._body(response, deadline)) as chunks:
            try:
                async for chunk in chunks:
                    yield chunk
            except ApiError as error:
                if not _is_stream(response):
                    raise
                yield sse(error.body()).encode()


class UpstreamStream(EventStream):
    """A body relayed from the upstream, an event stream or any other; once it ends, however it ends (client
    gone included), `cleanup` runs: it closes the upstream response and gives the request's slot back."""

    media_type = None  # the upstream's Content-Type is forwarded as it is

    def __init__(self, content: AsyncIterator[bytes], cleanup: Callable[[], Awaitable[None]], **kwargs: Any) -> None:
        super().__init__(content, **kwargs)
        self.cleanup = cleanup

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.cleanup()


def forwarded(response: Response, upstream: httpx.Response) -> Response:
    """`response` with the upstream's end-to-end headers; a repeated one (Set-Cookie) stays repeated."""
    for name, value in end_to_end(upstream.headers.multi_items(), RESPONSE_DROP):
        response.headers.append(name, value)
    return response


def _json(content: bytes | bytearray) -> Any:
    """The parsed JSON, or None when it is not JSON (Tally.add then counts the answer as unusable)."""
    try:
        return json.loads(content)
    except ValueError:
        return None


def _is_stream(response: httpx.Response) -> bool:
    return response.headers.get("content-type", "").startswith("text/event-stream")


async def _unless_gone(request: Request, call: Awaitable[T]) -> T:
    """Await `call`, cancelling it (and so the upstream request) if the client disconnects meanwhile."""
    task = asyncio.ensure_future(call)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if done:
                return task.result()
            if await request.is_disconnected():
                raise ClientGone()
    except BaseException:
        await _discard(task)
        raise


async def _discard(task: asyncio.Future[Any]) -> None:
    """Cancel an upstream call nobody awaits any more, or, when it finished anyway (while the disconnect was
    being checked), close the response it got: either way its pooled connection is freed."""
    if not task.done():
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    if not task.cancelled() and task.exception() is None and isinstance(task.result(), httpx.Response):
        await task.result().aclose()


def _install_routes(app: FastAPI, proxy: Proxy) -> None:
    def logged(endpoint: str) -> Callable[[Request], Awaitable[Response]]:
        async def handler(request: Request) -> Response:
            return await proxy.handle(request, endpoint)
        return handler

    for path, endpoint in LOGGED.items():
        app.add_api_route(path, logged(endpoint), methods=["POST"])

    @app.api_route("/v1/{rest:path}", methods=["GET", "POST", "PUT", "PATCH", "DELETE"])
    async def other(request: Request) -> Response:
        return await proxy.handle(request, None)

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/ready")
    async def ready() -> JSONResponse:
        if (refusal := await proxy.refusal()) is not None:
            return JSONResponse({"status": "degraded", "reason": refusal.message}, status_code=503)
        return JSONResponse({"status": "ready", "upstream": proxy.base})


def create_proxy_app(config: ProxyConfig, tokenizer: PreTrainedTokenizerBase | None = None) -> FastAPI:
    """The proxy's app; `tokenizer` replaces loading config's target (tests)."""
    proxy = Proxy(config, tokenizer if tokenizer is not None else load_proxy_tokenizer(config))

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        proxy.open()
        try:
            await proxy.check_tokenizer()
            yield
        finally:
            await proxy.close()

    app = FastAPI(title="specops proxy", summary="OpenAI-compatible proxy that logs answers for retraining",
                  lifespan=lifespan)
    app.state.proxy = proxy
    install_error_handlers(app)
    _install_routes(app, proxy)
    install_guards(app, config)
    return app


def serve_proxy(config: ProxyConfig) -> None:
    """Run the proxy in the foreground until interrupted."""
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per forwarded request: uvicorn's access log has it
    uvicorn.Server(uvicorn_config(create_proxy_app(config), config, log_level="info")).run()
