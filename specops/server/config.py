"""Every setting of the OpenAI-compatible server and proxy, documented where it is declared.

The CLI (specops/server/commands.py) takes its help text from the `help` metadata and leaves unset flags
to these defaults, so a default is written exactly once.
"""

from __future__ import annotations

import ipaddress
import math
import os
import re
from dataclasses import MISSING, dataclass, field, fields
from typing import Any
from urllib.parse import urlsplit

from specops.core.memory import parse_bytes
from specops.core.target import DTYPES
from specops.drafters.kinds import DRAFTERS

MODEL_URI = re.compile(r"^models:/(?P<name>[^/@]+)@(?P<alias>[A-Za-z0-9_-]+)$")
LOOPBACK_NAMES = ("localhost", "127.0.0.1", "[::1]")  # as they appear in a Host header


def is_loopback(host: str) -> bool:
    """Whether listening on `host` keeps the server unreachable from other machines."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # another name: it may resolve to anything
        return False


def option(default: Any, help: str) -> Any:
    return field(default=default, metadata={"help": help})


def _api_key_from_env() -> str | None:
    return os.environ.get("SPECOPS_API_KEY") or None


def _upstream_key_from_env() -> str | None:
    return os.environ.get("SPECOPS_UPSTREAM_API_KEY") or None


def _check_positive(values: dict[str, float]) -> None:
    for name, value in values.items():
        if value <= 0:
            raise ValueError(f"{name} must be > 0, got {value}.")


@dataclass
class HttpConfig:
    """What every HTTP front of specops shares, `specops serve` and `specops proxy`: where it listens, its
    auth, connection and body limits, the per-request deadline and the feedback log."""

    # HTTP.
    host: str = option("127.0.0.1", "interface to listen on")
    port: int = option(8000, "TCP port to listen on")
    api_key: str | None = field(default_factory=_api_key_from_env, metadata={
        "help": "bearer token every endpoint but /health requires; read from env SPECOPS_API_KEY, so it never "
                "appears in a process listing"})
    insecure_no_auth: bool = option(
        False, "serve a non-loopback --host without an API key, every endpoint open to whoever reaches it "
               "(e.g. behind a proxy that authenticates); without it such a server refuses to start")
    max_body_bytes: int = option(1 << 20, "larger request bodies get 413")
    # Connections: without limits, clients that connect and send nothing (or a byte now and then) hold a file
    # descriptor each until the process runs out and stops accepting.
    max_connections: int = option(256, "open connections at most (keep it well below `ulimit -n`); requests "
                                       "arriving past it get 503")
    header_timeout_s: float = option(10.0, "a request's headers must arrive within this many seconds of the "
                                           "connection opening or of the previous response; else it is closed")
    body_timeout_s: float = option(30.0, "a request's body must arrive within this many seconds of its headers; "
                                         "else 408")
    keep_alive_s: int = option(5, "an idle keep-alive connection is closed after this many seconds")
    retry_after_s: int = option(1, "Retry-After seconds sent with a 429 or a 503")
    timeout_s: float = option(120.0, "per-request limit on the whole answer (the server: queue wait plus "
                                     "generation; the proxy: the upstream's answer); past it 504")
    # Feedback log for online retraining.
    feedback_db: str = option("feedback/feedback.db", "SQLite feedback database (WAL mode)")
    feedback_max_rows: int = option(1_000_000, "retention cap: the oldest rows are dropped beyond it")
    log_prompt_text: bool = option(False, "also store the prompt text (token ids are always stored)")

    def __post_init__(self) -> None:
        _check_positive({"timeout_s": self.timeout_s, "max_body_bytes": self.max_body_bytes,
                         "feedback_max_rows": self.feedback_max_rows, "max_connections": self.max_connections,
                         "header_timeout_s": self.header_timeout_s, "body_timeout_s": self.body_timeout_s,
                         "keep_alive_s": self.keep_alive_s})
        if self.retry_after_s < 0:
            raise ValueError(f"retry_after_s must be >= 0, got {self.retry_after_s}.")
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be in 0..65535, got {self.port}.")
        if self.api_key is not None and not self.api_key.strip():
            raise ValueError("The API key is empty: set SPECOPS_API_KEY to a secret, or unset it to serve without one.")
        if not self.api_key and not self.insecure_no_auth and not is_loopback(self.host):
            raise ValueError(f"Serving on {self.host} without an API key would open every endpoint to anyone who can "
                             "reach it. Set SPECOPS_API_KEY, or pass --insecure-no-auth if that is intended.")


@dataclass
class ServerConfig(HttpConfig):
    # What to serve: a bundle folder, a registry alias, or a plain target + drafter (neither).
    bundle: str | None = option(None, "bundle folder to serve, verified at start; never reloaded")
    model_uri: str | None = option(
        None, "models:/NAME@ALIAS: serve that registry version and poll the alias to hot-reload new ones")
    tracking_uri: str | None = option(
        None, "MLflow tracking and registry URI for --model-uri; unset uses MLflow's own (MLFLOW_TRACKING_URI)")
    poll_s: float = option(30.0, "seconds between polls of --model-uri's alias; 0 loads it once")
    target: str | None = option(
        None, "target model: 'smollm2', a .gguf file or an HF folder; unset means the bundle's own target, "
              "or smollm2 without a bundle")
    dtype: str = option("float32", "target precision when --target is loaded here (float32 or bfloat16)")
    drafter: str = option("recycling", "drafter without a bundle; 'none' is plain autoregressive decoding "
                                       "(a bundle's serving.yaml chooses its own)")
    draft_model: str | None = option(None, "the drafter's weights folder without a bundle: a draft LM for the "
                                           "draft-lm kinds, an aligned head, exit heads (del), or "
                                           "train_specialists' folder for the cosine kinds")
    static_width: int = option(0, "without a bundle: rows of each target pass on the static runtime (0: the "
                                  "dynamic cache); with --dtype bfloat16 its passes batch across requests (a "
                                  "bundle's serving.yaml sets its own)")
    model_name: str = option("specops", "model id shown by /v1/models; requests naming another model get 404")
    # Load: up to max_batch generations decode at once, their target passes batched (specops/server/worker.py);
    # the rest wait in a queue.
    max_batch: int = option(8, "generations decoding at once, their target passes batched; needs a model on the "
                               "eager static runtime in bfloat16 (a bundle's default), else one at a time")
    batch_window_ms: float = option(2.0, "how long a target pass waits for the other generations' passes "
                                         "before it runs without them")
    queue_size: int = option(16, "requests that may wait for a generation slot; more get 429")
    default_max_tokens: int = option(256, "max_tokens when a request gives none (cut to the context left)")
    max_prompt_tokens: int = option(4096, "longer prompts get 400: a prompt's prefill holds every queued request "
                                          "up (an abandoned one stops within one prefill chunk, DecodingConfig)")
    prefix_cache_mb: float = option(64.0, "MiB of prompts' first blocks (keys and values) kept for later prompts "
                                          "that start alike (a chat template's system turn, an instruction): "
                                          "exact on the native bf16 runtime, unused elsewhere; 0 turns it off")
    # Memory budget (SpecMemo, specops/server/budget.py): the planner fits width, drafts, slots and context into it.
    memory_budget: str | None = option(
        None, "the process's memory budget, e.g. 1.5GiB or 900MiB: at start the planner lowers --max-batch, the "
              "static width / draft length / tree size and the context per request until the memory model's peak "
              "fits, and refuses to start if one request cannot; unset: no budget")
    memory_headroom: float = option(0.1, "with --memory-budget: the fraction of the budget the plan leaves free for "
                                         "what the memory model does not count (under load the server held 4% and "
                                         "7% more than it predicted, docs/results.md)")
    min_context: int = option(1024, "with --memory-budget: the tokens (prompt + max_tokens) every generation slot "
                                    "must hold at least, or the server refuses to start")
    # Feedback log for online retraining (its path and retention: HttpConfig).
    feedback: bool = option(True, "log one row per finished request to the feedback database")

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.bundle and self.model_uri:
            raise ValueError("Give either a bundle folder or a models:/ URI, not both.")
        if self.model_uri and not MODEL_URI.match(self.model_uri):
            raise ValueError(f"Model URI '{self.model_uri}' must look like models:/NAME@ALIAS "
                             "(for a fixed version, publish it and pass the bundle folder).")
        if self.drafter not in DRAFTERS:
            raise ValueError(f"Unknown drafter '{self.drafter}'. Choose one of: {', '.join(DRAFTERS)}.")
        if self.dtype not in DTYPES:
            raise ValueError(f"Unknown dtype '{self.dtype}'. Choose one of: {', '.join(DTYPES)}.")
        _check_positive({"queue_size": self.queue_size, "default_max_tokens": self.default_max_tokens,
                         "max_prompt_tokens": self.max_prompt_tokens, "max_batch": self.max_batch})
        if self.poll_s < 0 or self.batch_window_ms < 0 or self.static_width < 0:
            raise ValueError("poll_s, batch_window_ms and static_width must be >= 0.")
        if not (math.isfinite(self.prefix_cache_mb) and self.prefix_cache_mb >= 0):
            raise ValueError(f"prefix_cache_mb must be a finite number >= 0, got {self.prefix_cache_mb}.")
        if self.memory_budget is not None:
            parse_bytes(self.memory_budget)  # a bad size fails here, with the CLI's message
            if self.model_uri:
                raise ValueError("--memory-budget plans the model loaded at start; a hot reload from --model-uri could "
                                 "bring a drafter the plan did not count. Serve the bundle folder instead.")
        _check_positive({"min_context": self.min_context})
        if not 0.0 <= self.memory_headroom < 1.0:
            raise ValueError(f"memory_headroom must be in [0, 1), got {self.memory_headroom}.")
        if self.static_width and (self.bundle or self.model_uri):
            raise ValueError("static_width applies to a plain target and drafter; a bundle's serving.yaml sets its own.")

    @property
    def prefix_cache_bytes(self) -> int:
        """--prefix-cache-mb in bytes."""
        return int(self.prefix_cache_mb * 2**20)


@dataclass
class ProxyConfig(HttpConfig):
    """`specops proxy` (specops/server/proxy.py): an OpenAI-compatible reverse proxy in front of another server
    (vLLM, SGLang, ...) that logs its answers to the feedback log as `specops serve` logs its own."""

    upstream: str | None = option(
        None, "base URL of the OpenAI-compatible server to forward to, e.g. http://127.0.0.1:8001 (a trailing /v1 "
              "is dropped); required")
    upstream_api_key: str | None = field(default_factory=_upstream_key_from_env, metadata={
        "help": "bearer token sent upstream; read from env SPECOPS_UPSTREAM_API_KEY, so it never appears in a "
                "process listing. The clients' own Authorization header (the proxy's key) is never forwarded"})
    target: str | None = option(
        None, "the upstream's model, for its tokenizer and chat template only (no weights are loaded): "
              "'smollm2', a .gguf file or a folder with the HF tokenizer files; unset means --bundle's target, "
              "or smollm2 without a bundle")
    bundle: str | None = option(None, "a bundle whose target is the upstream's model (instead of --target)")
    upstream_token_ids: bool = option(
        False, "add vLLM's return_token_ids to every forwarded request and log the token ids the upstream "
               "reports (servers without that extension may refuse the field); otherwise the text is "
               "re-tokenized here, unless a client asked for the ids itself")
    max_concurrent: int = option(64, "requests forwarded at once; more get 429 with Retry-After (the upstream "
                                     "queues what it is sent)")

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.upstream:
            raise ValueError("upstream is required: the base URL of the OpenAI-compatible server to forward to "
                             "(--upstream http://HOST:PORT).")
        parts = urlsplit(self.upstream)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise ValueError(f"upstream '{self.upstream}' must be an http:// or https:// URL such as "
                             "http://127.0.0.1:8001.")
        _check_positive({"max_concurrent": self.max_concurrent})


def help_of(name: str, config: type[HttpConfig] = ServerConfig) -> str:
    """A field's help with its default, for argparse."""
    spec = next(f for f in fields(config) if f.name == name)
    default = "$SPECOPS_API_KEY" if spec.default is MISSING else spec.default
    return f"{spec.metadata['help']} (default: {default})".replace("%", "%%")  # argparse formats help with %
