"""The promotion gate as a table, and its config as read from params.yaml."""

from __future__ import annotations

import pytest

from specops.eval.gate import GateConfig, GateError, decide
from specops.pipeline.params import ParamsError, build
from specops.pipeline.registry import PromoteConfig


def snapshot(speedup: float, lossless: bool = True, **extra: object) -> dict[str, object]:
    return {"method": "draft-lm+greedy", "speedup_vs_ar": speedup, "identical_to_plain": lossless,
            "mean_accepted_length": 2.0, **extra}


CFG = GateConfig(speedup_tolerance=0.05)
LOSSY = GateConfig(require_lossless=False, max_quality_drop=0.01)


@pytest.mark.parametrize(
    ("challenger", "champion", "cfg", "passed", "reason"),
    [
        (snapshot(1.2), None, CFG, True, "no champion yet"),
        (snapshot(0.8), None, CFG, True, "no champion yet"),  # the first lossless challenger wins, as specified
        (snapshot(3.0, lossless=False), None, CFG, False, "not lossless"),
        (snapshot(3.0, lossless=False), snapshot(1.0), CFG, False, "not lossless"),
        (snapshot(1.80), snapshot(2.0), CFG, False, "slower than the champion beyond tolerance"),
        (snapshot(1.94), snapshot(2.0), CFG, True, "within tolerance"),  # 3% slower, 5% allowed
        (snapshot(1.90), snapshot(2.0), CFG, True, "within tolerance"),  # exactly on the floor
        (snapshot(2.50), snapshot(2.0), CFG, True, "within tolerance"),
        (snapshot(1.94), snapshot(2.0), GateConfig(speedup_tolerance=0.0), False, "beyond tolerance"),
        ({**snapshot(1.0), "identical_to_plain": 1.0}, None, CFG, True, "no champion yet"),  # MLflow's 0/1 booleans
        (snapshot(2.0, lossless=False, quality_drop=0.005), snapshot(1.5), LOSSY, True, "within tolerance"),
        (snapshot(2.0, lossless=False, quality_drop=0.05), None, LOSSY, False, "loses too much quality"),
    ],
)
def test_gate_table(challenger, champion, cfg, passed, reason):
    decision = decide(challenger, champion, cfg)
    assert decision.passed is passed
    assert reason in decision.reason


def test_gate_compares_the_configured_metric():
    cfg = GateConfig(metric="mean_accepted_length", speedup_tolerance=0.0)
    faster_but_shorter = {**snapshot(3.0), "mean_accepted_length": 1.5}
    decision = decide(faster_but_shorter, snapshot(1.0), cfg)
    assert not decision.passed
    assert "mean_accepted_length 1.500 vs champion 2.000" in decision.reason


@pytest.mark.parametrize(
    ("challenger", "champion", "message"),
    [
        ({"identical_to_plain": True}, None, r"challenger's eval snapshot has no number under 'speedup_vs_ar'"),
        ({"speedup_vs_ar": 2.0}, None, r"challenger's eval snapshot has no boolean under 'identical_to_plain'"),
        (snapshot(2.0), {"method": "x"}, r"champion's eval snapshot has no number under 'speedup_vs_ar'"),
    ],
)
def test_gate_refuses_to_judge_malformed_snapshots(challenger, champion, message):
    with pytest.raises(GateError, match=message):
        decide(challenger, champion, CFG)


def test_gate_config_rejects_out_of_range_tolerance():
    with pytest.raises(ValueError, match="speedup_tolerance must be in"):
        GateConfig(speedup_tolerance=1.5)


def test_promote_config_reads_a_nested_gate_section():
    cfg = build(PromoteConfig, {"gate": {"speedup_tolerance": 0.1, "require_lossless": False}},
                "promote")
    assert cfg.gate == GateConfig(speedup_tolerance=0.1, require_lossless=False)
    assert cfg.decision_file == "metrics/promotion.json"
    with pytest.raises(ParamsError, match="Unknown key.*speedup_tolerence"):
        build(PromoteConfig, {"gate": {"speedup_tolerence": 0.1}}, "promote")
