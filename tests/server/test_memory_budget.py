"""`--memory-budget` through a real server on a tiny bf16 target: the plan caps the generation slots (more
requests queue, then get 429), a request longer than the planned context gets a 400 that names the
budget, the plan shows on /ready and /metrics, and a budget that cannot hold one request stops the start.

Generations are held open by a drafter that waits on an event, so what runs at once is observed, not
timed. Budgets are computed from the memory model itself, so they sit between two slot counts (with no
headroom: the default 10% is for the real process, tested by the load run in docs/results.md).
"""

from __future__ import annotations

import copy
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import httpx
import pytest
import torch

from specops.core.drafter import EMPTY, Draft, DrafterBase, TokenStop, refuse_stop
from specops.core.memory import DecodingShape, ModelShape, memory_report
from specops.core.planner import MemoryBudgetError
from specops.core.target import target_from_model
from specops.core.types import SamplingParams
from specops.drafters.kinds import DecodingConfig
from specops.server.app import create_app
from specops.server.budget import prefix_cache_bytes
from specops.server.config import ServerConfig
from specops.server.generator import TextGenerator
from specops.server.worker import ServedModel
from tests.conftest import tiny_llama, tiny_tokenizer
from tests.server.conftest import metric

WIDTH = 3
WAIT_S = 30.0  # a bound on waiting for the server to reach a state, never an assertion on time


class GateDrafter(DrafterBase):
    """Drafts nothing; once `armed`, every generation waits for `release` as it starts decoding (the loop
    resets the drafter then, whatever the plan's draft length, even none), so generations stay open on
    demand. Forks share both events (copy.copy keeps the references)."""

    name = "gate"

    def __init__(self) -> None:
        self.armed = threading.Event()
        self.release = threading.Event()

    def reset(self) -> None:
        if self.armed.is_set():
            self.release.wait(WAIT_S)

    def propose(self, context: list[int], k: int, sampling: SamplingParams, generator: torch.Generator | None,
                stop: TokenStop | None = None) -> Draft:
        refuse_stop(self, stop)
        return EMPTY

    def observe(self, tokens: list[int], logits: torch.Tensor) -> None:
        pass


@pytest.fixture(scope="module")
def bf16_target():
    return target_from_model(tiny_llama(0, dtype=torch.bfloat16, hidden=96), tiny_tokenizer(), "tiny-bf16")


def gated(target) -> tuple[ServedModel, GateDrafter]:
    drafter = GateDrafter()
    config = DecodingConfig(drafter="none", static_width=WIDTH, draft_tokens=WIDTH - 1)
    return ServedModel(TextGenerator(target, drafter, config), drafter="gate"), drafter


def peak(target, slots: int, context: int, width: int = WIDTH) -> int:
    """The memory model's peak for this server's plans (what budget.py computes, for a width-`width` plan)."""
    shape = DecodingShape(dtype="bfloat16", static_width=width, draft_tokens=width - 1, concurrency=slots,
                          context=context, sampled=True, gguf=False)
    return memory_report(ModelShape.of(target.model.config), shape).peak_bytes


def wait_for(condition, what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"the server never reached: {what}")
        time.sleep(0.02)


CACHE = 2**20  # the prefix cache's budget in these tests (--prefix-cache-mb 1)


def chat(url: str, content: str, max_tokens: int = 4) -> httpx.Response:
    return httpx.post(f"{url}/v1/chat/completions", timeout=WAIT_S + 30,
                      json={"model": "specops", "messages": [{"role": "user", "content": content}],
                            "max_tokens": max_tokens, "temperature": 0})


