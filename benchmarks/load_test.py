"""Loopback load test of `specops serve`: one server per configuration, the same requests at several concurrencies.

Every server runs as its own process on 127.0.0.1; all start before the first phase and phases
alternate between them, so a slow spell on a shared machine hits every server alike. Requests go
through the official `openai` client, greedy, alternately streamed (time to first token is measured
on those) and not. Each phase sends the same requests, so a server's texts at every concurrency must
equal its texts alone (batched passes are exact); with --fresh-prompts each concurrency gets its own
requests instead: with N levels, every N-th prompt of the dataset from the level's own offset (HumanEval's
prompts grow along the file, and consecutive slices gave the 1-user level prompts of 149 tokens on
average and the 8-user level 222, so one level's throughput against another's compared different work;
interleaved, 180-200). Either way every server's texts must equal the others' (greedy is the target's own
output). Writes JSON and a PNG of throughput and latency against concurrency.

A phase of 32 requests at 8 users lasts ~15 s, and on a shared 2-core machine the same server's
throughput moves by 20-30% from one run to the next (the champion over drafting off at 8 users read
0.78x in one run, 1.22x and 1.07x in the next two, same protocol, nothing else running). `--rounds N`
repeats everything on fresh servers and reports per-level medians, with every server's throughput over
the first's, round by round. A phase whose client and server together kept fewer than `--min-cores-busy` (0.8)
of the cores busy is starved: on this shared VM another tenant sometimes takes a core for minutes, and such a
phase ran at about half speed (its cores_busy 0.53-0.54 against 0.94-0.97 for the phases around it). It stays
in the JSON, flagged, but the medians and ratios leave it out where another round ran it unstarved.

    .venv/bin/python benchmarks/load_test.py --concurrency 1 2 4 8 16 --requests 32 --max-tokens 64 \
        --fresh-prompts --rounds 3 --out benchmarks/results/load_test_rounds.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import re
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import httpx
from openai import OpenAI, OpenAIError

from specops.data.datasets import bench_prompts

REPO = Path(__file__).resolve().parents[1]
# `specops serve` without depending on how the main CLI is wired: register() then the command's func.
CLI = ("import argparse, logging; from specops.server.commands import register; logging.basicConfig(level=logging.WARNING); "
       "p = argparse.ArgumentParser(); register(p.add_subparsers(dest='command', required=True)); "
       "a = p.parse_args(); a.func(a)")
READY_TIMEOUT_S = 300.0  # two SmolLM2 servers loading at once on 2 cores


@dataclass
class Result:
    ok: bool
    latency_s: float
    ttft_s: float | None
    completion_tokens: int
    drafted: int
    accepted: int
    text: str
    error: str | None = None


# name=`specops serve` arguments. "none" is the drafting-off baseline, "serial" the champion one request at a time.
DEFAULT_SERVERS = ["none=--drafter none --dtype bfloat16 --static-width 1",
                   "prompt-lookup=--drafter prompt-lookup --dtype bfloat16 --static-width 5",
                   "champion=--bundle bundles/champion",
                   "serial=--bundle bundles/champion --max-batch 1"]


@dataclass
class ServerProcess:
    drafter: str
    url: str
    db: Path
    process: subprocess.Popen[bytes]
    log: Path


def code_version(checkout: Path) -> str:
    """The commit a checkout's code is at, "+changes" when tracked files differ from it (what a server ran)."""
    def git(*command: str) -> str:
        return subprocess.run(["git", "-C", str(checkout), *command], capture_output=True, text=True).stdout.strip()

    return (git("rev-parse", "--short", "HEAD") or "unknown") + ("+changes" if git("status", "--porcelain",
                                                                                  "--untracked-files=no") else "")


