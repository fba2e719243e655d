"""The bundle: the one contract between training and serving.

```
bundle/
  manifest.json   format_version, created_at, git_sha, mlflow {run_id, model_name, model_version},
                  target {source, dtype, fingerprint {name, weights_sha256, vocab_sha256}},
                  files {relative path: {sha256, size}} for every other file, metrics (eval snapshot)
  serving.yaml    default strategy: {drafter: kind, verifier: ..., draft_tokens: ..., ...}
  drafter/        config.json + *.safetensors (+ tokenizer files); absent for weightless drafters. CoSine's is
                  a config.json naming its specialists and one such folder per specialist
  <component>/    optional (acceptance_head/, router/, ...): config.json + *.safetensors
```
Weights are safetensors only and nothing is unpickled: pickle-capable files are refused when
writing and when loading. `load_bundle` verifies every size and sha256, refuses unlisted files, and
checks the target fingerprint, so a bundle either loads exactly as written or not at all.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import yaml

from specops.core.target import TargetFingerprint, sha256_file

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
SERVING = "serving.yaml"
DRAFTER = "drafter"
# Formats that can carry a pickle (torch.save, pickle, joblib, Lightning checkpoints): loading one
# can run arbitrary code, so a bundle never contains them.
PICKLE_SUFFIXES = frozenset({".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt", ".joblib"})
COMPONENT_NAME = re.compile(r"^[a-z][a-z0-9_]*$")
MLFLOW_KEYS = ("run_id", "model_name", "model_version")
# Registry model-version tags that register_bundle records: what a download must hash to.
SHA256_TAG = "bundle.manifest_sha256"
VERSION_TAG = "bundle.version"


class BundleError(RuntimeError):
    """A bundle cannot be written or loaded; the message names the file and what is wrong."""


@dataclass(frozen=True)
class Bundle:
    root: Path
    manifest: dict[str, Any]
    serving: dict[str, Any]  # serving.yaml: the default strategy
    drafter_kind: str
    drafter_dir: Path | None  # None for weightless drafters (prompt lookup, token recycling)
    target_source: str  # what load_target() takes: "smollm2", a .gguf file or a model folder
    target_dtype: str
    fingerprint: TargetFingerprint
    manifest_sha256: str  # sha256(manifest.json): the manifest lists every file's sha256, so it names the bundle
    version: str  # its first 12 hex: changes whenever any file changes
    extra_dirs: dict[str, Path]  # optional components by name, e.g. {"acceptance_head": root/...}

    def check_target(self, expected: TargetFingerprint) -> None:
        """Refuse a bundle built for another target than `expected`."""
        reason = expected.mismatch(self.fingerprint)
        if reason:
            raise BundleError(f"Bundle {self.root} was built for another target ({self.fingerprint.name}), not "
                              f"{expected.name}: {reason}. Serve it with the target it was "
                              "trained on, or retrain the drafter for this one.")

    def check_registered(self, tags: dict[str, str]) -> None:
        """Refuse a download that is not the bundle the registry recorded at register time (its version tags).

        Checksums only prove that a bundle agrees with its own manifest; an edited file with a re-hashed
        manifest agrees too, but changes the manifest's hash."""
        if SHA256_TAG in tags:
            recorded, ours = tags[SHA256_TAG], self.manifest_sha256
        else:  # versions registered before the full hash was recorded carry only its 12-hex prefix
            recorded, ours = tags.get(VERSION_TAG), self.version
        if recorded != ours:
            raise BundleError(f"Bundle {self.root} is not the bundle the registry recorded: its manifest hashes to "
                              f"{ours}, the registry has {recorded}. Its files were changed after registration; "
                              "register the bundle again.")


def _pickle_refusal(rel: str) -> str | None:
    suffix = Path(rel).suffix.lower()
    if suffix in PICKLE_SUFFIXES:
        return (f"'{rel}' is a pickle-capable '{suffix}' file: bundles hold safetensors only and nothing is "
                "unpickled. Re-save the weights with save_pretrained(safe_serialization=True) or safetensors.")
    return None


