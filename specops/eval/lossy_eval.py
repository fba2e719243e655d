"""Stage lossy_eval: the speed-quality trade-off of the lossy modes, against lossless decoding in the same run.

Methods, run interleaved prompt by prompt (so a change in machine load hits all alike), each after one
untimed warm-up:
    ar                 HF generate, greedy: the speed baseline and the reference reply
    lossless           our speculative loop with the draft LM, greedy verification: the quality baseline
    autojudge@t        the same draft LM, AutoJudge verification at threshold t
    arbitrage@t        the Arbitrage step router at threshold t
    arbitrage_oracle   (optional) the scorer-based oracle router: the upper bound; its own rollouts are
                       excluded from its time, so its speed is what a perfect free router would give
Quality is the mean score of the chosen scorer over the prompts (replies scored after all timing);
quality_drop = quality(lossless) - quality(point), so a lossy point that does better has a negative drop.

metrics/lossy.json holds, per mode, a list of points
    {threshold, speedup_vs_ar, speedup_vs_lossless, quality, quality_drop, scorer, identical_to_ar,
     identical_to_plain, mean_accepted_length, lossy_accepted}
and each point plus its method name is a promotion-gate snapshot (specops/eval/gate.py): `gate_snapshot`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from specops.core.loop import SpeculativeGenerator
from specops.core.target import Target, encode_prompt
from specops.core.types import GenerationStats
from specops.drafters.draft_lm import DraftLMDrafter, load_draft
from specops.eval.benchmark import environment, merge_stats
from specops.lossy.arbitrage import ArbitrageGenerator
from specops.lossy.greedy_lm import GreedyLM
from specops.lossy.modes import LossyModels
from specops.train.mine_arbitrage import OracleDecision, StepOracle
from specops.train.sandbox import DEFAULT_ISOLATION
from specops.train.scorers import DEFAULT_SCORER, ScoringContext, get_scorer, reply_scorer
from specops.train.train_router import read_rows

log = logging.getLogger(__name__)
MODES = ("autojudge", "arbitrage")
ORACLE = "arbitrage_oracle"
AR, LOSSLESS = "ar", "lossless"
Run = Callable[[list[int]], tuple[list[int], GenerationStats | None]]


@dataclass
class LossyEvalConfig:
    """params.yaml section `lossy_eval`."""

    split: str = "test"
    """Prepared split to evaluate on; rows the scorer cannot score are skipped."""
    n_prompts: int = 6
    """Prompts to run (the first scoreable ones, in file order)."""
    max_new_tokens: int = 64
    """Tokens generated per prompt and method."""
    draft_tokens: int = 4
    """Draft tokens per step for lossless speculative decoding and AutoJudge (the same draft LM)."""
    scorer: str = DEFAULT_SCORER
    """Quality scorer: humaneval, exact_match or target_likelihood (specops/train/scorers.py)."""
    autojudge_thresholds: list[float] = field(default_factory=lambda: [0.1, 0.3, 0.5, 0.7, 0.9])
    """AutoJudge accepts a mismatch when its P(important) is below the threshold (0 is lossless)."""
    arbitrage_thresholds: list[float] = field(default_factory=lambda: [0.1, 0.3, 0.5, 0.7, 0.9])
    """Arbitrage keeps a draft step when its P(target better) is below the threshold (0 is lossless)."""
    oracle: bool = False
    """Also run the Arbitrage oracle: two target rollouts per differing step, so slow."""
    timeout_s: float = 5.0
    """humaneval scorer: wall-clock limit per program run."""
    sandbox_isolation: str = DEFAULT_ISOLATION
    """humaneval scorer: how generated programs are contained (specops/train/sandbox.py): 'namespaces' (needs
    root and user namespaces; refused with the reason where missing) or 'none' (limits and a private workdir
    only, so a program could fake its verdict)."""
    out: str = "metrics/lossy.json"
    """The metrics file."""
    plot: str = "metrics/plots/lossy_speed_quality.png"
    """The speed-quality plot."""

    def __post_init__(self) -> None:
        get_scorer(self.scorer)
        if self.n_prompts < 1 or self.max_new_tokens < 1 or self.draft_tokens < 1:
            raise ValueError("lossy_eval.n_prompts, max_new_tokens and draft_tokens must be >= 1.")


def _ar(target: Target, max_new_tokens: int) -> Run:
    def run(ids: list[int]) -> tuple[list[int], GenerationStats | None]:
        inputs = torch.tensor([ids])
        out = target.model.generate(inputs, attention_mask=torch.ones_like(inputs), max_new_tokens=max_new_tokens,
                                    do_sample=False)
        return out[0, len(ids):].tolist(), None
    return run


def _ours(generator: SpeculativeGenerator, max_new_tokens: int) -> Run:
    def run(ids: list[int]) -> tuple[list[int], GenerationStats | None]:
        result = generator.generate(ids, max_new_tokens)
        return result.token_ids, result.stats
    return run


def build_methods(cfg: LossyEvalConfig, target: Target, draft_model: Any, lossy: LossyModels,
                  oracle: OracleDecision | None) -> dict[str, Run]:
    """AR first: its reply is every other method's reference."""
    m = cfg.max_new_tokens
    methods = {AR: _ar(target, m),
               LOSSLESS: _ours(SpeculativeGenerator(target, DraftLMDrafter(draft_model, target.vocab_size,
                                                                           vocab=lossy.draft_vocab),
                                                    "greedy", cfg.draft_tokens), m)}
    for t in cfg.autojudge_thresholds:
        methods[f"autojudge@{t:g}"] = _ours(lossy.generator("autojudge", t, cfg.draft_tokens), m)
    for t in cfg.arbitrage_thresholds:
        methods[f"arbitrage@{t:g}"] = _ours(lossy.generator("arbitrage", t), m)
    if oracle is not None:
        steps = lossy.router("arbitrage").config.extra
        generator = ArbitrageGenerator(target, draft_model, oracle, lossy.boundaries(steps["delimiter"]),
                                       steps["max_step_tokens"], lossy.draft_vocab)
        methods[ORACLE] = _ours(generator, m)
    return methods


