"""register -> promote -> publish -> hot reload against a real `mlflow server` process, as a team runs it:
tracking over HTTP, artifacts proxied by the server (`--serve-artifacts`, clients see mlflow-artifacts:
URIs) to a folder or to S3 (moto's S3 server). Everything the stages write must land in the server's
artifact destination, none of it in the project folder (no ./mlflow, no ./mlruns)."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlflow
import pytest
from mlflow import MlflowClient

from specops.pipeline import stages
from specops.pipeline.registry import CHAMPION, RegisterConfig, register_bundle
from specops.server.bundle import load_bundle
from specops.server.metrics import ServerMetrics
from specops.server.reload import RegistryWatcher
from specops.server.worker import ServedModel
from tests.pipeline.servers import S3, S3_ENV, mlflow_server, moto_s3

pytestmark = [pytest.mark.slow, pytest.mark.e2e]
MODEL = "remote-drafter"


@dataclass
class TrackingServer:
    uri: str
    stored: Callable[[], list[str]]
    """Every file in the server's artifact destination, relative to it."""


def _folder_files(root: Path) -> Callable[[], list[str]]:
    return lambda: sorted(str(path.relative_to(root)) for path in root.rglob("*") if path.is_file())


def _bucket_files(s3: S3, prefix: str) -> Callable[[], list[str]]:
    return lambda: [key.removeprefix(prefix) for key in s3.keys(prefix)]


@pytest.fixture(scope="module", params=["folder", "s3"])
def tracking_server(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory,
                    mlflow_template_db: Path) -> Iterator[TrackingServer]:
    """A tracking server whose artifacts go to a folder only it writes, or to an S3 bucket only it can reach
    (the credentials and endpoint are in its environment, not the test's)."""
    folder = tmp_path_factory.mktemp(f"server-{request.param}")
    shutil.copy(mlflow_template_db, folder / "backend.db")
    with ExitStack() as stack:
        if request.param == "s3":
            s3 = stack.enter_context(moto_s3(folder))
            destination, env = f"s3://{s3.bucket}/mlflow", {**S3_ENV, "MLFLOW_S3_ENDPOINT_URL": s3.endpoint}
            stored = _bucket_files(s3, "mlflow/")
        else:
            destination, env = str(folder / "artifacts"), {}
            stored = _folder_files(folder / "artifacts")
        uri = stack.enter_context(mlflow_server(folder / "backend.db", destination, folder / "mlflow.log", env))
        yield TrackingServer(uri, stored)


@pytest.fixture
def project(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """An empty project folder as the working directory, where a stray ./mlflow or ./mlruns would appear."""
    folder = tmp_path / "project"
    folder.mkdir()
    monkeypatch.chdir(folder)
    # tracking_setup exports the URIs as environment variables; monkeypatch restores them afterwards.
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "")
    monkeypatch.setenv("MLFLOW_REGISTRY_URI", "")
    yield folder
    mlflow.set_tracking_uri(None)
    mlflow.set_registry_uri(None)


def _snapshot(speedup: float) -> dict[str, Any]:
    return {"method": "draft-lm+greedy", "speedup_vs_ar": speedup, "identical_to_plain": True,
            "mean_accepted_length": 2.0, "accepted_per_position": [5, 3, 1]}


def _register(params: dict[str, Any], make_bundle: Any, name: str, speedup: float) -> tuple[str, str]:
    """What the register stage does after building its bundle, with the stage's own settings (RegisterConfig's
    defaults: artifact_root is the embedded store's folder, mlflow/artifacts) and an evaluate report for promote."""
    registry, cfg = stages.tracking(params), stages.section(params, RegisterConfig, "register")
    root = make_bundle(name, metrics=_snapshot(speedup))
    plot = root.parent / f"{name}-acceptance.png"
    plot.write_bytes(b"\x89PNG\r\n\x1a\n")
    run_id, version = register_bundle(root, model_name=registry.model_name, experiment=cfg.experiment,
                                      artifact_root=cfg.artifact_root, params=params, plots=[plot])
    stages.write_json(f"eval-{name}.json", {"default": _snapshot(speedup)})  # promote's input: evaluate's report
    return run_id, version


def _promote(params: dict[str, Any], name: str) -> dict[str, Any]:
    # Without "champion" in the report, promote reads the champion's snapshot from its run's artifacts.
    stages.promote(params, {"evaluation": Path(f"eval-{name}.json")})
    return json.loads(Path("metrics/promotion.json").read_text())


def test_stages_and_hot_reload_run_against_a_tracking_server(tracking_server, project, make_bundle, target):
    params = {"mlflow": {"tracking_uri": tracking_server.uri, "model_name": MODEL}}
    client = MlflowClient(tracking_server.uri, tracking_server.uri)

    run_id, v1 = _register(params, make_bundle, "b1", speedup=1.5)
    assert _promote(params, "b1")["champion_version"] == v1
    stages.publish(params, {})
    assert load_bundle(project / "bundles" / "champion").version == load_bundle(project.parent / "b1").version

    # The real generator: reload.py bound it when this module was imported, before fake_factory stood in for it.
    watcher = RegistryWatcher(f"models:/{MODEL}@{CHAMPION}", tracking_server.uri, poll_s=3600,
                              metrics=ServerMetrics())
    installed: list[ServedModel] = [watcher.load_initial(target)]
    watcher.start(installed.append)
    try:
        _, v2 = _register(params, make_bundle, "b2", speedup=1.2)  # slower: the gate keeps v1
        refused = _promote(params, "b2")
        assert not refused["passed"] and refused["champion"]["speedup_vs_ar"] == 1.5
        _, v3 = _register(params, make_bundle, "b3", speedup=1.6)
        assert _promote(params, "b3")["champion_version"] == v3
        watcher.poll_once()
    finally:
        watcher.stop()
    assert [model.model_version for model in installed] == [v1, v3]

    # Everything went through the server: its destination holds the runs' files and the models' bundles...
    run = client.get_run(run_id)
    assert run.info.artifact_uri.startswith("mlflow-artifacts:/")
    prefix = run.info.artifact_uri.removeprefix("mlflow-artifacts:/")
    stored = tracking_server.stored()
    assert {f"{prefix}/eval_metrics.json", f"{prefix}/plots/b1-acceptance.png"} <= set(stored)
    for version in (v1, v2, v3):
        model_id = client.get_model_version(MODEL, version).source.removeprefix("models:/")
        assert any(key.endswith("/manifest.json") and f"/models/{model_id}/" in key for key in stored)
    # ...and the project folder holds only what the stages write there: no ./mlflow, no ./mlruns.
    assert sorted(path.name for path in project.iterdir()) == ["bundles", "eval-b1.json", "eval-b2.json",
                                                                "eval-b3.json", "metrics"]
