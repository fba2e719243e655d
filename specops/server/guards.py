"""ASGI middleware in front of the API: request counting, bearer-token auth (or, without a key, a Host check)
and a body size limit and deadline.

They are plain ASGI (not Starlette's BaseHTTPMiddleware) so streaming responses and client
disconnects pass through them untouched.
"""

from __future__ import annotations

import asyncio
import hmac
import time
from collections.abc import Collection

from starlette.applications import Starlette
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from specops.server.config import LOOPBACK_NAMES, HttpConfig, is_loopback
from specops.server.metrics import ServerMetrics
from specops.server.protocol import error_body

# A handler sets this key in the request state when the status sent at the start is not the outcome:
# 499 when a client left mid-stream, 504 when a stream timed out.
STATUS_KEY = "specops_status"


async def _send_error(scope: Scope, receive: Receive, send: Send, status: int, message: str, type: str,
                      code: str | None = None, headers: dict[str, str] | None = None) -> None:
    await JSONResponse(error_body(message, type, None, code), status_code=status, headers=headers)(scope, receive, send)


class RequestRecorder:
    """Counts completion requests by final status, and times the successful ones."""

    def __init__(self, app: ASGIApp, metrics: ServerMetrics, paths: Collection[str]) -> None:
        self.app = app
        self.metrics = metrics
        self.paths = frozenset(paths)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] not in self.paths:
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        state = scope.setdefault("state", {})
        status = 500  # what the server error middleware answers if nothing else does

        async def capture(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, capture)
        finally:
            final = state.get(STATUS_KEY, status)
            self.metrics.requests.labels(status=str(final)).inc()
            if final == 200:
                self.metrics.latency.observe(time.perf_counter() - start)


class BearerAuth:
    """Every path but the open ones needs `Authorization: Bearer <key>` (compared in constant time)."""

    def __init__(self, app: ASGIApp, api_key: str, open_paths: Collection[str] = ("/health",)) -> None:
        self.app = app
        self.key = api_key.encode()
        self.open_paths = frozenset(open_paths)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in self.open_paths:
            await self.app(scope, receive, send)
            return
        header = dict(scope["headers"]).get(b"authorization", b"").decode("latin-1")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode("latin-1"), self.key):
            message = ("Missing bearer token: send the header 'Authorization: Bearer <key>'." if not header
                       else "Incorrect API key provided.")
            await _send_error(scope, receive, send, 401, message, "invalid_request_error", "invalid_api_key",
                              headers={"WWW-Authenticate": "Bearer"})
            return
        await self.app(scope, receive, send)


def _split_host(host: str) -> tuple[str, str]:
    """A Host header's name and port ('' when absent): '[::1]:8000' -> ('[::1]', '8000')."""
    name, colon, port = host.rpartition(":")
    if not colon or "]" in port:  # no port; in '[::1]' the colons are the address's own
        return host, ""
    return name, port


class LoopbackHosts:
    """Only requests addressed to a loopback name pass, for a keyless server listening on loopback.

    A web page can point a domain of its own at 127.0.0.1 (DNS rebinding) and reach such a server from the
    browser of anyone on the machine; its requests then carry that domain in the Host header.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        host = dict(scope["headers"]).get(b"host", b"").decode("latin-1").lower()
        name, port = _split_host(host)
        server = scope.get("server")
        if not is_loopback(name.strip("[]")) or (port and (server is None or port != str(server[1]))):
            await _send_error(scope, receive, send, 400, f"Invalid Host header '{host}': this server has no API key, "
                              f"so it answers only requests addressed to {', '.join(LOOPBACK_NAMES)} and its port.",
                              "invalid_request_error", "invalid_host")
            return
        await self.app(scope, receive, send)


class BodyTooLargeError(Exception):
    """The body is past BodyLimit's max_bytes."""


class BodyLimit:
    """Reads the body up front: 413 past `max_bytes` (with or without a Content-Length), 408 when it has not
    arrived `timeout_s` after the headers."""

    def __init__(self, app: ASGIApp, max_bytes: int, timeout_s: float) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.timeout_s = timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        too_large = f"The request body is larger than this server's limit of {self.max_bytes} bytes."
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None:
            if not declared.isdigit():
                await _send_error(scope, receive, send, 400, "Invalid Content-Length header.", "invalid_request_error")
                return
            if int(declared) > self.max_bytes:
                await _send_error(scope, receive, send, 413, too_large, "invalid_request_error", "body_too_large")
                return
        try:
            body = await asyncio.wait_for(self._read(receive), self.timeout_s)
        except BodyTooLargeError:
            await _send_error(scope, receive, send, 413, too_large, "invalid_request_error", "body_too_large")
            return
        except TimeoutError:
            # Closing the connection: the rest of the body may still be on its way.
            await _send_error(scope, receive, send, 408, f"The request body did not arrive within {self.timeout_s:g} s.",
                              "invalid_request_error", "body_timeout", headers={"Connection": "close"})
            return
        if body is None:
            return  # the client left before sending its body
        replayed = False

        async def replay() -> Message:
            # The body once, then the real channel, so disconnects still reach the app.
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    async def _read(self, receive: Receive) -> bytes | None:
        """The whole body; None if the client disconnected first."""
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_bytes:
                raise BodyTooLargeError()
            if not message.get("more_body", False):
                return b"".join(chunks)


def install_guards(app: Starlette, config: HttpConfig) -> None:
    """The server's and the proxy's guards. add_middleware wraps, so the last added runs first:
    authenticate (or, keyless on loopback, check the Host), then read the body."""
    app.add_middleware(BodyLimit, max_bytes=config.max_body_bytes, timeout_s=config.body_timeout_s)
    if config.api_key:
        app.add_middleware(BearerAuth, api_key=config.api_key)
    elif is_loopback(config.host):
        app.add_middleware(LoopbackHosts)
