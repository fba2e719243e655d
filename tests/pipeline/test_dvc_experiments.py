"""`dvc exp run --queue` and `dvc queue start` work with the project's DVC config.

A relative core.site_cache_dir in .dvc/config broke every experiment that runs outside the workspace
(--queue, --temp, --dry): DVC runs them from a copy under .dvc/tmp/exps, where the relative path names
no database ("unable to open database file"). The Makefile's setup puts an absolute one in config.local.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
pytestmark = pytest.mark.slow

# One stage, no Python: the param goes through DVC's templating into the metric.
PIPELINE = {"stages": {"echo": {"cmd": """echo '{"y": ${x}}' > result.json""", "params": ["x"],
                                "metrics": [{"result.json": {"cache": False}}]}}}
DONE = ("Success", "Failed")
QUEUE_DEADLINE_S = 180  # only so that a stuck worker fails the test instead of hanging it


def dvc(args: list[str], cwd: Path) -> str:
    # Without DVC_SITE_CACHE_DIR, which would override the config under test.
    env = {key: value for key, value in os.environ.items() if key != "DVC_SITE_CACHE_DIR"}
    env |= {"PATH": f"{BIN}:{env['PATH']}", "DVC_NO_ANALYTICS": "1", "GIT_AUTHOR_NAME": "t",
            "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t"}
    result = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, f"{args} failed:\n{result.stdout}\n{result.stderr}"
    return result.stdout


def queue_status(name: str, repo: Path) -> str:
    """The task's status column in `dvc queue status` (Queued, Running, Success, Failed)."""
    rows = [line.split() for line in dvc(["dvc", "queue", "status"], repo).splitlines()]
    return next(row[-1] for row in rows if len(row) > 1 and row[1] == name)


def experiments(repo: Path) -> dict[str, dict]:
    """Experiment name -> its data (params, metrics) from `dvc exp show --json`."""
    shown = json.loads(dvc(["dvc", "exp", "show", "--json"], repo))
    return {rev["name"]: rev["data"] for baseline in shown for exp in baseline.get("experiments") or []
            for rev in exp["revs"]}


def test_a_queued_experiment_runs_with_the_project_dvc_config(tmp_path):
    repo = tmp_path / "repo"
    repo.mkdir()
    dvc(["git", "init", "-q"], repo)
    dvc(["dvc", "init", "-q"], repo)
    shutil.copy(ROOT / ".dvc" / "config", repo / ".dvc" / "config")
    (repo / "dvc.yaml").write_text(yaml.safe_dump(PIPELINE))
    (repo / "params.yaml").write_text("x: 2\n")
    dvc(["git", "add", "-A"], repo)
    dvc(["git", "commit", "-qm", "tiny pipeline"], repo)

    dvc(["dvc", "exp", "run", "--queue", "-S", "x=3", "--name", "three"], repo)
    dvc(["dvc", "queue", "start"], repo)
    deadline = time.monotonic() + QUEUE_DEADLINE_S
    while (status := queue_status("three", repo)) not in DONE and time.monotonic() < deadline:
        time.sleep(0.5)

    assert status == "Success", dvc(["dvc", "queue", "logs", "three"], repo)
    result = experiments(repo)["three"]
    assert result["params"]["params.yaml"]["data"] == {"x": 3}
    assert result["metrics"]["result.json"]["data"] == {"y": 3}
