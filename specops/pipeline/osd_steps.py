"""The five steps of one OSD retrain, each thin like a DVC stage: read the exported window and the
params, call the library, write the outputs. Heavy imports stay inside the steps, so importing
STEPS (the CLI does) is cheap.

    traces    window -> osd.traces_dir: the target's top-k on the window's training requests
    train     parent draft + those traces + a replay sample -> osd.out_dir (specops/train/osd_distill.py)
    evaluate  challenger vs parent on held-out traffic and the test split -> osd.eval_out, osd.plot
    register  osd.bundle_dir -> a registry version with alias `challenger` and lineage tags
    promote   the gate on both slices -> osd.decision_file; alias `champion` moves if it passes

`specops retrain` exports the window and runs them in order in one process, loading the target
once; osd/dvc.yaml runs each as `specops retrain --step NAME` from a recorded window. The window's
window.json pins the parent version, so a rerun trains from the same parent whatever the champion
is by then.
"""

from __future__ import annotations

import json
import logging
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from specops.drafters.kinds import DRAFT_LM_KINDS
from specops.pipeline.stages import Params, mlflow_logger, report_path, section, tracking, write_json

log = logging.getLogger("specops.osd")

WINDOW_PARQUET = "window.parquet"
WINDOW_INFO = "window.json"
# Model version tags that carry a retrain's lineage; `osd.window_last_id` also lets a retrain that
# died between the gate and the watermark write recover (specops/pipeline/retrain.py).
TAG_PREFIX = "osd."


def osd_config(params: Params):
    from specops.train.osd_distill import OSDConfig

    return section(params, OSDConfig, "osd")


def read_window_info(window_dir: Path | str) -> dict[str, Any]:
    path = Path(window_dir) / WINDOW_INFO
    if not path.is_file():
        raise FileNotFoundError(f"No exported feedback window in {window_dir}: `specops retrain` exports one "
                                "and then runs every step.")
    return json.loads(path.read_text())


def split_rows(params: Params):
    """(train, held-out) rows of the exported window."""
    from specops.data.feedback_traces import read_window, split_window

    cfg = osd_config(params)
    return split_window(read_window(Path(cfg.window_dir) / WINDOW_PARQUET), cfg.heldout_fraction, cfg.split_salt)


@contextmanager
def parent_bundle(params: Params) -> Iterator[Any]:
    """The verified bundle of the parent version pinned in window.json, in a temporary folder."""
    from specops.pipeline.registry import download_bundle
    from specops.server.bundle import load_bundle

    info = read_window_info(osd_config(params).window_dir)
    registry = tracking(params)
    with tempfile.TemporaryDirectory(prefix="specops-osd-parent-") as tmp:
        bundle = load_bundle(download_bundle(registry.model_name, info["parent_version"], Path(tmp)))
        if bundle.drafter_kind not in DRAFT_LM_KINDS or bundle.drafter_dir is None:
            raise ValueError(f"OSD distills a draft LM, but version {info['parent_version']} of "
                             f"'{registry.model_name}' drafts with '{bundle.drafter_kind}'.")
        yield bundle


def write_challenger(out_dir: Path | str, parent: Any, draft_dir: Path | str, metrics: dict[str, Any]) -> Path:
    """A bundle that is the parent's with the retrained draft: same target, decoding strategy and
    drafter kind and components (an acceptance head stays; speed is what the gate measures, output
    stays lossless)."""
    from specops.pipeline.registry import git_provenance
    from specops.server.bundle import write_bundle

    serving = {key: value for key, value in parent.serving.items() if key != "drafter"}
    return write_bundle(out_dir, drafter_dir=Path(draft_dir), drafter_kind=parent.drafter_kind, serving=serving,
                        target_source=parent.target_source, target_dtype=parent.target_dtype,
                        fingerprint=parent.fingerprint, metrics=metrics, extra_dirs=parent.extra_dirs,
                        git_sha=git_provenance().get("git_sha"), overwrite=True)


def traces(params: Params, target: Any) -> dict[str, Any]:
    from specops.data.collect import CollectConfig
    from specops.data.feedback_traces import served_acceptance, write_feedback_traces

    cfg = osd_config(params)
    info = read_window_info(cfg.window_dir)
    train_rows, heldout_rows = split_rows(params)
    top_k = section(params, CollectConfig, "collect").top_k_logits
    report = {"window_rows": info["rows"], "train_rows": len(train_rows), "heldout_rows": len(heldout_rows),
              "served_acceptance": served_acceptance(train_rows + heldout_rows),
              **write_feedback_traces(train_rows, target, Path(cfg.traces_dir), top_k, info["parquet_sha256"])}
    write_json(report_path(params, "osd_traces"), report)
    return report


