"""LongSpec (arXiv 2502.17421) on this CPU: does drafting stay cheap as the prompt grows?

Prompts of about 1k, 2k, 4k and 7k tokens (SmolLM2's context is 8k) are conversations of earlier
questions with their answers followed by a last question (specops.data.datasets.long_context_prompts);
length 0 is the last question alone, the short-prompt reference. At each length `specops bench`'s
interleaved loop runs our plain decoding and every method on the same prompts, through the bf16 static
runtime, checking each is bitwise plain decoding. The prompt is prefilled once per prompt and shared
(specops.core.loop.PrefillCache), so speeds are of decoding alone; the target's prefill (TTFT) is
reported apart. HF greedy runs only up to --hf-max-length (its own prefill of a 7k prompt takes minutes).

    PYTHONPATH=. .venv/bin/python benchmarks/long_context.py --n 3 \\
        --out benchmarks/results/long_context.json --plot benchmarks/results/long_context.png

Per length and method: decode tokens/s, speedup over plain decoding, tokens per target step and
accepted draft tokens per step, the draft's peak KV bytes (measured from its tensors) and the target's
prefill seconds. The bar (issue #26): at 4k tokens the windowed drafter keeps >= 80% of its
short-prompt speedup, and its draft memory does not grow with the prompt.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig

from specops.core.memory import DTYPE_BYTES, ModelShape
from specops.core.target import encode_prompt, load_target
from specops.data.datasets import long_context_prompts
from specops.drafters.kinds import MethodSpec
from specops.eval.benchmark import BASELINE, PLAIN, BenchConfig, environment, run_benchmark_ids
from specops.eval.plots import speedup_vs_length

WINDOW = 384  # the draft LM's training length (models/draft_lm/specops_training.json: max_seq_len)
METHODS = ["draft-lm@4", f"draft-lm@4:window={WINDOW}", "draft-lm-suffix+specdecpp@4",
           f"draft-lm-suffix+specdecpp@4:window={WINDOW}", "suffix@4"]
BAR_LENGTH, BAR_RETENTION = 4096, 0.8


def length_summary(report: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Per method at one length: decode speed against plain decoding, acceptance and the draft's memory."""
    rows = report["per_prompt"]
    out = {}
    for name, row in report["methods"].items():
        steps = sum(r[name].get("steps", 0) for r in rows)
        out[name] = {"decode_tokens_per_s": row["decode_tokens_per_s"], "tokens_per_s": row["tokens_per_s"],
                     "decode_speedup_vs_plain": row["decode_speedup_vs_plain"],
                     "tokens_per_step": row["mean_accepted_length"],
                     "accepted_per_step": round(sum(r[name].get("accepted", 0) for r in rows) / steps, 3) if steps else None,
                     # a target pass's cost (plain decoding's step, a method's verification) and drafting's
                     "verify_ms_per_step": round(1e3 * row["verify_s"] / steps, 2) if steps else None,
                     "draft_ms_per_step": round(1e3 * row["draft_s"] / steps, 2) if steps else None,
                     "draft_kv_bytes": max((r[name].get("draft_kv_bytes", 0) for r in rows), default=0),
                     "prefill_s": row["prefill_s"], "identical_to_plain": row["identical_to_plain"]}
    return out


def retention(lengths: dict[int, dict[str, Any]]) -> dict[str, dict[int, float | None]]:
    """Each method's decode speedup at each length over its own at length 0 (the short prompts)."""
    short = lengths[0]["methods"]
    out: dict[str, dict[int, float | None]] = {}
    for name, row in short.items():
        base = row["decode_speedup_vs_plain"]
        out[name] = {length: (round(entry["methods"][name]["decode_speedup_vs_plain"] / base, 3) if base else None)
                     for length, entry in lengths.items()}
    return out


