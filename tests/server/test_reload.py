"""Hot reload from a throwaway MLflow registry: a new champion is swapped in between requests, a tampered
or foreign bundle is refused while the old one keeps answering."""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from specops.core.target import TargetFingerprint
from specops.server.bundle import load_bundle, write_bundle
from specops.server.reload import bundle_model, find_bundle_root
from tests.server.conftest import metric

MODEL = "tiny-drafter"
CHAMPION = "champion"


@pytest.fixture
def registry(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """A fresh sqlite tracking + registry store; returns its URI."""
    from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore

    from specops.pipeline.registry import tracking_setup

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    SqlAlchemyStore(uri, (tmp_path / "mlartifacts").as_uri())
    # tracking_setup exports the URIs as environment variables; monkeypatch restores them afterwards.
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "")
    monkeypatch.setenv("MLFLOW_REGISTRY_URI", "")
    tracking_setup(uri)
    return uri


def make_bundle(folder: Path, drafter: str, fingerprint: TargetFingerprint) -> Path:
    return write_bundle(folder, drafter_dir=None, drafter_kind=drafter, serving={"draft_tokens": 4},
                        target_source="in-memory", target_dtype="float32", fingerprint=fingerprint,
                        metrics={"speedup_vs_ar": 1.0})


def register(bundle: Path, artifacts: Path, champion: bool = True) -> str:
    from mlflow import MlflowClient

    from specops.pipeline.registry import register_bundle

    _, version = register_bundle(bundle, model_name=MODEL, experiment="reload", artifact_root=str(artifacts),
                                 params={})
    if champion:
        MlflowClient().set_registered_model_alias(MODEL, CHAMPION, version)
    return version


def stored_bundle(version: str) -> Path:
    """The registry's own copy of a version's bundle, to tamper with it."""
    import mlflow
    from mlflow import MlflowClient

    model_id = MlflowClient().get_model_version(MODEL, version).source.removeprefix("models:/")
    return find_bundle_root(Path(mlflow.get_logged_model(model_id).artifact_location.removeprefix("file://")))


def card(url: str) -> dict[str, Any]:
    return httpx.get(f"{url}/v1/models").json()["data"][0]


def reloads(url: str, result: str) -> float:
    return metric(httpx.get(f"{url}/metrics").text, "specops_reloads_total", f'result="{result}"')


def wait_for(condition: Any, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out waiting for the reload"
        time.sleep(0.1)


def answers(url: str) -> dict[str, Any]:
    response = httpx.post(f"{url}/v1/completions", json={"prompt": "w1 w2", "max_tokens": 5, "temperature": 0},
                          timeout=30)
    assert response.status_code == 200, response.text
    return response.json()


@pytest.mark.slow
def test_new_champion_is_hot_swapped_and_bad_bundles_are_refused(registry, start_server, target, tmp_path, caplog):
    artifacts = tmp_path / "mlartifacts"
    first = make_bundle(tmp_path / "b1", "recycling", target.fingerprint)
    register(first, artifacts)
    live = start_server(target=target, model_uri=f"models:/{MODEL}@{CHAMPION}", tracking_uri=registry, poll_s=0.2)
    v1 = load_bundle(first).version
    assert (card(live.url)["model_version"], card(live.url)["bundle_version"]) == ("1", v1)
    assert answers(live.url)["system_fingerprint"] == f"bundle-{v1}"

    # A version whose files were changed after registration: refused, version 1 keeps serving.
    tampered = register(make_bundle(tmp_path / "b2", "prompt-lookup", target.fingerprint), artifacts, champion=False)
    (stored_bundle(tampered) / "serving.yaml").write_text("drafter: prompt-lookup\ndraft_tokens: 64\n")
    from mlflow import MlflowClient

    MlflowClient().set_registered_model_alias(MODEL, CHAMPION, tampered)
    wait_for(lambda: reloads(live.url, "refused") == 1)
    assert "'serving.yaml' does not match its checksum" in caplog.text
    assert card(live.url)["model_version"] == "1"
    assert answers(live.url)["system_fingerprint"] == f"bundle-{v1}"

    # A bundle built for another target: refused too (the fingerprint is checked against the loaded one).
    other = TargetFingerprint(name="other", weights_sha256="0" * 64, vocab_sha256=target.fingerprint.vocab_sha256)
    register(make_bundle(tmp_path / "b3", "prompt-lookup", other), artifacts)
    wait_for(lambda: reloads(live.url, "refused") == 2)
    assert "was built for another target" in caplog.text
    assert card(live.url)["model_version"] == "1"

    # A good new champion is swapped in.
    good = make_bundle(tmp_path / "b4", "prompt-lookup", target.fingerprint)
    version = register(good, artifacts)
    wait_for(lambda: card(live.url)["model_version"] == version)
    v4 = load_bundle(good).version
    assert card(live.url)["bundle_version"] == v4 and card(live.url)["drafter"] == "prompt-lookup"
    assert answers(live.url)["system_fingerprint"] == f"bundle-{v4}"
    metrics = httpx.get(f"{live.url}/metrics").text
    assert metric(metrics, "specops_bundle_info", f'drafter="prompt-lookup",model_version="{version}",version="{v4}"') == 1
    assert f'version="{v1}"' not in metrics
    assert reloads(live.url, "ok") == 1


def test_bundle_mode_verifies_before_serving(tmp_path, target):
    bundle = make_bundle(tmp_path / "b", "recycling", target.fingerprint)
    assert bundle_model(bundle, target).bundle_version == load_bundle(bundle).version
    copy = tmp_path / "copy"
    shutil.copytree(bundle, copy)
    (copy / "extra.txt").write_text("not listed in the manifest")
    with pytest.raises(RuntimeError, match="extra file"):
        bundle_model(copy, target)


def test_serves_a_bundle_folder_or_a_plain_drafter(start_server, target, tmp_path):
    bundle = make_bundle(tmp_path / "b", "recycling", target.fingerprint)
    from_bundle = start_server(target=target, bundle=str(bundle), feedback_db=str(tmp_path / "bundle.db"))
    plain = start_server(target=target, drafter="none", feedback_db=str(tmp_path / "plain.db"))

    assert card(from_bundle.url)["bundle_version"] == load_bundle(bundle).version
    assert answers(from_bundle.url)["system_fingerprint"] == f"bundle-{load_bundle(bundle).version}"
    reply = answers(plain.url)
    assert reply["system_fingerprint"] == "drafter-none" and reply["usage"]["drafted"] == 0
    assert reply["choices"][0]["text"] == answers(from_bundle.url)["choices"][0]["text"]  # lossless
