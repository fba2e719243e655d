"""uvicorn as the server runs it: a connection limit, keep-alive, and a deadline on request headers.

The body's deadline is ASGI middleware (specops/server/guards.py, BodyLimit): the body is read there anyway.
"""

from __future__ import annotations

import asyncio
from typing import Any

import h11
import uvicorn
from starlette.types import ASGIApp
from uvicorn.protocols.http.h11_impl import H11Protocol

from specops.server.config import HttpConfig


class HeaderDeadlineProtocol(H11Protocol):
    """uvicorn's h11 protocol with a deadline on each request's headers.

    Neither h11 nor uvicorn bounds how long a client may take to send them: a connection that sends nothing,
    or a byte now and then (slowloris), holds its socket forever, and enough of them exhaust the file
    descriptors until the server stops accepting. Here the headers must arrive within `header_timeout_s` of
    the connection opening or of the previous response ending, or the connection is closed.
    """

    header_timeout_s: float  # set by `header_deadline_protocol`
    _header_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:
        super().connection_made(transport)
        self._arm_header_timer()

    def on_response_complete(self) -> None:
        # Armed first: super() may parse a pipelined request, whose headers are then already in.
        self._arm_header_timer()
        super().on_response_complete()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
        super().connection_lost(exc)

    def _arm_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
        self._header_timer = self.loop.call_later(self.header_timeout_s, self._header_deadline_passed)

    def _header_deadline_passed(self) -> None:
        # h11 keeps the client IDLE until a request's headers are complete; past IDLE a request is running.
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self.conn.send(h11.ConnectionClosed())  # as uvicorn's own keep-alive timeout does
            self.transport.close()


def header_deadline_protocol(timeout_s: float) -> type[HeaderDeadlineProtocol]:
    """The protocol class for uvicorn's `http` setting (uvicorn builds protocols from the class alone)."""
    return type("HeaderDeadlineProtocol", (HeaderDeadlineProtocol,), {"header_timeout_s": timeout_s})


def uvicorn_config(app: ASGIApp, config: HttpConfig, **extra: Any) -> uvicorn.Config:
    """uvicorn's settings for `config`; `extra` adds others (log_level, timeout_graceful_shutdown, ...).

    The h11 protocol is named rather than left to uvicorn's "auto", which would take httptools where it is
    installed and lose the header deadline. `limit_concurrency` answers 503 to requests past the limit.
    """
    return uvicorn.Config(app, host=config.host, port=config.port, http=header_deadline_protocol(config.header_timeout_s),
                          limit_concurrency=config.max_connections, timeout_keep_alive=config.keep_alive_s, **extra)