def start_server(spec: str, port: int, folder: Path, args: argparse.Namespace) -> ServerProcess:
    name, _, serve_args = spec.partition("=")
    db = folder / f"feedback-{name}.db"
    log = folder / f"server-{name}.log"
    cli = CLI
    if name in args.checkout:  # its specops package first on the path; the paths in its arguments stay ours
        cli = f"import sys; sys.path.insert(0, {str(args.checkout[name])!r}); {CLI}"
    command = [sys.executable, "-c", cli, "serve", *serve_args.split(), "--port", str(port), "--feedback-db", str(db),
               "--queue-size", str(2 * max(args.concurrency)), "--max-prompt-tokens", "8000", "--timeout-s", "3600"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    if args.threads:
        env["OMP_NUM_THREADS"] = str(args.threads)  # torch's intra-op pool takes its size from this
    with open(log, "wb") as handle:
        process = subprocess.Popen(command, cwd=REPO, env=env, stdout=handle, stderr=subprocess.STDOUT)
    return ServerProcess(name, f"http://127.0.0.1:{port}", db, process, log)


def process_status_mib(pid: int) -> dict[str, float]:
    """VmRSS and VmHWM (its peak RSS, load included) of a running process, MiB; {} once it is gone."""
    try:
        with open(f"/proc/{pid}/status") as handle:
            return {k: int(v.split()[0]) / 1024 for k, _, v in (line.partition(":") for line in handle)
                    if k in ("VmRSS", "VmHWM")}
    except OSError:
        return {}


def process_cpu_s(pid: int) -> float:
    """A process's CPU seconds so far, user and system over all its threads (/proc/PID/stat); 0 once it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as handle:
            fields = handle.read().rpartition(")")[2].split()  # after the command name, which may hold spaces
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime: fields 14 and 15


class RssSampler:
    """Samples each server's resident memory every `interval_s` while the phases run (a second view of the
    peak beside the kernel's VmHWM, read before the server stops)."""

    def __init__(self, servers: list[ServerProcess], interval_s: float) -> None:
        self.servers, self.interval_s = servers, interval_s
        self.max_rss: dict[str, float] = {server.drafter: 0.0 for server in servers}
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self.stop.wait(self.interval_s):
            for server in self.servers:
                rss = process_status_mib(server.process.pid).get("VmRSS", 0.0)
                self.max_rss[server.drafter] = max(self.max_rss[server.drafter], rss)


def memory_budget_mib(spec: str) -> float | None:
    """The --memory-budget a server spec passes, in MiB (None without one)."""
    from specops.core.memory import parse_bytes

    words = spec.partition("=")[2].split()
    return parse_bytes(words[words.index("--memory-budget") + 1]) / 2**20 if "--memory-budget" in words else None


def wait_ready(server: ServerProcess, deadline: float) -> None:
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            raise RuntimeError(f"The {server.drafter} server exited; see {server.log}:\n{server.log.read_text()[-2000:]}")
        try:
            if httpx.get(f"{server.url}/ready", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"The {server.drafter} server was not ready within {READY_TIMEOUT_S:.0f} s; see {server.log}.")


def one_request(url: str, messages: list[dict[str, str]], max_tokens: int, stream: bool) -> Result:
    api = OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=3600)
    start = time.perf_counter()
    ttft = None
    try:
        if not stream:
            reply = api.chat.completions.create(model="specops", messages=messages, max_tokens=max_tokens,
                                                temperature=0)
            usage = reply.usage.model_extra if reply.usage else {}
            return Result(True, time.perf_counter() - start, None, reply.usage.completion_tokens if reply.usage else 0,
                          usage.get("drafted", 0), usage.get("accepted", 0), reply.choices[0].message.content or "")
        parts: list[str] = []
        usage_chunk = None
        for chunk in api.chat.completions.create(model="specops", messages=messages, max_tokens=max_tokens,
                                                 temperature=0, stream=True, stream_options={"include_usage": True}):
            for choice in chunk.choices:
                if choice.delta.content:
                    ttft = ttft if ttft is not None else time.perf_counter() - start
                    parts.append(choice.delta.content)
            usage_chunk = chunk.usage or usage_chunk
        extra = usage_chunk.model_extra if usage_chunk else {}
        return Result(True, time.perf_counter() - start, ttft, usage_chunk.completion_tokens if usage_chunk else 0,
                      extra.get("drafted", 0), extra.get("accepted", 0), "".join(parts))
    except OpenAIError as error:
        return Result(False, time.perf_counter() - start, ttft, 0, 0, 0, "", repr(error)[:300])


