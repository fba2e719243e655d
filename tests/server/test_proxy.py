"""`specops proxy` in front of our own server: the answers are the upstream's, and each finished choice is one
feedback row holding the very token ids the upstream logged for the same request in its own log."""

from __future__ import annotations

import asyncio
import json
import socket
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import uvicorn

from specops.cli import build_parser
from specops.core.target import TargetLoadError
from specops.server import proxy as proxy_module
from specops.server.app import ClientGone
from specops.server.commands import _given
from specops.server.config import ProxyConfig, ServerConfig
from specops.server.protocol import ApiError
from specops.server.proxy import Proxy, Tally, Unloggable, _unless_gone, create_proxy_app, records, sse_events
from specops.server.transport import uvicorn_config
from tests.conftest import tiny_tokenizer
from tests.server.conftest import LiveServer, free_socket, metric, served, slow_model, start_live, wait_ready
from tests.server.test_load import LONG, wait_until
from tests.server.test_openai_api import client

UPSTREAM_KEY = "upstream-secret"
EOS_PROMPT = "w49 w54 w59"  # the tiny target's greedy reply ends on its EOS after 7 tokens


def start_proxy(upstream: str, folder: Path, tokenizer: Any = None, **overrides: Any) -> LiveServer:
    """A proxy on 127.0.0.1 in a thread, with uvicorn's settings as `specops proxy` runs it."""
    values: dict[str, Any] = {"upstream": upstream, "feedback_db": str(folder / "proxy.db"), "api_key": None,
                              "upstream_api_key": UPSTREAM_KEY}
    config = ProxyConfig(**{**values, **overrides})
    app = create_proxy_app(config, tokenizer=tokenizer)
    sock = free_socket()
    server = uvicorn.Server(uvicorn_config(app, config, log_level="warning", timeout_graceful_shutdown=5))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    live = LiveServer(f"http://127.0.0.1:{sock.getsockname()[1]}", app, config, server, thread)  # type: ignore[arg-type]
    try:
        wait_ready(live.url, {"Authorization": f"Bearer {config.api_key}"} if config.api_key else None)
    except BaseException:
        live.stop()
        raise
    return live


def rows(db: str | Path) -> list[dict[str, Any]]:
    with sqlite3.connect(db) as conn:
        conn.row_factory = sqlite3.Row
        return [dict(row) for row in conn.execute("SELECT * FROM requests ORDER BY id")]


