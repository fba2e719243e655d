"""train_aligned: vocabulary, data layout, one short fit that trains every parameter, refusals."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from specops.data.collect import collect
from specops.data.traces import TraceShards
from specops.drafters.aligned_head.model import load_head
from specops.pipeline.params import ParamsError, build
from specops.pipeline.stages import STAGES
from specops.train.train_aligned import (
    INFO_FILE,
    AlignedDataset,
    TrainAlignedConfig,
    build_head,
    collate,
    train_aligned,
)
from specops.train.vocab import draft_vocabulary
from tests.drafters.aligned_head.conftest import fit_config
from tests.train.conftest import collect_config


def test_draft_vocabulary_takes_the_most_frequent_tokens_and_the_eos():
    counts = torch.tensor([5, 0, 9, 9, 1, 7])
    assert draft_vocabulary(counts, 3, always=set()).tolist() == [2, 3, 5]  # ties broken by the lower id
    assert draft_vocabulary(counts, 3, always={1}).tolist() == [1, 2, 3]
    with pytest.raises(ValueError, match="exceeds"):
        draft_vocabulary(counts, 7, always=set())


def test_positions_read_f_t_and_x_t1_and_predict_x_t2(aligned_traces):
    data = AlignedDataset(aligned_traces / "train", max_seq_len=10_000)
    raw = TraceShards(aligned_traces / "train")[0]
    item = data[0]
    ids, n = raw["input_ids"], len(raw["input_ids"]) - 1
    assert torch.equal(item["features"], raw["hidden_states"]) and item["features"].shape[1] == 2
    assert torch.equal(item["tokens"], ids[1:]) and torch.equal(item["teacher_ids"], raw["topk_ids"][1:])
    assert item["labels"][:-1].tolist() == ids[2:].tolist() and item["labels"][-1] == -1
    assert item["valid"][:-1].tolist() == raw["loss_mask"][2:].tolist() and not item["valid"][-1]
    assert len(item["tokens"]) == n
    cut = AlignedDataset(aligned_traces / "train", max_seq_len=5)[0]
    assert cut["features"].shape[0] == 6 and cut["tokens"].shape[0] == 5 and cut["valid"].shape[0] == 5
    batch = collate([data[0], data[1]])
    width = max(len(data[0]["tokens"]), len(data[1]["tokens"]))
    assert batch["features"].shape[:2] == (2, width + 1) and batch["labels"].shape == (2, width)


def test_fit_trains_every_parameter_and_saves_a_loadable_head(trained, chat_target, aligned_traces):
    cfg, report = trained
    assert report["steps"] == cfg.max_steps and torch.isfinite(torch.tensor(report["final_loss"]))
    assert len(report["val_acc_per_step"]) == cfg.ttt_steps and report["hidden_layers"] == [0, 1]
    assert 0 < report["draft_vocab_coverage"] <= 1
    initial, _ = build_head(chat_target, cfg, TraceShards(aligned_traces / "train", fields=("input_ids", "loss_mask")))
    head = load_head(cfg.out_dir)
    before, after = dict(initial.named_parameters()), dict(head.named_parameters())
    assert before.keys() == after.keys()
    unchanged = [name for name in before if torch.equal(before[name], after[name])]
    assert not unchanged, f"parameters that did not train: {unchanged}"
    assert torch.equal(head.d2t, initial.d2t)  # the vocabulary is data, not a parameter
    info = json.loads((Path(cfg.out_dir) / INFO_FILE).read_text())
    assert info["target"] == chat_target.fingerprint.to_dict() and info["config"]["ttt_steps"] == 3


def test_refuses_traces_without_hidden_states(tmp_path, chat_target, aligned_traces):
    bare = tmp_path / "bare"
    prompts = aligned_traces.parent / "prompts"
    collect(collect_config(bare, hidden_layers=[], max_new_tokens=4, max_prompts_per_split=3), chat_target, prompts)
    with pytest.raises(ValueError, match="no hidden states"):
        train_aligned(fit_config(tmp_path / "head"), chat_target, bare)


def test_config_comes_from_its_params_section():
    assert "train_aligned" in STAGES
    cfg = build(TrainAlignedConfig, {"ttt_steps": 2, "draft_vocab_size": None}, "train_aligned")
    assert cfg.ttt_steps == 2 and cfg.draft_vocab_size is None
    with pytest.raises(ParamsError, match="ttt_step"):
        build(TrainAlignedConfig, {"ttt_step": 2}, "train_aligned")
    with pytest.raises(ValueError, match="ttt_steps"):
        TrainAlignedConfig(ttt_steps=0)
