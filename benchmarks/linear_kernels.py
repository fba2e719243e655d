"""Stock `F.linear` against specops.core.small_batch_linear on the real target, side by side in one run.

For each kernel set: the median time of one cached target pass over 1..8 tokens (what verifying a
draft of 0..7 tokens costs, specops/core/cost_model.py), and HF `generate` tokens/s on a few test prompts.
It also checks that greedy `generate` gives the same tokens with both kernel sets.

    .venv/bin/python benchmarks/linear_kernels.py --threads 1 --out benchmarks/results/linear_kernels.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from specops.core.cost_model import measure_cost_model
from specops.core.small_batch_linear import use_small_batch_linear
from specops.core.target import encode_prompt, load_target
from specops.data.datasets import bench_prompts

SIZES = (1, 2, 3, 4, 5, 6, 8)


def measure(model: torch.nn.Module, prompts: list[list[int]], new_tokens: int) -> dict:
    cost = measure_cost_model(model, context_tokens=128, sizes=SIZES, repeats=7)
    outputs, seconds = [], 0.0
    with torch.inference_mode():
        for ids in prompts:
            start = time.perf_counter()
            out = model.generate(torch.tensor([ids]), max_new_tokens=new_tokens, do_sample=False)
            seconds += time.perf_counter() - start
            outputs.append(out[0, len(ids):].tolist())
    tokens = sum(len(o) for o in outputs)
    return {"verify_ms": {n: round(s * 1000, 2) for n, s in cost.verify_s},
            "verify_over_one_token": {n: round(s / cost.verify_s[0][1], 3) for n, s in cost.verify_s},
            "generate_tokens_per_s": round(tokens / seconds, 2), "outputs": outputs}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dataset", default="data/prompts/test.jsonl", help="humaneval, sharegpt or a prompts JSONL (as specops bench)")
    parser.add_argument("--n", type=int, default=4, help="prompts for the generate check")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (benchmarks use 1)")
    parser.add_argument("--out", default="benchmarks/results/linear_kernels.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    target = load_target(small_batch_linear=False)
    prompts = [encode_prompt(target.tokenizer, messages) for messages in bench_prompts(args.dataset, args.n)]
    stock = measure(target.model, prompts, args.max_new_tokens)
    swapped = use_small_batch_linear(target.model)
    fast = measure(target.model, prompts, args.max_new_tokens)
    report = {
        "threads": args.threads, "torch": torch.__version__, "linear_layers_swapped": swapped,
        "stock": {k: v for k, v in stock.items() if k != "outputs"},
        "small_batch_linear": {k: v for k, v in fast.items() if k != "outputs"},
        "generate_speedup": round(fast["generate_tokens_per_s"] / stock["generate_tokens_per_s"], 3),
        "greedy_identical": stock["outputs"] == fast["outputs"], "prompts": len(prompts),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
