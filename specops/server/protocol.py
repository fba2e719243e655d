"""The OpenAI wire format: request bodies, error objects, responses and stream chunks.

Wrong types are a 400. Unknown top-level request fields are accepted and ignored, with a warning logged
once per field name, as vLLM does: agent frameworks (LangChain and others) send fields of their own. OpenAI
fields whose feature is not implemented here (tools, response_format, suffix, ...) are a 400 that names
the feature when they ask for it, never silently dropped; penalties and logit_bias are accepted only at
their neutral value, because common client libraries send those defaults explicitly. `n` > 1 runs n
independent generations; `logprobs` are the target's own (specops/core/sampling.py token_logprobs).
`user` and a message's `name` are accepted and ignored; inside a message, unknown fields are still a 400.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from specops.core.types import TokenLogprob
from specops.server.logprobs import TokenText, chat_logprobs, completion_logprobs
from specops.server.worker import Completion

MAX_STOP_STRINGS = 4  # as in OpenAI's API
# Accepted only at these values: penalties would change the target distribution that verification preserves.
NEUTRAL = {"presence_penalty": 0.0, "frequency_penalty": 0.0}
MAX_N = 16  # choices per request: each is a generation of its own and takes a queue slot
MAX_TOP_LOGPROBS = {"chat": 20, "completions": 5}  # OpenAI's limits
# Below it, logits / temperature can overflow (5e-324 makes every probability NaN), and the distribution is
# greedy's in all but rounding anyway; vLLM raises smaller temperatures to the same value.
MIN_TEMPERATURE = 0.01
# OpenAI request fields whose feature this server does not implement: asking for one (any value but null,
# false or empty) is a 400 naming it, since ignoring it would answer a different question.
UNSUPPORTED = {"suffix": "insertion (suffix)",
               "response_format": "structured output (response_format)", "tools": "tool calling (tools)",
               "tool_choice": "tool calling (tool_choice)", "functions": "function calling (functions)",
               "function_call": "function calling (function_call)"}
log = logging.getLogger(__name__)
_warned: set[str] = set()  # unknown field names already logged: once each, not once per request


class ApiError(Exception):
    """An error answered with an OpenAI error object."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def _not_unicode(value: Any, path: tuple[str, ...] = ()) -> tuple[str, ...] | None:
    """Where in a decoded JSON value a string or key is not valid Unicode (None if nowhere). JSON's \\ud800
    escapes decode to lone surrogates, on which the tokenizer, SQLite and UTF-8 responses all fail."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return path
        return None
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, item in items:
        where = (*path, str(key))
        found = _not_unicode(key, where) if isinstance(key, str) else None
        if found is None:
            found = _not_unicode(item, where)
        if found is not None:
            return found
    return None


class StrictModel(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(StrictModel):
    include_usage: bool = False


class SamplingFields(StrictModel):
    """Fields both endpoints share."""

    model: str | None = None  # None: the one model this server serves
    max_tokens: int | None = Field(None, ge=1)  # None: the server's default, cut to the context left
    temperature: float = Field(1.0, ge=0, le=2)  # OpenAI's default; 0 is greedy (and lossless-checkable)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=0)  # an extension (as in vLLM); 0 disables it
    seed: int | None = Field(None, ge=-(2**63), lt=2**63)  # None: a random seed, recorded in the feedback log
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # accepted for compatibility; never stored
    n: int = Field(1, ge=1, le=MAX_N)  # choice i samples with seed + i: the same as a request for one with that seed
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None

    model_config = ConfigDict(extra="ignore", strict=True)  # unknown top-level fields: see the module docstring

    @model_validator(mode="before")
    @classmethod
    def _known_features(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        for name, feature in UNSUPPORTED.items():
            if data.get(name) not in (None, False, [], {}):
                raise ApiError(400, f"This server does not support {feature}.", param=name,
                               code="unsupported_feature")
        for name in sorted(set(data) - set(cls.model_fields) - set(UNSUPPORTED) - _warned):
            if isinstance(name, str) and name.isprintable() and len(name) <= 64:  # a client's field, not junk
                _warned.add(name)
                log.warning("Ignoring the unknown request field '%s' (logged once).", name)
        return data

    @model_validator(mode="before")
    @classmethod
    def _unicode_only(cls, data: Any) -> Any:
        # Raised as is (pydantic wraps only ValueError): its message and param name the place, which may itself
        # be a field name with a lone surrogate in it, escaped here so the error response can be encoded.
        path = _not_unicode(data)
        if path is None:
            return data
        where = [part.encode("utf-8", "backslashreplace").decode("utf-8") for part in path]
        raise ApiError(400, f"Invalid value for '{'.'.join(where)}': the text has a lone surrogate (such as "
                       "\\ud800), which is not valid Unicode.", param=where[0] if where else None,
                       code="invalid_unicode")

    @field_validator("presence_penalty", "frequency_penalty")
    @classmethod
    def _neutral_only(cls, value: float, info: ValidationInfo) -> float:
        if value != NEUTRAL[info.field_name]:
            raise ValueError(f"this server supports only {info.field_name}={NEUTRAL[info.field_name]}")
        return value

    @field_validator("temperature")
    @classmethod
    def _not_tiny(cls, temperature: float) -> float:
        if 0 < temperature < MIN_TEMPERATURE:
            raise ValueError(f"temperature must be 0 (greedy) or at least {MIN_TEMPERATURE}: smaller ones overflow "
                             "the logits")
        return temperature

    @field_validator("logit_bias")
    @classmethod
    def _no_bias(cls, bias: dict[str, float] | None) -> dict[str, float] | None:
        if bias:
            raise ValueError("this server does not support logit_bias")
        return bias

    @field_validator("stop")
    @classmethod
    def _check_stop(cls, stop: str | list[str] | None) -> str | list[str] | None:
        if isinstance(stop, list) and len(stop) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings are allowed")
        if stop == "" or (isinstance(stop, list) and "" in stop):
            raise ValueError("stop strings must not be empty")
        return stop

    def stop_list(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(SamplingFields):
    prompt: str | list[int]  # text (no chat template) or token ids
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS["completions"])
    echo: bool = False  # the prompt comes back before the completion (with its tokens' logprobs when asked)

    def top_logprobs_asked(self) -> int | None:
        return self.logprobs


class TextPart(StrictModel):
    type: Literal["text"]
    text: str


class ChatMessage(StrictModel):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]
    name: str | None = None  # accepted for compatibility; the chat template has no use for it

    def as_template_message(self) -> dict[str, str]:
        text = self.content if isinstance(self.content, str) else "".join(part.text for part in self.content)
        # "developer" is OpenAI's newer name for "system"; chat templates know only the latter.
        return {"role": "system" if self.role == "developer" else self.role, "content": text}


class ChatRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)  # OpenAI's newer name for max_tokens
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS["chat"])

    @model_validator(mode="after")
    def _top_needs_logprobs(self) -> ChatRequest:
        if self.top_logprobs and not self.logprobs:
            raise ApiError(400, "top_logprobs needs logprobs: true.", param="top_logprobs", code="invalid_value")
        return self

    def top_logprobs_asked(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class TokenizeRequest(StrictModel):
    """vLLM's /tokenize: a text prompt as is, or chat messages through the chat template."""

    model_config = ConfigDict(extra="ignore", strict=True)
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt and messages")
        return self


