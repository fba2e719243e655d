"""An S3 DVC remote (moto's S3 server, through dvc-s3): `dvc push` from one repo, `dvc pull` into a fresh
clone with an empty cache gives back every tracked file, byte for byte. What a team does with
`dvc remote add -d storage s3://bucket/path` instead of the project's local dvc-remote/ folder."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.pipeline.servers import BIN, S3_ENV, moto_s3

pytestmark = pytest.mark.slow
# A tracked folder and a stage output from it, as the project's data/ and models/.
PIPELINE = {"stages": {"train": {"cmd": "mkdir -p models && cat data/shard.bin data/shard.bin > models/w.bin",
                                 "deps": ["data"], "outs": ["models"]}}}


def run(args: list[str], cwd: Path, env: dict[str, str]) -> str:
    result = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, f"{args} failed:\n{result.stdout}\n{result.stderr}"
    return result.stdout


def tracked(repo: Path) -> dict[str, bytes]:
    return {str(path.relative_to(repo)): path.read_bytes()
            for folder in ("data", "models") for path in sorted((repo / folder).rglob("*")) if path.is_file()}


def test_push_to_an_s3_remote_and_pull_into_a_fresh_clone(tmp_path):
    env = {**os.environ, **S3_ENV, "PATH": f"{BIN}:{os.environ['PATH']}", "DVC_NO_ANALYTICS": "1",
           "DVC_SITE_CACHE_DIR": str(tmp_path / "dvc-site"), "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t",
           "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t"}
    repo, clone = tmp_path / "repo", tmp_path / "clone"
    (repo / "data").mkdir(parents=True)
    (repo / "data" / "prompts.jsonl").write_text('{"prompt": "hi"}\n')
    (repo / "data" / "shard.bin").write_bytes(os.urandom(200_000))
    (repo / "dvc.yaml").write_text(yaml.safe_dump(PIPELINE))
    with moto_s3(tmp_path) as s3:
        run(["git", "init", "-q"], repo, env)
        run(["dvc", "init", "-q"], repo, env)
        run(["dvc", "remote", "add", "-d", "storage", f"s3://{s3.bucket}/dvc"], repo, env)
        run(["dvc", "remote", "modify", "storage", "endpointurl", s3.endpoint], repo, env)
        run(["dvc", "add", "-q", "data"], repo, env)
        run(["dvc", "repro", "-q"], repo, env)
        run(["git", "add", "-A"], repo, env)
        run(["git", "commit", "-qm", "data and a model"], repo, env)
        run(["dvc", "push"], repo, env)
        # Content-addressed objects: the shard, the prompts, the model, and one listing per folder.
        assert len(s3.keys("dvc/files/md5/")) == 5

        run(["git", "clone", "-q", str(repo), str(clone)], tmp_path, env)
        assert tracked(clone) == {}  # git has only the .dvc/dvc.lock pointers
        run(["dvc", "pull"], clone, env)
    assert tracked(clone) == tracked(repo)
    assert set(tracked(repo)) == {"data/prompts.jsonl", "data/shard.bin", "models/w.bin"}