def percentile(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile; None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    return round(ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)], 4)


def rows_logged(db: Path) -> int:
    with sqlite3.connect(db) as conn:
        return conn.execute("SELECT COUNT(*) FROM requests").fetchone()[0]


def scrape(url: str) -> str:
    """The server's /metrics, in Prometheus text."""
    return httpx.get(f"{url}/metrics", timeout=30).text


def observed_step_costs(text: str) -> dict[str, float | None]:
    """What the server's batcher has observed of its passes (specops_observed_step_costs, the draft length
    policy's step-time model under load), from its /metrics text; {} for a server that does not batch."""
    return {name: None if value == "NaN" else float(value) for name, value in  # NaN: not observed yet
            re.findall(r'^specops_observed_step_costs\{field="(\w+)"\} (\S+)$', text, re.MULTILINE)}


T = TypeVar("T")
PASS_KINDS = ("target", "draft", "target_alone", "draft_alone", "other")  # specops_pass_seconds' kinds


def pass_seconds(text: str) -> dict[str, float]:
    """The seconds the server's pass thread has run passes so far, by kind (specops_pass_seconds: PASS_KINDS),
    from its /metrics text; {} for a server that does not batch."""
    return {kind: float(value) for kind, value in
            re.findall(r'^specops_pass_seconds_total\{kind="(\w+)"\} (\S+)$', text, re.MULTILINE)}


def prompt_counts(text: str) -> tuple[float, float]:
    """Prompt tokens of the requests finished so far, and those the prefix cache held (0 where a server has no
    prefix cache), from its /metrics text."""
    def total(name: str) -> float:
        found = re.search(rf"^{name}_total (\S+)$", text, re.MULTILINE)
        return float(found.group(1)) if found else 0.0
    return total("specops_prompt_tokens"), total("specops_cached_prompt_tokens")


