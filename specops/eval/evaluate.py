"""Stage evaluate: benchmark every method side by side on the held-out test prompts.

The current champion (if the registry has one) runs in the same benchmark, so the promotion gate
compares challenger and champion on the same prompts, machine and moment, not on numbers from an
older run.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from specops.core.loop import SpeculativeGenerator
from specops.core.target import DTYPES, Target
from specops.core.types import DEFAULT_DRAFT_TOKENS, static_tree_refusal
from specops.data.prompts import read_split as read_split_rows
from specops.drafters.kinds import DRAFTERS, DecodingConfig, MethodSpec
from specops.eval.benchmark import BASELINE, BenchConfig, run_benchmark

log = logging.getLogger(__name__)
CHAMPION_METHOD = "champion"
# A method's headline numbers: what the gate judges (snapshot) and what DVC tracks per method (dvc_metrics).
HEADLINE = ("speedup_vs_ar", "speedup_median", "identical_to_plain", "identical_to_ar", "mean_accepted_length", "acceptance_rate",
            "tokens_per_s")


@dataclass
class EvaluateConfig:
    """params.yaml section `evaluate`."""

    split: str = "test"
    """Which prepared split to evaluate on (a file <prepare.out_dir>/<split>.jsonl)."""
    n_prompts: int = 12
    """How many prompts of the split to run (the first ones, in the split file's id order)."""
    max_new_tokens: int = 96
    """Tokens generated per prompt and method."""
    methods: list[str] = field(default_factory=lambda: ["prompt-lookup", "draft-lm@4"])
    """Our methods, drafter[@size]; sizes of one kind make a sweep (the bundle takes the best)."""
    draft_tokens: int = DEFAULT_DRAFT_TOKENS
    """Draft length of chain methods without an @SIZE, and the depth limit of tree methods (whose @SIZE
    is their node count); the bundle's default method keeps it."""
    bundle_drafters: list[str] = field(default_factory=lambda: ["draft-lm"])
    """Drafter kinds the bundle may ship; the fastest lossless method among them becomes its default."""
    hf_assisted: bool = True
    """Also run HF assisted generation with the trained draft LM, as the baseline to beat."""
    compare_champion: bool = True
    """Also run the registry's current champion bundle in the same benchmark."""
    dtype: str = "bfloat16"
    """The target's precision here and in the bundle's serving runtime (float32 or bfloat16). Lossless means
    bitwise our plain decoding in this dtype, through the same runtime."""
    static_width: int = DEFAULT_DRAFT_TOKENS + 1
    """The serving runtime measured here and written to the bundle: 0 is the dynamic KV cache (in bf16 its
    multi-row passes round differently, so nothing stays lossless there); N > 0 the static runtime, every
    pass N rows wide (chains of at most N - 1 tokens, trees that deep in bf16; DecodingConfig.static_width)."""
    compiled: bool = False
    """The static runtime's passes through torch.compile: a minute or two of compiling per process and
    pass width, then about 2x faster passes (DecodingConfig.compiled)."""
    out: str = "metrics/eval.json"
    """DVC metrics: numbers only (dvc_metrics), so `dvc metrics show` and `dvc exp show` stay readable."""
    report: str = "metrics/eval_report.json"
    """The whole evaluation: the numbers, and the method names, benchmark settings, target, dtype and
    machine they were measured with. register and promote read it."""
    plots_dir: str = "metrics/plots"
    """Plots of acceptance per draft position and speedup per method: PNGs, and the data DVC draws itself
    (specops/eval/plots.py: evaluation_plots), so `dvc plots diff` overlays experiments."""

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"evaluate.dtype '{self.dtype}' is unknown. Choose one of: {', '.join(DTYPES)}.")
        runtime = DecodingConfig(drafter="none", static_width=self.static_width, compiled=self.compiled)  # checks the pair
        for name in self.methods:  # fail before any model loads, naming the method
            try:
                config = MethodSpec.parse(name).decoding(replace(runtime, draft_tokens=self.draft_tokens))
            except ValueError as error:
                raise ValueError(f"evaluate.methods: {name}: {error}") from error
            tree = self.static_width and DRAFTERS[config.drafter].tree
            if tree and (reason := static_tree_refusal(self.compiled, self.dtype)):
                raise ValueError(f"evaluate.methods: {name} drafts trees: {reason}; use dtype bfloat16, "
                                 "or static_width 0 for float32 trees.")
            if self.static_width and config.draft_tokens >= self.static_width:
                raise ValueError(f"evaluate.methods: {name} drafts {config.draft_tokens} tokens, but passes of "
                                 f"static_width {self.static_width} verify at most {self.static_width - 1}.")


