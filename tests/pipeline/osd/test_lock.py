"""The retrain lock: a second retrain exits at once with EXIT_LOCKED and says who runs; a holder killed
with SIGKILL leaves no stale lock behind."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from specops.cli import main
from specops.pipeline.retrain import EXIT_LOCKED
from specops.pipeline.run_lock import LockHeldError, RunLock, lock_holder

HOLDER = """
import sys, time
from specops.pipeline.run_lock import RunLock
with RunLock(sys.argv[1]):
    print("locked", flush=True)
    time.sleep(120)
"""


def hold_in_another_process(lock_file: Path) -> subprocess.Popen:
    process = subprocess.Popen([sys.executable, "-c", HOLDER, str(lock_file)], stdout=subprocess.PIPE, text=True)
    assert process.stdout is not None and process.stdout.readline().strip() == "locked"
    return process


def test_second_retrain_exits_with_a_clear_message_and_code(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    lock_file = tmp_path / "osd.lock"
    Path("params.yaml").write_text(yaml.safe_dump({"osd": {"lock_file": str(lock_file)}}))
    holder = hold_in_another_process(lock_file)
    try:
        assert f"pid {holder.pid} " in (lock_holder(lock_file) or "")
        for argv in (["retrain"], ["retrain", "--step", "promote"]):
            with pytest.raises(SystemExit) as exit_info:
                main(argv)
            assert exit_info.value.code == EXIT_LOCKED
            message = capsys.readouterr().err
            assert "already running" in message and f"pid {holder.pid} " in message
        with pytest.raises(LockHeldError), RunLock(lock_file):
            pass
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()

    # The kernel dropped the killed holder's lock; its leftover note is recognised as stale.
    assert lock_holder(lock_file) is None
    with RunLock(lock_file):
        assert lock_holder(lock_file) is not None
    assert lock_holder(lock_file) is None
