"""What the server serves, and hot reload from the MLflow registry.

Three sources: a bundle folder (verified once), `models:/NAME@ALIAS` (downloaded, verified, and the
alias polled), or a plain target + drafter without a bundle. On a new alias version the watcher
downloads it, finds the bundle root (the folder holding manifest.json), verifies every checksum,
that the manifest hashes to what the registry recorded at register time (a re-hashed manifest
passes the checksums) and the target fingerprint against the loaded target, and hands it to the
worker, which warms it up with a greedy and a sampled request and swaps it in for the next requests
(generations already running finish on the old model).
A version that fails is refused, logged and counted, and the old model keeps serving; it is tried
again only if the alias moves on.

A bundle built for another target is refused, not served by loading a second target: that would
double memory and change tokenization under queued requests. Serving a new target is a restart.

MLflow is imported lazily here and only here: serving needs it for models:/ URIs alone.
"""

from __future__ import annotations

import logging
import shutil
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from specops.core.batching import on_short_thread
from specops.core.target import DEFAULT_TARGET, Target, load_target
from specops.drafters.factory import build_drafter
from specops.drafters.kinds import DecodingConfig
from specops.server.bundle import MANIFEST, BundleError, load_bundle
from specops.server.config import MODEL_URI, ServerConfig
from specops.server.generator import TextGenerator, generator_from_bundle
from specops.server.metrics import ServerMetrics
from specops.server.worker import ServedModel

if TYPE_CHECKING:
    from mlflow import MlflowClient

log = logging.getLogger(__name__)



def plain_model(config: ServerConfig, target: Target | None = None) -> ServedModel:
    """The configured target and drafter, without a bundle (e.g. --drafter none as a baseline)."""
    target = target or load_target(config.target or DEFAULT_TARGET, config.dtype)
    width = config.static_width
    decoding = DecodingConfig(drafter=config.drafter, static_width=width,
                              **({"draft_tokens": min(DecodingConfig.draft_tokens, width - 1)} if width else {}))
    drafter = build_drafter(config.drafter, target, decoding, config.draft_model)
    return ServedModel(TextGenerator(target, drafter, decoding), drafter=config.drafter)


def bundle_model(path: Path | str, target: Target | None, model_version: str | None = None,
                 source: str | None = None, registry_tags: dict[str, str] | None = None) -> ServedModel:
    """A verified bundle. With `target`, the bundle must have been built for exactly that target; with
    `registry_tags` (a model version's), it must be the bundle the registry recorded."""
    bundle = load_bundle(path)  # hashes every file once; the generator checks the target's fingerprint
    if registry_tags is not None:
        bundle.check_registered(registry_tags)
    generator = generator_from_bundle(bundle, target=target)
    return ServedModel(generator, drafter=bundle.drafter_kind, bundle_version=bundle.version,
                       model_version=model_version, source=source or str(path))


def find_bundle_root(folder: Path) -> Path:
    """The one folder under `folder` that holds a manifest.json (a pyfunc model nests it in artifacts/)."""
    roots = sorted(path.parent for path in folder.rglob(MANIFEST))
    if len(roots) != 1:
        found = ", ".join(str(root) for root in roots) or "none"
        raise BundleError(f"Expected exactly one bundle ({MANIFEST}) in the downloaded model {folder}; found: {found}.")
    return roots[0]


class RegistryWatcher:
    """Serves `models:/NAME@ALIAS` and, once started, polls the alias to hot-reload new versions."""

    def __init__(self, model_uri: str, tracking_uri: str | None, poll_s: float, metrics: ServerMetrics) -> None:
        match = MODEL_URI.match(model_uri)
        if match is None:
            raise ValueError(f"Model URI '{model_uri}' must look like models:/NAME@ALIAS.")
        self.model_uri = model_uri
        self.name, self.alias = match["name"], match["alias"]
        self.tracking_uri = tracking_uri
        self.poll_s = poll_s
        self._metrics = metrics
        self._version: str | None = None  # the registry version being served
        self._refused: str | None = None  # the last version that failed, not retried until the alias moves
        self._download: Path | None = None  # the serving version's download, removed once replaced
        self._target: Target | None = None
        self._install: Callable[[ServedModel], None] | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="specops-registry-watcher", daemon=True)

    def load_initial(self, target: Target | None) -> ServedModel:
        """Download and verify the alias's current version; raises if it does not verify."""
        version = self._alias_version()
        model, self._download = self._load(version, target)
        self._version = version
        self._target = model.target
        return model

    def start(self, install: Callable[[ServedModel], None]) -> None:
        """Poll every poll_s seconds; `install` puts a verified model into service (or raises)."""
        self._install = install
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=30)
        if self._download is not None:
            shutil.rmtree(self._download, ignore_errors=True)

    def poll_once(self) -> None:
        """Install the alias's version if it is new and verifies; otherwise keep serving the current one."""
        if self._install is None or self._target is None:
            raise RuntimeError("poll_once needs load_initial and start first.")
        version = self._alias_version()
        if version in (self._version, self._refused):
            return
        log.info("%s now points to version %s (serving %s); loading it", self.model_uri, version, self._version)
        try:
            folder = self._install_version(version, self._install, self._target)
        except Exception as error:  # verification, download or warm-up: any failure keeps the old model
            log.error("Refused version %s of %s; still serving version %s. %s", version, self.model_uri,
                      self._version, error)
            self._refused = version
            self._metrics.reloads.labels(result="refused").inc()
            return
        previous, self._download, self._version = self._download, folder, version
        if previous is not None:
            shutil.rmtree(previous, ignore_errors=True)
        self._metrics.reloads.labels(result="ok").inc()
        log.info("Now serving version %s of %s", version, self.model_uri)

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            try:
                self.poll_once()
            except Exception:  # a registry outage must not kill the watcher: the next poll retries
                log.exception("Polling %s failed; retrying in %.0f s", self.model_uri, self.poll_s)

    def _client(self) -> MlflowClient:
        from mlflow import MlflowClient

        return MlflowClient(tracking_uri=self.tracking_uri, registry_uri=self.tracking_uri)

    def _alias_version(self) -> str:
        return str(self._client().get_model_version_by_alias(self.name, self.alias).version)

    def _install_version(self, version: str, install: Callable[[ServedModel], None], target: Target) -> Path:
        # Not on this long-lived thread: one that ran parallel torch work slows every batched pass after.
        model, folder = on_short_thread(lambda: self._load(version, target), "specops-reload")
        try:
            install(model)
        except BaseException:
            shutil.rmtree(folder, ignore_errors=True)
            raise
        return folder

    def _load(self, version: str, target: Target | None) -> tuple[ServedModel, Path]:
        """Download one version into a fresh folder and build a verified model; the folder goes if it fails."""
        import mlflow.artifacts

        folder = Path(tempfile.mkdtemp(prefix=f"specops-{self.name}-v{version}-"))
        try:
            mlflow.artifacts.download_artifacts(artifact_uri=f"models:/{self.name}/{version}", dst_path=str(folder),
                                                tracking_uri=self.tracking_uri, registry_uri=self.tracking_uri)
            tags = self._client().get_model_version(self.name, version).tags
            model = bundle_model(find_bundle_root(folder), target, model_version=version,
                                 source=f"models:/{self.name}/{version}", registry_tags=tags)
        except BaseException:
            shutil.rmtree(folder, ignore_errors=True)
            raise
        return model, folder