@pytest.fixture(scope="module")
def upstream(target: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    """Our server, keyed, logging to its own feedback log."""
    folder = tmp_path_factory.mktemp("upstream")
    live = start_live(ServerConfig(feedback_db=str(folder / "upstream.db"), api_key=UPSTREAM_KEY), model=served(target),
                      auth={"Authorization": f"Bearer {UPSTREAM_KEY}"})
    yield live
    live.stop()


@pytest.fixture
def proxy_in_front(upstream: LiveServer, target: Any, tmp_path: Path) -> Iterator[Callable[..., LiveServer]]:
    started: list[LiveServer] = []

    def start(url: str | None = None, **overrides: Any) -> LiveServer:
        started.append(start_proxy(url or upstream.url, tmp_path, target.tokenizer, **overrides))
        return started[-1]

    yield start
    for live in started:
        live.stop()


SPECULATIVE = ("drafted", "accepted", "mean_accepted_length")  # token recycling learns from every request


def _same(a: Any, b: Any) -> None:
    """Equal but for what differs between any two requests: ids, creation times and the drafter's counters."""
    def strip(x: Any) -> Any:
        out = {k: v for k, v in x.model_dump().items() if k not in ("id", "created")}
        if out.get("usage"):
            out["usage"] = {k: v for k, v in out["usage"].items() if k not in SPECULATIVE}
        return out
    assert strip(a) == strip(b)


def test_answers_are_the_upstreams_and_rows_are_its_rows(upstream, proxy_in_front):
    proxy = proxy_in_front()
    direct, proxied = client(upstream.url, UPSTREAM_KEY), client(proxy.url)
    chat = {"model": "specops", "messages": [{"role": "user", "content": EOS_PROMPT}], "max_tokens": 20,
            "temperature": 0}
    text = {"model": "specops", "prompt": "w3 w9 w27", "max_tokens": 6, "temperature": 0}
    sampled = {"model": "specops", "prompt": "w10 w11", "max_tokens": 5, "temperature": 0.9, "seed": 7, "n": 2}
    calls: list[tuple[Callable[..., Any], dict[str, Any]]] = [
        (lambda api, **b: api.chat.completions.create(**b), chat),
        (lambda api, **b: list(api.chat.completions.create(stream=True, **b)), chat),
        (lambda api, **b: api.completions.create(**b), text),
        (lambda api, **b: list(api.completions.create(stream=True, **b)), text),
        (lambda api, **b: api.completions.create(**b), sampled),
    ]
    first = len(rows(upstream.config.feedback_db))
    for call, body in calls:
        ours, theirs = call(proxied, **body), call(direct, **body)
        for a, b in zip(ours if isinstance(ours, list) else [ours], theirs if isinstance(theirs, list) else [theirs],
                        strict=True):
            _same(a, b)  # streams: chunk for chunk
    assert direct.models.list().data == proxied.models.list().data  # the other /v1 endpoints pass through

    logged = rows(proxy.config.feedback_db)
    # The upstream logged each request twice, the proxy's first (one row per choice).
    upstream_rows = rows(upstream.config.feedback_db)[first:]
    by_proxy = [upstream_rows[0], upstream_rows[2], upstream_rows[4], upstream_rows[6], *upstream_rows[8:10]]
    assert len(logged) == len(by_proxy) == 6
    for mine, theirs in zip(logged, by_proxy, strict=True):
        for key in ("prompt_ids", "output_ids", "endpoint", "finish_reason"):
            assert mine[key] == theirs[key], key
        assert mine["drafter"] == "upstream" and json.loads(mine["steps"]) == []
    assert json.loads(logged[0]["output_ids"])[-1] == 2 and logged[0]["finish_reason"] == "stop"  # the EOS, logged
    assert logged[4]["request_id"].endswith("-0") and logged[5]["request_id"].endswith("-1")
    assert json.loads(logged[4]["sampling"])["seed"] == 7


def test_keys_errors_and_an_unreachable_upstream(upstream, proxy_in_front):
    keyed = proxy_in_front(api_key="proxy-secret")
    body = {"messages": [{"role": "user", "content": "w1 w2"}], "max_tokens": 2}
    assert httpx.post(keyed.url + "/v1/chat/completions", json=body).status_code == 401
    wrong = httpx.post(keyed.url + "/v1/chat/completions", json=body, headers={"Authorization": "Bearer nope"})
    assert wrong.status_code == 401
    # The client's key is the proxy's; the upstream gets its own (it would refuse the proxy's).
    assert client(keyed.url, "proxy-secret").chat.completions.create(model="specops", **body).choices

    plain = proxy_in_front()
    for bad in ({**body, "temperature": 5}, {**body, "model": "another"}):  # upstream 400 and 404: passed on as is
        ours = httpx.post(plain.url + "/v1/chat/completions", json=bad)
        theirs = httpx.post(upstream.url + "/v1/chat/completions", json=bad,
                            headers={"Authorization": f"Bearer {UPSTREAM_KEY}"})
        assert ours.status_code == theirs.status_code >= 400 and ours.json() == theirs.json()
    # The clients' key is never forwarded, even where it would open the upstream: without an upstream key, the
    # upstream gets none, and its 401 comes back.
    unkeyed = proxy_in_front(api_key=UPSTREAM_KEY, upstream_api_key=None)
    refused = httpx.post(unkeyed.url + "/v1/chat/completions", json=body,
                         headers={"Authorization": f"Bearer {UPSTREAM_KEY}"})
    assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key"
    assert len(rows(plain.config.feedback_db)) == 1  # the keyed proxy's answer; errors log nothing

    closed = free_socket()
    down = f"http://127.0.0.1:{closed.getsockname()[1]}"
    closed.close()
    gone = proxy_in_front(down)
    refused = httpx.post(gone.url + "/v1/chat/completions", json=body)
    assert refused.status_code == 502 and refused.json()["error"]["code"] == "upstream_unavailable"
    assert down in refused.json()["error"]["message"]


def test_unwritable_log_fails_the_answer_then_refuses_until_it_writes(upstream, proxy_in_front, monkeypatch):
    proxy = proxy_in_front(retry_after_s=3)
    body = {"model": "specops", "messages": [{"role": "user", "content": "w5 w6"}], "max_tokens": 3, "temperature": 0}
    api = client(proxy.url)

    def full(*args: Any) -> None:
        raise sqlite3.OperationalError("database or disk is full")

    log = proxy.app.state.proxy.feedback.log  # the proxy's only: the upstream, in this process, keeps writing
    monkeypatch.setattr(log, "append", full)
    monkeypatch.setattr(log, "probe", full)
    # Its row failed before [DONE] went out, so the stream ends in an error, not a finish.
    with pytest.raises(openai.APIError, match="disk is full"):
        for _ in api.chat.completions.create(stream=True, **body):
            pass
    refused = httpx.post(proxy.url + "/v1/chat/completions", json=body)
    assert refused.status_code == 503 and refused.headers["retry-after"] == "3"
    assert refused.json()["error"]["code"] == "feedback_unavailable"
    assert httpx.get(proxy.url + "/ready").json()["status"] == "degraded"

    monkeypatch.undo()  # room again: the next probe, a second later, writes
    wait_until(lambda: httpx.get(proxy.url + "/ready").status_code == 200, what="the log to write again")
    assert api.chat.completions.create(**body).choices
    assert len(rows(proxy.config.feedback_db)) == 1


def cancelled(url: str) -> float:
    """Requests our server saw its client leave (499)."""
    return metric(httpx.get(url + "/metrics").text, "specops_requests_total", 'status="499"')


def test_slow_upstream_limits_timeouts_and_disconnects(start_server, target, tmp_path):
    model, drafter = slow_model(target, step_s=0.05)
    slow = start_server(model=model, feedback_db=str(tmp_path / "slow.db"))
    proxy = start_proxy(slow.url, tmp_path, target.tokenizer, upstream_api_key=None, max_concurrent=1,
                        retry_after_s=2)
    hurried = start_proxy(slow.url, tmp_path / "hurried", target.tokenizer, upstream_api_key=None, timeout_s=1.0)
    chat = proxy.url + "/v1/chat/completions"
    try:
        with ThreadPoolExecutor(1) as pool:
            running = pool.submit(httpx.post, chat, json={**LONG, "max_tokens": 12}, timeout=60)
            wait_until(lambda: proxy.app.state.proxy.in_flight == 1, what="the first request to be forwarded")
            busy = httpx.post(chat, json={**LONG, "max_tokens": 2})
            assert running.result().status_code == 200
        assert busy.status_code == 429 and busy.headers["retry-after"] == "2"

        late = httpx.post(hurried.url + "/v1/chat/completions", json={**LONG, "max_tokens": 24}, timeout=30)
        assert late.status_code == 504 and late.json()["error"]["code"] == "timeout"
        # The proxy gave up and closed the upstream request: our server stops that generation too.
        wait_until(lambda: cancelled(slow.url) == 1, what="the upstream to drop the timed-out request")
        assert len(rows(slow.config.feedback_db)) == 1
        with pytest.raises(openai.APIError, match="did not answer") as error:
            for _ in client(hurried.url).chat.completions.create(model="specops", stream=True, max_tokens=200, **LONG):
                pass
        assert not isinstance(error.value, openai.APIStatusError)  # mid-stream: an error event, not a status

        # A client that leaves mid-stream: the proxy closes the upstream request, which stops generating.
        wait_until(lambda: cancelled(slow.url) == 2, what="the upstream to drop the timed-out stream")
        drafter.proposals = 0
        with httpx.stream("POST", chat, json={**LONG, "max_tokens": 200, "stream": True}, timeout=30) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data: ")
            next(lines), next(lines)
        wait_until(lambda: cancelled(slow.url) == 3, what="the upstream to see the disconnect")
        assert proxy.app.state.proxy.in_flight == 0  # the stream gave its slot back
        steps = drafter.proposals
        time.sleep(0.3)
        assert drafter.proposals <= steps + 1 and steps < 50  # far from the 200 steps it would have run
        assert len(rows(proxy.config.feedback_db)) == 1  # the one finished answer
        assert rows(hurried.config.feedback_db) == []
    finally:
        proxy.stop()
        hurried.stop()


def test_upstream_token_ids_are_logged_as_reported(tokenizer):
    """vLLM's return_token_ids, as its own tests show the shape: prompt_token_ids in the first chunk, each chunk's
    token_ids (EOS included). They win over re-tokenizing, which here would give other ids."""
    tally = Tally("chat", {"messages": [{"role": "user", "content": "w1"}], "stream": True})
    tally.add({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}], "prompt_token_ids": [3, 7, 9]},
              streamed=True)
    tally.add({"choices": [{"index": 0, "delta": {"content": "w5"}, "token_ids": [11]}]}, streamed=True)
    tally.add({"choices": [{"index": 0, "delta": {"content": " w6"}, "token_ids": [12, 2], "finish_reason": "stop",
                            "stop_reason": None}]}, streamed=True)
    [row] = records(tally, tokenizer)
    assert (row.prompt_ids, row.output_ids) == ([3, 7, 9], [11, 12, 2])
    # A completion whose prompt only the upstream's ids tell: no prompt text, rather than the text "null".
    tally = Tally("completions", {})
    tally.add({"choices": [{"index": 0, "text": "w5", "token_ids": [11, 2], "prompt_token_ids": [3],
                            "finish_reason": "stop"}]}, streamed=False)
    assert records(tally, tokenizer)[0].prompt_text is None


