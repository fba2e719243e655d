"""The batched server's generation worker under load in one process: no HTTP, no event loop, no client.

benchmarks/load_test.py measures the server as users see it, over loopback, where the event loop and the
client share the 2 cores with the passes and one phase at 8 users moves by 20-30% from run to run. This
drives the same `GenerationWorker` (its slots, its PassBatcher, SmartSpec's caps) directly: `c` client
threads each submit a job and wait for it to finish, alternating servers phase by phase, so what it
compares is the decoding, not the transport. Every server's output must equal the others' on every
prompt (greedy: the target's own output, whatever the drafter and the batch).

    .venv/bin/python benchmarks/batched_serving.py --concurrency 1 8 16 --requests 32 --max-tokens 64 \\
        --rounds 3 --out benchmarks/results/batched_serving.json

Servers are `name=bundle-folder` or `name=drafter`, a drafter kind served without a bundle (bf16, static
width 5, or 1 for `none`). A worker is built fresh for each round, as load_test.py starts fresh servers.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from specops.core.batching import on_short_thread
from specops.core.target import DEFAULT_TARGET, Target, encode_prompt, load_target
from specops.core.types import SamplingParams
from specops.data.datasets import bench_prompts
from specops.server.config import ServerConfig
from specops.server.metrics import ServerMetrics
from specops.server.reload import bundle_model, plain_model
from specops.server.worker import Completion, Event, Failed, Finished, GenerationWorker, Job, ServedModel

READY_TIMEOUT_S = 300.0


def served(spec: str, target: Target) -> ServedModel:
    """`name=bundle-folder` or `name=drafter-kind`."""
    source = spec.split("=", 1)[1]
    if Path(source).is_dir():
        return bundle_model(source, target)
    width = 1 if source == "none" else 5
    return plain_model(ServerConfig(drafter=source, dtype="bfloat16", static_width=width), target)


def run_job(worker: GenerationWorker, prompt_ids: list[int], max_tokens: int, index: int) -> Completion:
    done, box = threading.Event(), []

    def emit(event: Event) -> None:
        if isinstance(event, (Finished, Failed)):
            box.append(event)
            done.set()

    worker.submit(Job(f"bench-{index}", "chat", prompt_ids, max_tokens, SamplingParams(), 0, [], None, emit))
    done.wait()
    if isinstance(box[0], Failed):
        raise RuntimeError(f"request {index} failed: {box[0].message}")
    return box[0].completion


def phase(worker: GenerationWorker, prompts: list[list[int]], max_tokens: int, users: int) -> dict[str, Any]:
    """Every prompt once, `users` at a time (closed loop); throughput and the drafts' share."""
    start = time.perf_counter()
    with ThreadPoolExecutor(users) as pool:
        done = list(pool.map(lambda i: run_job(worker, prompts[i], max_tokens, i), range(len(prompts))))
    wall = time.perf_counter() - start
    tokens = sum(len(c.output_ids) for c in done)
    return {"users": users, "wall_s": wall, "tok_s": tokens / wall, "tokens": tokens,
            "drafted_per_token": sum(c.stats.drafted for c in done) / tokens,
            "tokens_per_step": tokens / sum(c.stats.steps for c in done),
            "outputs": [c.output_ids for c in done]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--servers", nargs="+", default=["none=none", "champion=bundles/champion"],
                        help="name=bundle-folder or name=drafter-kind (default: drafting off and the champion)")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 16], help="users at once, per phase")
    parser.add_argument("--requests", type=int, default=32, help="requests per phase")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3, help="every server and level, again on fresh workers")
    parser.add_argument("--dataset", default="humaneval")
    parser.add_argument("--threads", type=int, default=2, help="the pass thread's intra-op threads (serve --threads)")
    parser.add_argument("--out", default="benchmarks/results/batched_serving.json")
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    # Loaded on short threads: a long-lived thread that ran parallel ops keeps an OpenMP team, which slows every
    # batched pass after (specops.core.batching).
    target = on_short_thread(lambda: load_target(DEFAULT_TARGET, "bfloat16"))
    names = [spec.split("=", 1)[0] for spec in args.servers]
    pool = [encode_prompt(target.tokenizer, messages) for messages in
            bench_prompts(args.dataset, args.requests * len(args.concurrency))]
    if len(pool) < args.requests * len(args.concurrency):
        raise SystemExit(f"{args.dataset} has {len(pool)} prompts; {args.requests * len(args.concurrency)} needed.")
    rows: list[dict[str, Any]] = []
    for round_ in range(args.rounds):
        workers = {}
        for name, spec in zip(names, args.servers, strict=True):
            model = on_short_thread(lambda spec=spec: served(spec, target))
            worker = GenerationWorker(model, args.requests, ServerMetrics(), None, slots=max(args.concurrency))
            worker.start()
            if not worker.ready.wait(READY_TIMEOUT_S):
                raise SystemExit(f"{name}: not ready after {READY_TIMEOUT_S:.0f} s ({worker.failure}).")
            workers[name] = worker
        for level, users in enumerate(args.concurrency):
            prompts = pool[level * args.requests:(level + 1) * args.requests]
            order = names if round_ % 2 == 0 else names[::-1]  # who runs first alternates
            results = {name: phase(workers[name], prompts, args.max_tokens, users) for name in order}
            reference = results[names[0]].pop("outputs")
            for name in names[1:]:
                if results[name].pop("outputs") != reference:
                    raise SystemExit(f"{name}'s outputs differ from {names[0]}'s at {users} users: not lossless.")
            for name in names:
                observed = workers[name]._serving.batcher.observed() if workers[name].batched else {}
                rows.append({"round": round_, "server": name, **results[name], "observed": observed})
                print(f"round {round_} {users:>2} users {name:>12}: {results[name]['tok_s']:6.1f} tok/s, "
                      f"{results[name]['drafted_per_token']:.2f} drafted a token, "
                      f"{results[name]['tokens_per_step']:.2f} tokens a step", flush=True)
        for worker in workers.values():
            worker.stop()
    summary = {}
    for users in args.concurrency:
        for name in names:
            summary[f"{name}@{users}"] = statistics.median(r["tok_s"] for r in rows
                                                           if r["server"] == name and r["users"] == users)
        for name in names[1:]:
            ratios = [next(r["tok_s"] for r in rows if r["server"] == name and r["users"] == users and r["round"] == k)
                      / next(r["tok_s"] for r in rows if r["server"] == names[0] and r["users"] == users
                             and r["round"] == k) for k in range(args.rounds)]
            summary[f"{name}/{names[0]}@{users}"] = statistics.median(ratios)
            print(f"{users:>2} users: {name} / {names[0]} median {statistics.median(ratios):.2f}x "
                  f"({min(ratios):.2f}-{max(ratios):.2f})")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(args), "machine": platform.processor() or platform.machine(),
                               "summary": summary, "rows": rows}, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
