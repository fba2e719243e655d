"""The speedup ceiling of speculative decoding on this machine: our loop with an oracle drafter.

The oracle knows the answer: it proposes the target's own greedy continuation, taken from one plain
decoding pass before the timed run, and keeps each proposed token with probability `acceptance`,
replacing it otherwise by a token the target rejects. A step then accepts a geometric run of tokens,
as a drafter with that per-token acceptance would. Drafting costs nothing, so each speedup is an
upper bound for every real drafter with that acceptance and draft length: what remains of a step is
the target's verification pass and the loop around it. A tree of n nodes verifies n + 1 tokens and
accepts at most its depth plus one, so the chain at k = n bounds it too.

Every method runs interleaved with plain decoding on the same prompts in one process
(specops.eval.benchmark), and must stay token-identical to it. Writes the grid as JSON and a plot of
speedup against draft length, one line per acceptance, with a reference line (`--bar`).

    .venv/bin/python benchmarks/ceiling.py --n 6 --max-new-tokens 64 --out benchmarks/results/ceiling.json
"""

from __future__ import annotations

import argparse
import json
import logging
import random
from pathlib import Path
from typing import Any

import torch

from specops.core.drafter import EMPTY, Draft, DrafterBase, TokenStop, refuse_stop
from specops.core.loop import SpeculativeGenerator
from specops.core.target import DEFAULT_TARGET, DTYPES, Target, encode_prompt, load_target
from specops.core.types import SamplingParams
from specops.data.datasets import bench_prompts
from specops.eval.benchmark import BenchConfig, run_benchmark_ids

log = logging.getLogger("specops.ceiling")


class OracleDrafter(DrafterBase):
    """Proposes the known continuation of whichever reference sequence the context is a prefix of."""

    name = "oracle"

    def __init__(self, references: list[list[int]], acceptance: float, vocab_size: int, seed: int = 0) -> None:
        if not 0.0 <= acceptance <= 1.0:
            raise ValueError(f"acceptance must be in [0, 1], got {acceptance}")
        self.references = references
        self.acceptance = acceptance
        self.vocab_size = vocab_size
        self.rng = random.Random(seed)

    def propose(self, context: list[int], k: int, sampling: SamplingParams,
                generator: torch.Generator | None, stop: TokenStop | None = None) -> Draft:
        refuse_stop(self, stop)
        n = len(context)
        for reference in self.references:
            if len(reference) > n and reference[:n] == context:
                # A kept token is the target's greedy choice; a replaced one is off by one id, never it.
                return Draft(tokens=[t if self.rng.random() < self.acceptance else (t + 1) % self.vocab_size
                                     for t in reference[n:n + k]])
        return EMPTY


def greedy_references(target: Target, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """Each prompt followed by the target's greedy continuation (HF generate, what the benchmark compares to)."""
    references = []
    with torch.inference_mode():
        for ids in prompts:
            inputs = torch.tensor([ids])
            out = target.model.generate(inputs, attention_mask=torch.ones_like(inputs),
                                        max_new_tokens=max_new_tokens, do_sample=False)
            references.append(out[0].tolist())
    return references


def method_name(acceptance: float, k: int) -> str:
    return f"oracle{acceptance:g}@{k}"


def ceiling_grid(report: dict[str, Any], acceptances: list[float], draft_tokens: list[int]) -> list[dict[str, Any]]:
    """One row per (acceptance, k): the measured speedup, accepted tokens per step, and identity to AR."""
    rows = []
    for acceptance in acceptances:
        for k in draft_tokens:
            result = report["methods"][method_name(acceptance, k)]
            rows.append({"acceptance": acceptance, "draft_tokens": k, "speedup_vs_ar": result["speedup_vs_ar"],
                         "mean_accepted_length": result["mean_accepted_length"],
                         "verify_s": result["verify_s"], "seconds": result["seconds"],
                         "identical_to_ar": result["identical_to_ar"]})
    return rows


def plot_ceiling(grid: list[dict[str, Any]], bar: float | None, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for acceptance in sorted({row["acceptance"] for row in grid}, reverse=True):
        rows = [row for row in grid if row["acceptance"] == acceptance]
        ax.plot([r["draft_tokens"] for r in rows], [r["speedup_vs_ar"] for r in rows], marker="o",
                label=f"per-token acceptance {acceptance:g}")
    ax.axhline(1.0, color="grey", linewidth=0.8)
    if bar is not None:
        ax.axhline(bar, color="red", linestyle="--", linewidth=0.8, label=f"{bar:g}x")
    ax.set_xlabel("draft tokens per step (k)")
    ax.set_ylabel("speedup vs plain greedy decoding")
    ax.set_title("Oracle drafter (free drafting): the ceiling on this machine")
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dataset", default="data/prompts/test.jsonl", help="humaneval, sharegpt or a prompts JSONL (as specops bench)")
    parser.add_argument("--target", default=DEFAULT_TARGET, help="'smollm2', a .gguf file or a local HF model folder")
    parser.add_argument("--dtype", default="float32", choices=sorted(DTYPES), help="target precision")
    parser.add_argument("--n", type=int, default=6, help="prompts")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--acceptance", type=float, nargs="+", default=[1.0, 0.8, 0.6, 0.4],
                        help="per-token acceptance rates of the oracle")
    parser.add_argument("--draft-tokens", type=int, nargs="+", default=[1, 2, 4, 6, 8], help="draft lengths k")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--bar", type=float, default=1.8, help="speedup to draw as a reference line")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="benchmarks/results/ceiling.json")
    parser.add_argument("--plot", default=None, help="PNG path (default: --out with .png)")
    args = parser.parse_args()
    if not all(0.0 <= a <= 1.0 for a in args.acceptance):
        parser.error(f"--acceptance values must be in [0, 1], got {args.acceptance}")
    if min(args.draft_tokens) < 1:
        parser.error(f"--draft-tokens values must be >= 1, got {args.draft_tokens}")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.threads:
        torch.set_num_threads(args.threads)
    target = load_target(args.target, args.dtype)
    prompts = [encode_prompt(target.tokenizer, messages) for messages in bench_prompts(args.dataset, args.n)]
    log.info("greedy references for %d prompts, %d tokens each", len(prompts), args.max_new_tokens)
    references = greedy_references(target, prompts, args.max_new_tokens)
    generators = {
        method_name(a, k): SpeculativeGenerator(target, OracleDrafter(references, a, target.vocab_size, args.seed),
                                                "greedy", k)
        for a in args.acceptance for k in args.draft_tokens
    }
    cfg = BenchConfig(dataset=args.dataset, n=args.n, max_new_tokens=args.max_new_tokens, drafters=[],
                      hf_assisted=False, hf_prompt_lookup_tokens=0)
    report = run_benchmark_ids(target, prompts, cfg, extra=generators)
    report["ceiling"] = ceiling_grid(report, args.acceptance, args.draft_tokens)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    plot_ceiling(report["ceiling"], args.bar, Path(args.plot) if args.plot else out.with_suffix(".png"))
    for row in report["ceiling"]:
        log.info("acceptance %.2f k=%d: %.3fx (%.2f accepted/step)%s", row["acceptance"], row["draft_tokens"],
                 row["speedup_vs_ar"], row["mean_accepted_length"], "" if row["identical_to_ar"] else " NOT IDENTICAL")


if __name__ == "__main__":
    main()