def _check_component(name: str, src: Path) -> None:
    """A component folder must be a real model folder with safetensors weights and nothing picklable."""
    if not COMPONENT_NAME.match(name):
        raise BundleError(f"Bad bundle component name '{name}': use lowercase letters, digits and '_'.")
    if not src.is_dir():
        raise BundleError(f"Component '{name}': {src} is not a directory.")
    if not (src / "config.json").is_file():
        raise BundleError(f"Component '{name}': {src} has no config.json.")
    if not any(src.rglob("*.safetensors")):  # in subfolders too: CoSine's specialists are one model folder each
        raise BundleError(f"Component '{name}': {src} has no *.safetensors weights.")
    for path in sorted(p for p in src.rglob("*") if p.is_file()):
        refusal = _pickle_refusal(path.relative_to(src).as_posix())
        if refusal:
            raise BundleError(f"Refusing to bundle component '{name}' from {src}: {refusal}")


def _prepare_out_dir(out_dir: Path, overwrite: bool) -> None:
    if out_dir.exists() and any(out_dir.iterdir()):
        if not overwrite:
            raise BundleError(f"{out_dir} exists and is not empty; remove it or pass overwrite=True.")
        shutil.rmtree(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)


def _file_table(root: Path) -> dict[str, dict[str, Any]]:
    return {
        path.relative_to(root).as_posix(): {"sha256": sha256_file(path), "size": path.stat().st_size}
        for path in sorted(root.rglob("*"))
        if path.is_file() and path.relative_to(root).as_posix() != MANIFEST
    }


def write_bundle(
    out_dir: Path | str,
    *,
    drafter_dir: Path | None,
    drafter_kind: str,
    serving: dict[str, Any],
    target_source: str,
    target_dtype: str,
    fingerprint: TargetFingerprint,
    metrics: dict[str, Any],
    extra_dirs: dict[str, Path] | None = None,
    git_sha: str | None = None,
    mlflow_info: dict[str, Any] | None = None,
    overwrite: bool = False,
) -> Path:
    """Assemble a bundle in `out_dir` and return it. `serving` is the default strategy without the
    drafter kind (or with the same one); `metrics` is the eval snapshot (see specops/eval/gate.py).

    Everything is checked before anything is copied, and manifest.json is written last, so a
    folder with a manifest is a complete bundle.
    """
    out_dir = Path(out_dir)
    components = {DRAFTER: Path(drafter_dir)} if drafter_dir is not None else {}
    for name, src in (extra_dirs or {}).items():
        if name == DRAFTER:
            raise BundleError("Pass the drafter as drafter_dir, not in extra_dirs.")
        components[name] = Path(src)
    for name, src in components.items():
        _check_component(name, src)
    if serving.get("drafter", drafter_kind) != drafter_kind:
        raise BundleError(f"serving.yaml says drafter '{serving['drafter']}' but drafter_kind is '{drafter_kind}'.")
    unknown = sorted(set(mlflow_info or {}) - set(MLFLOW_KEYS))
    if unknown:
        raise BundleError(f"Unknown mlflow_info key(s): {', '.join(unknown)}. Allowed: {', '.join(MLFLOW_KEYS)}.")

    _prepare_out_dir(out_dir, overwrite)
    for name, src in components.items():
        shutil.copytree(src, out_dir / name)  # follows symlinks (HF cache folders), so content is copied
    (out_dir / SERVING).write_text(yaml.safe_dump({"drafter": drafter_kind, **serving}, sort_keys=False))

    manifest = {
        "format_version": FORMAT_VERSION,
        "created_at": datetime.now(UTC).isoformat(timespec="seconds"),
        "git_sha": git_sha,
        "mlflow": {key: (mlflow_info or {}).get(key) for key in MLFLOW_KEYS},
        "target": {"source": target_source, "dtype": target_dtype, "fingerprint": fingerprint.to_dict()},
        "files": _file_table(out_dir),
        "metrics": metrics,
    }
    # Write then rename, so a crash never leaves a truncated manifest that looks complete.
    tmp = out_dir / f"{MANIFEST}.tmp"
    tmp.write_text(json.dumps(manifest, indent=2, sort_keys=False) + "\n")
    os.replace(tmp, out_dir / MANIFEST)
    return out_dir


