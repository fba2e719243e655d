"""`specops retrain`: one round of online retraining (OSD, arXiv 2310.07177) over the feedback the
server logged since the previous round. A scheduler runs it (docs/osd.md: cron, Kubernetes CronJob).

    specops retrain              export the new feedback, run the steps, advance the watermark
    specops retrain --dry-run    report what a round would do; writes nothing
    specops retrain --step NAME  one step on the window already exported (what osd/dvc.yaml runs)

A round holds an exclusive lock (specops/pipeline/run_lock.py): a second scheduler exits at once with
EXIT_LOCKED. Then:
1. Read the watermark (specops/pipeline/watermark.py) and the champion version; OSD retrains the
   champion's draft LM, so a champion of another drafter kind is an error.
2. Fewer than osd.min_rows new rows: nothing to do, the rows wait. Otherwise export the rows above
   the watermark, oldest first, at most osd.max_rows, into osd.window_dir: window.parquet, and
   window.json with the id range, its checksum and the parent (champion) version.
3. Run the steps of specops/pipeline/osd_steps.py in this process (traces, train, evaluate, register,
   promote). A running server polling `models:/NAME@champion` hot-reloads a promoted challenger.
4. Advance the watermark to the window's last id, only now that the gate has decided. A round that
   fails anywhere before leaves it, and the next round retrains on the same rows plus the newer
   ones. A round killed between the gate and the watermark write is recovered from the registry:
   the challenger's version tags carry its window (`recover`).

Why the steps run in-process instead of through `dvc repro osd/dvc.yaml`: the target loads once
instead of once per step (about 12 s each for SmolLM2 on a CPU); a CronJob image needs the package
and params.yaml, not a git and DVC checkout; DVC's repository lock would make a scheduled round fail
whenever someone runs the main pipeline; and the round owns the lock and watermark around the
steps. The round still records its inputs: the window files stay in osd.window_dir and go to the
challenger's MLflow run (artifacts osd_window/), which osd/dvc.yaml takes as its deps with the
params, so `dvc repro osd/dvc.yaml` recomputes a recorded round.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

from specops.drafters.kinds import DRAFT_LM_KINDS
from specops.pipeline.osd_steps import (
    NEEDS_TARGET,
    STEPS,
    TAG_PREFIX,
    WINDOW_INFO,
    WINDOW_PARQUET,
    osd_config,
)
from specops.pipeline.params import read_params
from specops.pipeline.run_lock import LockHeldError, RunLock, lock_holder
from specops.pipeline.stages import Params, stage_target, tracking, write_json
from specops.pipeline.watermark import Watermark, WatermarkError, read_watermark, write_watermark

log = logging.getLogger("specops.retrain")

EXIT_LOCKED = 75  # EX_TEMPFAIL in sysexits.h: a temporary condition, try again later
WINDOW_TAG = TAG_PREFIX + "window_last_id"
LOG_TAG = TAG_PREFIX + "feedback_log_id"


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def recover(watermark: Watermark, model_name: str) -> Watermark:
    """The watermark, moved past the window of any retrain whose gate decided after it was written.

    Such a retrain was killed between its gate decision (a `gate.passed` tag, or the champion alias)
    and its watermark write; its version's tags say which rows it consumed.
    """
    from mlflow import MlflowClient

    from specops.pipeline.registry import CHAMPION, alias_version

    champion = alias_version(model_name, CHAMPION)
    best = watermark
    for version in MlflowClient().search_model_versions(f"name = '{model_name}'"):
        tags = version.tags
        decided = "gate.passed" in tags or str(version.version) == champion
        if decided and tags.get(LOG_TAG) == str(watermark.log_id) and int(tags.get(WINDOW_TAG, 0)) > best.last_id:
            best = Watermark(log_id=watermark.log_id, last_id=int(tags[WINDOW_TAG]), feedback_db=watermark.feedback_db,
                             model_version=str(version.version), updated_at=_now())
    return best


def _champion(model_name: str) -> dict[str, Any]:
    """The champion's version, bundle version and drafter kind (from its version tags), and why OSD cannot
    retrain it (None when it can)."""
    from mlflow import MlflowClient

    from specops.pipeline.registry import CHAMPION, alias_version

    version = alias_version(model_name, CHAMPION)
    if version is None:
        return {"version": None, "blocker": f"'{model_name}' has no champion yet: run the main pipeline "
                                            "(dvc repro) first; OSD retrains the champion's draft LM."}
    tags = MlflowClient().get_model_version(model_name, version).tags
    kind = tags.get("bundle.drafter_kind")
    blocker = None if kind in DRAFT_LM_KINDS else (
        f"champion v{version} drafts with '{kind}'; OSD retrains a draft LM ({' or '.join(DRAFT_LM_KINDS)}; "
        "make the main pipeline's bundle default to one)")
    return {"version": version, "bundle_version": tags.get("bundle.version"), "drafter": kind, "blocker": blocker}


def survey(params: Params) -> dict[str, Any]:
    """Where the feedback stands: watermark (recovered from the registry if need be), pending rows, champion.
    Reads only."""
    from specops.server.feedback import log_state

    cfg = osd_config(params)
    registry = tracking(params)
    db = Path(cfg.feedback_db).resolve()
    stored = read_watermark(cfg.watermark_file, log_state(db, 0).log_id, db)
    watermark = recover(stored, registry.model_name)
    state = log_state(db, watermark.last_id)
    if state.last_assigned < watermark.last_id:
        raise WatermarkError(f"The watermark ({cfg.watermark_file}) is at row {watermark.last_id}, but {db} has "
                             f"never assigned an id above {state.last_assigned}: it went back in time (restored from "
                             "a backup?). New rows would reuse ids below the watermark and be skipped; set last_id "
                             f"in the watermark file to {state.last_assigned} to read them.")
    return {"feedback_db": str(db), "log_id": state.log_id, "model_name": registry.model_name,
            "stored_watermark": stored, "watermark": watermark, "pending_rows": state.pending,
            "window_rows": min(state.pending, cfg.max_rows), "champion": _champion(registry.model_name)}


def load_params(params_file: str | Path, feedback_db: str | None = None, tracking_uri: str | None = None) -> Params:
    """The params file, with the two settings a scheduler's environment usually owns replaced when given.
    The values used are recorded with the rest of the params in the challenger's MLflow run."""
    params = read_params(params_file)
    if feedback_db is not None:
        params["osd"] = {**(params.get("osd") or {}), "feedback_db": feedback_db}
    if tracking_uri is not None:
        params["mlflow"] = {**(params.get("mlflow") or {}), "tracking_uri": tracking_uri}
    return params


