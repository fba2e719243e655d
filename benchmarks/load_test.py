"""Loopback load test of `specops serve`: one server per drafter, the same requests at several concurrencies.

Every server runs as its own process on 127.0.0.1; all start before the first phase and phases
alternate between them, so a slow spell on a shared machine hits every drafter alike. Requests are
greedy chat completions streamed over SSE, so time to first token is measured by the client.

    .venv/bin/python benchmarks/load_test.py --drafters recycling none --concurrency 1 4 8 \
        --requests 40 --max-tokens 48 --out benchmarks/results/load_test.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sqlite3
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

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


@dataclass
class ServerProcess:
    drafter: str
    url: str
    db: Path
    process: subprocess.Popen[bytes]
    log: Path


def start_server(drafter: str, port: int, folder: Path, args: argparse.Namespace) -> ServerProcess:
    db = folder / f"feedback-{drafter}.db"
    log = folder / f"server-{drafter}.log"
    command = [sys.executable, "-c", CLI, "serve", "--target", args.target, "--dtype", args.dtype, "--drafter", drafter,
               "--port", str(port), "--feedback-db", str(db), "--queue-size", str(2 * max(args.concurrency)),
               "--timeout-s", "3600"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    if args.threads:
        env["OMP_NUM_THREADS"] = str(args.threads)  # torch's intra-op pool takes its size from this
    with open(log, "wb") as handle:
        process = subprocess.Popen(command, cwd=REPO, env=env, stdout=handle, stderr=subprocess.STDOUT)
    return ServerProcess(drafter, f"http://127.0.0.1:{port}", db, process, log)


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


def one_request(url: str, messages: list[dict[str, str]], max_tokens: int) -> Result:
    body = {"messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    ttft = None
    parts: list[str] = []
    usage: dict[str, Any] = {}
    try:
        with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=3600) as response:
            if response.status_code != 200:
                response.read()
                return Result(False, time.perf_counter() - start, None, 0, 0, 0, "",
                              f"{response.status_code}: {response.text[:200]}")
            for line in response.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line.removeprefix("data: "))
                if "error" in chunk:
                    return Result(False, time.perf_counter() - start, ttft, 0, 0, 0, "", chunk["error"]["message"])
                for choice in chunk["choices"]:
                    content = choice["delta"].get("content")
                    if content:
                        ttft = ttft if ttft is not None else time.perf_counter() - start
                        parts.append(content)
                usage = chunk.get("usage") or usage
    except httpx.HTTPError as error:
        return Result(False, time.perf_counter() - start, ttft, 0, 0, 0, "", repr(error))
    return Result(True, time.perf_counter() - start, ttft, usage.get("completion_tokens", 0), usage.get("drafted", 0),
                  usage.get("accepted", 0), "".join(parts))


def percentile(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile; None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    return round(ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)], 4)


def rows_logged(db: Path) -> int:
    with sqlite3.connect(db) as conn:
        return conn.execute("SELECT COUNT(*) FROM requests").fetchone()[0]


def run_phase(server: ServerProcess, prompts: list[list[dict[str, str]]], concurrency: int,
              max_tokens: int) -> tuple[dict[str, Any], list[Result]]:
    rows_before = rows_logged(server.db)
    start = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        results = list(pool.map(lambda messages: one_request(server.url, messages, max_tokens), prompts))
    wall = time.perf_counter() - start
    ok = [r for r in results if r.ok]
    tokens = sum(r.completion_tokens for r in ok)
    drafted = sum(r.drafted for r in ok)
    summary = {
        "requests": len(results), "errors": len(results) - len(ok), "wall_s": round(wall, 2),
        "throughput_tok_s": round(tokens / wall, 2), "requests_per_s": round(len(ok) / wall, 3),
        "completion_tokens": tokens,
        "latency_p50_s": percentile([r.latency_s for r in ok], 50),
        "latency_p99_s": percentile([r.latency_s for r in ok], 99),
        "ttft_p50_s": percentile([r.ttft_s for r in ok if r.ttft_s is not None], 50),
        "ttft_p99_s": percentile([r.ttft_s for r in ok if r.ttft_s is not None], 99),
        "acceptance_rate": round(sum(r.accepted for r in ok) / drafted, 4) if drafted else None,
        "rows_logged": rows_logged(server.db) - rows_before,
        "error_samples": sorted({r.error for r in results if r.error})[:3],
    }
    return summary, results


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="smollm2", help="passed to `specops serve --target`")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--drafters", nargs="+", default=["recycling", "none"])
    parser.add_argument("--concurrency", nargs="+", type=int, default=[1, 4, 8])
    parser.add_argument("--requests", type=int, default=40, help="requests per phase (one phase = drafter x concurrency)")
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--dataset", default="humaneval", help="humaneval, sharegpt or a JSONL file (specops.data.datasets)")
    parser.add_argument("--threads", type=int, default=0,
                        help="torch threads per server (0: torch's default, one per core); 1 avoids stalls when "
                             "other work holds a core")
    parser.add_argument("--base-port", type=int, default=18400, help="servers listen on base-port, base-port+1, ...")
    parser.add_argument("--out", default="benchmarks/results/load_test.json")
    args = parser.parse_args(argv)
    if args.requests < 1 or args.max_tokens < 1 or min(args.concurrency) < 1:
        parser.error("--requests, --max-tokens and --concurrency must be >= 1")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    prompts = bench_prompts(args.dataset, args.requests)
    prompts = [prompts[i % len(prompts)] for i in range(args.requests)]
    folder = Path(tempfile.mkdtemp(prefix="specops-load-"))
    servers = [start_server(d, args.base_port + i, folder, args) for i, d in enumerate(args.drafters)]
    report: dict[str, Any] = {
        "config": {k: v for k, v in vars(args).items() if k != "out"},
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "load_avg_start": os.getloadavg()},
        "results": {d: {} for d in args.drafters},
    }
    texts: dict[str, list[str]] = {}
    try:
        deadline = time.monotonic() + READY_TIMEOUT_S
        for server in servers:
            wait_ready(server, deadline)
        for phase, concurrency in enumerate(args.concurrency):
            # Alternate which server goes first, so neither always runs right after the other's load.
            order = servers if phase % 2 == 0 else servers[::-1]
            for server in order:
                summary, results = run_phase(server, prompts, concurrency, args.max_tokens)
                report["results"][server.drafter][str(concurrency)] = summary
                texts.setdefault(server.drafter, [r.text for r in results])
                print(f"{server.drafter:>12} c={concurrency}: {summary['throughput_tok_s']:6.2f} tok/s, "
                      f"p50 {summary['latency_p50_s']} s, p99 {summary['latency_p99_s']} s, "
                      f"TTFT p50 {summary['ttft_p50_s']} s, errors {summary['errors']}, rows {summary['rows_logged']}",
                      flush=True)
    finally:
        for server in servers:
            server.process.terminate()
        for server in servers:
            server.process.wait(timeout=60)
    report["machine"]["load_avg_end"] = os.getloadavg()
    if "none" in texts:  # greedy speculative decoding is lossless: the texts must match plain decoding
        report["identical_to_none"] = {d: sum(a == b for a, b in zip(t, texts["none"], strict=True)) / len(t)
                                       for d, t in texts.items() if d != "none"}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