def _read_manifest(root: Path) -> tuple[dict[str, Any], bytes]:
    path = root / MANIFEST
    if not path.is_file():
        raise BundleError(f"{root} is not a bundle: {MANIFEST} is missing.")
    raw = path.read_bytes()
    try:
        manifest = json.loads(raw)
    except json.JSONDecodeError as error:
        raise BundleError(f"Bundle {root}: {MANIFEST} is not valid JSON ({error}).") from error
    if not isinstance(manifest, dict) or manifest.get("format_version") != FORMAT_VERSION:
        found = manifest.get("format_version") if isinstance(manifest, dict) else None
        raise BundleError(f"Bundle {root}: unsupported format_version {found!r} (this code reads {FORMAT_VERSION}).")
    missing = [key for key in ("target", "files", "metrics") if key not in manifest]
    if missing:
        raise BundleError(f"Bundle {root}: {MANIFEST} lacks {', '.join(missing)}.")
    return manifest, raw


def _verify_files(root: Path, files: dict[str, dict[str, Any]]) -> None:
    """Every listed file is present, safe and unchanged; nothing else is present."""
    resolved_root = root.resolve()
    for rel, entry in files.items():
        path = root / rel
        refusal = _pickle_refusal(rel)
        if refusal:
            raise BundleError(f"Bundle {root}: {refusal}")
        if not path.resolve().is_relative_to(resolved_root):
            raise BundleError(f"Bundle {root}: manifest lists '{rel}', which is outside the bundle.")
        if not path.is_file():
            raise BundleError(f"Bundle {root}: file '{rel}' is listed in {MANIFEST} but missing.")
        # The size check is free and catches truncated copies before hashing gigabytes.
        if path.stat().st_size != entry["size"] or sha256_file(path) != entry["sha256"]:
            raise BundleError(f"Bundle {root}: file '{rel}' does not match its checksum in {MANIFEST} "
                              "(tampered or corrupted). Rebuild or re-download the bundle.")
    for path in sorted(root.rglob("*")):
        rel = path.relative_to(root).as_posix()
        if path.is_symlink():
            raise BundleError(f"Bundle {root}: '{rel}' is a symlink; bundles hold plain files only.")
        if path.is_file() and rel != MANIFEST and rel not in files:
            raise BundleError(f"Bundle {root}: extra file '{rel}' is not listed in {MANIFEST}. "
                              "Remove it or rebuild the bundle.")


def load_bundle(path: Path | str, expected_fingerprint: TargetFingerprint | None = None) -> Bundle:
    """Verify and open a bundle. With `expected_fingerprint`, refuse a bundle built for another target."""
    root = Path(path)
    manifest, raw = _read_manifest(root)
    _verify_files(root, manifest["files"])
    target = manifest["target"]
    fingerprint = TargetFingerprint(**target["fingerprint"])
    serving = yaml.safe_load((root / SERVING).read_text()) if SERVING in manifest["files"] else None
    if not isinstance(serving, dict) or not isinstance(serving.get("drafter"), str):
        raise BundleError(f"Bundle {root}: {SERVING} is missing or does not name a drafter kind.")
    components = {rel.split("/", 1)[0] for rel in manifest["files"] if "/" in rel}
    digest = hashlib.sha256(raw).hexdigest()
    bundle = Bundle(
        root=root,
        manifest=manifest,
        serving=serving,
        drafter_kind=serving["drafter"],
        drafter_dir=root / DRAFTER if DRAFTER in components else None,
        target_source=target["source"],
        target_dtype=target["dtype"],
        fingerprint=fingerprint,
        manifest_sha256=digest,
        version=digest[:12],
        extra_dirs={name: root / name for name in sorted(components - {DRAFTER})},
    )
    if expected_fingerprint is not None:
        bundle.check_target(expected_fingerprint)
    return bundle
