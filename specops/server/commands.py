"""`specops serve` and `specops feedback export`: call `register(subparsers)` from the main CLI.

Flags left unset fall through to ServerConfig's defaults, so each default is written once.
"""

from __future__ import annotations

import argparse
from dataclasses import fields
from typing import Any

from specops.core.target import DTYPES
from specops.drafters.kinds import DRAFTERS
from specops.server.config import ServerConfig, help_of


def _config(args: argparse.Namespace) -> ServerConfig:
    names = {f.name for f in fields(ServerConfig)}
    given: dict[str, Any] = {k: v for k, v in vars(args).items() if k in names and v is not None}
    if "drafter" in given and (args.bundle or args.model_uri):
        raise ValueError("--drafter applies without a bundle only: a bundle's serving.yaml names its drafter.")
    return ServerConfig(**given)


def cmd_serve(args: argparse.Namespace) -> None:
    from specops.server.app import serve

    serve(_config(args))


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
    serve.add_argument("--host", help=help_of("host"))
    serve.add_argument("--port", type=int, help=help_of("port"))
    serve.add_argument("--insecure-no-auth", action="store_const", const=True, help=help_of("insecure_no_auth"))
    serve.add_argument("--max-connections", type=int, help=help_of("max_connections"))
    serve.add_argument("--header-timeout-s", type=float, help=help_of("header_timeout_s"))
    serve.add_argument("--body-timeout-s", type=float, help=help_of("body_timeout_s"))
    serve.add_argument("--keep-alive-s", type=int, help=help_of("keep_alive_s"))
    serve.add_argument("--max-batch", type=int, help=help_of("max_batch"))
    serve.add_argument("--batch-window-ms", type=float, help=help_of("batch_window_ms"))
    serve.add_argument("--queue-size", type=int, help=help_of("queue_size"))
    serve.add_argument("--timeout-s", type=float, help=help_of("timeout_s"))
    serve.add_argument("--max-body-bytes", type=int, help=help_of("max_body_bytes"))
    serve.add_argument("--default-max-tokens", type=int, help=help_of("default_max_tokens"))
    serve.add_argument("--max-prompt-tokens", type=int, help=help_of("max_prompt_tokens"))
    serve.add_argument("--feedback-db", help=help_of("feedback_db"))
    serve.add_argument("--no-feedback", dest="feedback", action="store_const", const=False,
                       help="do not log requests to the feedback database")
    serve.add_argument("--feedback-max-rows", type=int, help=help_of("feedback_max_rows"))
    serve.add_argument("--log-prompt-text", action="store_const", const=True, help=help_of("log_prompt_text"))
    serve.set_defaults(func=cmd_serve)


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
    """Add `serve` and `feedback export` to an argparse subparsers object."""
    _add_serve(subparsers)
    _add_feedback(subparsers)