def bar(lengths: dict[int, dict[str, Any]], kept: dict[str, dict[int, float | None]], method: str,
        window_bytes: int) -> dict[str, Any]:
    """Issue #26's bar for one windowed method: the speedup kept at BAR_LENGTH, and draft memory that does
    not grow with the prompt (at every length within `window_bytes`, a full window's keys and values)."""
    memory = {length: entry["methods"][method]["draft_kv_bytes"] for length, entry in lengths.items()}
    kept_at = kept[method].get(BAR_LENGTH)
    return {"method": method, "speedup_kept_at_4k": kept_at, "draft_kv_bytes": memory, "window_bytes": window_bytes,
            "speedup_kept": kept_at is not None and kept_at >= BAR_RETENTION,
            "memory_flat": all(m <= window_bytes for m in memory.values())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dataset", default="humaneval", choices=["humaneval", "sharegpt"])
    parser.add_argument("--lengths", type=int, nargs="+", default=[0, 1024, 2048, 4096, 7168],
                        help="prompt tokens at most; 0: the last question alone (the short-prompt reference)")
    parser.add_argument("--n", type=int, default=3, help="prompts per length")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--methods", nargs="+", default=METHODS)
    parser.add_argument("--draft-model", default="models/draft_lm")
    parser.add_argument("--acceptance-head", default="models/acceptance_head")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--static-width", type=int, default=5)
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--hf-max-length", type=int, default=2048, help="HF greedy runs at lengths up to this")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default="benchmarks/results/long_context.json")
    parser.add_argument("--plot", default="benchmarks/results/long_context.png")
    args = parser.parse_args()
    if 0 not in args.lengths:
        raise SystemExit("--lengths needs 0: the short-prompt reference every retention is measured against.")
    torch.set_num_threads(args.threads)
    started = time.perf_counter()
    target = load_target("smollm2", args.dtype)
    lengths: dict[int, dict[str, Any]] = {}
    for length in sorted(args.lengths):
        prompts = [encode_prompt(target.tokenizer, p) for p in long_context_prompts(
            args.dataset, length, args.n, lambda chat: len(encode_prompt(target.tokenizer, chat)))]
        cfg = BenchConfig(dataset=args.dataset, n=args.n, max_new_tokens=args.max_new_tokens,
                          max_prompt_tokens=target.max_context - args.max_new_tokens, drafters=args.methods,
                          draft_model=args.draft_model, acceptance_head=args.acceptance_head, hf_assisted=False,
                          hf_prompt_lookup_tokens=0, hf_greedy=length <= args.hf_max_length,
                          static_width=args.static_width, compiled=args.compile, share_prefill=True, warmup_tokens=0)
        report = run_benchmark_ids(target, prompts, cfg)
        lengths[length] = {"prompt_tokens": [len(p) for p in prompts], "methods": length_summary(report),
                           "hf_greedy": report["methods"].get(BASELINE), "per_prompt": report["per_prompt"]}
        print(f"length {length}: prompts of {[len(p) for p in prompts]} tokens, target prefill "
              f"{lengths[length]['methods'][PLAIN]['prefill_s']:.1f} s in all ({time.perf_counter() - started:.0f} s so far)")
        for name, row in lengths[length]["methods"].items():
            if row["decode_tokens_per_s"] is None:  # HF generate: end to end, prefill included
                print(f"  {name:44s} {row['tokens_per_s']:7.2f} tok/s end to end  identical {row['identical_to_plain']}")
                continue
            print(f"  {name:44s} {row['decode_tokens_per_s']:7.2f} tok/s  {row['decode_speedup_vs_plain']:5.2f}x plain  "
                  f"{row['tokens_per_step']:.2f} tok/step  pass {row['verify_ms_per_step']:6.1f} ms  draft "
                  f"{row['draft_ms_per_step']:5.1f} ms/step  draft KV {row['draft_kv_bytes'] / 2**20:6.2f} MiB  "
                  f"identical {row['identical_to_plain']}")
    kept = retention(lengths)
    windowed = [m for m in args.methods if MethodSpec.parse(m).window]
    draft = ModelShape.of(AutoConfig.from_pretrained(args.draft_model))
    bars = [bar(lengths, kept, m, draft.kv_bytes(MethodSpec.parse(m).window or 0, DTYPE_BYTES[args.dtype]))
            for m in windowed] if BAR_LENGTH in lengths else []
    result = {"lengths": {str(k): v for k, v in lengths.items()}, "retention": kept, "bar": bars,
              "config": vars(args), "environment": environment(), "wall_s": round(time.perf_counter() - started, 1),
              "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    series = {name: [(sum(e["prompt_tokens"]) / len(e["prompt_tokens"]), e["methods"][name]["decode_speedup_vs_plain"])
                     for e in lengths.values()]
              for name, row in lengths[0]["methods"].items() if name != PLAIN and row["decode_speedup_vs_plain"]}
    speedup_vs_length(series, Path(args.plot), "decode speedup vs our plain decoding")
    for row in bars:
        print(f"bar, {row['method']}: speedup kept at 4k {row['speedup_kept_at_4k']} (>= {BAR_RETENTION}: "
              f"{row['speedup_kept']}), draft memory flat: {row['memory_flat']}")
    print(f"wrote {args.out} and {args.plot} in {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