def dry_run(params: Params) -> dict[str, Any]:
    cfg = osd_config(params)
    state = survey(params)
    champion = state["champion"]
    reason = champion["blocker"]
    if reason is None and state["pending_rows"] < cfg.min_rows:
        reason = f"only {state['pending_rows']} new request(s), fewer than osd.min_rows={cfg.min_rows}"
    watermark = state["watermark"]
    return {
        "dry_run": True, "would_retrain": reason is None, "reason": reason, "feedback_db": state["feedback_db"],
        "watermark": {"last_id": watermark.last_id, "model_version": watermark.model_version,
                      "updated_at": watermark.updated_at,
                      "recovered_from_registry": watermark != state["stored_watermark"]},
        "pending_rows": state["pending_rows"], "window_rows": state["window_rows"],
        "backlog_after": state["pending_rows"] - state["window_rows"], "model_name": state["model_name"],
        "champion": {key: champion.get(key) for key in ("version", "bundle_version", "drafter")},
        "lock_holder": lock_holder(cfg.lock_file),
    }


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def export_window(params: Params, state: dict[str, Any]) -> dict[str, Any]:
    """Export the next window into osd.window_dir (window.parquet, then window.json); returns window.json."""
    import pyarrow.parquet as pq

    from specops.core.target import sha256_file
    from specops.server.feedback import export_after

    cfg = osd_config(params)
    after = state["watermark"].last_id
    folder = Path(cfg.window_dir)
    folder.mkdir(parents=True, exist_ok=True)
    parquet = folder / WINDOW_PARQUET
    tmp = folder / f".{WINDOW_PARQUET}.tmp"
    rows = export_after(state["feedback_db"], after, cfg.max_rows, tmp)
    table = pq.read_table(tmp, columns=["id", "created_at"]).to_pydict()
    os.replace(tmp, parquet)
    ids, times = table["id"], table["created_at"]
    champion = state["champion"]
    info = {
        "feedback_db": state["feedback_db"], "log_id": state["log_id"], "after_id": after, "first_id": ids[0], "last_id": ids[-1], "rows": rows,
        # Ids are consecutive, so a gap before the first one is rows the retention cap deleted unseen.
        "lost_to_retention": ids[0] - after - 1,
        "first_created_at": times[0].isoformat(), "last_created_at": times[-1].isoformat(),
        "parquet_sha256": sha256_file(parquet), "model_name": state["model_name"],
        "parent_version": champion["version"], "parent_bundle_version": champion["bundle_version"],
        "exported_at": _now(),
    }
    _write_atomic(folder / WINDOW_INFO, json.dumps(info, indent=2) + "\n")
    return info


