"""OSD's training side: the derived rejected positions are exactly where speculative decoding rejects the
draft, the window split is stable, and one tiny fit trains every trainable parameter and nothing else."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
import torch
from safetensors.torch import load_file

from specops.core.loop import SpeculativeGenerator
from specops.core.target import encode_prompt
from specops.data.collect import score
from specops.data.feedback_traces import split_window, write_feedback_traces
from specops.data.traces import next_token_mask
from specops.drafters.draft_lm import DraftLMDrafter
from specops.train.osd_distill import OSDConfig, load_parent, osd_distill, rejected_positions
from specops.train.train_draft import truncated_target
from tests.pipeline.osd.conftest import prompt_text, served_rows


def test_rejected_positions_are_where_greedy_verification_rejects(target):
    # A one-layer truncation of the target agrees with it often, but not always: both outcomes occur.
    draft = truncated_target(target.model, 1).eval()
    generator = SpeculativeGenerator(target, DraftLMDrafter(draft, target.vocab_size), "greedy", draft_tokens=1)
    outcomes: list[bool] = []
    for i in range(6):
        prompt = encode_prompt(target.tokenizer, prompt_text(i))
        result = generator.generate(prompt, 24)
        trace = score(target.model, "p", prompt, result.token_ids, 4, [])
        served = next_token_mask(torch.arange(len(trace.input_ids)) >= trace.n_prompt)
        rejected = rejected_positions(draft, trace.input_ids, trace.topk_ids[:, 0], served)
        position = 0  # output index of the token the next step proposes
        for drafted, accepted in result.stats.per_step:
            if drafted:  # row n_prompt - 1 + position predicts output token `position`
                assert bool(rejected[len(prompt) - 1 + position]) == (accepted == 0)
                outcomes.append(accepted == 0)
            position += accepted + 1
    assert any(outcomes) and not all(outcomes)


def test_window_split_is_stable_disjoint_and_never_empty():
    rows = [{"request_id": f"r{i}"} for i in range(10)]
    train, heldout = split_window(rows, 0.2, "salt")
    assert len(heldout) == 2 and len(train) == 8
    assert {r["request_id"] for r in train} | {r["request_id"] for r in heldout} == {f"r{i}" for i in range(10)}
    shuffled = random.Random(0).sample(rows, len(rows))
    assert {r["request_id"] for r in split_window(shuffled, 0.2, "salt")[1]} == {r["request_id"] for r in heldout}
    assert len(split_window(rows[:2], 0.01, "salt")[1]) == 1 and len(split_window(rows[:2], 0.99, "salt")[0]) == 1


@pytest.fixture(scope="module")
def fitted(osd_assets, tmp_path_factory):
    target, root = osd_assets["target"], osd_assets["root"]
    folder = tmp_path_factory.mktemp("osd-fit")
    write_feedback_traces(served_rows(target, 40, 6), target, folder / "served", 8, "window")
    write_feedback_traces(served_rows(target, 60, 6), target, folder / "replay", 8, "replay")
    cfg = OSDConfig(lr=0.01, epochs=2, batch_size=4, max_seq_len=64, accelerator="cpu", replay_ratio=0.5,
                    out_dir=str(folder / "out"))
    report = osd_distill(cfg, target, root / "parent", folder / "served", folder / "replay")
    return cfg, report, folder


def test_fit_trains_every_layer_keeps_the_frozen_head_and_mixes_replay(fitted, osd_assets):
    cfg, report, _ = fitted
    assert torch.isfinite(torch.tensor(report["final_loss"])) and report["steps"] > 0
    assert 0 < report["focus_positions"] <= report["served_positions"]
    assert report["replay_sequences"] == round(cfg.replay_ratio * report["focused_sequences"])
    parent = load_parent(osd_assets["root"] / "parent", train_embeddings=False)
    after = load_file(f"{cfg.out_dir}/model.safetensors")
    for name, before in parent.state_dict().items():
        frozen = not dict(parent.named_parameters())[name].requires_grad
        assert torch.equal(before, after[name]) == frozen, name


def test_replay_traces_must_share_the_served_top_k(fitted, osd_assets):
    cfg, _, folder = fitted
    target = osd_assets["target"]
    write_feedback_traces(served_rows(target, 80, 2), target, folder / "replay_k4", 4, "other")
    with pytest.raises(ValueError, match="must match"):
        osd_distill(replace(cfg, out_dir=str(folder / "unused")), target, osd_assets["root"] / "parent",
                    folder / "served", folder / "replay_k4")


def test_a_parent_with_a_draft_vocabulary_passes_it_on(fitted, osd_assets, tmp_path):
    import shutil

    from specops.drafters.draft_lm import load_draft_vocab, save_draft_vocab

    cfg, _, folder = fitted
    parent = tmp_path / "parent"
    shutil.copytree(osd_assets["root"] / "parent", parent)
    vocab = torch.arange(0, osd_assets["target"].vocab_size, 2)
    save_draft_vocab(parent, vocab)
    # The mask pass proposes from the vocabulary too: a token outside it is never the draft's proposal.
    trace = load_file(next((folder / "served").glob("shard-*.safetensors")))
    ids, top = trace["input_ids"][:20].long(), trace["topk_ids"][:20, 0].long()
    served = torch.ones(20, dtype=torch.bool)
    odd_target = top % 2 == 1
    assert rejected_positions(load_parent(parent, False), ids, top, served, vocab)[odd_target].all()
    with pytest.raises(ValueError, match="forward_kl"):
        osd_distill(replace(cfg, loss="tvd", out_dir=str(tmp_path / "unused")), osd_assets["target"], parent,
                    folder / "served", folder / "replay")
    report = osd_distill(replace(cfg, out_dir=str(tmp_path / "child")), osd_assets["target"], parent,
                         folder / "served", folder / "replay")
    assert torch.isfinite(torch.tensor(report["final_loss"]))
    assert torch.equal(load_draft_vocab(tmp_path / "child"), vocab)


@pytest.mark.parametrize(("overrides", "match"), [
    ({"strategy": "horovod"}, "osd.strategy 'horovod' is unknown"),
    ({"batch_size": 0}, "osd: batch_size"),
    ({"focus": "some"}, "osd.focus"),
    ({"eval_prompts": 0}, "eval_prompts"),
])
def test_bad_osd_settings_name_their_key(overrides, match):
    with pytest.raises(ValueError, match=match):
        OSDConfig(**overrides)
