"""The train_router and lossy_eval stages end to end on tiny models: routers saved and loadable, mined data
written, metrics/lossy.json in the documented shape, the plot drawn, and threshold 0 lossless."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from specops.lossy.router import LinearRouter
from specops.pipeline.stages import STAGES, stage_inputs
from tests.lossy.conftest import DELIMITER

POINT_KEYS = {"threshold", "speedup_vs_ar", "speedup_vs_lossless", "quality", "quality_drop", "scorer",
              "identical_to_ar", "identical_to_plain", "mean_accepted_length", "lossy_accepted"}


@pytest.fixture(scope="module")
def params(tmp_path_factory: pytest.TempPathFactory, target, tokenizer, prompts_file, draft_dir) -> dict:
    root = tmp_path_factory.mktemp("pipeline")
    target.model.save_pretrained(root / "target")
    tokenizer.save_pretrained(root / "target")
    return {
        "target": {"source": str(root / "target")},
        "metrics": {"dir": str(root / "metrics")},
        "prepare": {"out_dir": str(prompts_file.parent)},
        "train_draft": {"out_dir": str(draft_dir)},
        "train_router": {"split": "test", "max_prompts": 4, "max_new_tokens": 16, "autojudge_rollouts": 12,
                         "arbitrage_rollouts": 12, "max_rollouts_per_prompt": 4, "step_delimiter": DELIMITER,
                         "max_step_tokens": 6, "holdout_fraction": 0.3, "out_dir": str(root / "router"),
                         "mined_dir": str(root / "mined")},
        "lossy_eval": {"split": "test", "n_prompts": 2, "max_new_tokens": 12, "draft_tokens": 3,
                       "autojudge_thresholds": [0.0, 0.5, 1.01], "arbitrage_thresholds": [0.0, 1.01], "oracle": True,
                       "out": str(root / "metrics" / "lossy.json"), "plot": str(root / "plots" / "lossy.png")},
    }


def test_train_router_then_lossy_eval(params):
    STAGES["train_router"](params, stage_inputs("train_router", params))
    report = json.loads((Path(params["metrics"]["dir"]) / "train_router.json").read_text())
    for kind in ("autojudge", "arbitrage"):
        router = LinearRouter.load(Path(params["train_router"]["out_dir"]) / kind, kind=kind)
        assert router.config.threshold == report[kind]["threshold"] and router.config.scorer == "target_likelihood"
        assert report[kind]["examples"] > 0 and len(report[kind]["sweep"]) == 10
        assert (Path(params["train_router"]["mined_dir"]) / f"{kind}.safetensors").is_file()
    assert report["autojudge"]["examples"] <= 12
    assert router.config.extra == {"delimiter": DELIMITER, "max_step_tokens": 6}

    STAGES["lossy_eval"](params, stage_inputs("lossy_eval", params))
    lossy = json.loads(Path(params["lossy_eval"]["out"]).read_text())
    assert lossy["scorer"] == "target_likelihood" and lossy["prompts"] == 2
    assert lossy["lossless"]["identical_to_ar"] and lossy["lossless"]["quality"] == 1.0  # the target's own reply
    assert [p["threshold"] for p in lossy["autojudge"]] == [0.0, 0.5, 1.01]
    for mode in ("autojudge", "arbitrage", "arbitrage_oracle"):
        for point in lossy[mode]:
            assert set(point) >= POINT_KEYS and point["scorer"] == "target_likelihood"
    for mode in ("autojudge", "arbitrage"):
        at_zero = lossy[mode][0]
        assert at_zero["identical_to_ar"] and at_zero["quality_drop"] == 0.0 and at_zero["lossy_accepted"] == 0
        everything = lossy[mode][-1]
        assert everything["lossy_accepted"] > 0 and everything["quality_drop"] > 0  # random drafts cost quality
    assert Path(params["lossy_eval"]["plot"]).stat().st_size > 0
