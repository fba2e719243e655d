"""The OSD gate: a challenger worse on recent traffic, or one that forgot the original test split, is
refused and the champion stays; one that trained from a champion that has since been replaced is not
gated at all."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from mlflow import MlflowClient

from specops.eval.gate import GateConfig
from specops.eval.osd_eval import forgetting_refusal
from specops.pipeline.osd_steps import promote
from specops.pipeline.params import read_params
from specops.pipeline.registry import RegistryError, alias_version, register_bundle
from tests.pipeline.osd.conftest import MODEL


def snap(length: float) -> dict[str, Any]:
    return {"method": "draft-lm", "mean_accepted_length": length, "speedup_vs_ar": 1.0, "identical_to_plain": True,
            "acceptance_rate": 0.5, "tokens_per_s": 10.0}


def evaluation(traffic: tuple[float, float], test: tuple[float, float]) -> dict[str, Any]:
    """(champion, challenger) mean accepted lengths per slice, as specops/eval/osd_eval.py reports them."""
    return {name: {"prompts": 3, "champion": snap(old), "challenger": snap(new), "methods": {}}
            for name, (old, new) in (("traffic", traffic), ("test", test))}


def register_challenger(project: Path) -> str:
    params = yaml.safe_load(Path("params.yaml").read_text())
    _, version = register_bundle(project / "champion", model_name=MODEL, experiment="osd",
                                 artifact_root=params["register"]["artifact_root"], params={})
    Path("metrics").mkdir(exist_ok=True)
    Path("metrics/osd_register.json").write_text(json.dumps({"version": version, "parent_version": "1"}))
    return version


def gate(report: dict[str, Any]) -> dict[str, Any]:
    Path("metrics/osd_eval.json").write_text(json.dumps(report))
    return promote(read_params("params.yaml"))


def test_forgetting_is_judged_with_the_gate_rules():
    rules = GateConfig(metric="mean_accepted_length", speedup_tolerance=0.05)
    assert forgetting_refusal(evaluation((1.0, 2.0), (2.0, 1.97)), rules) is None  # within tolerance
    refusal = forgetting_refusal(evaluation((1.0, 2.0), (2.0, 1.5)), rules)
    assert refusal is not None and refusal.startswith("on the original test split")


@pytest.mark.slow
def test_worse_challengers_are_refused_and_the_champion_stays(project):
    version = register_challenger(project)
    tags = lambda: MlflowClient().get_model_version(MODEL, version).tags  # noqa: E731

    worse = gate(evaluation(traffic=(2.0, 1.5), test=(2.0, 2.0)))
    assert not worse["passed"] and "slower than the champion" in worse["reason"]
    assert alias_version(MODEL, "champion") == "1" and tags()["gate.passed"] == "false"

    forgetful = gate(evaluation(traffic=(1.5, 2.5), test=(2.0, 1.2)))
    assert not forgetful["passed"] and forgetful["reason"].startswith("on the original test split")
    assert forgetful["test"]["challenger"]["mean_accepted_length"] == 1.2
    assert alias_version(MODEL, "champion") == "1" and tags()["gate.reason"] == forgetful["reason"]

    better = gate(evaluation(traffic=(1.5, 2.5), test=(2.0, 2.0)))
    assert better["passed"] and alias_version(MODEL, "champion") == version
    assert json.loads(Path("metrics/osd_promotion.json").read_text())["champion_version"] == version


@pytest.mark.slow
def test_a_challenger_of_a_replaced_champion_is_not_gated(project):
    version = register_challenger(project)
    MlflowClient().set_registered_model_alias(MODEL, "champion", version)  # someone promoted meanwhile
    register_challenger(project)
    with pytest.raises(RegistryError, match="The registry moved during the retrain"):
        gate(evaluation(traffic=(1.0, 3.0), test=(1.0, 3.0)))
    assert alias_version(MODEL, "champion") == version
