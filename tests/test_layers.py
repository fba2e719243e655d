"""The package's layer rules, enforced (docs/architecture.md).

Folders of `specops/` are ranked; a module may import from its own folder and from folders ranked
below it, never above, counting imports inside functions too:

    core < drafters < lossy < server < data < train < eval < pipeline < cli

And what a production image needs stays light: importing the serving side (core, drafters, lossy,
server) loads no Lightning, DeepSpeed, MLflow, DVC or matplotlib, checked in a clean interpreter.
Both checks are run against a planted violation first, so they can fail.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "specops"
LAYERS = ["core", "drafters", "lossy", "server", "data", "train", "eval", "pipeline", "cli"]
HEAVY = ("lightning", "pytorch_lightning", "lightning_fabric", "deepspeed", "mlflow", "dvc", "matplotlib")
SERVING_SIDE = ["specops.core.loop", "specops.drafters.factory", "specops.lossy.modes", "specops.server.app",
                "specops.server.commands", "specops.server.generator", "specops.server.proxy"]


def layer_of(module: str) -> str | None:
    """'specops.server.app' -> 'server'; 'specops.cli' -> 'cli'."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[0] == "specops" and parts[1] in LAYERS else None


def imported_modules(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every import in a file, at any depth (lazy imports count)."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out += [(node.lineno, f"{node.module}.{alias.name}") for alias in node.names]
    return out


def violations(root: Path) -> list[str]:
    found = []
    for path in sorted(root.rglob("*.py")):
        module = ".".join(("specops", *path.relative_to(root).with_suffix("").parts))
        own = layer_of(module)
        if own is None:
            continue
        for line, name in imported_modules(path):
            other = layer_of(name)
            if other is not None and LAYERS.index(other) > LAYERS.index(own):
                found.append(f"{path.relative_to(root.parent)}:{line} ({own}) imports {name} ({other})")
    return found


def heavy_modules_loaded(modules: list[str], cwd: Path) -> list[str]:
    code = ("import sys\n" + "".join(f"import {m}\n" for m in modules) +
            f"print(' '.join(sorted({{m.split('.')[0] for m in sys.modules}} & set({HEAVY!r}))))")
    out = subprocess.run([sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True, check=True)
    return out.stdout.split()


def test_every_folder_is_a_ranked_layer():
    folders = {p.name for p in ROOT.iterdir() if p.is_dir() and (p / "__init__.py").is_file()}
    assert folders == set(LAYERS) - {"cli"}


def test_no_module_imports_a_higher_layer():
    assert violations(ROOT) == []


def test_an_upward_import_is_caught(tmp_path):
    fake = tmp_path / "specops"
    (fake / "core").mkdir(parents=True)
    (fake / "core" / "bad.py").write_text("def f():\n    from specops.server.app import create_app\n")
    assert violations(fake) == ["specops/core/bad.py:2 (core) imports specops.server.app.create_app (server)"]


@pytest.mark.slow
def test_serving_side_loads_no_pipeline_dependencies():
    assert heavy_modules_loaded(SERVING_SIDE, ROOT.parent) == []


@pytest.mark.slow
def test_a_heavy_import_is_caught():
    assert heavy_modules_loaded(["specops.train.strategies"], ROOT.parent) != []
