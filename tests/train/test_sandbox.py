"""The code sandbox (issue #23). The verdict comes from tests run in this process, so no program can forge a
pass; under isolation='namespaces' each escape found in review is a must-fail case: writes outside the
workdir do not land, host files and environments cannot be read, forked and setsid children die with the
run, the process count is capped, and `_socket` reaches no network."""

from __future__ import annotations

import contextlib
import os
import secrets
import socket
import threading
from pathlib import Path

import pytest

from specops.data.datasets import read_humaneval
from specops.train import sandbox
from specops.train.sandbox import (
    ENV,
    FAILED,
    ISOLATION_LEVELS,
    MAX_TASKS,
    PASSED,
    TIMED_OUT,
    WORKDIR,
    SandboxResult,
    SandboxUnavailable,
    check_program,
)
from specops.train.scorers import SCORERS, Response, ScoringContext

ADD = "def add(a, b):\n    return a + b\n"
ADD_TEST = "def check(candidate):\n    assert candidate(2, 3) == 5\n    assert candidate([1], [2]) == [1, 2]\n"


def run(program: str, test: str = ADD_TEST, timeout_s: float = 5.0, isolation: str = "namespaces") -> SandboxResult:
    return check_program(program, "add", test, timeout_s=timeout_s, isolation=isolation)


def running_commands() -> set[str]:
    names = set()
    for comm in Path("/proc").glob("[0-9]*/comm"):
        with contextlib.suppress(OSError):  # exited while we looked
            names.add(comm.read_text().strip())
    return names


@pytest.mark.parametrize("isolation", ISOLATION_LEVELS)
def test_correct_code_passes_and_wrong_code_fails(isolation):
    assert run(ADD, isolation=isolation) == SandboxResult(PASSED)
    assert run(ADD.replace("a + b", "a - b"), isolation=isolation).detail.startswith("AssertionError")
    raising = "def add(a, b):\n    raise ValueError('boom')\n"
    assert run(raising, isolation=isolation) == SandboxResult(FAILED, "ValueError: boom")
    assert run("def add(a, b)\n    return a\n", isolation=isolation).detail.startswith("SyntaxError")
    assert run("def plus(a, b):\n    return a + b\n", isolation=isolation).detail == "KeyError: 'add'"


@pytest.mark.parametrize("program", ["while True:\n    pass\n", "def add(a, b):\n    while True:\n        pass\n"])
def test_a_hanging_program_times_out(program):
    assert run(program, timeout_s=1.0).status == TIMED_OUT


FORGED_PASSES = {
    "the review's nonce forge": "import sys\nm = sys.modules['__main__']\nm.result.write(m.job['nonce'] + '\\n')\n"
                                "m.result.flush()\nassert 1 == 2\n",
    "exit 0 while loading": "import os\nos._exit(0)\n",
    "exit 0 when called": "import os\ndef add(a, b):\n    os._exit(0)\n",
    "sys.exit when called": "import sys\ndef add(a, b):\n    sys.exit(0)\n",
    "equal to everything": "class Yes:\n    def __eq__(self, other):\n        return True\n"
                           "def add(a, b):\n    return Yes()\n",
}


@pytest.mark.parametrize("case", list(FORGED_PASSES))
def test_a_program_cannot_forge_a_pass(case):
    assert run(FORGED_PASSES[case]).status == FAILED


def test_writes_outside_the_private_workdir_do_not_land(tmp_path):
    kept = tmp_path / "kept.txt"
    kept.write_text("keep")
    fresh = [str(tmp_path / "new.txt"), f"/tmp/specops-escape-{secrets.token_hex(4)}", "/usr/specops-escape"]
    program = ("import os\n"
               "def add(paths):\n"
               "    for path in paths:\n"
               "        try:\n"
               "            open(path, 'w').write('escaped')\n"
               "        except OSError:\n"
               "            pass\n"
               "    open('note.txt', 'w').write('private')\n"
               "    return open('note.txt').read(), os.getcwd()\n")
    test = f"def check(candidate):\n    assert candidate({[str(kept), *fresh]!r}) == ('private', {WORKDIR!r})\n"
    assert run(program, test) == SandboxResult(PASSED)  # the writes were tried, and the workdir is writable
    assert kept.read_text() == "keep"
    assert not [path for path in fresh if Path(path).exists()]


def test_each_run_has_its_own_workdir():
    program = "import os\ndef add(a, b):\n    seen = os.path.exists('left.txt')\n    open('left.txt', 'w').close()\n" \
              "    return seen\n"
    test = "def check(candidate):\n    assert candidate(0, 0) is False\n"
    assert run(program, test) == SandboxResult(PASSED)
    assert run(program, test) == SandboxResult(PASSED)  # the first run's file is not there