def _oracle(cfg: LossyEvalConfig, target: Target, lossy: LossyModels, margin: float) -> OracleDecision:
    steps = lossy.router("arbitrage").config.extra
    judge = StepOracle(GreedyLM(target.model), lossy.boundaries(steps["delimiter"]), target.eos_token_ids,
                       cfg.max_new_tokens, steps["max_step_tokens"], margin)
    return OracleDecision(judge)


def lossy_eval(cfg: LossyEvalConfig, target: Target, prompts_file: Path, draft_dir: Path, router_dir: Path,
               oracle_margin: float = 0.05) -> dict[str, Any]:
    """Run every method on the prompts, score the replies, return the report (see the module docstring)."""
    rows = read_rows(prompts_file, cfg.scorer, cfg.n_prompts)
    draft_model, vocab = load_draft(draft_dir, target.model.dtype)
    lossy = LossyModels(target, draft_model, router_dir, vocab)
    oracle = _oracle(cfg, target, lossy, oracle_margin) if cfg.oracle else None
    methods = build_methods(cfg, target, draft_model, lossy, oracle)
    prompts = [encode_prompt(target.tokenizer, row["messages"]) for row in rows]
    ctx = ScoringContext(target=target, timeout_s=cfg.timeout_s, isolation=cfg.sandbox_isolation)
    scorers = [reply_scorer(cfg.scorer, row, ids, target.tokenizer, ctx) for row, ids in zip(rows, prompts, strict=True)]
    with torch.inference_mode():
        for name, run in methods.items():
            if name != ORACLE:  # the oracle needs a reference reply; its warm-up is the others'
                run(prompts[0][:32])
    replies: dict[str, list[list[int]]] = {name: [] for name in methods}
    seconds = dict.fromkeys(methods, 0.0)
    stats = {name: GenerationStats() for name in methods}
    for ids, score in tqdm(list(zip(prompts, scorers, strict=True)), desc="lossy_eval prompts", unit="prompt"):
        for name, run in methods.items():
            if oracle is not None and name == ORACLE:
                oracle.start(ids, score, replies[AR][-1])
            spent_by_oracle = oracle.seconds if oracle is not None else 0.0
            start = time.perf_counter()
            with torch.inference_mode():
                tokens, run_stats = run(ids)
            elapsed = time.perf_counter() - start
            if oracle is not None and name == ORACLE:
                elapsed -= oracle.seconds - spent_by_oracle
            seconds[name] += elapsed
            replies[name].append(tokens)
            if run_stats is not None:
                merge_stats(stats[name], run_stats)
                stats[name].lossy_accepted += run_stats.lossy_accepted
    return _report(cfg, target, replies, seconds, stats, scorers, lossy, oracle)


