"""The router: save/load round trip, fitting, the threshold sweep, and the checks that refuse a wrong router."""

from __future__ import annotations

import json

import pytest
import torch

from specops.lossy.router import LinearRouter, RouterConfig, RouterLoadError
from specops.train.router_fit import choose_threshold, fit_router, in_holdout, threshold_sweep
from tests.lossy.conftest import random_router


def test_save_load_round_trip(tmp_path, target):
    router = random_router("arbitrage", 10, target, extra={"delimiter": "\n", "max_step_tokens": 7})
    with torch.no_grad():
        router.mean.uniform_(-1, 1)
        router.scale.uniform_(0.5, 2)
        router.linear.bias.fill_(0.3)
    router.save(tmp_path)
    assert {p.name for p in tmp_path.iterdir()} == {"config.json", "model.safetensors"}  # nothing pickled
    loaded = LinearRouter.load(tmp_path, kind="arbitrage")
    x = torch.randn(5, 10)
    assert torch.equal(loaded(x), router(x))
    assert loaded.config == router.config
    with pytest.raises(RouterLoadError, match="not a autojudge"):
        LinearRouter.load(tmp_path, kind="autojudge")


def test_load_refuses_a_foreign_folder(tmp_path):
    with pytest.raises(RouterLoadError, match="train_router"):
        LinearRouter.load(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"format": "other"}))
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(RouterLoadError, match="specops-router"):
        LinearRouter.load(tmp_path)


def test_fit_separates_a_separable_set_and_sweep_counts():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(200, 6, generator=gen) * torch.tensor([1.0, 50.0, 1, 1, 1, 1])  # unequal scales: standardized
    y = (x[:, 0] + x[:, 1] / 50 > 0.5).long()
    router = fit_router(x, y, RouterConfig(kind="autojudge", input_dim=6, threshold=0.0, scorer="stub"), l2=0.01)
    probs = router(x).detach()
    assert ((probs > 0.5).long() == y).float().mean() > 0.95
    sweep = threshold_sweep(probs, y, [0.0, 0.5, 1.01])
    assert sweep[0]["accepted"] == 0.0 and sweep[-1]["accepted"] == 1.0
    assert sweep[1]["accepted_harmless"] > 0.9 and sweep[1]["accepted_harmful"] < 0.1
    assert choose_threshold(sweep, 0.1) == 0.5
    assert choose_threshold(sweep, -1) == 0.0  # nothing qualifies: lossless


def test_fit_with_one_class_predicts_its_base_rate():
    x = torch.randn(9, 3)
    router = fit_router(x, torch.zeros(9), RouterConfig(kind="arbitrage", input_dim=3, threshold=0.0, scorer="stub"))
    assert torch.allclose(router(x), torch.full((9,), 0.5 / 10), atol=1e-6)
    assert threshold_sweep(router(x).detach(), torch.zeros(9), [0.5])[0]["accepted_harmful"] is None


def test_holdout_is_deterministic_per_prompt():
    groups = [f"prompt-{i}" for i in range(400)]
    held = [in_holdout(g, 0.25) for g in groups]
    assert held == [in_holdout(g, 0.25) for g in groups]
    assert 0.15 < sum(held) / len(held) < 0.35