def run_phase(server: ServerProcess, prompts: list[list[dict[str, str]]], concurrency: int,
              max_tokens: int) -> tuple[dict[str, Any], list[Result]]:
    rows_before = rows_logged(server.db)
    before = scrape(server.url)
    busy_before, prompts_before = pass_seconds(before), prompt_counts(before)
    cpu_before = time.process_time(), process_cpu_s(server.process.pid)
    start = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        results = list(pool.map(lambda i: one_request(server.url, prompts[i], max_tokens, stream=i % 2 == 0),
                                range(len(prompts))))
    wall = time.perf_counter() - start
    client_cpu, server_cpu = time.process_time() - cpu_before[0], process_cpu_s(server.process.pid) - cpu_before[1]
    metrics = scrape(server.url)
    busy = {kind: round(seconds - busy_before.get(kind, 0.0), 3) for kind, seconds in pass_seconds(metrics).items()}
    ok = [r for r in results if r.ok]
    tokens = sum(r.completion_tokens for r in ok)
    prompt_tokens, cached = (now - was for now, was in zip(prompt_counts(metrics), prompts_before, strict=True))
    drafted = sum(r.drafted for r in ok)
    summary = {
        "requests": len(results), "errors": len(results) - len(ok), "wall_s": round(wall, 2),
        "throughput_tok_s": round(tokens / wall, 2), "requests_per_s": round(len(ok) / wall, 3),
        "completion_tokens": tokens,
        # The prompts' tokens, and those whose keys and values came from the prefix cache (--prefix-cache-mb).
        "prompt_tokens": int(prompt_tokens), "cached_prompt_tokens": int(cached),
        "latency_p50_s": percentile([r.latency_s for r in ok], 50),
        "latency_p99_s": percentile([r.latency_s for r in ok], 99),
        "ttft_p50_s": percentile([r.ttft_s for r in ok if r.ttft_s is not None], 50),
        "ttft_p99_s": percentile([r.ttft_s for r in ok if r.ttft_s is not None], 99),
        "acceptance_rate": round(sum(r.accepted for r in ok) / drafted, 4) if drafted else None,
        "drafted_per_token": round(drafted / tokens, 4) if tokens else None,
        "observed_step_costs": observed_step_costs(metrics),
        # Where the phase's wall time went on the pass thread; the rest it waited for the sequences' own work.
        "pass_thread_s": busy,
        "pass_thread_busy": round(sum(busy.values()) / wall, 3) if busy else None,
        # The client runs on the same cores (loopback): the CPU it took, the server could not have.
        "client_cpu_s": round(client_cpu, 2), "server_cpu_s": round(server_cpu, 2),
        "cores_busy": round((client_cpu + server_cpu) / (wall * (os.cpu_count() or 1)), 3),
        "rows_logged": rows_logged(server.db) - rows_before,
        "error_samples": sorted({r.error for r in results if r.error})[:3],
        "server_5xx": sum(1 for r in results if r.error and "Error code: 5" in r.error),
    }
    return summary, results


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--servers", nargs="+", default=DEFAULT_SERVERS,
                        help="NAME=`specops serve` arguments, one server each (default: %(default)s)")
    parser.add_argument("--concurrency", nargs="+", type=int, default=[1, 2, 4, 8, 16])
    parser.add_argument("--requests", type=int, default=32, help="requests per phase (one phase = server x concurrency)")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--dataset", default="humaneval", help="humaneval, sharegpt or a JSONL file (specops.data.datasets)")
    parser.add_argument("--fresh-prompts", action="store_true",
                        help="each concurrency level gets its own requests (every server the same ones), every "
                             "N-th prompt of the dataset for N levels: a drafter that learns from served responses "
                             "(Suffix Decoding) then never sees a request again, and every level gets prompts of "
                             "the whole dataset's lengths")
    parser.add_argument("--threads", type=int, default=0,
                        help="torch threads per server (0: torch's default, one per core); 1 avoids stalls when "
                             "other work holds a core")
    parser.add_argument("--base-port", type=int, default=18400, help="servers listen on base-port, base-port+1, ...")
    parser.add_argument("--rss-interval-s", type=float, default=0.05,
                        help="how often each server's resident memory is sampled during the phases")
    parser.add_argument("--rounds", type=int, default=1,
                        help="repeat everything on fresh servers; results are then per-level medians over the rounds "
                             "(counts summed), with each round's report and every server's throughput over the first "
                             "server's, round by round")
    parser.add_argument("--checkout", nargs="+", default=[], metavar="NAME=PATH",
                        help="serve NAME with the specops package of another checkout (`git worktree add PATH "
                             "COMMIT`), to compare two versions of the code side by side in one run")
    parser.add_argument("--min-cores-busy", type=float, default=0.8,
                        help="a phase whose client and server kept less than this share of the cores busy is "
                             "starved (on a shared machine another tenant took a core): recorded, but left out of "
                             "the medians and ratios where another round ran it unstarved")
    parser.add_argument("--out", default="benchmarks/results/load_test.json")
    args = parser.parse_args(argv)
    names = {spec.partition("=")[0] for spec in args.servers}
    checkouts = [spec.partition("=") for spec in args.checkout]
    if any(not path or name not in names or not (Path(path) / "specops").is_dir() for name, _, path in checkouts):
        parser.error("--checkout takes NAME=PATH, NAME one of --servers and PATH a checkout holding specops/")
    args.checkout = {name: Path(path).resolve() for name, _, path in checkouts}
    if args.requests < 1 or args.max_tokens < 1 or min(args.concurrency) < 1 or args.rounds < 1:
        parser.error("--requests, --max-tokens, --concurrency and --rounds must be >= 1")
    return args


def plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    busy = [(name, level, phases[level]) for name, phases in report["results"].items()
            for level in sorted(phases, key=int) if phases[level].get("pass_thread_s")]
    fig, axes = plt.subplots(1, 3 if busy else 2, figsize=(17 if busy else 11, 4))
    left, right = axes[0], axes[1]
    for name, phases in report["results"].items():
        levels = sorted(phases, key=int)
        x = [int(c) for c in levels]
        (line,) = left.plot(x, [phases[c]["throughput_tok_s"] for c in levels], marker="o", label=name)
        color = line.get_color()  # a server's color in both panels: p50 solid, p99 dashed
        right.plot(x, [phases[c]["latency_p50_s"] for c in levels], marker="o", color=color, label=f"{name} p50")
        right.plot(x, [phases[c]["latency_p99_s"] for c in levels], marker="x", linestyle="--", color=color,
                   label=f"{name} p99")
    left.set(xlabel="concurrent clients", ylabel="generated tokens / s", title="Throughput", xscale="log", xticks=[])
    right.set(xlabel="concurrent clients", ylabel="seconds", title="Request latency", xscale="log")
    for ax in (left, right):
        ax.minorticks_off()  # a log axis labels its minor ticks 2x10^0, ...
        ax.set_xticks(report["config"]["concurrency"], [str(c) for c in report["config"]["concurrency"]])
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    if busy:  # where the pass thread's time went, as a share of each phase's wall time
        # One group of bars per server, a gap between groups: the ticks name the level, the server under its group.
        names = list(dict.fromkeys(name for name, _, _ in busy))
        x = [i + names.index(name) for i, (name, _, _) in enumerate(busy)]  # busy runs server by server
        bottom = [0.0] * len(busy)
        seen = {kind for _, _, phase in busy for kind in phase["pass_thread_s"]}
        for kind in [k for k in PASS_KINDS if k in seen] + sorted(seen - set(PASS_KINDS)):  # and older runs' kinds
            shares = [100 * (phase["pass_thread_s"].get(kind) or 0.0) / phase["wall_s"] for _, _, phase in busy]
            axes[2].bar(x, shares, bottom=bottom, label=kind)
            bottom = [b + share for b, share in zip(bottom, shares, strict=True)]
        axes[2].set_xticks(x, [level for _, level, _ in busy], fontsize=7)
        for name in names:
            group = [position for position, (other, _, _) in zip(x, busy, strict=True) if other == name]
            axes[2].text(sum(group) / len(group), -0.13, name, transform=axes[2].get_xaxis_transform(), ha="center",
                         fontsize=8)
        axes[2].set(ylabel="% of the phase's wall time", ylim=(0, 100), title="Pass thread busy, by kind (x: clients)")
        axes[2].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def level_prompts(pool: list[T], level: int, levels: int) -> list[T]:
    """The prompts of the `level`-th of `levels` concurrency levels: every levels-th of the pool from its own
    offset, so that each level's prompts span the whole dataset (see the module docstring)."""
    return pool[level % levels:: levels]


