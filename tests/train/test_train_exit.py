"""train_exit: the exit heads train on traces (every parameter moves, the loss is finite), the report
gives each layer's agreement before and after, and the saved folder drafts for DEL losslessly."""

from __future__ import annotations

import pytest
import torch

from specops.core.loop import SpeculativeGenerator
from specops.drafters.del_exit import DELDrafter, ExitHeads
from specops.train.train_exit import TrainExitConfig, train_exit


def test_train_exit_moves_every_parameter_and_saves_heads_del_drafts_with(tmp_path, tiny_target, traces_dir,
                                                                          monkeypatch):
    cfg = TrainExitConfig(exit_layers=[1], draft_vocab_size=16, epochs=3, batch_size=8, lr=1e-2,
                          out_dir=str(tmp_path / "exit"))
    seen = {}
    original = ExitHeads.from_target.__func__

    def keep(cls, *args):  # the untrained heads, to compare with what training saved
        seen["initial"] = original(cls, *args)
        return original(cls, *args)
    monkeypatch.setattr(ExitHeads, "from_target", classmethod(keep))
    report = train_exit(cfg, tiny_target, traces_dir)
    assert torch.isfinite(torch.tensor(report["train_loss"])) and report["positions"]["train"] > 0
    assert set(report["agreement"]) == set(report["agreement_untrained"]) == {"1"}
    heads = ExitHeads.load(cfg.out_dir)
    assert heads.config.prior_acceptance == [round(report["agreement"]["1"], 4)]
    initial = seen["initial"].state_dict()
    for name, value in heads.state_dict().items():
        if value.is_floating_point():
            assert not torch.equal(value, initial[name]), f"{name} did not train"
    assert len(heads.vocab) == 16
    plain = SpeculativeGenerator(tiny_target, None, "greedy", 0, static_width=4)
    spec = SpeculativeGenerator(tiny_target, DELDrafter(tiny_target.model, heads, 1), "greedy", 3, static_width=4)
    prompt = tiny_target.tokenizer("question 3: what is", add_special_tokens=False)["input_ids"]
    assert spec.generate(prompt, 16).token_ids == plain.generate(prompt, 16).token_ids


def test_bad_exit_layers_are_refused(tmp_path, tiny_target, traces_dir):
    with pytest.raises(ValueError, match="ascending"):
        TrainExitConfig(exit_layers=[4, 2])
    with pytest.raises(ValueError, match="below the target"):
        train_exit(TrainExitConfig(exit_layers=[1, 2], out_dir=str(tmp_path)), tiny_target, traces_dir)
