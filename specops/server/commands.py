"""`specops serve`, `specops proxy` and `specops feedback export`: call `register(subparsers)` from the main CLI.

Flags left unset fall through to the config dataclasses' defaults, so each default is written once.
"""

from __future__ import annotations

import argparse
from dataclasses import fields
from typing import Any

from specops.core.target import DTYPES
from specops.drafters.kinds import DRAFTERS
from specops.server.config import HttpConfig, ProxyConfig, ServerConfig, help_of


def _given(args: argparse.Namespace, config: type[HttpConfig]) -> dict[str, Any]:
    """The flags that were set, by field name."""
    names = {f.name for f in fields(config)}
    return {k: v for k, v in vars(args).items() if k in names and v is not None}


def _config(args: argparse.Namespace) -> ServerConfig:
    given = _given(args, ServerConfig)
    if "drafter" in given and (args.bundle or args.model_uri):
        raise ValueError("--drafter applies without a bundle only: a bundle's serving.yaml names its drafter.")
    return ServerConfig(**given)


def cmd_serve(args: argparse.Namespace) -> None:
    from specops.server.app import serve

    serve(_config(args))


def cmd_proxy(args: argparse.Namespace) -> None:
    from specops.server.proxy import serve_proxy

    serve_proxy(ProxyConfig(**_given(args, ProxyConfig)))


def cmd_feedback_export(args: argparse.Namespace) -> None:
    from specops.server.feedback import export, parse_since

    since = parse_since(args.since) if args.since else None
    db = args.db or ServerConfig.__dataclass_fields__["feedback_db"].default
    rows = export(db, since, args.out)
    print(f"wrote {rows} rows from {db} to {args.out}")


def _add_serve(sub: Any) -> None:
    serve = sub.add_parser("serve", help="run the OpenAI-compatible server",
                           description="Serve a bundle, a registry alias (hot-reloaded) or a plain target + "
                                       "drafter over an OpenAI-compatible HTTP API. Auth: set SPECOPS_API_KEY.")
    source = serve.add_mutually_exclusive_group()
    source.add_argument("--bundle", help=help_of("bundle"))
    source.add_argument("--model-uri", help=help_of("model_uri"))
    serve.add_argument("--tracking-uri", help=help_of("tracking_uri"))
    serve.add_argument("--poll-s", type=float, help=help_of("poll_s"))
    serve.add_argument("--target", help=help_of("target"))
    serve.add_argument("--dtype", choices=list(DTYPES), help=help_of("dtype"))
    serve.add_argument("--drafter", choices=list(DRAFTERS), help=help_of("drafter"))
    serve.add_argument("--draft-model", help=help_of("draft_model"))
    serve.add_argument("--static-width", type=int, help=help_of("static_width"))
    serve.add_argument("--model-name", help=help_of("model_name"))
    serve.add_argument("--max-batch", type=int, help=help_of("max_batch"))
    serve.add_argument("--batch-window-ms", type=float, help=help_of("batch_window_ms"))
    serve.add_argument("--queue-size", type=int, help=help_of("queue_size"))
    serve.add_argument("--default-max-tokens", type=int, help=help_of("default_max_tokens"))
    serve.add_argument("--max-prompt-tokens", type=int, help=help_of("max_prompt_tokens"))
    serve.add_argument("--memory-budget", help=help_of("memory_budget"))
    serve.add_argument("--min-context", type=int, help=help_of("min_context"))
    serve.add_argument("--memory-headroom", type=float, help=help_of("memory_headroom"))
    serve.add_argument("--no-feedback", dest="feedback", action="store_const", const=False,
                       help="do not log requests to the feedback database")
    _add_http(serve)
    serve.set_defaults(func=cmd_serve)


def _add_http(parser: argparse.ArgumentParser) -> None:
    """The flags every HTTP front shares (HttpConfig): listening, limits, deadline, feedback log."""
    parser.add_argument("--host", help=help_of("host", HttpConfig))
    parser.add_argument("--port", type=int, help=help_of("port", HttpConfig))
    parser.add_argument("--insecure-no-auth", action="store_const", const=True, help=help_of("insecure_no_auth", HttpConfig))
    parser.add_argument("--max-connections", type=int, help=help_of("max_connections", HttpConfig))
    parser.add_argument("--header-timeout-s", type=float, help=help_of("header_timeout_s", HttpConfig))
    parser.add_argument("--body-timeout-s", type=float, help=help_of("body_timeout_s", HttpConfig))
    parser.add_argument("--keep-alive-s", type=int, help=help_of("keep_alive_s", HttpConfig))
    parser.add_argument("--timeout-s", type=float, help=help_of("timeout_s", HttpConfig))
    parser.add_argument("--max-body-bytes", type=int, help=help_of("max_body_bytes", HttpConfig))
    parser.add_argument("--feedback-db", help=help_of("feedback_db", HttpConfig))
    parser.add_argument("--feedback-max-rows", type=int, help=help_of("feedback_max_rows", HttpConfig))
    parser.add_argument("--log-prompt-text", action="store_const", const=True, help=help_of("log_prompt_text", HttpConfig))


def _add_proxy(sub: Any) -> None:
    proxy = sub.add_parser("proxy", help="log another OpenAI-compatible server's traffic for retraining",
                           description="An OpenAI-compatible reverse proxy in front of vLLM, SGLang or any OpenAI "
                                       "server: it forwards every /v1 request and logs each finished completion "
                                       "to the feedback log, as `specops serve` does. Auth: SPECOPS_API_KEY (its "
                                       "clients), SPECOPS_UPSTREAM_API_KEY (sent upstream).")
    proxy.add_argument("--upstream", required=True, help=help_of("upstream", ProxyConfig))
    source = proxy.add_mutually_exclusive_group()
    source.add_argument("--target", help=help_of("target", ProxyConfig))
    source.add_argument("--bundle", help=help_of("bundle", ProxyConfig))
    proxy.add_argument("--upstream-token-ids", action="store_const", const=True,
                       help=help_of("upstream_token_ids", ProxyConfig))
    proxy.add_argument("--max-concurrent", type=int, help=help_of("max_concurrent", ProxyConfig))
    proxy.add_argument("--retry-after-s", type=int, help=help_of("retry_after_s", ProxyConfig))
    _add_http(proxy)
    proxy.set_defaults(func=cmd_proxy)


def _add_feedback(sub: Any) -> None:
    feedback = sub.add_parser("feedback", help="work with the serving feedback log")
    actions = feedback.add_subparsers(dest="feedback_command", required=True)
    export = actions.add_parser("export", help="export feedback rows to Parquet for retraining",
                                description="Write the feedback rows logged at or after --since to a Parquet file.")
    export.add_argument("--since", help="ISO 8601 time, e.g. 2025-01-31T00:00:00Z (UTC without a zone); "
                                        "default: every row")
    export.add_argument("--out", required=True, help="the .parquet file to write")
    export.add_argument("--db", help=help_of("feedback_db"))
    export.set_defaults(func=cmd_feedback_export)


def register(subparsers: Any) -> None:
    """Add `serve`, `proxy` and `feedback export` to an argparse subparsers object."""
    _add_serve(subparsers)
    _add_proxy(subparsers)
    _add_feedback(subparsers)
