"""Packed bf16 products (specops/core/packed_linear.py) against F.linear on the real target, side by side.

Two parts, both eager (the runtime `specops serve` batches), bf16, on the static runtime:

1. Pass times: the median of one target pass over 1 and 5 rows of one sequence, and of one batched pass
   over 8 sequences of 1 and of 5 rows each (`forward_many`, as the server's pass thread runs it), with
   the lean forward's packed products and with F.linear, alternating.
2. The benchmark, methods interleaved prompt by prompt (specops.eval.benchmark): HF greedy (the
   baseline), our plain decoding and each drafter with packed products, and the same with F.linear
   (the target's and a draft LM's lean forward; a draft head or exit heads stay packed). Where the
   weights are in oneDNN's packing (SPECOPS_NATIVE=0, or a CPU without AVX-512 bf16) each run must equal
   our plain decoding bitwise on every prompt, its products being F.linear's sums; our kernel's round
   otherwise (specops.core.packed_linear), and batched_pass.py --onednn times it against oneDNN's. With
   `--compiled`, plain decoding through torch.compile runs too (its own rounding: not compared).

    .venv/bin/python benchmarks/packed_linear.py --dataset humaneval --n 10 --max-new-tokens 128 \
        --draft-model models/draft_lm --drafters prompt-lookup@4 draft-lm@4
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from specops.core.llama import LlamaForward, Segment, llama_forward
from specops.core.loop import SpeculativeGenerator
from specops.core.target import DEFAULT_TARGET, Target, encode_prompt, load_target
from specops.core.types import static_cache_length
from specops.data.datasets import bench_prompts
from specops.drafters.draft_lm import DraftLMDrafter
from specops.eval.benchmark import BenchConfig, build_methods, run_benchmark_ids


def forwards(generator: SpeculativeGenerator) -> list[LlamaForward]:
    """The lean forwards a generator's passes run: the target's, and its draft LM's."""
    out = [llama_forward(generator.target.model)[0]]
    if isinstance(generator.drafter, DraftLMDrafter):
        out.append(llama_forward(generator.drafter.model)[0])
    return out


class UnpackedGenerator(SpeculativeGenerator):
    """The same generator with F.linear in its lean forwards while it decodes (methods run one at a time)."""

    def _steps(self, *args: Any, **kwargs: Any) -> Iterator[list[int]]:
        lean = forwards(self)
        for forward in lean:
            forward.packing = False
        try:
            yield from super()._steps(*args, **kwargs)
        finally:
            for forward in lean:
                forward.packing = True


def pass_times(target: Target, context: list[int], repeats: int) -> dict[str, dict[str, float]]:
    """Median ms of a pass over (sequences x rows), packed and F.linear, alternating run by run."""
    forward = llama_forward(target.model)[0]
    length = static_cache_length(len(context), 64, 5)
    caches = []
    with torch.inference_mode():
        for _ in range(8):
            keys, values = forward.new_cache(length)
            cos, sin = forward.tables(length)
            forward.prefill(torch.tensor(context), torch.arange(len(context)), keys, values, cos, sin)
            caches.append((keys, values, cos, sin))
    out: dict[str, dict[str, float]] = {}
    for sequences, rows in ((1, 1), (1, 5), (8, 1), (8, 5)):
        ids, pos = torch.tensor(context[:rows]), torch.arange(len(context), len(context) + rows)
        segments = [Segment(ids, pos, *cache) for cache in caches[:sequences]]
        times: dict[str, list[float]] = {"packed": [], "f_linear": []}
        try:
            with torch.inference_mode():
                for i in range(2 * repeats + 2):
                    packing = i % 2 == 0
                    forward.packing = packing
                    start = time.perf_counter()
                    forward.forward_many(segments)
                    if i >= 2:  # the first of each is a warm-up
                        times["packed" if packing else "f_linear"].append(time.perf_counter() - start)
        finally:
            forward.packing = True
        medians = {name: 1e3 * statistics.median(values) for name, values in times.items()}
        out[f"{sequences}x{rows}"] = {**medians, "speedup": medians["f_linear"] / medians["packed"]}
        print(f"pass over {sequences} sequence(s) x {rows} row(s): packed {medians['packed']:.1f} ms, "
              f"F.linear {medians['f_linear']:.1f} ms", flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dataset", default="humaneval")
    parser.add_argument("--n", type=int, default=10)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--static-width", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=20, help="runs of each pass timing, per variant")
    parser.add_argument("--draft-model", help="draft LM folder, for draft-lm methods")
    parser.add_argument("--drafters", nargs="*", default=["prompt-lookup@4"])
    parser.add_argument("--compiled", action="store_true", help="also plain decoding compiled (70-90 s to compile)")
    parser.add_argument("--target", default=DEFAULT_TARGET)
    parser.add_argument("--out", default="benchmarks/results/packed_linear.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    target = load_target(args.target, "bfloat16")
    prompts = [encode_prompt(target.tokenizer, p) for p in bench_prompts(args.dataset, args.n)]
    passes = pass_times(target, prompts[0][:64], args.repeats)
    cfg = BenchConfig(dataset=args.dataset, n=args.n, max_new_tokens=args.max_new_tokens, drafters=args.drafters,
                      draft_model=args.draft_model, static_width=args.static_width, hf_prompt_lookup_tokens=0,
                      hf_assisted=False)
    # The F.linear twins of our methods: the same drafters' settings, decoding with packing off.
    twins: dict[str, SpeculativeGenerator] = {}
    for name, run in build_methods(target, cfg).items():
        generator = getattr(run, "generator", None)
        if isinstance(generator, SpeculativeGenerator):
            twin = UnpackedGenerator.__new__(UnpackedGenerator)
            twin.__dict__.update(generator.__dict__)
            twin.drafter = copy.copy(generator.drafter)  # its own per-request state, as a server slot's fork
            twins[f"{name} (F.linear)"] = twin
    if args.compiled:
        twins["plain (compiled)"] = SpeculativeGenerator(target, None, "greedy", 0, static_width=args.static_width,
                                                         compiled=True)
    report = run_benchmark_ids(target, prompts, cfg, extra=twins)
    result = {"config": vars(args), "pass_ms": passes, "bench": report}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({name: {k: v for k, v in m.items() if k in ("tokens_per_s", "speedup_vs_ar", "identical_to_plain")}
                      for name, m in report["methods"].items()}, indent=1))


if __name__ == "__main__":
    main()