def _report(cfg: LossyEvalConfig, target: Target, replies: dict[str, list[list[int]]], seconds: dict[str, float],
            stats: dict[str, GenerationStats], scorers: list[Callable[[list[int], list[int]], float]],
            lossy: LossyModels, oracle: OracleDecision | None) -> dict[str, Any]:
    reference = replies[AR]
    tps = {name: sum(map(len, replies[name])) / seconds[name] for name in replies}
    quality = {name: sum(score(reply, ref) for score, reply, ref in zip(scorers, replies[name], reference, strict=True))
               / len(reference) for name in replies}

    def point(name: str, threshold: float) -> dict[str, Any]:
        s = stats[name]
        # Also the gate's lossless flag (identical_to_plain): HF greedy is our plain decoding's output on this
        # runtime (the target's dtype, dynamic cache, prompts within one prefill chunk), as
        # tests/core/test_greedy_equality.py checks.
        same = replies[name] == reference
        return {"threshold": threshold, "speedup_vs_ar": round(tps[name] / tps[AR], 4),
                "speedup_vs_lossless": round(tps[name] / tps[LOSSLESS], 4), "quality": round(quality[name], 4),
                "quality_drop": round(quality[LOSSLESS] - quality[name], 4), "scorer": cfg.scorer,
                "identical_to_ar": same, "identical_to_plain": same,
                "mean_accepted_length": round(s.mean_accepted_length, 4) if s.steps else None,
                "lossy_accepted": s.lossy_accepted}

    report: dict[str, Any] = {
        "scorer": cfg.scorer, "prompts": len(reference), "max_new_tokens": cfg.max_new_tokens,
        "ar": {"tokens_per_s": round(tps[AR], 3), "quality": round(quality[AR], 4)},
        "lossless": {**point(LOSSLESS, 0.0), "tokens_per_s": round(tps[LOSSLESS], 3)},
        "trained_thresholds": {mode: lossy.router(mode).config.threshold for mode in MODES},
    }
    for mode, thresholds in (("autojudge", cfg.autojudge_thresholds), ("arbitrage", cfg.arbitrage_thresholds)):
        report[mode] = [point(f"{mode}@{t:g}", t) for t in thresholds]
    if oracle is not None:
        report[ORACLE] = [{**point(ORACLE, oracle.threshold),
                           "note": "threshold is the oracle's margin; its rollouts are not timed"}]
    report.update(config=asdict(cfg), target=target.fingerprint.to_dict(), environment=environment(),
                  created_at=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
    if not report["lossless"]["identical_to_ar"]:
        log.warning("lossy_eval: lossless speculative decoding differs from AR on some prompt: the quality "
                    "baseline is not the target's own output.")
    return report


def gate_snapshot(report: dict[str, Any], mode: str, threshold: float) -> dict[str, Any]:
    """The promotion gate's view (specops/eval/gate.py) of one lossy point: its method name and numbers."""
    for p in report[mode]:
        if p["threshold"] == threshold:
            return {"method": f"{mode}@{threshold:g}", **p}
    raise KeyError(f"lossy_eval measured no {mode} point at threshold {threshold}.")
