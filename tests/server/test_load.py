"""Load behaviour through a real server: 429 on a full queue, timeouts, disconnects, and no cross-talk
between concurrent requests."""

from __future__ import annotations

import sqlite3
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import openai
import pytest

from specops.core.kv import CachedLM
from specops.drafters.kinds import DecodingConfig
from specops.server.generator import TextGenerator
from specops.server.worker import ServedModel
from tests.server.conftest import PROMPTS, metric, served, slow_model
from tests.server.test_openai_api import client

CHAT = "/v1/chat/completions"
# The tiny target's greedy reply to PROMPTS[0] runs past 200 tokens without an EOS (checked below),
# so a generation of it lasts as long as max_tokens says.
LONG = {"messages": [{"role": "user", "content": PROMPTS[0]}], "temperature": 0}


def wait_until(condition: Any, timeout: float = 10.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


def queue_depth(url: str) -> float:
    return metric(httpx.get(f"{url}/metrics").text, "specops_queue_depth")


def test_full_queue_answers_429_with_retry_after(start_server, target):
    model, drafter = slow_model(target, step_s=0.03)
    live = start_server(model=model, queue_size=1, retry_after_s=2)
    drafter.proposals = 0  # the warm-up drafted too
    with ThreadPoolExecutor(2) as pool:
        running = pool.submit(httpx.post, live.url + CHAT, json={**LONG, "max_tokens": 60}, timeout=60)
        wait_until(lambda: drafter.proposals > 0, what="the first request to start")
        queued = pool.submit(httpx.post, live.url + CHAT, json={**LONG, "max_tokens": 2}, timeout=60)
        wait_until(lambda: queue_depth(live.url) == 1, what="the second request to queue")
        refused = httpx.post(live.url + CHAT, json={**LONG, "max_tokens": 2}, timeout=60)
        assert running.result().status_code == queued.result().status_code == 200

    assert refused.status_code == 429
    assert refused.headers["retry-after"] == "2"
    assert refused.json()["error"]["code"] == "queue_full"
    assert running.result().json()["usage"]["completion_tokens"] == 60  # no EOS cut the long reply short
    assert metric(httpx.get(live.url + "/metrics").text, "specops_requests_total", 'status="429"') == 1


def test_request_timeout_is_504_and_stops_the_generation(start_server, target):
    model, drafter = slow_model(target, step_s=0.05)
    live = start_server(model=model, timeout_s=0.6)
    response = httpx.post(live.url + CHAT, json={**LONG, "max_tokens": 200}, timeout=30)
    assert response.status_code == 504 and response.json()["error"]["code"] == "timeout"

    with pytest.raises(openai.APIError):  # mid-stream, the timeout arrives as an SSE error event
        for _ in client(live.url).chat.completions.create(model="specops", stream=True, max_tokens=200, **LONG):
            pass
    steps = drafter.proposals
    time.sleep(0.3)
    assert drafter.proposals <= steps + 1  # at most the step in flight when the flag was set
    assert live.state.feedback.count() == 0  # unfinished requests leave no row


def test_client_disconnect_mid_stream_stops_the_generation(start_server, target):
    model, drafter = slow_model(target, step_s=0.05)
    live = start_server(model=model)
    with httpx.stream("POST", live.url + CHAT, json={**LONG, "max_tokens": 200, "stream": True}, timeout=30) as r:
        lines = r.iter_lines()
        received = [next(lines) for _ in range(4)]  # the role chunk, a blank line, then generated text
    assert received[0].startswith("data: ")
    wait_until(lambda: metric(httpx.get(live.url + "/metrics").text, "specops_requests_total",
                              'status="499"') == 1, what="the disconnect to be recorded")
    steps = drafter.proposals
    time.sleep(0.3)
    assert drafter.proposals <= steps + 1
    assert steps < 50  # far from the 200 steps it would have run
    quick = httpx.post(live.url + CHAT, json={**LONG, "max_tokens": 3}, timeout=30)  # the worker is free again
    assert quick.status_code == 200
    assert live.state.feedback.count() == 1  # only the finished request


def test_client_leaving_a_non_streamed_request_stops_the_generation(start_server, target):
    """Tokens keep coming, so the handler is never idle: the disconnect is still noticed (on a clock)."""
    model, drafter = slow_model(target, step_s=0.05)
    live = start_server(model=model)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(live.url + CHAT, json={**LONG, "max_tokens": 200}, timeout=1.0)
    wait_until(lambda: metric(httpx.get(live.url + "/metrics").text, "specops_requests_total",
                              'status="499"') == 1, what="the disconnect to be recorded")
    steps = drafter.proposals
    time.sleep(0.3)
    assert drafter.proposals <= steps + 1 and steps < 100  # far from the 200 steps it would have run
    assert live.state.feedback.count() == 0


def _chat(url: str, prompt: str) -> tuple[str, str]:
    response = httpx.post(url + CHAT, json={"messages": [{"role": "user", "content": prompt}], "max_tokens": 48,
                                            "temperature": 0}, timeout=60)
    assert response.status_code == 200, response.text
    body = response.json()
    return body["id"], body["choices"][0]["message"]["content"]


def test_concurrent_greedy_requests_equal_solo_ones_and_each_logs_one_row(start_server, target, tmp_path):
    live = start_server(model=served(target), queue_size=len(PROMPTS))
    alone = [_chat(live.url, prompt)[1] for prompt in PROMPTS]
    barrier = threading.Barrier(len(PROMPTS))

    def together(prompt: str) -> tuple[str, str]:
        barrier.wait()
        return _chat(live.url, prompt)

    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        concurrent = list(pool.map(together, PROMPTS))

    # The speculative output must equal plain greedy decoding of the target, request by request.
    plain = TextGenerator(target, None, DecodingConfig(drafter="none"))
    reference = [plain.generate_text(prompt, 48)["text"] for prompt in PROMPTS]
    assert [text for _, text in concurrent] == alone == reference
    assert len(set(alone)) == len(alone)  # distinct replies, so a mix-up could not go unnoticed
    with sqlite3.connect(live.config.feedback_db) as db:
        rows = dict(db.execute("SELECT request_id, output_ids FROM requests").fetchall())
    assert len(rows) == 2 * len(PROMPTS)
    assert {request_id for request_id, _ in concurrent} <= set(rows)


def test_an_abandoned_long_prompt_frees_the_worker_within_one_prefill_chunk(start_server, target, monkeypatch):
    """The worker polls the job between prefill chunks: a prompt whose client timed out stops at the next
    chunk, so the request behind it is served within its own deadline instead of waiting out the prefill."""
    chunk_s, passes = 0.1, []
    original = CachedLM.prefill

    def slow_chunk(self: CachedLM, ids: list[int]) -> None:
        passes.append(len(ids))
        time.sleep(chunk_s)
        original(self, ids)

    monkeypatch.setattr(CachedLM, "prefill", slow_chunk)
    config = DecodingConfig(drafter="none", prefill_chunk=8)
    live = start_server(model=ServedModel(TextGenerator(target, None, config), drafter="none"), timeout_s=1.0)
    long_prompt = " ".join(f"w{i % 90}" for i in range(200))  # ~200 tokens: 26 chunks, 2.6 s of prefill
    passes.clear()  # the warm-up prefilled too
    response = httpx.post(live.url + CHAT, json={"messages": [{"role": "user", "content": long_prompt}],
                                                 "max_tokens": 2, "temperature": 0}, timeout=30)
    assert response.status_code == 504
    started = len(passes)  # the job was cancelled before its 504 was sent
    quick = httpx.post(live.url + CHAT, json={**LONG, "max_tokens": 2}, timeout=30)
    assert quick.status_code == 200  # not a 504 behind the rest of the abandoned prefill
    # The long prompt's chunks are 8 tokens; the quick prompt's 5 go in one pass of their own.
    assert 0 < started < 25 and passes[started:].count(8) <= 1  # at most the chunk in flight when cancelled
    assert live.state.feedback.count() == 1  # only the quick request