def read_split(path: Path, n: int) -> list[list[dict[str, str]]]:
    rows = read_split_rows(path)
    if not rows:
        raise ValueError(f"{path} holds no prompts; lower prepare's filters or add prompts.")
    return [row["messages"] for row in rows[:n]]


def method_kind(name: str) -> str | None:
    """'draft-lm+specdecpp@8' -> 'draft-lm'; None for a baseline such as hf_ar."""
    try:
        return MethodSpec.parse(name).kind
    except ValueError:
        return None


def default_method(methods: dict[str, dict[str, Any]], kinds: list[str]) -> str:
    """The fastest lossless method (bitwise our plain decoding through the same runtime) of the bundle's
    drafter kinds; the fastest of them if none is lossless. Fastest by the median per-prompt speedup,
    which a burst of load on a few prompts does not move (specops.eval.benchmark)."""
    candidates = [name for name in methods if method_kind(name) in kinds]
    if not candidates:
        raise ValueError(f"evaluate.methods has no method of {kinds}, so the bundle's default cannot be chosen.")
    lossless = [name for name in candidates if methods[name]["identical_to_plain"]] or candidates
    return max(lossless, key=lambda name: methods[name]["speedup_median"])


def snapshot(methods: dict[str, dict[str, Any]], name: str) -> dict[str, Any]:
    """The gate's view of one method: its name and headline numbers."""
    row = methods[name]
    return {"method": name, **{key: row[key] for key in HEADLINE}}


def dvc_metrics(report: dict[str, Any]) -> dict[str, Any]:
    """The report's numbers for DVC: each method's headline numbers, and the default's and the champion's.
    Method names, settings and the machine stay in the report: DVC would make a column of each string."""
    def numbers(row: dict[str, Any]) -> dict[str, Any]:
        return {key: row[key] for key in HEADLINE if row.get(key) is not None}  # None: HF rows have no drafts

    metrics = {"prompts": report["prompts"], "methods": {name: numbers(row) for name, row in report["methods"].items()}}
    return metrics | {side: numbers(report[side]) for side in ("default", "champion") if side in report}


@dataclass
class TrainedModels:
    """Folders of the trained drafters the methods may use (None: not trained in this pipeline)."""

    draft_model: Path | None = None
    aligned_head: Path | None = None
    acceptance_head: Path | None = None
    exit_heads: Path | None = None
    specialists: Path | None = None

    def available(self) -> dict[str, str | None]:
        return {name: str(path) if path is not None and path.exists() else None
                for name, path in vars(self).items()}


def evaluate(cfg: EvaluateConfig, target: Target, prompts_file: Path, models: TrainedModels,
             champion: SpeculativeGenerator | None) -> dict[str, Any]:
    prompts = read_split(prompts_file, cfg.n_prompts)
    bench = BenchConfig(dataset=str(prompts_file), n=len(prompts), max_new_tokens=cfg.max_new_tokens,
                        drafters=cfg.methods, draft_tokens=cfg.draft_tokens, hf_assisted=cfg.hf_assisted,
                        static_width=cfg.static_width, compiled=cfg.compiled, **models.available())
    report = run_benchmark(target, prompts, bench, {CHAMPION_METHOD: champion} if champion else None)
    methods = report["methods"]
    chosen = default_method(methods, cfg.bundle_drafters)
    report["default"] = snapshot(methods, chosen)
    if champion is not None:
        report["champion"] = snapshot(methods, CHAMPION_METHOD)
    report["baseline"] = BASELINE
    log.info("evaluate: default method %s: %.3fx vs AR (median per prompt %.3fx), %.2f tokens/step, lossless=%s",
             chosen, methods[chosen]["speedup_vs_ar"], methods[chosen]["speedup_median"], methods[chosen]["mean_accepted_length"] or 0,
             methods[chosen]["identical_to_plain"])
    return report