def train(params: Params, target: Any) -> dict[str, Any]:
    from specops.data.collect import CollectConfig
    from specops.train.osd_distill import osd_distill

    cfg = osd_config(params)
    replay_dir = Path(section(params, CollectConfig, "collect").out_dir) / "train"
    with parent_bundle(params) as parent:
        logger = mlflow_logger(params, "osd_train")
        report = osd_distill(cfg, target, parent.drafter_dir, Path(cfg.traces_dir), replay_dir, logger=logger)
    write_json(report_path(params, "osd_train"), {**report, "mlflow_run_id": logger.run_id})
    return report


def _eval_prompts(params: Params, target: Any, heldout_rows: list[dict[str, Any]]) -> dict[str, list[list[int]]]:
    from specops.core.target import encode_prompt
    from specops.data.prompts import PrepareConfig
    from specops.eval.evaluate import EvaluateConfig, read_split

    cfg = osd_config(params)
    room = target.max_context - cfg.eval_max_new_tokens
    traffic = [row["prompt_ids"] for row in heldout_rows if len(row["prompt_ids"]) <= room][: cfg.eval_prompts]
    if not traffic:
        raise ValueError(f"No held-out request leaves room for {cfg.eval_max_new_tokens} new tokens in the "
                         "target's context; lower osd.eval_max_new_tokens.")
    split = section(params, EvaluateConfig, "evaluate").split
    test_file = Path(section(params, PrepareConfig, "prepare").out_dir) / f"{split}.jsonl"
    test = [encode_prompt(target.tokenizer, messages) for messages in read_split(test_file, cfg.eval_prompts)]
    return {"traffic": traffic, "test": test}


def evaluate(params: Params, target: Any) -> dict[str, Any]:
    from specops.core.types import SamplingParams
    from specops.eval import plots
    from specops.eval.osd_eval import CHALLENGER, CHAMPION, evaluate_slices
    from specops.server.generator import generator_from_bundle

    cfg = osd_config(params)
    _, heldout_rows = split_rows(params)
    prompts = _eval_prompts(params, target, heldout_rows)
    with parent_bundle(params) as parent, tempfile.TemporaryDirectory(prefix="specops-osd-eval-") as tmp:
        if str(target.model.dtype).removeprefix("torch.") != parent.target_dtype:  # measure in the serving dtype
            from specops.core.target import load_target

            target = load_target(parent.target_source, parent.target_dtype)
        # The challenger runs from a bundle too, so it is measured through exactly the path that will serve it.
        challenger = write_challenger(Path(tmp) / "challenger", parent, cfg.out_dir, metrics={})
        generators = {name: generator_from_bundle(path, target).generator(SamplingParams())
                      for name, path in ((CHAMPION, parent.root), (CHALLENGER, challenger))}
        report = evaluate_slices(target, prompts, cfg.eval_max_new_tokens, generators[CHAMPION], generators[CHALLENGER])
    write_json(cfg.eval_out, report)
    plots.acceptance_per_position({name: report["traffic"]["methods"][name] for name in (CHAMPION, CHALLENGER)},
                                  Path(cfg.plot))
    for name, result in report.items():
        log.info("osd evaluate %s: acceptance %s -> %s, speedup %.3fx -> %.3fx", name,
                 result[CHAMPION]["acceptance_rate"], result[CHALLENGER]["acceptance_rate"],
                 result[CHAMPION]["speedup_vs_ar"], result[CHALLENGER]["speedup_vs_ar"])
    return report


def lineage(info: dict[str, Any], traces_report: dict[str, Any]) -> dict[str, str]:
    """Tags that say where a challenger came from: its parent, the feedback window and the row counts."""
    values = {
        "parent_version": info["parent_version"], "parent_bundle_version": info["parent_bundle_version"],
        "feedback_db": info["feedback_db"], "feedback_log_id": info["log_id"], "window_first_id": info["first_id"],
        "window_last_id": info["last_id"],
        "window_first_at": info["first_created_at"], "window_last_at": info["last_created_at"],
        "window_sha256": info["parquet_sha256"], "rows": info["rows"], "rows_train": traces_report["train_rows"],
        "rows_heldout": traces_report["heldout_rows"], "lost_to_retention": info["lost_to_retention"],
    }
    return {TAG_PREFIX + key: str(value) for key, value in values.items()}


