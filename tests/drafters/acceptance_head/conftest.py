"""Fixtures for the acceptance head and draft length policy tests.

The training smoke test reuses the training package's tiny char-level target and its traces.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from specops.drafters.acceptance_head import AcceptanceHead, AcceptanceHeadConfig
from tests.train.conftest import chat_tokenizer, prompts_dir, tiny_target, traces_dir  # noqa: F401  (fixtures)


def random_head(hidden_size: int, seed: int = 0, rejection_weight: float = 1.0) -> AcceptanceHead:
    """An untrained head: its predictions vary with the draft state, which is all the lossless tests need."""
    torch.manual_seed(seed)
    return AcceptanceHead(AcceptanceHeadConfig(hidden_size=hidden_size, hidden_units=8,
                                               rejection_weight=rejection_weight)).eval()


@pytest.fixture(scope="session")
def head_dir(tmp_path_factory: pytest.TempPathFactory, draft_model) -> Path:
    """A random head for the tiny draft LM, saved as a head folder."""
    return random_head(draft_model.config.hidden_size).save(tmp_path_factory.mktemp("head"))
