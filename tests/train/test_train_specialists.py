"""train_specialists: one draft LM per slice of the traces, continued from the general draft LM."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from specops.core.loop import SpeculativeGenerator
from specops.data.prompts import read_split
from specops.drafters.cosine import SPECIALISTS_FILE, CosineDrafter
from specops.drafters.draft_lm import load_draft_vocab
from specops.drafters.factory import build_drafter
from specops.drafters.kinds import DecodingConfig
from specops.train.train_draft import train_draft
from specops.train.train_specialists import (
    SliceDataset,
    TrainSpecialistsConfig,
    prompt_sources,
    train_specialists,
)
from tests.train.conftest import write_jsonl
from tests.train.test_draft_lm import fit_config


@pytest.fixture(scope="module")
def two_source_prompts(tmp_path_factory, prompts_dir):
    """The prepared splits with every other prompt relabelled: sources 'even' and 'odd'."""
    root = tmp_path_factory.mktemp("two_sources")
    for split in ("train", "val", "test"):
        rows = read_split(prompts_dir / f"{split}.jsonl")
        write_jsonl(root / f"{split}.jsonl", [{**row, "source": ("even", "odd")[i % 2]} for i, row in enumerate(rows)])
    return root


@pytest.fixture(scope="module")
def general_draft(tmp_path_factory, tiny_target, traces_dir):
    out = tmp_path_factory.mktemp("general")
    train_draft(fit_config(out / "draft", init_layers_from_target=True, train_embeddings=False, draft_vocab_size=24,
                           max_steps=2), tiny_target, traces_dir)
    return out / "draft"


@pytest.fixture(scope="module")
def specialists(tmp_path_factory, tiny_target, traces_dir, general_draft, two_source_prompts):
    out = tmp_path_factory.mktemp("specialists")
    cfg = TrainSpecialistsConfig(slices={"evens": ["even"], "odds": ["odd"]}, batch_size=2, max_steps=3, lr=1e-2,
                                 accelerator="cpu", out_dir=str(out / "specialists"),
                                 checkpoint_dir=str(out / "checkpoints"), curves_dir=str(out / "curves"))
    return cfg, train_specialists(cfg, tiny_target, general_draft, two_source_prompts, traces_dir)


def test_a_slice_holds_exactly_its_sources_sequences(traces_dir, two_source_prompts):
    sources = prompt_sources(two_source_prompts)
    evens = frozenset(i for i, s in sources.items() if s == "even")
    data = SliceDataset(traces_dir / "train", 64, evens)
    assert 0 < len(data) < len(SliceDataset(traces_dir / "train", 64, frozenset(sources)))
    assert all(data.shards.prompt_ids[row] in evens for row in data.rows)
    assert torch.equal(data[0]["input_ids"], data.shards[data.rows[0]]["input_ids"][:64])


def test_each_specialist_continues_the_general_draft_on_its_slice(specialists, general_draft):
    cfg, report = specialists
    root_path = Path(cfg.out_dir)
    assert json.loads((root_path / SPECIALISTS_FILE).read_text())["specialists"] == ["evens", "odds"]
    general = dict(AutoModelForCausalLM.from_pretrained(general_draft).named_parameters())
    trained = {}
    for name in ("evens", "odds"):
        assert math.isfinite(report["reports"][name]["final_loss"]) and report["reports"][name]["steps"] == 3
        trained[name] = dict(AutoModelForCausalLM.from_pretrained(root_path / name).named_parameters())
        for param, tensor in trained[name].items():
            frozen = param in ("model.embed_tokens.weight", "lm_head.weight")
            assert torch.equal(general[param], tensor) == frozen, (name, param)
        assert torch.equal(load_draft_vocab(root_path / name), load_draft_vocab(general_draft))  # the general one's rows
        assert (Path(cfg.curves_dir) / name / "train.csv").is_file()
    layer = "model.layers.0.mlp.up_proj.weight"
    assert not torch.equal(trained["evens"][layer], trained["odds"][layer])  # different slices, different drafts
    assert set(load_file(str(root_path / "evens" / "model.safetensors"))) == set(
        load_file(str(general_draft / "model.safetensors")))


def test_the_specialists_folder_drafts_as_cosine_and_stays_lossless(specialists, tiny_target):
    cfg, _ = specialists
    prompt = tiny_target.tokenizer.encode("question 3: what is")
    plain = SpeculativeGenerator(tiny_target, None).generate(prompt, 12).token_ids
    for kind in ("cosine", "cosine-tree"):
        config = DecodingConfig(drafter=kind, tree_nodes=4)
        drafter = build_drafter(kind, tiny_target, config, cfg.out_dir)
        assert isinstance(drafter, CosineDrafter) and drafter.names == ["evens", "odds"]
        assert SpeculativeGenerator(tiny_target, drafter, draft_tokens=3).generate(prompt, 12).token_ids == plain


def test_settings_are_checked():
    with pytest.raises(ValueError, match="at least two specialists"):
        TrainSpecialistsConfig(slices={"only": ["a"]})
    with pytest.raises(ValueError, match="loss"):
        TrainSpecialistsConfig(loss="nope")


def test_a_slice_without_traces_is_refused(tmp_path, tiny_target, traces_dir, general_draft, two_source_prompts):
    cfg = TrainSpecialistsConfig(slices={"evens": ["even"], "ghosts": ["nowhere"]}, max_steps=1, accelerator="cpu",
                                 out_dir=str(tmp_path / "out"), checkpoint_dir=None, batch_size=2)
    with pytest.raises(ValueError, match="no train traces for specialist 'ghosts'"):
        train_specialists(cfg, tiny_target, general_draft, two_source_prompts, traces_dir)
