"""Fixtures for the lossy-mode tests: random routers for the tiny target and draft, saved as a router folder."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from specops.lossy.arbitrage import DEFAULT_MAX_STEP_TOKENS
from specops.lossy.router import LinearRouter, RouterConfig

# "w1" occurs in w1 and w10..w19: about one token in nine ends a step of the tiny vocabulary.
DELIMITER = "w1"


def random_router(kind: str, input_dim: int, target, seed: int = 0, extra: dict | None = None) -> LinearRouter:
    """An untrained router whose probabilities vary with the features: enough for the wiring tests."""
    torch.manual_seed(seed)
    config = RouterConfig(kind=kind, input_dim=input_dim, threshold=0.5, scorer="target_likelihood",
                          target=target.fingerprint.to_dict(), extra=extra or {})
    router = LinearRouter(config)
    with torch.no_grad():
        router.linear.weight.normal_()
    return router.eval()


@pytest.fixture(scope="session")
def router_dir(tmp_path_factory: pytest.TempPathFactory, target, draft_model) -> Path:
    root = tmp_path_factory.mktemp("router")
    h_draft, h_target = draft_model.config.hidden_size, target.model.config.hidden_size
    random_router("autojudge", h_draft + h_target, target).save(root / "autojudge")
    steps = {"delimiter": DELIMITER, "max_step_tokens": DEFAULT_MAX_STEP_TOKENS}
    random_router("arbitrage", 2 * h_draft + 2, target, seed=1, extra=steps).save(root / "arbitrage")
    return root


@pytest.fixture(scope="session")
def prompts_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A prepared split of tiny chat prompts (rows as the prepare stage writes them)."""
    path = tmp_path_factory.mktemp("prompts") / "test.jsonl"
    rows = [{"id": f"p{i}", "source": "user", "messages": [{"role": "user", "content": text}]}
            for i, text in enumerate(["w20 w21 w22", "w30 w31 w32 w33", "w40 w41", "w50 w51 w52 w53 w54", "w60"])]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path