class DetokenizeRequest(StrictModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    model: str | None = None
    tokens: list[int]


def usage(completions: list[Completion]) -> dict[str, Any]:
    """OpenAI's token counts (the prompt once, every choice's tokens) plus the speculative decoding counters."""
    first = completions[0]
    generated = sum(len(c.output_ids) for c in completions)
    steps = sum(c.stats.steps for c in completions)
    counts = {"prompt_tokens": first.prompt_tokens, "completion_tokens": generated,
              "total_tokens": first.prompt_tokens + generated,
              "prompt_tokens_details": {"cached_tokens": first.stats.cached_prompt_tokens},
              "drafted": sum(c.stats.drafted for c in completions), "accepted": sum(c.stats.accepted for c in completions),
              "mean_accepted_length": round(sum(c.stats.new_tokens for c in completions) / steps, 4) if steps else 0.0}
    stats = first.stats  # every choice ran the same model and mode
    # A lossy mode's output is not the target's own: say so, and how lossy (specops/lossy/autojudge.py, arbitrage.py).
    return {**counts, "lossy": stats.lossy,
            **({"lossy_mode": stats.lossy_mode, "lossy_threshold": stats.lossy_threshold} if stats.lossy else {})}


def system_fingerprint(completion: Completion) -> str:
    """OpenAI's field for "the backend configuration that produced this": here the bundle or the drafter."""
    model = completion.model
    return f"bundle-{model.bundle_version}" if model.bundle_version else f"drafter-{model.drafter}"


@dataclass
class Choice:
    """One choice of a response as it is put together: its text and logprob entries so far, and its end."""

    text: str = ""
    logprobs: list[TokenLogprob] = field(default_factory=list)
    completion: Completion | None = None


class ResponseBuilder:
    """Builds the response and stream chunks of one request, for either endpoint. `text_of` is given when
    the request asked for logprobs."""

    def __init__(self, chat: bool, request_id: str, model_name: str, text_of: TokenText | None = None) -> None:
        self.chat = chat
        self.request_id = request_id
        self.model_name = model_name
        self.text_of = text_of
        self.created = int(time.time())
        self._offsets: dict[int, int] = {}  # completions' text_offset, per choice, while streaming

    def _envelope(self, kind: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": self.request_id, "object": kind, "created": self.created, "model": self.model_name,
                "choices": choices}

    def _logprobs(self, entries: list[TokenLogprob] | tuple[TokenLogprob, ...], offset: int) -> dict[str, Any] | None:
        if self.text_of is None:
            return None
        if self.chat:
            return chat_logprobs(entries, self.text_of)
        return completion_logprobs(entries, self.text_of, offset)

    def response(self, choices: list[Choice]) -> dict[str, Any]:
        completions = [c.completion for c in choices if c.completion is not None]
        body = self._envelope("chat.completion" if self.chat else "text_completion", [
            {"index": index, **({"message": {"role": "assistant", "content": c.text}} if self.chat else {"text": c.text}),
             "logprobs": self._logprobs(c.logprobs, 0),
             "finish_reason": c.completion.finish_reason if c.completion else None}
            for index, c in enumerate(choices)])
        return {**body, "usage": usage(completions), "system_fingerprint": system_fingerprint(completions[0])}

    def chunk(self, index: int = 0, text: str | None = None, logprobs: tuple[TokenLogprob, ...] = (),
              finish_reason: str | None = None, role: bool = False) -> dict[str, Any]:
        """A stream chunk of choice `index`: the role announcement (chat only), a text delta with the
        logprobs of its tokens, or the final finish_reason."""
        scored = None
        if logprobs and self.text_of is not None:
            offset = self._offsets.get(index, 0)
            scored = self._logprobs(logprobs, offset)
            self._offsets[index] = offset + sum(len(self.text_of(e.token)[0]) for e in logprobs)
        if self.chat:
            delta: dict[str, Any] = {"role": "assistant", "content": ""} if role else {}
            if text is not None:
                delta["content"] = text
            choice = {"index": index, "delta": delta, "logprobs": scored, "finish_reason": finish_reason}
        else:
            choice = {"index": index, "text": text or "", "logprobs": scored, "finish_reason": finish_reason}
        return self._envelope("chat.completion.chunk" if self.chat else "text_completion", [choice])

    def usage_chunk(self, completions: list[Completion]) -> dict[str, Any]:
        """The extra last chunk OpenAI sends with stream_options.include_usage: no choices, only usage."""
        body = self._envelope("chat.completion.chunk" if self.chat else "text_completion", [])
        return {**body, "usage": usage(completions), "system_fingerprint": system_fingerprint(completions[0])}
