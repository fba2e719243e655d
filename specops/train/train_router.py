"""Stage train_router: mine AutoJudge mismatches and Arbitrage step pairs, then fit both routers.

For each prompt of the split that the chosen scorer can score (in file order), the target writes its
greedy reply once; the AutoJudge miner (specops/train/mine_autojudge.py) and the Arbitrage miner
(specops/train/mine_arbitrage.py) then label what-if rollouts against it until their budgets are spent. Each
router is a logistic regression (specops/train/router_fit.py) fitted on the prompts outside a
deterministic holdout; the threshold sweep runs on the holdout and picks the default threshold.

Outputs: out_dir/{autojudge,arbitrage}/ (router folders: config.json + model.safetensors) and
mined_dir/{autojudge,arbitrage}.{safetensors,json} (features and labels, per-example details).
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from tqdm import tqdm

from specops.core.target import Target, encode_prompt
from specops.data.prompts import read_split
from specops.drafters.draft_lm import load_draft
from specops.lossy.arbitrage import DEFAULT_DELIMITER, DEFAULT_MAX_STEP_TOKENS, boundary_ids
from specops.lossy.greedy_lm import GreedyLM
from specops.lossy.router import RouterConfig
from specops.train.mine_arbitrage import StepOracle, mine_steps
from specops.train.mine_autojudge import mine_mismatches
from specops.train.router_fit import choose_threshold, fit_router, in_holdout, threshold_sweep
from specops.train.sandbox import DEFAULT_ISOLATION
from specops.train.scorers import (
    DEFAULT_SCORER,
    REQUIRED_FIELDS,
    ScoringContext,
    get_scorer,
    reply_scorer,
    scoreable,
)

log = logging.getLogger(__name__)


@dataclass
class TrainRouterConfig:
    """params.yaml section `train_router`."""

    split: str = "train"
    """Prepared split to mine (<prepare.out_dir>/<split>.jsonl); rows the scorer cannot score are skipped."""
    max_prompts: int = 16
    """Prompts to mine at most, in file order (mining stops earlier when both budgets are spent)."""
    scorer: str = DEFAULT_SCORER
    """Quality scorer defining the labels: humaneval, exact_match or target_likelihood (specops/train/scorers.py)."""
    margin: float = 0.05
    """Score differences up to this are no change: pass/fail scorers change by 1, target_likelihood by little."""
    max_new_tokens: int = 64
    """Reply budget of the target's reference reply and of every what-if completion."""
    autojudge_rollouts: int = 60
    """AutoJudge budget: mismatches labelled (one target completion each)."""
    arbitrage_rollouts: int = 60
    """Arbitrage budget: target completions (two per step where draft and target steps differ)."""
    max_rollouts_per_prompt: int = 12
    """Per-prompt cap on both budgets, so the examples come from several prompts."""
    step_delimiter: str = DEFAULT_DELIMITER
    """Arbitrage steps end after a token whose text contains this."""
    max_step_tokens: int = DEFAULT_MAX_STEP_TOKENS
    """Arbitrage steps end after this many tokens at most."""
    l2: float = 1.0
    """L2 penalty of the logistic regressions (the data are small and wide: keep it)."""
    holdout_fraction: float = 0.25
    """Share of prompts held out for the threshold sweep."""
    thresholds: list[float] = field(default_factory=lambda: [0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9])
    """Thresholds swept on the holdout."""
    max_harmful_accept: float = 0.1
    """The default threshold is the largest accepting at most this share of the holdout's harmful cases."""
    timeout_s: float = 5.0
    """humaneval scorer: wall-clock limit per program run."""
    sandbox_isolation: str = DEFAULT_ISOLATION
    """humaneval scorer: how generated programs are contained (specops/train/sandbox.py): 'namespaces' (needs
    root and user namespaces; refused with the reason where missing) or 'none' (limits and a private workdir
    only, so a program could fake its verdict)."""
    out_dir: str = "models/router"
    """Router folders, one per mode."""
    mined_dir: str = "data/router"
    """Mined examples, one safetensors + JSON pair per mode."""

    def __post_init__(self) -> None:
        get_scorer(self.scorer)
        if self.max_prompts < 1 or self.max_new_tokens < 1 or self.max_step_tokens < 1:
            raise ValueError("train_router.max_prompts, max_new_tokens and max_step_tokens must be >= 1.")
        if self.margin < 0 or not 0 <= self.holdout_fraction < 1:
            raise ValueError("train_router.margin must be >= 0 and holdout_fraction in [0, 1).")


def read_rows(path: Path, scorer: str, n: int) -> list[dict[str, Any]]:
    usable = [row for row in read_split(path) if scoreable(row, scorer)][:n]
    if not usable:
        raise ValueError(f"{path} has no rows the {scorer} scorer can score (it needs "
                         f"{', '.join(REQUIRED_FIELDS[scorer])}); pick another scorer or add prompts.")
    return usable


def save_mined(directory: Path, kind: str, features: torch.Tensor, labels: torch.Tensor,
               details: list[dict[str, Any]]) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    save_file({"features": features.float().contiguous(), "labels": labels.to(torch.uint8)},
              str(directory / f"{kind}.safetensors"))
    (directory / f"{kind}.json").write_text(json.dumps(details, indent=1) + "\n")


