"""One retrain at a time: an exclusive, non-blocking `flock` on a lock file.

The kernel releases a flock when its holder's process ends, however it ends (kill -9 included), so
a crashed retrain never leaves a stale lock behind and no PID bookkeeping decides who may run. The
holder writes its PID, host and start time into the file only so that a refused contender, or a dry
run, can say who holds it. The file is never deleted: unlinking it while locked would let the next
process lock a new file of the same name while the holder still runs. flock works on local
filesystems and on NFSv4 (Linux maps it to byte-range locks there).
"""

from __future__ import annotations

import fcntl
import os
import re
import socket
import time
from pathlib import Path
from types import TracebackType

NOTE = re.compile(r"^pid (?P<pid>\d+) on (?P<host>\S+) since ")


class LockHeldError(RuntimeError):
    """Another process holds the lock; the message names it."""


def _describe() -> str:
    return f"pid {os.getpid()} on {socket.gethostname()} since {time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())}"


class RunLock:
    """`with RunLock(path):` runs the block holding the lock, or raises LockHeldError at once."""

    def __init__(self, path: Path | str, what: str = "a retrain") -> None:
        self.path = Path(path)
        self.what = what
        self._handle = None

    def __enter__(self) -> RunLock:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        handle = open(self.path, "a+")  # never truncate before holding the lock: the holder's note is in it
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.seek(0)
            holder = handle.read().strip() or "another process"
            handle.close()
            raise LockHeldError(f"{self.what} is already running ({holder}; lock file {self.path}). "
                                "Not starting a second one; the next scheduled run will pick up the new "
                                "feedback.") from None
        handle.seek(0)
        handle.truncate()
        handle.write(_describe() + "\n")
        handle.flush()
        self._handle = handle
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 traceback: TracebackType | None) -> None:
        handle, self._handle = self._handle, None
        if handle is None:
            return
        handle.truncate(0)  # an empty file reads as "free" to lock_holder
        handle.flush()
        fcntl.flock(handle, fcntl.LOCK_UN)
        handle.close()


def lock_holder(path: Path | str) -> str | None:
    """Who holds the lock, from the note the holder wrote; None when free. Reads only, so a dry run
    never makes a starting retrain fail. A note left by a killed process on this host is ignored."""
    path = Path(path)
    note = path.read_text().strip() if path.is_file() else ""
    if not note:
        return None
    match = NOTE.match(note)
    if match and match["host"] == socket.gethostname():
        try:
            os.kill(int(match["pid"]), 0)
        except ProcessLookupError:
            return None
        except PermissionError:  # alive, owned by another user
            pass
    return note
