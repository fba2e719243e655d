"""The built wheel ships everything the code needs: installed without the source tree, the CLI runs and
the DeepSpeed strategies find their ZeRO configs and the native decoder its C++ sources (package data)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import sysconfig
import venv
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_wheel_installs_and_runs_without_the_source_tree(tmp_path):
    source = tmp_path / "source"  # a clean copy: a stale build/ folder in the checkout could hide a missing file
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, source / name)
    shutil.copytree(REPO / "specops", source / "specops", ignore=shutil.ignore_patterns("__pycache__"))
    dist = tmp_path / "dist"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(dist),
                    str(source)], check=True, capture_output=True)
    wheel = next(dist.glob("specops-*.whl"))
    scratch = tmp_path / "venv"
    venv.create(scratch, with_pip=False)
    python = scratch / "bin" / "python"
    site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          check=True, capture_output=True, text=True).stdout.strip()
    # Reuse this venv's packages (torch, lightning, ...) by path, after the scratch venv's own site-packages.
    # A plain path entry does not run this venv's .pth files, so its editable specops stays out.
    (Path(site) / "reuse_test_venv.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", site, str(wheel)],
                   check=True, capture_output=True)
    run = tmp_path / "elsewhere"
    run.mkdir()
    where = subprocess.run([str(python), "-c", "import specops; print(specops.__file__)"], cwd=run, check=True,
                           capture_output=True, text=True).stdout.strip()
    assert where.startswith(site), where  # the wheel's copy, not the source tree
    help_text = subprocess.run([str(scratch / "bin" / "python"), "-m", "specops.cli", "--help"], cwd=run, check=True,
                               capture_output=True, text=True).stdout
    assert "generate" in help_text and "stage" in help_text
    code = ("from specops.train.strategies import make_strategy\n"
            "for stage in (2, 3):\n"
            "    assert make_strategy(f'deepspeed_stage_{stage}').config['zero_optimization']['stage'] == stage\n"
            "from specops.core import native\n"  # the native decoder's sources, which it builds where it runs
            "assert all(path.is_file() for path in [*native.SOURCES, *native.HEADERS])\n"
            "print('ok')")
    out = subprocess.run([str(python), "-c", code], cwd=run, check=True, capture_output=True, text=True).stdout
    assert out.splitlines()[-1] == "ok"
