"""OSD evaluation and gate: the challenger next to the champion, on recent traffic and on the original test split.

Both drafters run in one benchmark per slice (specops.eval.benchmark: interleaved prompt by prompt with
the target's own greedy decoding), so the gate compares numbers from the same prompts, machine and
moment:
- traffic: the window's held-out requests, never trained on. Is the challenger better where the
  traffic is now? That is the point of OSD.
- test: the original test split (evaluate.split). Has it forgotten what it was first trained for?
The challenger must pass the promotion gate (specops/eval/gate.py) on both slices. `promote` judges
the traffic slice and moves the alias; the test slice is judged first, with the same rules.
"""

from __future__ import annotations

from typing import Any

from specops.core.loop import SpeculativeGenerator
from specops.core.target import Target
from specops.eval.benchmark import BenchConfig, run_benchmark_ids
from specops.eval.evaluate import snapshot
from specops.eval.gate import GateConfig, decide

CHAMPION = "champion"
CHALLENGER = "challenger"


def evaluate_slices(target: Target, slices: dict[str, list[list[int]]], max_new_tokens: int,
                    champion: SpeculativeGenerator, challenger: SpeculativeGenerator) -> dict[str, Any]:
    """{slice: {prompts, champion, challenger, methods}} with each drafter's gate snapshot (specops.eval.evaluate.snapshot)."""
    report: dict[str, Any] = {}
    for name, prompts in slices.items():
        # No HF prompt-lookup or assisted baselines: the gate needs the target's own decoding and the two drafters.
        # Plain decoding runs on the challenger's runtime: the one whose losslessness the gate checks.
        bench = BenchConfig(dataset=f"osd:{name}", n=len(prompts), max_new_tokens=max_new_tokens, drafters=[],
                            hf_assisted=False, hf_prompt_lookup_tokens=0, static_width=challenger.static_width,
                            compiled=challenger.compiled, prefill_chunk=challenger.prefill_chunk)
        methods = run_benchmark_ids(target, prompts, bench, {CHAMPION: champion, CHALLENGER: challenger})["methods"]
        report[name] = {"prompts": len(prompts), CHAMPION: snapshot(methods, CHAMPION),
                        CHALLENGER: snapshot(methods, CHALLENGER), "methods": methods}
    return report


def forgetting_refusal(report: dict[str, Any], gate: GateConfig) -> str | None:
    """Why the challenger may not replace the champion on the original test split, or None when it may."""
    decision = decide(report["test"][CHALLENGER], report["test"][CHAMPION], gate)
    return None if decision.passed else f"on the original test split: {decision.reason}"
