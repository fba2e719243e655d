"""CoSine on a mixed code + chat test set: the routed (and fused) specialists against each single drafter.

The draft LMs are of the same size and draft vocabulary: the general one (train_draft), each
specialist alone (train_specialists: the general one distilled further on its own slice of the traces),
optionally a control (e.g. the general one distilled further on every slice, as many steps as the
specialists took together), and the ensemble: `cosine` routes each step's chain to one specialist (both
runtimes), `cosine-tree` fuses the specialists' dynamic trees (the fp32 dynamic runtime), against
`draft-lm-tree` of the same node budget for each single drafter; and a model-free specialist, Suffix
Decoding, alone and in front of the routed draft LMs (`cosine-suffix`, which takes the suffix tries' draft
on the steps they are confident of), beside the general draft LM behind the same front. The methods run
through `specops bench`'s interleaved loop on the prepared test split, which holds both sources; the
report adds, per method and per source, tokens per step (the bonus token included) and accepted draft
tokens per step.

    .venv/bin/python benchmarks/cosine_mixed.py --prompts data/prompts/test.jsonl --draft-model models/draft_lm \
        --specialists models/specialists --max-new-tokens 128 --out benchmarks/results/cosine_mixed.json

Accepted tokens per step do not depend on the machine's load (greedy decoding); tokens/s do.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch
from suffix_stream import pass_summary  # benchmarks/ is the script's folder

from specops.core.loop import SpeculativeGenerator
from specops.core.target import encode_prompt, load_target
from specops.data.prompts import read_split
from specops.drafters.cosine import specialist_names
from specops.drafters.factory import build_drafter
from specops.drafters.kinds import DecodingConfig
from specops.eval.benchmark import BenchConfig, run_benchmark_ids


def generators(target, args: argparse.Namespace) -> dict[str, SpeculativeGenerator]:
    """Each single draft LM as a chain (and a tree on the dynamic runtime), and the cosine drafters."""
    singles = {"general": args.draft_model, **{name: str(Path(args.specialists) / name)
                                                  for name in specialist_names(args.specialists)}}
    if args.control:
        singles["control"] = args.control
    kinds = [("draft-lm", "cosine", args.draft_tokens)]
    if not args.static_width:
        kinds.append(("draft-lm-tree", "cosine-tree", args.tree_nodes))
    out = {}
    for single, ensemble, size in kinds:
        config = DecodingConfig(drafter=single, verifier="greedy", draft_tokens=args.draft_tokens,
                                tree_nodes=args.tree_nodes, static_width=args.static_width, compiled=args.compile)
        for name, folder in singles.items():
            out[f"{single}[{name}]@{size}"] = run(target, build_drafter(single, target, config, folder), config)
        config.drafter = ensemble
        out[f"{ensemble}@{size}"] = run(target, build_drafter(ensemble, target, config, args.specialists), config)
    # A model-free specialist (Suffix Decoding) alone, and in front of the routed draft LMs (cosine-suffix);
    # the general draft LM behind the same front (draft-lm-suffix) shows what the routing among draft LMs adds.
    k = args.draft_tokens
    for kind, weights, name in (("suffix", None, f"suffix@{k}"), ("cosine-suffix", args.specialists, f"cosine-suffix@{k}"),
                                ("draft-lm-suffix", args.draft_model, f"draft-lm-suffix[general]@{k}")):
        config = DecodingConfig(drafter=kind, verifier="greedy", draft_tokens=k, static_width=args.static_width,
                                compiled=args.compile)
        out[name] = run(target, build_drafter(kind, target, config, weights), config)
    return out


def run(target, drafter, config: DecodingConfig) -> SpeculativeGenerator:
    return SpeculativeGenerator(target, drafter, "greedy", config.draft_tokens, static_width=config.static_width,
                                compiled=config.compiled)


def per_source(report: dict[str, Any], sources: list[str]) -> dict[str, dict[str, Any]]:
    """pass_summary per prompt source, plus tokens per step (bonus included) from the same rows."""
    out = {}
    for source in sorted(set(sources)):
        rows = [row for row, s in zip(report["per_prompt"], sources, strict=True) if s == source]
        methods = [name for name in report["methods"] if "steps" in rows[0][name]]
        summary = pass_summary(rows, methods)
        for name in methods:
            steps = sum(r[name]["steps"] for r in rows)
            summary[name]["tokens_per_step"] = round(sum(r[name]["tokens"] for r in rows) / steps, 3)
        out[source] = summary
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prompts", default="data/prompts/test.jsonl", help="a prepared split (rows with source)")
    parser.add_argument("--draft-model", required=True, help="the general draft LM (train_draft's out_dir)")
    parser.add_argument("--specialists", required=True, help="train_specialists' out_dir")
    parser.add_argument("--control", help="another draft LM folder to run alone, e.g. the general one trained on")
    parser.add_argument("--n", type=int, default=0, help="prompts (0: the whole split)")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--draft-tokens", type=int, default=4, help="chain length; the trees' depth")
    parser.add_argument("--tree-nodes", type=int, default=8)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--static-width", type=int, default=0, help="the static runtime (chains only): width")
    parser.add_argument("--compile", action="store_true")
    parser.add_argument("--out", default="benchmarks/results/cosine_mixed.json")
    args = parser.parse_args()
    rows = read_split(args.prompts)[: args.n or None]
    target = load_target("smollm2", args.dtype)
    cfg = BenchConfig(dataset=args.prompts, n=len(rows), max_new_tokens=args.max_new_tokens, drafters=[],
                      draft_tokens=args.draft_tokens, hf_assisted=False, hf_prompt_lookup_tokens=0,
                      static_width=args.static_width, compiled=args.compile)
    ids = [encode_prompt(target.tokenizer, row["messages"]) for row in rows]
    kept = [row["source"] for row, prompt in zip(rows, ids, strict=True) if len(prompt) <= cfg.max_prompt_tokens]
    report = run_benchmark_ids(target, ids, cfg, extra=generators(target, args))
    report["per_source"] = per_source(report, kept)
    report["all"] = per_source(report, ["all"] * len(kept))["all"]
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    print(f"{'method':<28} {'all tok/step':>12} {'acc/step':>9}  " + "  ".join(f"{s:>18}" for s in report["per_source"]))
    for name, row in report["all"].items():
        by = "  ".join(f"{report['per_source'][s][name]['tokens_per_step']:>8} /{report['per_source'][s][name]['accepted_per_step']:>8}"
                       for s in report["per_source"])
        print(f"{name:<28} {row['tokens_per_step']:>12} {row['accepted_per_step']:>9}  {by}  "
              f"{'=plain' if row['identical_to_plain'] else 'DIFFERS'}")


if __name__ == "__main__":
    torch.set_num_threads(2)
    main()
