"""PEARL (specops/core/pearl.py) against draft-then-verify with the same draft LM and the same 2 cores.

Two parts, both on the bf16 target on the static runtime:

1. An overlap probe: target passes and draft tokens timed alone (at 1 and 2 intra-op threads) and
   then at once, each in its own thread with one intra-op thread. If the two threads serialised (on
   the GIL, or on one core), each side's time at once would grow by the other's; if they overlap, it
   grows only by what they contend for (memory bandwidth, Python).
2. The benchmark, methods interleaved prompt by prompt (specops.eval.benchmark): HF greedy (the
   baseline), our plain decoding, draft-then-verify at 2 intra-op threads and at 1, and PEARL with one
   intra-op thread per side, waiting for 1 draft (the paper's pre-verify) and for a full pass of
   drafts. Each must equal our plain decoding bitwise on every prompt. PEARL's per-thread time split
   (target passes, target waits, draft busy and idle) is summed over the timed generations.

    .venv/bin/python benchmarks/pearl.py --dataset humaneval --n 20 --max-new-tokens 128
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from collections.abc import Iterator
from dataclasses import asdict, fields
from pathlib import Path
from typing import Any

import torch

from specops.core.kv import StaticLM
from specops.core.loop import SpeculativeGenerator
from specops.core.pearl import PearlGenerator, PearlTimings, intra_op_threads
from specops.core.target import DEFAULT_TARGET, Target, encode_prompt, load_target
from specops.core.types import SamplingParams, static_cache_length
from specops.data.datasets import bench_prompts
from specops.drafters.draft_lm import DraftLMDrafter, load_draft
from specops.eval.benchmark import BenchConfig, run_benchmark_ids

DRAFTS = 4  # draft tokens a pass: static width 5, the serving default


class OneThreadGenerator(SpeculativeGenerator):
    """Draft-then-verify on one intra-op thread: half the cores, the share each PEARL side gets."""

    def _steps(self, *args: Any, **kwargs: Any) -> Iterator[list[int]]:
        with intra_op_threads(1):
            yield from super()._steps(*args, **kwargs)


def _timed(work, n: int) -> float:
    """Seconds per call of `work`, over n calls after one untimed."""
    work()
    start = time.perf_counter()
    for _ in range(n):
        work()
    return (time.perf_counter() - start) / n


def overlap_probe(target: Target, drafter: DraftLMDrafter, prompt: list[int], width: int, n: int) -> dict[str, float]:
    """Milliseconds per target pass and per draft token: alone at 1 and 2 threads, and at once."""
    lm = StaticLM(target.model, width, static_cache_length(len(prompt), 8, width))
    lm.prefill(prompt[:-1])
    tail = [prompt[-1]] * width
    flip = [0]

    def target_pass() -> None:
        lm.forward(tail)
        lm.crop(len(prompt) - 1)

    def draft_token() -> None:  # the last token alternates: each call re-feeds exactly one token
        flip[0] ^= 1
        drafter.propose(prompt + [flip[0]], 1, SamplingParams(), None)

    drafter.reset()
    out: dict[str, float] = {}
    with torch.inference_mode():
        for threads in (2, 1):
            with intra_op_threads(threads):
                out[f"target_pass_ms_{threads}t"] = 1e3 * _timed(target_pass, n)
                out[f"draft_token_ms_{threads}t"] = 1e3 * _timed(draft_token, 4 * n)
        done = threading.Event()
        drafted = [0, 0.0]

        def drafting() -> None:
            with intra_op_threads(1), torch.inference_mode():
                start = time.perf_counter()
                while not done.is_set():
                    draft_token()
                    drafted[0] += 1
                drafted[1] = time.perf_counter() - start

        other = threading.Thread(target=drafting)
        with intra_op_threads(1):
            other.start()
            out["target_pass_ms_concurrent"] = 1e3 * _timed(target_pass, n)
            done.set()
            other.join()
    out["draft_token_ms_concurrent"] = 1e3 * drafted[1] / drafted[0]
    return {k: round(v, 3) for k, v in out.items()}


def pearl_split(generator: PearlGenerator) -> dict[str, Any]:
    """PEARL's time split summed over its timed generations (the first one is the benchmark's warm-up)."""
    total = PearlTimings()
    for timings in generator.timings[1:]:
        for f in fields(PearlTimings):
            setattr(total, f.name, getattr(total, f.name) + getattr(timings, f.name))
    split = {k: round(v, 3) for k, v in asdict(total).items()}
    # Against the probe's times alone at one thread: how much the two threads slowed each other.
    split["target_pass_ms"] = round(1e3 * total.target_pass_s / max(total.passes, 1), 3)
    split["draft_token_ms"] = round(1e3 * total.draft_busy_s / max(total.drafted + total.discarded, 1), 3)
    return split


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dataset", default="humaneval", help="humaneval, sharegpt or a prompts JSONL")
    parser.add_argument("--n", type=int, default=20, help="prompts")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--draft-model", default="models/draft_lm")
    parser.add_argument("--target", default=DEFAULT_TARGET)
    parser.add_argument("--lookahead", type=int, nargs="*", default=[],
                        help="also run PEARL (pre-verify) holding at most this many drafts ahead")
    parser.add_argument("--probe-passes", type=int, default=20, help="target passes per overlap-probe timing")
    parser.add_argument("--out", default=None, help="default: benchmarks/results/pearl_{dataset}.json")
    args = parser.parse_args()
    width = DRAFTS + 1
    target = load_target(args.target, "bfloat16")
    model, vocab = load_draft(args.draft_model, torch.bfloat16)
    prompts = [encode_prompt(target.tokenizer, p) for p in bench_prompts(args.dataset, args.n)]
    probe = overlap_probe(target, DraftLMDrafter(model, target.vocab_size, vocab=vocab), prompts[0], width,
                          args.probe_passes)
    print(json.dumps(probe, indent=1))

    def drafter() -> DraftLMDrafter:
        return DraftLMDrafter(model, target.vocab_size, vocab=vocab)

    pearl = {f"pearl@{DRAFTS}": PearlGenerator(target, drafter(), "greedy", DRAFTS, static_width=width),
             f"pearl@{DRAFTS}[wait {DRAFTS}]": PearlGenerator(target, drafter(), "greedy", DRAFTS, DRAFTS,
                                                               static_width=width),
             **{f"pearl@{DRAFTS}[ahead {n}]": PearlGenerator(target, drafter(), "greedy", DRAFTS, 1, n, width)
                for n in args.lookahead}}
    extra: dict[str, SpeculativeGenerator] = {
        f"draft-lm@{DRAFTS}[1 thread]": OneThreadGenerator(target, drafter(), "greedy", DRAFTS, static_width=width),
        **pearl}
    cfg = BenchConfig(dataset=args.dataset, n=args.n, max_new_tokens=args.max_new_tokens, drafters=[f"draft-lm@{DRAFTS}"],
                      draft_model=args.draft_model, hf_assisted=False, hf_prompt_lookup_tokens=0, static_width=width)
    report = run_benchmark_ids(target, prompts, cfg, extra)
    report["overlap_probe"] = probe
    report["pearl_split"] = {name: pearl_split(generator) for name, generator in pearl.items()}
    methods = report["methods"]
    dtv = methods[f"draft-lm@{DRAFTS}"]["tokens_per_s"]
    report["pearl_vs_draft_then_verify"] = {name: round(methods[name]["tokens_per_s"] / dtv, 4) for name in pearl}
    out = Path(args.out or f"benchmarks/results/pearl_{args.dataset}.json")
    out.write_text(json.dumps(report, indent=1) + "\n")
    summary = {name: {k: m[k] for k in ("tokens_per_s", "speedup_vs_ar", "mean_accepted_length", "draft_s", "verify_s",
                                         "identical_to_plain")} for name, m in methods.items()}
    print(json.dumps({"methods": summary, "pearl_split": report["pearl_split"],
                      "pearl_vs_draft_then_verify": report["pearl_vs_draft_then_verify"]}, indent=1))


if __name__ == "__main__":
    main()