def _summary(info: dict[str, Any], outcome: dict[str, dict[str, Any]], seconds: dict[str, float]) -> dict[str, Any]:
    decision, evaluation = outcome["promote"], outcome["evaluate"]
    slices = {name: {side: {key: evaluation[name][side][key] for key in
                            ("acceptance_rate", "mean_accepted_length", "speedup_vs_ar", "identical_to_plain")}
                     for side in ("champion", "challenger")} for name in evaluation}
    return {"status": "retrained", "window": info, "parent_version": info["parent_version"],
            "challenger_version": decision["challenger_version"], "promoted": decision["passed"],
            "reason": decision["reason"], "champion_version": decision["champion_version"],
            "train": {key: outcome["train"][key] for key in ("focus_positions", "served_positions", "parent_agreement",
                                                             "replay_sequences", "steps", "final_loss")},
            "evaluation": slices, "seconds": seconds}


def retrain(params: Params) -> dict[str, Any]:
    """One round (see the module docstring); returns its summary, also written to osd.report_file."""
    cfg = osd_config(params)
    with RunLock(cfg.lock_file):
        state = survey(params)
        watermark = state["watermark"]
        if watermark != state["stored_watermark"]:
            log.warning("retrain: a previous round was gated but did not record it; watermark %d -> %d (v%s).",
                        state["stored_watermark"].last_id, watermark.last_id, watermark.model_version)
            write_watermark(cfg.watermark_file, watermark)
        if state["champion"]["blocker"]:
            from specops.pipeline.registry import RegistryError

            raise RegistryError(state["champion"]["blocker"])
        if state["pending_rows"] < cfg.min_rows:
            log.info("retrain: %d new request(s) since row %d, fewer than osd.min_rows=%d; nothing to do.",
                     state["pending_rows"], watermark.last_id, cfg.min_rows)
            return {"status": "nothing to do", "pending_rows": state["pending_rows"], "watermark": watermark.last_id}
        info = export_window(params, state)
        log.info("retrain: window rows %d..%d (%d requests), parent v%s", info["first_id"], info["last_id"],
                 info["rows"], info["parent_version"])
        target = stage_target(params)
        outcome: dict[str, dict[str, Any]] = {}
        seconds: dict[str, float] = {}
        for name, step in STEPS.items():
            start = time.perf_counter()
            outcome[name] = step(params, target)
            seconds[name] = round(time.perf_counter() - start, 2)
        decision = outcome["promote"]
        write_watermark(cfg.watermark_file, Watermark(log_id=info["log_id"], last_id=info["last_id"],
                                                      feedback_db=info["feedback_db"],
                                                      model_version=decision["challenger_version"], updated_at=_now()))
        summary = _summary(info, outcome, seconds)
        write_json(cfg.report_file, summary)
        return summary


def run_step(name: str, params: Params) -> dict[str, Any]:
    """One step on the exported window, under the same lock; the watermark is not touched."""
    with RunLock(osd_config(params).lock_file):
        return STEPS[name](params, stage_target(params) if name in NEEDS_TARGET else None)


def cmd_retrain(args: argparse.Namespace) -> None:
    params = load_params(args.params, args.feedback_db, args.tracking_uri)
    try:
        if args.dry_run:
            report = dry_run(params)
        elif args.step:
            report = run_step(args.step, params)
        else:
            report = retrain(params)
    except LockHeldError as error:
        print(f"specops retrain: {error}", file=sys.stderr)
        raise SystemExit(EXIT_LOCKED) from None
    print(json.dumps(report, indent=2, default=str))


def register(subparsers: Any) -> None:
    """Add `retrain` to the CLI's subparsers."""
    retrain_parser = subparsers.add_parser(
        "retrain", help="online retraining (OSD): distill the champion draft LM on served traffic",
        description="Export the feedback logged since the last round, distill the champion's draft LM on the "
                    "positions it got wrong (OSD, arXiv 2310.07177), evaluate it next to the champion on held-out "
                    "traffic and the test split, register it as challenger and run the promotion gate. Exit codes: "
                    f"0 done or nothing to do, 1 failed, 2 bad input, {EXIT_LOCKED} another retrain is running. "
                    "See docs/osd.md.")
    retrain_parser.add_argument("--params", default="params.yaml", help="the params file (section `osd`)")
    retrain_parser.add_argument("--feedback-db", help="replaces osd.feedback_db, e.g. from the scheduler's environment")
    retrain_parser.add_argument("--tracking-uri", help="replaces mlflow.tracking_uri, e.g. $MLFLOW_TRACKING_URI")
    mode = retrain_parser.add_mutually_exclusive_group()
    mode.add_argument("--dry-run", action="store_true",
                      help="report the watermark, the new rows, the champion and the lock; change nothing")
    mode.add_argument("--step", choices=list(STEPS),
                      help="run one step on the window already in osd.window_dir (what osd/dvc.yaml runs); "
                           "no export, the watermark is left alone")
    retrain_parser.set_defaults(func=cmd_retrain)
