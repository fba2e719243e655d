"""Suffix Decoding over a stream of served requests: does drafting from past responses pay once traffic
repeats? The stream is the first N prompts of a dataset served `--passes` times in a row (HumanEval
twice: a repeated task), run through `specops bench`'s interleaved loop, so every method decodes request
i before any decodes request i + 1, and the suffix drafter has seen exactly the responses before it.

    .venv/bin/python benchmarks/suffix_stream.py --dataset humaneval --n 20 --passes 2 \
        --out benchmarks/results/suffix_stream_humaneval.json

Each pass is reported on its own: tokens/s over HF greedy in the same dtype, mean accepted tokens per
step, and whether every request was bitwise our plain decoding's. The warm-up generation (the first
prompt cut to 32 tokens) also enters the suffix drafter's cache, as a served request would.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch

from specops.core.target import encode_prompt, load_target
from specops.data.datasets import bench_prompts
from specops.eval.benchmark import BASELINE, BenchConfig, run_benchmark_ids


def pass_summary(rows: list[dict[str, Any]], methods: list[str]) -> dict[str, dict[str, Any]]:
    """Per method over some requests: tokens/s against HF greedy's, accepted tokens per step, exactness."""
    base = sum(r[BASELINE]["tokens"] for r in rows) / sum(r[BASELINE]["seconds"] for r in rows)
    out = {}
    for name in methods:
        tokens, seconds = sum(r[name]["tokens"] for r in rows), sum(r[name]["seconds"] for r in rows)
        steps, accepted = sum(r[name].get("steps", 0) for r in rows), sum(r[name].get("accepted", 0) for r in rows)
        out[name] = {"tokens_per_s": round(tokens / seconds, 2), "speedup_vs_ar": round(tokens / seconds / base, 3),
                     "accepted_per_step": round(accepted / steps, 3) if steps else None,
                     "identical_to_plain": all(r[name].get("identical_to_plain", True) for r in rows)}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dataset", default="humaneval")
    parser.add_argument("--n", type=int, default=20, help="distinct prompts")
    parser.add_argument("--passes", type=int, default=2, help="times the stream serves each prompt, in order")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--methods", nargs="+", default=["prompt-lookup@4", "suffix@4", "suffix@8"])
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--static-width", type=int, default=9, help="0: the dynamic runtime (fp32; trees allowed)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default="benchmarks/results/suffix_stream.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    target = load_target("smollm2", args.dtype)
    cfg = BenchConfig(dataset=args.dataset, n=args.n * args.passes, max_new_tokens=args.max_new_tokens,
                      drafters=args.methods, static_width=args.static_width)
    # The first n prompts that fit (the benchmark skips longer ones, which would shift the passes).
    encoded = (encode_prompt(target.tokenizer, p) for p in bench_prompts(args.dataset, 4 * args.n))
    prompts = [ids for ids in encoded if len(ids) <= cfg.max_prompt_tokens][:args.n]
    if len(prompts) < args.n:
        raise SystemExit(f"Only {len(prompts)} of the dataset's prompts fit max_prompt_tokens={cfg.max_prompt_tokens}.")
    report = run_benchmark_ids(target, prompts * args.passes, cfg)
    rows, names = report["per_prompt"], list(report["methods"])
    size = len(prompts)
    report["passes"] = [pass_summary(rows[i * size:(i + 1) * size], names) for i in range(args.passes)]
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    for i, summary in enumerate(report["passes"]):
        print(f"pass {i + 1}:")
        for name, row in summary.items():
            print(f"  {name:24s} {row['tokens_per_s']:7.2f} tok/s  {row['speedup_vs_ar']:5.2f}x  "
                  f"accepted/step {row['accepted_per_step']}  identical {row['identical_to_plain']}")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
