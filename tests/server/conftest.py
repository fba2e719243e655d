"""A real uvicorn server on 127.0.0.1 around the tiny target, in a thread (or a subprocess for crash tests)."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
import uvicorn

from specops.core.drafter import EMPTY, Draft, DrafterBase, TokenStop, refuse_stop
from specops.core.types import SamplingParams
from specops.drafters.factory import build_drafter
from specops.drafters.kinds import DecodingConfig
from specops.server.app import create_app
from specops.server.config import ServerConfig
from specops.server.generator import TextGenerator
from specops.server.transport import uvicorn_config
from specops.server.worker import ServedModel

START_TIMEOUT_S = 60.0  # the first generation in a process pays one-off costs (warm-up)
PROMPTS = ["w1 w2 w3", "w10 w11", "w40 w41 w42 w43", "w7", "w20 w21 w22", "w33 w5", "w60 w61", "w3 w9 w27"]


class SlowDrafter(DrafterBase):
    """Drafts nothing and sleeps in every step, so a generation lasts long enough to be interrupted.

    Output is unaffected: with no draft each step is one plain target step.
    """

    name = "slow"

    def __init__(self, step_s: float) -> None:
        self.step_s = step_s
        self.proposals = 0  # steps run, to see that a cancelled generation stopped

    def reset(self) -> None:
        pass

    def propose(self, context: list[int], k: int, sampling: SamplingParams,
                generator: torch.Generator | None, stop: TokenStop | None = None) -> Draft:
        refuse_stop(self, stop)
        self.proposals += 1
        time.sleep(self.step_s)
        return EMPTY

    def observe(self, tokens: list[int], logits: torch.Tensor) -> None:
        pass


def served(target: Any, drafter: str = "recycling", **extra: Any) -> ServedModel:
    config = DecodingConfig(drafter=drafter, recycling_nodes=8)
    return ServedModel(TextGenerator(target, build_drafter(drafter, target, config), config), drafter=drafter, **extra)


def slow_model(target: Any, step_s: float) -> tuple[ServedModel, SlowDrafter]:
    drafter = SlowDrafter(step_s)
    config = DecodingConfig(drafter="none")
    return ServedModel(TextGenerator(target, drafter, config), drafter="slow"), drafter


def free_socket() -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    return sock


def wait_ready(url: str, headers: dict[str, str] | None = None, timeout: float = START_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/ready", headers=headers, timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    raise TimeoutError(f"{url} did not become ready within {timeout} s")


@dataclass
class LiveServer:
    url: str
    app: Any
    config: ServerConfig
    server: uvicorn.Server
    thread: threading.Thread

    @property
    def state(self) -> Any:
        return self.app.state.server

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)


def start_live(config: ServerConfig, model: ServedModel | None = None, target: Any = None,
               auth: dict[str, str] | None = None) -> LiveServer:
    app = create_app(config, model=model, target=target)
    sock = free_socket()
    port = sock.getsockname()[1]
    # The settings `specops serve` uses (connection limit, header deadline), so the tests see what it serves.
    server = uvicorn.Server(uvicorn_config(app, config, log_level="warning", timeout_graceful_shutdown=5))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    live = LiveServer(f"http://127.0.0.1:{port}", app, config, server, thread)
    try:
        wait_ready(live.url, auth)
    except BaseException:
        live.stop()
        raise
    return live


@pytest.fixture
def make_config(tmp_path: Path) -> Callable[..., ServerConfig]:
    def make(**overrides: Any) -> ServerConfig:
        values: dict[str, Any] = {"feedback_db": str(tmp_path / "feedback.db"), "api_key": None}
        values.update(overrides)
        return ServerConfig(**values)

    return make


@pytest.fixture
def start_server(make_config: Callable[..., ServerConfig]) -> Iterator[Callable[..., LiveServer]]:
    """start_server(model=..., target=..., **config) -> a running LiveServer, stopped after the test."""
    started: list[LiveServer] = []

    def start(model: ServedModel | None = None, target: Any = None, auth: dict[str, str] | None = None,
              **overrides: Any) -> LiveServer:
        live = start_live(make_config(**overrides), model=model, target=target, auth=auth)
        started.append(live)
        return live

    yield start
    for live in started:
        live.stop()


@pytest.fixture(scope="module")
def shared_server(target: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    """One recycling server for the many tests that only read from it."""
    folder = tmp_path_factory.mktemp("shared-server")
    live = start_live(ServerConfig(feedback_db=str(folder / "feedback.db"), api_key=None), model=served(target))
    yield live
    live.stop()


def metric(text: str, name: str, labels: str = "") -> float:
    """The value of one sample in Prometheus text, 0 when absent."""
    key = f"{name}{{{labels}}}" if labels else name
    for line in text.splitlines():
        if line.startswith(key + " "):
            return float(line.split()[-1])
    return 0.0
