"""Real server processes for tests against remote storage: an MLflow tracking server and moto's S3.

Each runs in a session of its own (its own process group), so teardown ends it together with the
workers it forks (the MLflow server's uvicorn), and nothing outlives the test that started it.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

BIN = Path(sys.executable).parent
START_TIMEOUT_S = 60.0  # only so that a server that never comes up fails the test instead of hanging it
STOP_TIMEOUT_S = 15.0
CLIENT_ONLY_ENV = ("MLFLOW_TRACKING_URI", "MLFLOW_REGISTRY_URI")
# moto accepts any credentials; they only have to be there for boto3 and s3fs to sign requests.
S3_ENV = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _stop(process: subprocess.Popen[bytes]) -> None:
    """SIGTERM to the server's process group, then SIGKILL to whatever of it is left (a worker that lingers)."""
    with suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGTERM)
    with suppress(subprocess.TimeoutExpired):
        process.wait(timeout=STOP_TIMEOUT_S)
    with suppress(ProcessLookupError):  # the group is gone once all of it has exited
        os.killpg(process.pid, signal.SIGKILL)
    process.wait()


@contextmanager
def server_process(args: list[str], ready_url: str, log: Path, env: dict[str, str] | None = None) -> Iterator[None]:
    """Run `args` until the context exits; ready once `ready_url` answers 200. Output goes to `log`, and the
    process runs in log's folder, so that nothing it writes by a relative path lands in the project."""
    # Not the client's tracking URI (`make test` exports the project's sqlite:///mlflow/mlflow.db).
    inherited = {key: value for key, value in os.environ.items() if key not in CLIENT_ONLY_ENV}
    with log.open("wb") as out:
        process = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                   cwd=log.parent, env={**inherited, **(env or {})})
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while not _answers(ready_url):
            assert process.poll() is None, f"{args[:2]} exited with {process.returncode}:\n{log.read_text()}"
            assert time.monotonic() < deadline, f"{args[:2]} did not come up:\n{log.read_text()}"
            time.sleep(0.2)
        yield
    finally:
        _stop(process)


def _answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.TransportError:
        return False


@dataclass
class S3:
    """A bucket on a local S3-compatible server."""

    endpoint: str
    bucket: str

    def client(self) -> Any:
        import boto3

        return boto3.client("s3", endpoint_url=self.endpoint, aws_access_key_id=S3_ENV["AWS_ACCESS_KEY_ID"],
                            aws_secret_access_key=S3_ENV["AWS_SECRET_ACCESS_KEY"],
                            region_name=S3_ENV["AWS_DEFAULT_REGION"])

    def keys(self, prefix: str = "") -> list[str]:
        pages = self.client().get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=prefix)
        return sorted(item["Key"] for page in pages for item in page.get("Contents", []))

    def read(self, key: str) -> bytes:
        return self.client().get_object(Bucket=self.bucket, Key=key)["Body"].read()


@contextmanager
def moto_s3(folder: Path, bucket: str = "specops") -> Iterator[S3]:
    """moto's S3 server on a free port, with one empty bucket."""
    port = free_port()
    endpoint = f"http://127.0.0.1:{port}"
    with server_process([str(BIN / "python"), "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                        f"{endpoint}/moto-api/", folder / "moto.log"):
        s3 = S3(endpoint, bucket)
        s3.client().create_bucket(Bucket=bucket)
        yield s3


@contextmanager
def mlflow_server(backend_db: Path, artifacts_destination: str, log: Path,
                  env: dict[str, str] | None = None) -> Iterator[str]:
    """`mlflow server` on a free port with a sqlite backend, proxying artifacts to `artifacts_destination`
    (clients see mlflow-artifacts: URIs and never the destination itself); yields its tracking URI."""
    port = free_port()
    uri = f"http://127.0.0.1:{port}"
    args = [str(BIN / "mlflow"), "server", "--backend-store-uri", f"sqlite:///{backend_db}", "--serve-artifacts",
            "--artifacts-destination", artifacts_destination, "--host", "127.0.0.1", "--port", str(port),
            "--workers", "1"]
    # The job runner (GenAI scorers) forks seven huey consumers, which nothing here uses.
    with server_process(args, f"{uri}/health", log, {"MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false", **(env or {})}):
        yield uri
