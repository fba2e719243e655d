"""A tiny train_acceptance run: finite losses, every head parameter trained, a loadable safetensors head."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from specops.drafters.acceptance_head import AcceptanceHead
from specops.server.bundle import PICKLE_SUFFIXES
from specops.train.train_acceptance import INFO_FILE, TrainAcceptanceConfig, build_head, train_acceptance
from tests.train.conftest import tiny_llama


def tiny_config(root: Path, **overrides) -> TrainAcceptanceConfig:
    settings = dict(hidden_units=16, epochs=3, batch_size=16, lr=1e-2, out_dir=str(root / "head"),
                    plot=str(root / "plots" / "calibration.png"))
    return TrainAcceptanceConfig(**{**settings, **overrides})


@pytest.fixture(scope="module")
def chat_draft_dir(tmp_path_factory, tiny_target) -> Path:
    """A random draft over the char-level target's vocabulary, saved as an HF folder."""
    path = tmp_path_factory.mktemp("chat_draft")
    tiny_llama(tiny_target.vocab_size, tiny_target.model.config.eos_token_id, seed=5).save_pretrained(path)
    return path


@pytest.mark.parametrize(("proposal", "label"), [("argmax", "soft"), ("sample", "greedy")])
def test_fit_trains_every_parameter_and_saves_a_safetensors_head(tmp_path, tiny_target, traces_dir, chat_draft_dir,
                                                                 proposal, label):
    cfg = tiny_config(tmp_path, proposal=proposal, label=label)
    report = train_acceptance(cfg, tiny_target, chat_draft_dir, traces_dir)
    assert math.isfinite(report["train_loss"]) and math.isfinite(report["loss"]) and report["eval_split"] == "val"
    assert report["positions"]["train"] > 0 and report["positions"]["val"] > 0
    assert 0.0 <= report["observed_acceptance"] <= 1.0 and 0.0 <= report["ece"] <= 1.0
    trained = AcceptanceHead.load(cfg.out_dir)
    initial = build_head(cfg, trained.config.hidden_size)  # seeded: the weights training started from
    assert trained.config.rejection_weight == cfg.rejection_weight
    unchanged = [name for name, tensor in initial.named_parameters()
                 if torch.equal(tensor, dict(trained.named_parameters())[name])]
    assert not unchanged, f"parameters that did not train: {unchanged}"
    files = {path.name for path in Path(cfg.out_dir).iterdir()}
    assert files == {"config.json", "model.safetensors", INFO_FILE}
    assert not any(Path(name).suffix in PICKLE_SUFFIXES for name in files)
    assert json.loads((Path(cfg.out_dir) / INFO_FILE).read_text())["report"] == report
    assert Path(cfg.plot).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bad_inputs_are_refused(tmp_path, tiny_target, traces_dir):
    with pytest.raises(ValueError, match="proposal 'beam'"):
        TrainAcceptanceConfig(proposal="beam")
    with pytest.raises(ValueError, match="label 'hard'"):
        TrainAcceptanceConfig(label="hard")
    other = tmp_path / "other_vocab"
    tiny_llama(tiny_target.vocab_size + 4, 2, seed=6).save_pretrained(other)
    with pytest.raises(ValueError, match="does not share the target's vocabulary"):
        train_acceptance(tiny_config(tmp_path), tiny_target, other, traces_dir)
    with pytest.raises(FileNotFoundError, match="acceptance head folder"):
        AcceptanceHead.load(tmp_path)