def run_round(args: argparse.Namespace, pool: list[list[dict[str, str]]], phases: int) -> dict[str, Any]:
    """Fresh servers, every phase on each, then stopped: one round's results, memory and texts."""
    folder = Path(tempfile.mkdtemp(prefix="specops-load-"))
    servers = [start_server(spec, args.base_port + i, folder, args) for i, spec in enumerate(args.servers)]
    names = [server.drafter for server in servers]
    report: dict[str, Any] = {"load_avg_start": os.getloadavg(), "results": {name: {} for name in names},
                              "code": {name: code_version(args.checkout.get(name, REPO)) for name in names}}
    texts: dict[str, dict[int, list[str]]] = {name: {} for name in names}
    try:
        deadline = time.monotonic() + READY_TIMEOUT_S
        for server in servers:
            wait_ready(server, deadline)
        sampler = RssSampler(servers, args.rss_interval_s)
        sampler.thread.start()
        for phase, concurrency in enumerate(args.concurrency):
            # Rotate which server goes first, so none always runs right after another's load.
            order = servers[phase % len(servers):] + servers[: phase % len(servers)]
            prompts = level_prompts(pool, phase, phases)
            for server in order:
                summary, results = run_phase(server, prompts, concurrency, args.max_tokens)
                summary["starved"] = summary["cores_busy"] < args.min_cores_busy
                report["results"][server.drafter][str(concurrency)] = summary
                texts[server.drafter][concurrency] = [r.text for r in results]
                print(f"{server.drafter:>14} c={concurrency:<3}: {summary['throughput_tok_s']:7.2f} tok/s, "
                      f"p50 {summary['latency_p50_s']} s, p99 {summary['latency_p99_s']} s, "
                      f"TTFT p99 {summary['ttft_p99_s']} s, errors {summary['errors']}, rows {summary['rows_logged']}, "
                      f"CPU s client {summary['client_cpu_s']} server {summary['server_cpu_s']}, "
                      f"pass thread busy {summary['pass_thread_busy']} {summary['pass_thread_s']}"
                      f"{' STARVED (left out of the medians)' if summary['starved'] else ''}", flush=True)
        sampler.stop.set()
        report["memory"] = {
            server.drafter: {"budget_mib": memory_budget_mib(spec), "max_rss_sampled_mib": sampler.max_rss[server.drafter],
                             **{f"{k}_at_end_mib": v for k, v in process_status_mib(server.process.pid).items()}}
            for server, spec in zip(servers, args.servers, strict=True)}
        for name, memory in report["memory"].items():
            print(f"{name:>14} memory: peak RSS (VmHWM) {memory.get('VmHWM_at_end_mib')} MiB, sampled max "
                  f"{memory['max_rss_sampled_mib']} MiB, budget {memory['budget_mib']} MiB", flush=True)
    finally:
        for server in servers:
            server.process.terminate()
        for server in servers:
            server.process.wait(timeout=60)
    report["load_avg_end"] = os.getloadavg()
    first = args.concurrency[0]
    # Exactness under load: every phase's texts equal the same server's at the first concurrency (alone
    # when that is 1). Speculative == plain decoding through the same runtime is the evaluate stage's check.
    if not args.fresh_prompts:
        report["same_texts_at_every_concurrency"] = {
            name: all(by_level[c] == by_level[first] for c in by_level) for name, by_level in texts.items()}
    # Across servers: greedy output of every lossless method is the target's own, so servers of one target and
    # dtype answer alike whatever their drafter, width or batch (true only if passes are shape-invariant).
    report["same_texts_across_servers"] = {
        str(c): all(texts[name][c] == texts[names[0]][c] for name in names) for c in args.concurrency}
    report["text_differences"] = {  # each request on which servers disagreed, with every server's text
        str(c): [{"request": i, **{name: texts[name][c][i] for name in names}} for i in range(len(texts[names[0]][c]))
                 if len({texts[name][c][i] for name in names}) > 1] for c in args.concurrency}
    return report


SUMMED = ("requests", "errors", "completion_tokens", "rows_logged", "server_5xx")  # over rounds; other numbers: medians


def median_of(values: list[Any]) -> float | None:
    numbers = [v for v in values if v is not None]
    return round(statistics.median(numbers), 4) if numbers else None


