"""Where a batched target pass's time goes: `LlamaForward.forward_many` over sequences of given cache lengths
and rows, the target in bf16 (as the server batches it), timed alone; optionally with torch's profiler.

Each cache length attends in a call of its own per layer (specops.core.llama._AttentionPlan), so a pass over
sequences of several lengths costs more than one over the same sequences at one length.

    .venv/bin/python benchmarks/batched_pass.py --cases 320 320x8 256,320,384,448x2 --rows 1 5
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from specops.core.kv import StaticLM
from specops.core.llama import Segment, llama_forward
from specops.core.target import load_target

EMPTY_SLOTS = 80  # a cache's slots past its prompt: 64 new tokens and the runtime's room (static_cache_length)


def lengths_of(case: str) -> list[int]:
    """"256,320x2" -> [256, 320, 256, 320]: the comma-separated lengths, the list repeated."""
    spec, _, times = case.partition("x")
    lengths = [int(n) for n in spec.split(",")] * int(times or 1)
    if any(n <= EMPTY_SLOTS or n % 64 for n in lengths):
        raise SystemExit(f"Cache lengths are multiples of 64 above {EMPTY_SLOTS}, got {case}.")
    return lengths


def pass_of(model: torch.nn.Module, lengths: list[int], rows: int) -> Callable[[], object]:
    """One pass of `rows` rows per sequence, a sequence per length, prompts filling each cache but its last
    EMPTY_SLOTS slots (the rows are written past the prompt and not kept), warmed up."""
    forward = llama_forward(model)[0]
    caches = []
    for length in lengths:
        lm = StaticLM(model, 5, length)
        lm.prefill([10 + i % 50 for i in range(length - EMPTY_SLOTS)])
        caches.append(lm)

    def run() -> object:
        return forward.forward_many([Segment(torch.full((rows,), 42), torch.arange(lm.length, lm.length + rows),
                                             lm.keys, lm.values, *lm.tables) for lm in caches])

    for _ in range(3):  # allocator, oneDNN primitives
        run()
    return run


def median_seconds(run: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", nargs="+", default=["320", "320x8", "256,320,384,448x2"],
                        help="one pass's cache lengths: comma-separated, xN repeats the list")
    parser.add_argument("--rows", nargs="+", type=int, default=[1, 5], help="rows per sequence")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--profile", action="store_true", help="print torch's profile of the last case's passes")
    parser.add_argument("--out", default="benchmarks/results/batched_pass.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model = load_target("smollm2", dtype="bfloat16").model
    results, profiled = [], []
    with torch.inference_mode():
        for case in args.cases:
            lengths = lengths_of(case)
            for rows in args.rows:
                seconds = median_seconds(pass_of(model, lengths, rows), args.repeats)
                results.append({"lengths": lengths, "distinct_lengths": len(set(lengths)), "rows": rows,
                                "median_ms": round(seconds * 1000, 2)})
                print(f"{len(lengths)} sequences over {len(set(lengths))} cache lengths, {rows} rows each: "
                      f"{seconds * 1000:.2f} ms", flush=True)
        if args.profile:
            from torch.profiler import ProfilerActivity, profile

            run = pass_of(model, lengths_of(args.cases[-1]), args.rows[-1])
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                for _ in range(5):
                    run()
            ops = sorted(prof.key_averages(), key=lambda op: op.self_cpu_time_total, reverse=True)
            total = sum(op.self_cpu_time_total for op in ops)
            profiled = [{"op": op.key, "self_cpu_share": round(op.self_cpu_time_total / total, 4), "calls": op.count}
                        for op in ops[:20]]
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20))
    Path(args.out).write_text(json.dumps({"threads": args.threads, "load_avg": os.getloadavg(), "results": results,
                                          "profile_of_last_case": profiled}, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