def test_plan_caps_the_slots_and_the_rest_queue_then_429(start_server, bf16_target):
    # Two slots of 64 tokens fit (at any width up to WIDTH), three do not: the plan must run two at once.
    budget = max(peak(bf16_target, 2, 64, w) for w in range(1, WIDTH + 1)) + 1
    assert budget < min(peak(bf16_target, 3, 64, w) for w in range(1, WIDTH + 1))
    model, drafter = gated(bf16_target)
    # The prefix cache's MiB is set aside first; the plan gets the rest.
    live = start_server(model=model, max_batch=8, queue_size=3, memory_budget=f"{budget + CACHE}B", min_context=64,
                        memory_headroom=0.0, prefix_cache_mb=1)
    plan = live.state.plan
    assert plan.max_batch == 2 and live.state.worker.batched
    assert live.state.worker.model.generator.config.static_width == plan.static_width <= WIDTH
    ready = httpx.get(live.url + "/ready").json()
    assert ready["memory_plan"]["max_batch"] == 2 and ready["memory_plan"]["budget_bytes"] == budget
    text = httpx.get(live.url + "/metrics").text
    assert metric(text, "specops_memory_plan", 'field="max_batch"') == 2
    assert metric(text, "specops_resident_memory_bytes") > 0

    drafter.armed.set()
    with ThreadPoolExecutor(6) as pool:
        def gauges() -> tuple[float, float]:
            text = httpx.get(live.url + "/metrics").text
            return metric(text, "specops_active_generations"), metric(text, "specops_queue_depth")

        # Two first, taken by the slots, then three more: sent at once, the queue (3) could be full before a
        # slot took any, and the last ones would get 429 (a slow machine did exactly that).
        held = [pool.submit(chat, live.url, f"w{i} w{i + 1}") for i in range(2)]
        wait_for(lambda: gauges() == (2, 0), "2 generations decoding")
        held += [pool.submit(chat, live.url, f"w{i} w{i + 1}") for i in range(2, 5)]
        wait_for(lambda: gauges() == (2, 3), "2 generations decoding and 3 queued")
        time.sleep(0.3)  # give a wrongly freed slot time to take a queued request
        assert gauges() == (2, 3)
        refused = chat(live.url, "w9")  # the queue (3) is full
        assert refused.status_code == 429
        drafter.release.set()
        assert [future.result().status_code for future in held] == [200] * 5


def test_a_request_longer_than_the_planned_context_gets_400(start_server, bf16_target):
    # One slot of at least 100 tokens fits, of the target's whole 256 not: the context lands in between.
    budget = peak(bf16_target, 1, 100)
    assert budget < peak(bf16_target, 1, 256, 1)
    model, _ = gated(bf16_target)
    live = start_server(model=model, max_batch=1, memory_budget=str(budget), min_context=100,
                        memory_headroom=0.0, prefix_cache_mb=0)
    limit = live.state.plan.max_context
    assert 100 <= limit < 256
    too_long = chat(live.url, " ".join(f"w{i % 50 + 6}" for i in range(limit)))
    assert too_long.status_code == 400
    error = too_long.json()["error"]
    assert error["code"] == "memory_budget_exceeded" and "memory budget" in error["message"]
    too_many = chat(live.url, "w7 w8", max_tokens=limit)
    assert too_many.status_code == 400 and too_many.json()["error"]["param"] == "max_tokens"
    assert chat(live.url, "w7 w8", max_tokens=8).status_code == 200


def test_a_budget_below_one_request_refuses_to_start(make_config, bf16_target):
    model, _ = gated(bf16_target)
    budget = peak(bf16_target, 1, 64, 1) - 1 + CACHE  # one byte short of the smallest plan beside the prefix cache
    with pytest.raises(MemoryBudgetError, match="cannot hold even one generation of 64 tokens.*prefix cache's 1 MiB"):
        create_app(make_config(memory_budget=f"{budget}B", min_context=64, memory_headroom=0.0, prefix_cache_mb=1),
                   model=model)


def test_a_bad_budget_is_refused_with_the_units(make_config):
    with pytest.raises(ValueError, match="e.g. 1.5GiB"):
        make_config(memory_budget="lots")
    with pytest.raises(ValueError, match="--model-uri"):
        make_config(memory_budget="1GiB", model_uri="models:/specops@champion")
    with pytest.raises(ValueError, match="memory_headroom"):
        make_config(memory_budget="1GiB", memory_headroom=1.0)


def test_a_runtime_that_cannot_use_a_prefix_cache_keeps_its_budget(bf16_target):
    """The budget set aside for the prefix cache: the whole --prefix-cache-mb where the runtime can use one
    (the eager static runtime in bf16), none elsewhere."""
    model, _ = gated(bf16_target)
    config = ServerConfig(prefix_cache_mb=2)
    assert prefix_cache_bytes(config, model.generator) == 2 * CACHE
    dynamic = copy.copy(model.generator)
    dynamic.config = replace(model.generator.config, static_width=0)
    assert prefix_cache_bytes(config, dynamic) == 0
    with pytest.raises(ValueError, match="finite"):
        ServerConfig(prefix_cache_mb=float("nan"))
