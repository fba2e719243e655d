"""How much could any choice of DEL's exit layer gain over the best fixed one? An oracle bound.

DEL (specops/drafters/del_exit.py) picks the exit layer and draft length each step from tracked
acceptance. It can only beat the best fixed layer where the layers' acceptance ranks differently from
one stretch of text to the next. This measures the most such a choice could gain with given heads and
costs, from the traces, without decoding:

- each exit head's top-1 agreement with the target's next token at every response position of the
  chosen trace sequences (the target's first layers in float32, as train_exit computes its features);
- the costs DEL weighs, measured on this machine (`measure_exit_costs`: a bf16 verification pass on
  the static runtime at `--width`, a drafted token from each exit layer);
- each position's modelled time, `1 / rate` with `rate` the expected committed tokens per second of
  DEL's own rule (`choose_exit`) at an acceptance rate: for each fixed layer at the agreement of the
  stretch of text it is in, and for an oracle that picks the best layer per request, per window of
  `--windows` tokens, knowing that stretch's true agreement (optimistic: short windows pick the luckiest
  head, which no tracker can).

The expected-tokens model assumes independent acceptances (specops.core.policies.expected_tokens); the
bound is on the layer choice, not on a decoding run. Writes JSON.

    .venv/bin/python benchmarks/del_oracle.py --exit-heads models/exit_heads --split train --sequences 96 338
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from specops.core.llama import llama_forward
from specops.core.policies import expected_tokens
from specops.core.target import DEFAULT_TARGET, load_target
from specops.data.traces import TraceShards
from specops.drafters.del_exit import DELDrafter, ExitCosts, ExitHeads, choose_exit, measure_exit_costs
from specops.train.train_exit import TRACE_FIELDS, response_features


def best_rate(alphas: list[float], token_costs: list[float], verify: float, max_k: int) -> float:
    """Expected committed tokens per second of the step DEL's rule picks from these candidates (k = 0, plain
    decoding, commits one token a verification)."""
    index, k = choose_exit(alphas, token_costs, verify, max_k)
    return expected_tokens(alphas[index], k) / (verify + k * token_costs[index])


def agreements(heads: ExitHeads, source: str, traces: Path, split: str, sequences: range) -> list[torch.Tensor]:
    """Per sequence, [E, n] bool: did each exit head predict the target's next token at each response position."""
    target = load_target(source, "float32")
    forward = llama_forward(target.model)[0]
    shards = TraceShards(traces / split, fields=TRACE_FIELDS)
    out = []
    for item, rows, features in response_features(forward, shards, heads.config.exit_layers, sequences):
        with torch.inference_mode():  # the features are inference tensors; the loaded heads require grad
            predicted = torch.stack([heads.predict(features[:, j], j) for j in range(len(heads.config.exit_layers))])
        out.append(predicted == item["topk_ids"][rows, 0])
    if not out:
        raise SystemExit(f"{traces / split} sequences {sequences.start}-{sequences.stop - 1} hold no response positions.")
    return out


def modelled_ms_per_token(stretches: list[torch.Tensor], costs: ExitCosts, max_k: int, candidates: list[int]) -> float:
    """Mean modelled time a token over `stretches` ([E, n] each), each at its own agreement, the step's layer
    chosen among `candidates` (exit-layer indices) knowing that agreement."""
    tokens = [costs.token[j] for j in candidates]
    seconds = sum(s.shape[1] / best_rate(s[candidates].float().mean(1).tolist(), tokens, costs.verify, max_k)
                  for s in stretches)
    return 1e3 * seconds / sum(s.shape[1] for s in stretches)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--exit-heads", default="models/exit_heads", help="train_exit's output folder")
    parser.add_argument("--traces", default="data/traces", help="collect's output folder")
    parser.add_argument("--split", default="val", help="trace split to read (train sequences the heads were not "
                                                      "trained on are held out too: train_exit uses the first max_sequences)")
    parser.add_argument("--sequences", type=int, nargs=2, default=[0, 1 << 30], metavar=("FIRST", "STOP"),
                        help="sequence indices [FIRST, STOP) of the split")
    parser.add_argument("--width", type=int, default=5, help="static runtime width the verification is timed at")
    parser.add_argument("--compile", action="store_true", help="time the compiled verification pass")
    parser.add_argument("--windows", type=int, nargs="+", default=[16, 32, 64], help="oracle window lengths, tokens")
    parser.add_argument("--target", default=DEFAULT_TARGET)
    parser.add_argument("--out", default="benchmarks/results/del_oracle.json")
    args = parser.parse_args()

    served = load_target(args.target, "bfloat16")
    heads = ExitHeads.load(args.exit_heads, served.model.dtype)
    drafter = DELDrafter(served.model, heads)
    costs = measure_exit_costs(drafter, served.model, args.width, args.compile)
    del served, drafter
    per_request = agreements(ExitHeads.load(args.exit_heads), args.target, Path(args.traces), args.split,
                             range(*args.sequences))
    layers = heads.config.exit_layers
    max_k = args.width - 1
    every = torch.cat(per_request, 1)
    fixed = {str(e): modelled_ms_per_token(per_request, costs, max_k, [j]) for j, e in enumerate(layers)}
    best_fixed = min(fixed.values())
    everyone = list(range(len(layers)))
    oracles = {"request": modelled_ms_per_token(per_request, costs, max_k, everyone)}
    for w in args.windows:
        windows = [s[:, c:c + w] for s in per_request for c in range(0, s.shape[1], w)]
        oracles[f"window_{w}"] = modelled_ms_per_token(windows, costs, max_k, everyone)
    result = {
        "exit_heads": args.exit_heads, "split": args.split, "sequences": len(per_request), "positions": every.shape[1],
        "costs_ms": {"verify": 1e3 * costs.verify, "token": dict(zip(map(str, layers), (1e3 * c for c in costs.token),
                                                                      strict=True))},
        "width": args.width, "compiled": args.compile,
        "agreement": dict(zip(map(str, layers), every.float().mean(1).tolist(), strict=True)),
        "fixed_ms_per_token": fixed,
        "oracle_ms_per_token": oracles,
        "oracle_gain_over_best_fixed": {name: best_fixed / ms for name, ms in oracles.items()},
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