def fit_and_save(kind: str, features: torch.Tensor, labels: torch.Tensor, groups: list[str], cfg: TrainRouterConfig,
                 target: Target, extra: dict[str, Any]) -> dict[str, Any]:
    """Fit on the non-holdout prompts, sweep on the holdout (all examples if it lacks a class), save."""
    holdout = torch.tensor([in_holdout(g, cfg.holdout_fraction) for g in groups])
    fit_rows = ~holdout if bool((~holdout).any()) else torch.ones_like(holdout)
    config = RouterConfig(kind=kind, input_dim=features.shape[1], threshold=0.0, scorer=cfg.scorer,
                          target=target.fingerprint.to_dict(), extra=extra)
    router = fit_router(features[fit_rows], labels[fit_rows], config, cfg.l2)
    both_classes = bool(labels[holdout].any()) and not bool(labels[holdout].all())
    sweep_rows = holdout if both_classes else torch.ones_like(holdout)
    with torch.no_grad():
        sweep = threshold_sweep(router(features[sweep_rows]), labels[sweep_rows], cfg.thresholds)
    router.config.threshold = choose_threshold(sweep, cfg.max_harmful_accept)
    router.save(Path(cfg.out_dir) / kind)
    return {"examples": int(features.shape[0]), "harmful": int(labels.sum()), "holdout_examples": int(holdout.sum()),
            "sweep_on": "holdout" if both_classes else "all examples (the holdout lacks a class)",
            "threshold": router.config.threshold, "sweep": sweep}


def train_router(cfg: TrainRouterConfig, target: Target, prompts_file: Path, draft_dir: Path) -> dict[str, Any]:
    draft_model, vocab = load_draft(draft_dir, target.model.dtype)
    rows = read_rows(prompts_file, cfg.scorer, cfg.max_prompts)
    tokenizer, eos = target.tokenizer, target.eos_token_ids
    ctx = ScoringContext(target=target, timeout_s=cfg.timeout_s, isolation=cfg.sandbox_isolation)
    target_lm, draft_lm = GreedyLM(target.model), GreedyLM(draft_model, vocab)
    oracle = StepOracle(target_lm, boundary_ids(tokenizer, cfg.step_delimiter), eos, cfg.max_new_tokens,
                        cfg.max_step_tokens, cfg.margin)
    judge: dict[str, list] = {"features": [], "labels": [], "groups": [], "details": []}
    steps: dict[str, list] = {"features": [], "labels": [], "groups": [], "details": []}
    judge_left, steps_left = cfg.autojudge_rollouts, cfg.arbitrage_rollouts
    mined_prompts = 0
    bar = tqdm(rows, desc="train_router: mining", unit="prompt")
    for row in bar:
        if judge_left <= 0 and steps_left <= 0:
            break
        mined_prompts += 1
        prompt_ids = encode_prompt(tokenizer, row["messages"])
        reference = target_lm.greedy(prompt_ids, cfg.max_new_tokens, eos).tokens
        score = reply_scorer(cfg.scorer, row, prompt_ids, tokenizer, ctx)
        if judge_left > 0:
            found = mine_mismatches(prompt_ids, reference, target_lm, draft_model, score, eos, cfg.max_new_tokens,
                                    cfg.margin, min(judge_left, cfg.max_rollouts_per_prompt), vocab)
            judge_left -= len(found)
            for m in found:
                _add(judge, row["id"], m.features, m.important, {k: v for k, v in asdict(m).items() if k != "features"})
        if steps_left > 0:
            used = oracle.rollouts
            pairs = mine_steps(prompt_ids, reference, draft_lm, oracle, score,
                               min(steps_left, cfg.max_rollouts_per_prompt))
            steps_left -= oracle.rollouts - used
            for p in pairs:
                _add(steps, row["id"], p.features, p.target_better, {k: v for k, v in asdict(p).items() if k != "features"})
        bar.set_postfix(mismatches=len(judge["labels"]), important=sum(judge["labels"]), steps=len(steps["labels"]),
                        target_better=sum(steps["labels"]))
    report: dict[str, Any] = {"scorer": cfg.scorer, "prompts_mined": mined_prompts, "config": asdict(cfg)}
    step_settings = {"delimiter": cfg.step_delimiter, "max_step_tokens": cfg.max_step_tokens}
    for kind, mined, extra in (("autojudge", judge, {}), ("arbitrage", steps, step_settings)):
        if not mined["features"]:
            raise ValueError(f"train_router: no {kind} examples were mined; raise max_prompts or the budgets.")
        features = torch.stack(mined["features"])
        labels = torch.tensor(mined["labels"], dtype=torch.bool)
        save_mined(Path(cfg.mined_dir), kind, features, labels, mined["details"])
        report[kind] = fit_and_save(kind, features, labels, mined["groups"], cfg, target, extra)
        log.info("train_router: %s: %d examples, %d harmful, default threshold %.2f", kind,
                 report[kind]["examples"], report[kind]["harmful"], report[kind]["threshold"])
    return report


def _add(mined: dict[str, list], group: str, features: torch.Tensor, label: bool, details: dict[str, Any]) -> None:
    mined["features"].append(features)
    mined["labels"].append(label)
    mined["groups"].append(group)
    mined["details"].append({"prompt_id": group, **details})