def unstarved(phases: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The phases whose processes had the cores (`starved` false), or all of them if none had."""
    return [phase for phase in phases if not phase.get("starved")] or phases


def combine(rounds: list[dict[str, Any]]) -> dict[str, dict[str, dict[str, Any]]]:
    """Per server and concurrency: counts summed over the rounds, other numbers their median over the rounds
    not starved (per key, in a dict of numbers such as the pass thread's seconds by kind), and every round's
    throughput (a shared machine moves a round by tens of percent; the median resists one bad round)."""
    combined: dict[str, dict[str, dict[str, Any]]] = {}
    for name, levels in rounds[0]["results"].items():
        combined[name] = {}
        for level in levels:
            phases = [r["results"][name][level] for r in rounds]
            kept = unstarved(phases)
            summary: dict[str, Any] = {}
            for field, value in phases[0].items():
                values = [phase[field] for phase in (phases if field in SUMMED else kept)]
                if field in SUMMED:
                    summary[field] = sum(values)
                elif isinstance(value, (int, float)) and not isinstance(value, bool):
                    summary[field] = median_of(values)
                elif isinstance(value, dict):
                    keys = sorted({key for v in values for key in v})
                    summary[field] = {key: median_of([v.get(key) for v in values]) for key in keys}
                elif field == "error_samples":
                    summary[field] = sorted({e for phase in phases for e in phase[field]})[:3]
            summary["throughput_tok_s_rounds"] = [phase["throughput_tok_s"] for phase in phases]
            summary["starved_rounds"] = [i for i, phase in enumerate(phases) if phase.get("starved")]
            combined[name][level] = summary
    return combined


def against(rounds: list[dict[str, Any]], baseline: str) -> dict[str, dict[str, list[float]]]:
    """Each server's throughput over the baseline server's, per concurrency, round by round: the rounds in
    which neither phase was starved (all rounds if every one had a starved phase)."""
    def ratios(name: str, level: str) -> list[float]:
        pairs = [(r["results"][name][level], r["results"][baseline][level]) for r in rounds]
        fed = [(a, b) for a, b in pairs if not a.get("starved") and not b.get("starved")] or pairs
        return [round(a["throughput_tok_s"] / b["throughput_tok_s"], 3) for a, b in fed]

    return {name: {level: ratios(name, level) for level in levels}
            for name, levels in rounds[0]["results"].items() if name != baseline}


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    phases = len(args.concurrency) if args.fresh_prompts else 1
    pool = bench_prompts(args.dataset, args.requests * phases)
    if len(pool) < args.requests * phases and args.fresh_prompts:
        raise SystemExit(f"--fresh-prompts needs {args.requests * phases} prompts; {args.dataset} has {len(pool)}.")
    pool = [pool[i % len(pool)] for i in range(args.requests * phases)]
    report: dict[str, Any] = {
        "config": {**{k: v for k, v in vars(args).items() if k != "out"},
                   "checkout": {name: str(path) for name, path in args.checkout.items()}},
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "load_avg_start": os.getloadavg()},
    }
    rounds = []
    for index in range(args.rounds):
        if args.rounds > 1:
            print(f"round {index + 1} of {args.rounds}", flush=True)
        rounds.append(run_round(args, pool, phases))
    report["machine"]["load_avg_end"] = os.getloadavg()
    baseline = next(iter(rounds[0]["results"]))  # the first server's name
    if args.rounds == 1:  # one round's report as it is
        report.update({k: v for k, v in rounds[0].items() if not k.startswith("load_avg")})
    else:
        report["results"] = combine(rounds)
        report["rounds"] = rounds
    report["throughput_vs_" + baseline] = against(rounds, baseline)
    for name, levels in report["throughput_vs_" + baseline].items():
        print(f"{name:>14} / {baseline}: " + ", ".join(f"c={level} {statistics.median(ratios):.2f}x "
                                                       f"({min(ratios):.2f}-{max(ratios):.2f})"
                                                       for level, ratios in levels.items()), flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    plot(report, out.with_suffix(".png"))
    print(f"wrote {out} and {out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