def register(params: Params, target: Any = None) -> dict[str, Any]:
    from mlflow import MlflowClient

    from specops.eval.osd_eval import CHALLENGER
    from specops.pipeline.registry import RegisterConfig, register_bundle

    cfg = osd_config(params)
    registry = tracking(params)
    register_cfg = section(params, RegisterConfig, "register")
    info = read_window_info(cfg.window_dir)
    evaluation = json.loads(Path(cfg.eval_out).read_text())
    traces_report = json.loads(report_path(params, "osd_traces").read_text())
    # The gate's snapshot is the held-out traffic one; the test slice rides along under "test".
    metrics = {**evaluation["traffic"][CHALLENGER], "test": evaluation["test"][CHALLENGER]}
    tags = lineage(info, traces_report)
    with parent_bundle(params) as parent:
        bundle = write_challenger(cfg.bundle_dir, parent, cfg.out_dir, metrics)
    run_id, version = register_bundle(bundle, model_name=registry.model_name, experiment=register_cfg.experiment,
                                      artifact_root=register_cfg.artifact_root, params=params, metrics=metrics,
                                      plots=[Path(cfg.plot)], tags={**tags, "stage": "osd"})
    client = MlflowClient()
    for key, value in tags.items():  # on the version too: the registry UI and the watermark recovery read them
        client.set_model_version_tag(registry.model_name, version, key, value)
    for name in (WINDOW_PARQUET, WINDOW_INFO):  # the inputs, so the retrain can be reproduced from the run alone
        client.log_artifact(run_id, str(Path(cfg.window_dir) / name), artifact_path="osd_window")
    report = {"run_id": run_id, "model_name": registry.model_name, "version": version,
              "parent_version": info["parent_version"]}
    write_json(report_path(params, "osd_register"), report)
    return report


def promote(params: Params, target: Any = None) -> dict[str, Any]:
    from mlflow import MlflowClient

    from specops.eval.osd_eval import CHALLENGER, CHAMPION, forgetting_refusal
    from specops.pipeline.registry import CHALLENGER as CHALLENGER_ALIAS
    from specops.pipeline.registry import CHAMPION as CHAMPION_ALIAS
    from specops.pipeline.registry import PromoteConfig, RegistryError, alias_version
    from specops.pipeline.registry import promote as gate_and_move

    cfg = osd_config(params)
    registry = tracking(params)
    gate = section(params, PromoteConfig, "promote").gate
    evaluation = json.loads(Path(cfg.eval_out).read_text())
    registered = json.loads(report_path(params, "osd_register").read_text())
    version, parent = registered["version"], registered["parent_version"]
    # The evaluation compared against the parent; gating against anything else would compare the wrong numbers.
    champion, challenger = (alias_version(registry.model_name, alias) for alias in (CHAMPION_ALIAS, CHALLENGER_ALIAS))
    if challenger != version or champion != parent:
        raise RegistryError(f"The registry moved during the retrain: challenger is v{challenger} (expected "
                            f"v{version}), champion v{champion} (expected the parent, v{parent}). Not promoting; "
                            "the next retrain starts from the current champion with the same feedback.")
    refusal = forgetting_refusal(evaluation, gate)
    if refusal is None:
        decision = gate_and_move(registry.model_name, gate_cfg=gate, challenger_metrics=evaluation["traffic"][CHALLENGER],
                                 champion_metrics=evaluation["traffic"][CHAMPION])
    else:
        client = MlflowClient()
        client.set_model_version_tag(registry.model_name, version, "gate.passed", "false")
        client.set_model_version_tag(registry.model_name, version, "gate.reason", refusal)
        decision = {"model_name": registry.model_name, "passed": False, "reason": refusal, "metric": gate.metric,
                    "challenger_version": version, "previous_champion_version": parent, "champion_version": parent,
                    "challenger": evaluation["traffic"][CHALLENGER], "champion": evaluation["traffic"][CHAMPION]}
    decision["test"] = {CHALLENGER: evaluation["test"][CHALLENGER], CHAMPION: evaluation["test"][CHAMPION]}
    write_json(cfg.decision_file, decision)
    log.info("osd promote: %s (%s)", "passed" if decision["passed"] else "refused", decision["reason"])
    return decision


Step = Callable[[Params, Any], dict[str, Any]]
STEPS: dict[str, Step] = {"traces": traces, "train": train, "evaluate": evaluate, "register": register,
                          "promote": promote}
NEEDS_TARGET = ("traces", "train", "evaluate")
