"""The evaluate stage's outputs: its DVC metrics are numbers only, its report keeps everything register and
promote read, and it writes exactly the plots dvc.yaml declares, with the fields DVC draws them from."""

from __future__ import annotations

import copy
import csv
import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from specops.pipeline import stages
from specops.pipeline.params import read_params

ROOT = Path(__file__).resolve().parents[2]
EVALUATE = yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"]["evaluate"]


def _row(speedup: float, acceptance: list[float], accepted: float | None) -> dict[str, Any]:
    return {"tokens_per_s": 40.0 * speedup, "speedup_vs_ar": speedup, "speedup_median": speedup,
            "mean_accepted_length": accepted,
            "acceptance_rate": sum(acceptance) / len(acceptance) if acceptance else None,
            "acceptance_per_position": acceptance, "draft_s": 0.5, "verify_s": 3.0, "identical_to_ar": False,
            "identical_to_plain": True, "identical_prompts": 2, "new_tokens": 96, "seconds": 2.4}


# What specops.eval.evaluate.evaluate returns, in short: numbers, and the strings and settings beside them.
REPORT: dict[str, Any] = {
    "methods": {"hf_ar": _row(1.0, [], None), "draft-lm@4": _row(1.4, [0.4, 0.3, 0.2, 0.1], 1.6)},
    "prompts": 2,
    "config": {"dataset": "data/prompts/test.jsonl", "drafters": ["draft-lm@4"], "max_new_tokens": 48},
    "target": {"name": "tiny.gguf", "weights_sha256": "ab12"},
    "dtype": "bfloat16",
    "bound": {"weight_bytes": 100, "bandwidth_gb_s": 20.0},
    "environment": {"platform": "Linux", "cpu_count": 2},
    "created_at": "2026-11-25T09:51:08Z",
    "default": {"method": "draft-lm@4", "speedup_vs_ar": 1.4, "speedup_median": 1.4, "identical_to_plain": True, "identical_to_ar": False,
                "mean_accepted_length": 1.6, "acceptance_rate": 0.25, "tokens_per_s": 56.0},
    "baseline": "hf_ar",
    "per_prompt": [{"prompt": 0}],
}


@pytest.fixture
def evaluated(tmp_path, monkeypatch) -> dict[str, Any]:
    """The evaluate stage run in tmp_path with params.yaml's settings, the benchmark replaced by REPORT."""
    import specops.eval.evaluate

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(stages, "stage_target", lambda params, dtype=None: None)
    monkeypatch.setattr(specops.eval.evaluate, "evaluate", lambda *args: copy.deepcopy(REPORT))
    params = read_params(ROOT / "params.yaml")
    params["evaluate"]["compare_champion"] = False  # no registry here
    stale = Path(params["evaluate"]["plots_dir"]) / "acceptance_per_position" / "dropped@4.csv"
    stale.parent.mkdir(parents=True)
    stale.write_text("position,acceptance\n1,0.5\n")
    stages.evaluate(params, stages.stage_inputs("evaluate", params))
    return params


def _rows(path: Path) -> list[dict[str, str]]:
    return list(csv.DictReader(path.read_text().splitlines()))


def _leaves(tree: Any) -> list[Any]:
    return [leaf for value in tree.values() for leaf in _leaves(value)] if isinstance(tree, dict) else [tree]


def _declared(params: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Every output dvc.yaml declares for evaluate (outs, metrics, plots): path -> its properties."""
    return {stages.resolve(path, params): props for kind in ("outs", "metrics", "plots")
            for entry in EVALUATE.get(kind, []) for path, props in entry.items()}


def test_metrics_are_numbers_and_the_report_keeps_the_rest(evaluated):
    cfg = evaluated["evaluate"]
    metrics = json.loads(Path(cfg["out"]).read_text())
    assert all(isinstance(leaf, (int, float)) for leaf in _leaves(metrics)), metrics  # bools are ints
    assert metrics["methods"]["draft-lm@4"]["speedup_vs_ar"] == 1.4
    assert metrics["default"]["acceptance_rate"] == 0.25 and "method" not in metrics["default"]
    assert "mean_accepted_length" not in metrics["methods"]["hf_ar"]  # None: HF's methods draft nothing
    report = json.loads(Path(cfg["report"]).read_text())
    assert report == {key: value for key, value in REPORT.items() if key != "per_prompt"}
    # register and promote read the report: the bundle's default method is named there.
    assert stages.STAGE_INPUTS["register"]["evaluation"] == stages.STAGE_INPUTS["promote"]["evaluation"] \
        == "${evaluate.report}"


def test_the_stage_writes_what_dvc_yaml_declares(evaluated, tmp_path):
    declared = _declared(evaluated)
    assert all(Path(path).exists() for path in declared), declared
    written = {path.relative_to(tmp_path) for path in tmp_path.rglob("*") if path.is_file()}
    assert all(any(path.is_relative_to(out) for out in declared) for path in written), written


def test_the_data_plots_hold_the_fields_dvc_draws(evaluated):
    plots_dir = Path(evaluated["evaluate"]["plots_dir"])
    declared = _declared(evaluated)
    acceptance, speedup = plots_dir / "acceptance_per_position", plots_dir / "speedup.csv"
    # One file per method with drafts, and none left from a method no longer evaluated.
    assert sorted(p.name for p in acceptance.iterdir()) == ["draft-lm@4.csv"]
    rows = _rows(acceptance / "draft-lm@4.csv")
    assert [(int(r["position"]), float(r["acceptance"])) for r in rows] == [(1, 0.4), (2, 0.3), (3, 0.2), (4, 0.1)]
    bars = {r["method"]: float(r["speedup_vs_ar"]) for r in _rows(speedup)}
    assert bars == {"hf_ar": 1.0, "draft-lm@4": 1.4}
    for data, file in ((acceptance, acceptance / "draft-lm@4.csv"), (speedup, speedup)):
        props = declared[str(data)]
        assert {props["x"], props["y"]} <= set(_rows(file)[0]), props
