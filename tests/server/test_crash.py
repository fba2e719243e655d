"""Durability: SIGKILL the server (a subprocess started through the CLI) under concurrent load; every
request that received a complete response must have its feedback row, and the database must be intact."""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from tests.server.conftest import PROMPTS, free_socket, wait_ready

REPO = Path(__file__).resolve().parents[2]
# The CLI as the lead wires it: register() on a subparsers object, then the chosen command's func.
CLI = ("import argparse; from specops.server.commands import register; p = argparse.ArgumentParser(); "
       "register(p.add_subparsers(dest='command', required=True)); a = p.parse_args(); a.func(a)")
REQUESTS = 40
KILL_AFTER = 6  # complete responses before the kill, with the rest queued or in flight


@pytest.fixture(scope="module")
def target_dir(target, tmp_path_factory) -> Path:
    """The tiny target saved as a Hugging Face folder, so a subprocess can load it with --target."""
    folder = tmp_path_factory.mktemp("tiny-target")
    target.model.save_pretrained(folder)
    target.tokenizer.save_pretrained(folder)
    return folder


@pytest.mark.slow
def test_sigkill_under_load_loses_no_answered_request(target_dir, tmp_path):
    db = tmp_path / "feedback.db"
    sock = free_socket()
    port = sock.getsockname()[1]
    sock.close()  # the server binds it again right away; a clash would fail the readiness wait loudly
    server = subprocess.Popen(
        [sys.executable, "-c", CLI, "serve", "--target", str(target_dir), "--drafter", "recycling", "--port", str(port),
         "--feedback-db", str(db), "--queue-size", str(REQUESTS)],
        cwd=REPO, env={**os.environ, "HF_HUB_OFFLINE": "1"}, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}"
    answered: list[str] = []
    lock = threading.Lock()

    def ask(i: int) -> None:
        body = {"messages": [{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}], "max_tokens": 64,
                "temperature": 0}
        try:
            response = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60)
        except httpx.TransportError:
            return  # in flight at the kill
        if response.status_code == 200:
            with lock:
                answered.append(response.json()["id"])

    try:
        wait_ready(url)
        with ThreadPoolExecutor(8) as pool:
            for i in range(REQUESTS):
                pool.submit(ask, i)
            deadline = time.monotonic() + 60
            while len(answered) < KILL_AFTER and time.monotonic() < deadline:
                time.sleep(0.005)
            server.send_signal(signal.SIGKILL)
        server.wait(timeout=10)
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
    assert server.returncode == -signal.SIGKILL
    assert KILL_AFTER <= len(answered) < REQUESTS, "the kill must land mid-load"

    with sqlite3.connect(db) as conn:  # opening replays the WAL, as the next server start would
        assert conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
        logged = {row[0] for row in conn.execute("SELECT request_id FROM requests")}
    assert set(answered) <= logged
    assert len(logged) <= REQUESTS
