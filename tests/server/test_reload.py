"""Hot reload from a throwaway MLflow registry: a new champion is swapped in between requests, a tampered
or foreign bundle is refused while the old one keeps answering."""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from specops.core.loop import GenerationRequestError
from specops.core.target import TargetFingerprint
from specops.drafters.factory import build_drafter
from specops.drafters.kinds import DecodingConfig
from specops.server.bundle import BundleError, load_bundle, write_bundle
from specops.server.generator import TextGenerator
from specops.server.metrics import ServerMetrics
from specops.server.reload import RegistryWatcher, bundle_model, find_bundle_root
from specops.server.worker import ServedModel, warm_up
from tests.pipeline.registry.conftest import rehash
from tests.server.conftest import metric, served

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


def make_bundle(folder: Path, drafter: str, fingerprint: TargetFingerprint, **serving: Any) -> Path:
    return write_bundle(folder, drafter_dir=None, drafter_kind=drafter, serving={"draft_tokens": 4, **serving},
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


def test_reload_refuses_what_the_registry_did_not_record_or_cannot_sample(registry, target, tmp_path, caplog):
    artifacts = tmp_path / "mlartifacts"
    first = register(make_bundle(tmp_path / "b1", "recycling", target.fingerprint), artifacts)
    watcher = RegistryWatcher(f"models:/{MODEL}@{CHAMPION}", registry, poll_s=3600, metrics=ServerMetrics())
    installed = [watcher.load_initial(target)]

    def install(model: ServedModel) -> None:  # what the worker does before it swaps a model in
        warm_up(model)
        installed.append(model)

    watcher.start(install)
    try:
        # Edited after registration and re-hashed: every checksum matches, the registry's record does not.
        edited = register(make_bundle(tmp_path / "b2", "prompt-lookup", target.fingerprint), artifacts)
        (stored_bundle(edited) / "serving.yaml").write_text("drafter: prompt-lookup\ndraft_tokens: 64\n")
        rehash(stored_bundle(edited), "serving.yaml")
        watcher.poll_once()
        assert "is not the bundle the registry recorded" in caplog.text
        # A bundle that refuses sampled requests fails the warm-up.
        register(make_bundle(tmp_path / "b3", "prompt-lookup", target.fingerprint, verifier="greedy"), artifacts)
        watcher.poll_once()
        assert "greedy verifier needs temperature 0" in caplog.text
        assert [model.model_version for model in installed] == [first]
        good = register(make_bundle(tmp_path / "b4", "prompt-lookup", target.fingerprint), artifacts)
        watcher.poll_once()
        assert [model.model_version for model in installed] == [first, good]
    finally:
        watcher.stop()


def test_warm_up_runs_greedy_and_sampled_requests(target):
    config = DecodingConfig(drafter="none", verifier="greedy")
    greedy_only = ServedModel(TextGenerator(target, build_drafter("none", target, config), config), drafter="none")
    with pytest.raises(GenerationRequestError, match="temperature 0"):
        warm_up(greedy_only)
    warm_up(served(target))  # verifier auto serves both


@pytest.mark.parametrize("router_dir", ["../routers", "{tmp}/routers"])
def test_router_dir_outside_the_bundle_is_refused(tmp_path, target, router_dir):
    outside = make_bundle(tmp_path / "b1", "recycling", target.fingerprint, router_dir=router_dir.format(tmp=tmp_path))
    with pytest.raises(BundleError, match="router_dir .* is outside the bundle"):
        bundle_model(outside, target)
    inside = make_bundle(tmp_path / "b2", "recycling", target.fingerprint, router_dir="router")
    assert bundle_model(inside, target).generator.config.router_dir == str((inside / "router").resolve())


def test_models_load_on_threads_that_end(make_config, target, tmp_path, monkeypatch):
    """Loading a model runs parallel torch work, and a thread that does so keeps an OpenMP team for good,
    which slowed every batched pass after it 2x (specops.core.batching): neither the thread that builds the
    app (the event loop's) nor the registry watcher loads a model itself."""
    import threading

    from specops.server import app

    loaders: list[threading.Thread] = []

    def recording(real):
        def load(*args, **kwargs):
            loaders.append(threading.current_thread())
            return real(*args, **kwargs)
        return load

    monkeypatch.setattr(app, "bundle_model", recording(bundle_model))
    bundle = make_bundle(tmp_path / "b", "recycling", target.fingerprint)
    app.create_app(make_config(bundle=str(bundle)), target=target)
    watcher = RegistryWatcher(f"models:/{MODEL}@{CHAMPION}", None, 0.0, ServerMetrics())
    monkeypatch.setattr(watcher, "_load", recording(lambda version, target: (bundle_model(bundle, target), tmp_path)))
    watcher._install_version("2", lambda model: None, target)
    assert len(loaders) == 2
    assert all(thread is not threading.current_thread() and not thread.is_alive() for thread in loaders)
