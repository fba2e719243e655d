"""Speculative logprobs against plain decoding's on a bundle's own runtime: tokens and logprobs (with the
top alternatives) must be bitwise equal, greedy and coupled sampling (the runs whose output is the target's
own draw whatever the draft).

    .venv/bin/python benchmarks/logprobs_check.py --bundle bundles/champion --out benchmarks/results/logprobs_check.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from specops.core.loop import SpeculativeGenerator
from specops.core.target import encode_prompt
from specops.core.types import SamplingParams
from specops.data.datasets import bench_prompts
from specops.server.generator import generator_from_bundle


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--bundle", default="bundles/champion")
    parser.add_argument("--dataset", default="sharegpt", help="humaneval, sharegpt or a JSONL file")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--top", type=int, default=3, help="alternatives per token")
    parser.add_argument("--out", default="benchmarks/results/logprobs_check.json")
    args = parser.parse_args()
    bundle = generator_from_bundle(args.bundle)
    target, config = bundle.target, bundle.config
    rows = []
    for verifier, sampling in (("greedy", SamplingParams()), ("coupled", SamplingParams(0.8, 0.95))):
        plain = SpeculativeGenerator(target, None, verifier, 0, static_width=config.static_width)
        spec = SpeculativeGenerator(target, bundle.drafter, verifier, config.draft_tokens, policy=bundle.policy,
                                    static_width=config.static_width)
        for i, messages in enumerate(bench_prompts(args.dataset, args.prompts)):
            ids = encode_prompt(target.tokenizer, messages)
            a = spec.generate(ids, args.max_tokens, sampling, seed=i, logprobs=args.top)
            b = plain.generate(ids, args.max_tokens, sampling, seed=i, logprobs=args.top)
            rows.append({"verifier": verifier, "prompt": i, "accepted": a.stats.accepted,
                         "tokens_equal": a.token_ids == b.token_ids, "logprobs_equal": a.logprobs == b.logprobs})
            print(rows[-1], flush=True)
    report = {"bundle": args.bundle, "dtype": str(target.model.dtype), "static_width": config.static_width,
              "rows": rows, "all_equal": all(r["tokens_equal"] and r["logprobs_equal"] for r in rows)}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(f"all equal: {report['all_equal']}; wrote {args.out}")


if __name__ == "__main__":
    main()