def test_host_files_and_environments_cannot_be_read(tmp_path, monkeypatch):
    token = secrets.token_hex(8)
    secret = tmp_path / "secret.txt"
    secret.write_text(token)
    monkeypatch.setenv("SPECOPS_SANDBOX_SECRET", token)
    paths = [str(secret), f"/proc/{os.getpid()}/environ", "/proc/self/environ", "/proc/1/environ"]
    program = ("import os\n"
               "def add(paths):\n"
               "    seen = [sorted(os.environ)]\n"
               "    for path in paths + ['/proc/%d/environ' % os.getppid()]:\n"
               "        try:\n"
               "            seen.append(open(path, 'rb').read().decode(errors='replace'))\n"
               "        except OSError as error:\n"
               "            seen.append(type(error).__name__)\n"
               "    return seen\n")
    test = (f"def check(candidate):\n    seen = candidate({paths!r})\n"
            f"    assert {token!r} not in repr(seen), seen\n    assert seen[0] == {sorted({*ENV, 'HOME', 'TMPDIR'})!r}, seen[0]\n")
    assert run(program, test) == SandboxResult(PASSED)
    leaked = run(f"raise RuntimeError(open({str(secret)!r}).read())\n")  # the error detail comes back to us
    assert leaked.status == FAILED and token not in leaked.detail


def test_forked_and_setsid_children_die_with_the_run():
    name = "esc" + secrets.token_hex(5)  # a process name (comm) has at most 15 characters
    program = ("import ctypes, os, posix, time\n"
               "def add(name):\n"
               "    ready, done = os.pipe()\n"
               "    if posix.fork() == 0:\n"
               "        posix.setsid()\n"
               "        ctypes.CDLL(None).prctl(15, name.encode(), 0, 0, 0)\n"
               "        os.write(done, b'x')\n"
               "        while True:\n"
               "            time.sleep(1)\n"
               "    os.read(ready, 1)\n"
               "    return 'forked'\n")
    test = f"def check(candidate):\n    assert candidate({name!r}) == 'forked'\n"
    assert run(program, test) == SandboxResult(PASSED)  # the child did start, named, in its own session
    assert name not in running_commands()


def test_the_process_count_is_capped():
    program = ("import posix, time\n"
               "def add(attempts):\n"
               "    for started in range(attempts):\n"
               "        try:\n"
               "            pid = posix.fork()\n"
               "        except BlockingIOError:\n"
               "            return started\n"
               "        if pid == 0:\n"
               "            time.sleep(60)\n"
               "            posix._exit(0)\n"
               "    return attempts\n")
    test = f"def check(candidate):\n    started = candidate({4 * MAX_TASKS})\n    assert started < {MAX_TASKS}, started\n"
    assert run(program, test) == SandboxResult(PASSED)


def test_no_network_even_through__socket():
    accepted: list = []
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(1)
        threading.Thread(target=lambda: accepted.append(server.accept()), daemon=True).start()
        program = ("import _socket\n"
                   "def add(port):\n"
                   "    s = _socket.socket(_socket.AF_INET, _socket.SOCK_STREAM)\n"
                   "    s.settimeout(2)\n"
                   "    s.connect(('127.0.0.1', port))\n"
                   "    return 'connected'\n")
        result = run(program, f"def check(candidate):\n    candidate({server.getsockname()[1]})\n")
    assert result.status == FAILED and "unreachable" in result.detail and not accepted


def test_unknown_isolation_and_missing_root_are_refused(monkeypatch):
    with pytest.raises(ValueError, match="Unknown sandbox isolation"):
        run(ADD, isolation="chroot")
    monkeypatch.setattr(sandbox.os, "geteuid", lambda: 1000)
    with pytest.raises(SandboxUnavailable, match="needs root"):
        run(ADD)
    assert run(ADD, isolation="none") == SandboxResult(PASSED)  # the uncontained level needs nothing


def test_a_setup_failure_is_refused_not_scored(monkeypatch):
    monkeypatch.setattr(sandbox, "_read_only_paths", lambda: ["/nonexistent-specops-path"])
    with pytest.raises(SandboxUnavailable, match="nonexistent-specops-path"):
        run(ADD)


@pytest.mark.slow
def test_every_canonical_humaneval_solution_passes():
    """The tests run here on literals sent back from the sandbox: all 164 must still accept their solutions."""
    ctx = ScoringContext(timeout_s=10.0)
    rows = list(read_humaneval())
    failed = [row["task_id"] for row in rows if SCORERS["humaneval"](Response(row, [1], [1], row["reply"]), ctx) != 1]
    assert len(rows) == 164 and not failed