def test_what_cannot_be_rebuilt_is_not_logged(tokenizer):
    answer = {"choices": [{"index": 0, "message": {"role": "assistant", "content": "w5"}, "finish_reason": "stop"}]}
    messages = [{"role": "user", "content": "w1"}]
    for body in ({"messages": messages, "tools": [{"type": "function"}]},
                 {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
                 {"messages": messages, "chat_template": "{{ messages }}"}):
        tally = Tally("chat", body)
        tally.add(answer, streamed=False)
        with pytest.raises(Unloggable):
            records(tally, tokenizer)
    # A stop string may have ended it: then no EOS is added, unless vLLM's stop_reason (None: the EOS) says so.
    w5 = tokenizer.convert_tokens_to_ids("w5")
    for request, reported, eos in (({"stop": ["w9"]}, {}, []), ({"stop": ["w9"]}, {"stop_reason": None}, [2]),
                                   ({}, {}, [2])):
        tally = Tally("chat", {"messages": messages, **request})
        tally.add({"choices": [{**answer["choices"][0], **reported}]}, streamed=False)
        assert records(tally, tokenizer)[0].output_ids == [w5, *eos]


def test_events_are_cut_where_they_end():
    async def events(parts: list[bytes], max_bytes: int = 1000) -> list[bytes]:
        async def chunks() -> Any:
            for part in parts:
                yield part
        return [event async for event in sse_events(chunks(), max_bytes)]

    stream = b'data: {"a": 1}\n\n: keep-alive\r\n\r\ndata: [DONE]\n\n'
    whole = asyncio.run(events([stream]))
    assert whole == [b'data: {"a": 1}\n\n', b": keep-alive\r\n\r\n", b"data: [DONE]\n\n"]
    assert asyncio.run(events([stream[i:i + 3] for i in range(0, len(stream), 3)])) == whole
    # An upstream that never ends an event is cut once it has sent max_bytes, not buffered without end.
    with pytest.raises(ApiError, match="MAX_EVENT_BYTES"):
        asyncio.run(events([b"data: " + b"x" * 40] * 30))


def test_a_different_tokenizer_is_refused_at_start(upstream, tmp_path):
    other = tiny_tokenizer()
    other.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    proxy = Proxy(ProxyConfig(upstream=upstream.url, feedback_db=str(tmp_path / "p.db"), api_key=None,
                              upstream_api_key=UPSTREAM_KEY), other)

    async def check() -> None:
        proxy.open()
        try:
            await proxy.check_tokenizer()
        finally:
            await proxy.close()

    with pytest.raises(TargetLoadError, match="--target"):
        asyncio.run(check())


def test_proxy_flags_fill_the_config_and_leave_defaults_to_it():
    args = build_parser().parse_args(["proxy", "--upstream", "http://127.0.0.1:8001/v1", "--max-concurrent", "3"])
    config = ProxyConfig(**_given(args, ProxyConfig))
    assert (config.upstream, config.max_concurrent, config.timeout_s) == ("http://127.0.0.1:8001/v1", 3, 120.0)
    with pytest.raises(ValueError, match="http:// or https://"):
        ProxyConfig(upstream="127.0.0.1:8001")


class FakeUpstream:
    """An upstream that records what reaches it (each request's raw path and query, and headers) and answers
    what the tests below need: headers to forward, a body that waits, answers too large to log."""

    def __init__(self) -> None:
        self.seen: list[tuple[bytes, list[tuple[str, str]]]] = []
        self.released = threading.Event()  # lets /v1/files/slow send the rest of its body

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        content = b""
        while (message := await receive())["type"] == "http.request":
            content += message.get("body", b"")
            if not message.get("more_body"):
                break
        headers = [(k.decode(), v.decode()) for k, v in scope["headers"]]
        self.seen.append((scope["raw_path"] + b"?" + scope["query_string"], headers))

        async def answer(kind: str, *parts: bytes, extra: tuple[tuple[str, str], ...] = ()) -> None:
            start_headers = [(b"content-type", kind.encode()), *((k.encode(), v.encode()) for k, v in extra)]
            await send({"type": "http.response.start", "status": 200, "headers": start_headers})
            for i, part in enumerate(parts):
                if i:  # the body's rest waits for the test
                    await asyncio.to_thread(self.released.wait, 10)
                await send({"type": "http.response.body", "body": part, "more_body": i < len(parts) - 1})

        if scope["path"] == "/v1/files/slow":
            await answer("application/octet-stream", b"first", b"second")
        elif scope["path"] == "/v1/chat/completions" and json.loads(content).get("stream"):
            await answer("text/event-stream", b"data: " + b"x" * 3000)  # an event that never ends
        elif scope["path"] == "/v1/chat/completions":
            await answer("application/json", json.dumps({"padding": "x" * 3000}).encode())
        else:
            await answer("application/json", json.dumps(headers).encode(), extra=(
                ("set-cookie", "a=1"), ("set-cookie", "b=2"), ("connection", "x-private"), ("x-private", "secret"),
                ("x-kept", "yes")))


@pytest.fixture(scope="module")
def fake() -> Iterator[tuple[FakeUpstream, str]]:
    upstream = FakeUpstream()
    sock = free_socket()
    server = uvicorn.Server(uvicorn.Config(upstream, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    wait_until(lambda: server.started, what="the fake upstream to start")
    yield upstream, url
    upstream.released.set()
    server.should_exit = True
    thread.join(timeout=30)


@pytest.fixture
def before_fake(fake, tokenizer, tmp_path) -> Iterator[tuple[FakeUpstream, LiveServer]]:
    upstream, url = fake
    proxy = start_proxy(url, tmp_path, tokenizer)
    upstream.seen.clear()
    upstream.released.clear()
    yield upstream, proxy
    proxy.stop()


def raw_status(url: str, target: str) -> int:
    """The status of a GET whose request target goes out byte for byte (httpx would resolve its dot segments)."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(f"GET {target} HTTP/1.1\r\nHost: {host}:{port}\r\nConnection: close\r\n\r\n".encode())
        return int(sock.recv(1024).split()[1])


def test_no_path_leaves_the_upstreams_v1_and_paths_go_as_sent(before_fake):
    upstream, proxy = before_fake
    for escape in ("/v1/../reset_prefix_cache", "/v1/..%2Fsleep", "/v1/%2E%2e/update_weights_from_disk",
                   "/v1/models/./x", "/v1/chat/completions/.."):
        assert raw_status(proxy.url, escape) == 400, escape
    assert raw_status(proxy.url, "/v1/models/org%2Fname?q=%2F") == 200  # not decoded into another path
    assert [path for path, _ in upstream.seen] == [b"/v1/models/org%2Fname?q=%2F"]


def test_headers_go_both_ways_repeated_and_without_hop_by_hop_ones(before_fake):
    upstream, proxy = before_fake
    sent = [("x-multi", "a"), ("x-multi", "b"), ("connection", "x-hop"), ("x-hop", "secret")]
    answer = httpx.get(proxy.url + "/v1/models", headers=sent)
    received = [(k, v) for k, v in upstream.seen[-1][1] if k in ("x-multi", "x-hop", "authorization")]
    assert received == [("x-multi", "a"), ("x-multi", "b"), ("authorization", f"Bearer {UPSTREAM_KEY}")]
    assert answer.headers.get_list("set-cookie") == ["a=1", "b=2"]  # not joined into one by a comma
    assert "x-private" not in answer.headers and answer.headers["x-kept"] == "yes"


def test_unlogged_answers_stream_and_logged_ones_are_bounded(before_fake, monkeypatch):
    upstream, proxy = before_fake
    # A file comes through as it comes: its first part arrives while the upstream still holds the rest back.
    with httpx.stream("GET", proxy.url + "/v1/files/slow", timeout=5) as response:
        parts = response.iter_raw()
        first = next(parts)
        upstream.released.set()
        assert first + b"".join(parts) == b"firstsecond"
    # What must be read whole to be logged is bounded: a 502, or an error event ending the stream.
    monkeypatch.setattr(proxy_module, "MAX_ANSWER_BYTES", 1000)
    monkeypatch.setattr(proxy_module, "MAX_EVENT_BYTES", 1000)
    chat = {"messages": [{"role": "user", "content": "w1"}]}
    whole = httpx.post(proxy.url + "/v1/chat/completions", json=chat)
    assert whole.status_code == 502 and "MAX_ANSWER_BYTES" in whole.json()["error"]["message"]
    streamed = httpx.post(proxy.url + "/v1/chat/completions", json={**chat, "stream": True})
    assert streamed.text.startswith("data: {") and "MAX_EVENT_BYTES" in streamed.text
    assert rows(proxy.config.feedback_db) == []


def test_an_answer_that_lands_as_the_client_leaves_is_closed(monkeypatch):
    """The upstream's response arrives while the disconnect is being checked: nobody will read it, so it is
    closed, else its pooled connection stays taken."""
    monkeypatch.setattr(proxy_module, "DISCONNECT_POLL_S", 0.01)
    closed: list[bool] = []

    class Body(httpx.AsyncByteStream):
        async def __aiter__(self) -> Any:
            yield b""

        async def aclose(self) -> None:
            closed.append(True)

    async def leave() -> None:
        release = asyncio.Event()

        async def upstream_call() -> httpx.Response:
            await release.wait()
            return httpx.Response(200, stream=Body())

        call = asyncio.ensure_future(upstream_call())

        class Leaving:
            async def is_disconnected(self) -> bool:
                release.set()
                await call  # the answer lands before the client is found gone
                return True

        with pytest.raises(ClientGone):
            await _unless_gone(Leaving(), call)  # type: ignore[arg-type]

    asyncio.run(leave())
    assert closed == [True]


def test_tokenizing_runs_off_the_event_loop(tokenizer, tmp_path, monkeypatch):
    threads: list[str] = []
    monkeypatch.setattr(proxy_module, "records", lambda *args: threads.append(threading.current_thread().name) or [])
    proxy = Proxy(ProxyConfig(upstream="http://127.0.0.1:1", feedback_db=str(tmp_path / "p.db"), api_key=None),
                  tokenizer)

    async def record() -> None:
        try:
            assert await proxy._record(Tally("chat", {})) is None
        finally:
            await proxy.close()

    asyncio.run(record())
    assert threads and threads[0].startswith("specops-tokenize")
