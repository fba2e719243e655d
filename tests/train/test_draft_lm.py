from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from pytorch_lightning.loggers import MLFlowLogger
from transformers import AutoModelForCausalLM, AutoTokenizer

from specops.core.target import target_from_model
from specops.train.strategies import STRATEGIES, make_strategy
from specops.train.train_draft import (
    INFO_FILE,
    DistillDataset,
    TrainDraftConfig,
    build_draft_model,
    collate,
    train_draft,
)
from tests.train.conftest import HIDDEN, tiny_llama


def fit_config(out_dir: Path, **overrides) -> TrainDraftConfig:
    settings = dict(hidden_size=HIDDEN, num_layers=1, num_heads=4, intermediate_size=64, batch_size=4, max_steps=4,
                    lr=1e-2, accelerator="cpu", log_every_n_steps=1, out_dir=str(out_dir),
                    checkpoint_dir=str(out_dir.parent / "checkpoints"))
    return TrainDraftConfig(**{**settings, **overrides})


def assert_every_parameter_changed(cfg: TrainDraftConfig, target_model, out_dir: Path) -> dict[str, torch.Tensor]:
    initial = dict(build_draft_model(target_model, cfg).named_parameters())  # seeded: the weights training started from
    trained = dict(AutoModelForCausalLM.from_pretrained(out_dir).named_parameters())
    assert initial.keys() == trained.keys()
    unchanged = [name for name in initial if torch.equal(initial[name], trained[name])]
    assert not unchanged, f"parameters that did not train: {unchanged}"
    return trained


@pytest.fixture(scope="module")
def auto_run(tmp_path_factory, tiny_target, traces_dir):
    root = tmp_path_factory.mktemp("draft_auto")
    logger = MLFlowLogger(experiment_name="train_draft", tracking_uri=f"sqlite:///{root / 'mlflow.db'}")
    cfg = fit_config(root / "draft")
    report = train_draft(cfg, tiny_target, traces_dir, logger=logger)
    return cfg, report, logger


def test_draft_shares_the_targets_vocabulary_and_embeddings(tiny_target):
    target = tiny_target.model
    draft = build_draft_model(target, fit_config(Path("unused")))
    assert draft.config.vocab_size == target.config.vocab_size and draft.config.num_hidden_layers == 1
    assert torch.equal(draft.get_input_embeddings().weight, target.get_input_embeddings().weight)
    assert torch.equal(draft.get_output_embeddings().weight, target.get_output_embeddings().weight)  # untied target
    fresh = build_draft_model(target, fit_config(Path("unused"), init_embeddings_from_target=False))
    assert not torch.equal(fresh.get_input_embeddings().weight, target.get_input_embeddings().weight)
    with pytest.raises(ValueError, match="hidden_size == the target's"):
        build_draft_model(target, fit_config(Path("unused"), hidden_size=2 * HIDDEN))


def test_batches_distill_the_predictions_of_response_tokens(traces_dir):
    data = DistillDataset(traces_dir / "train", max_seq_len=10_000)
    for item in (data[i] for i in range(len(data))):
        n_prompt = len(item["input_ids"]) - int(item["mask"].sum())  # one distilled row per response token
        # Row n_prompt - 1 (the last prompt token) predicts the first response token; the last row predicts nothing.
        assert item["mask"][: n_prompt - 1].sum() == 0 and item["mask"][n_prompt - 1 : -1].all() and not item["mask"][-1]
    items = [data[0], data[1], data[2]]
    batch = collate(items)
    width = max(len(item["input_ids"]) for item in items)
    assert batch["input_ids"].shape == (3, width) and batch["topk_ids"].shape == (3, width, 8)
    for row, item in enumerate(items):
        n = len(item["input_ids"])
        assert batch["attention_mask"][row].tolist() == [1] * n + [0] * (width - n)
        assert torch.equal(batch["mask"][row, :n], item["mask"]) and not batch["mask"][row, n:].any()
    cut = DistillDataset(traces_dir / "train", max_seq_len=5)[0]
    assert torch.equal(cut["input_ids"], data[0]["input_ids"][:5]) and cut["topk_logprobs"].shape == (5, 8)


def test_fit_trains_every_parameter_and_saves_a_loadable_folder(auto_run, tiny_target):
    cfg, report, logger = auto_run
    assert math.isfinite(report["final_loss"]) and math.isfinite(report["val_loss"]) and report["steps"] == 4
    out = Path(cfg.out_dir)
    trained = assert_every_parameter_changed(cfg, tiny_target.model, out)
    assert all(t.dtype == torch.float32 for t in trained.values())
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert tokenizer.get_vocab() == tiny_target.tokenizer.get_vocab() and tokenizer.chat_template
    info = json.loads((out / INFO_FILE).read_text())
    assert info["target"] == tiny_target.fingerprint.to_dict() and info["report"] == report
    run = logger.experiment.get_run(logger.run_id)  # the logger's MlflowClient, on the sqlite store
    assert run.data.params["loss"] == "forward_kl" and "train/loss" in run.data.metrics


@pytest.mark.parametrize("stage", [2, 3])
def test_deepspeed_zero_on_cpu_trains_like_auto(stage, auto_run, tmp_path, tiny_target, traces_dir):
    """Same seed, same data order, same AdamW: ZeRO only reshapes the optimizer state, so the losses and
    weights must match the plain run's up to float32 summation order."""
    auto_cfg, auto_report, _ = auto_run
    cfg = fit_config(tmp_path / "draft", strategy=f"deepspeed_stage_{stage}")
    report = train_draft(cfg, tiny_target, traces_dir)
    assert report["steps"] == 4
    assert report["final_loss"] == pytest.approx(auto_report["final_loss"], rel=1e-4)
    assert report["val_loss"] == pytest.approx(auto_report["val_loss"], rel=1e-4)
    trained = assert_every_parameter_changed(cfg, tiny_target.model, tmp_path / "draft")
    reference = dict(AutoModelForCausalLM.from_pretrained(auto_cfg.out_dir).named_parameters())
    for name, tensor in trained.items():
        torch.testing.assert_close(tensor, reference[name], rtol=1e-4, atol=1e-5)


def test_traces_of_another_target_are_refused(tmp_path, tiny_target, traces_dir):
    other = target_from_model(tiny_llama(tiny_target.vocab_size, 3, seed=7), tiny_target.tokenizer)
    with pytest.raises(ValueError, match="another target: weights differ"):
        train_draft(fit_config(tmp_path), other, traces_dir)


def test_strategies_by_name(tmp_path):
    assert set(STRATEGIES) == {"auto", "ddp", "fsdp", "deepspeed_stage_2", "deepspeed_stage_3"}
    assert make_strategy("auto") == "auto"
    assert make_strategy("deepspeed_stage_3").config["zero_optimization"]["stage"] == 3
    with pytest.raises(ValueError, match="Unknown strategy 'deepspeed'"):
        make_strategy("deepspeed")
    wrong = tmp_path / "zero.json"
    wrong.write_text(json.dumps({"zero_optimization": {"stage": 3}}))
    with pytest.raises(ValueError, match="sets ZeRO stage 3"):
        make_strategy("deepspeed_stage_2", str(wrong))
    with pytest.raises(ValueError, match="not a deepspeed one"):
        TrainDraftConfig(deepspeed_config=str(wrong))


def test_truncated_target_keeps_the_targets_weights(target):
    """All layers kept: the draft computes exactly the target; fewer: the target's first layers."""
    from specops.train.train_draft import truncated_target

    ids = torch.tensor([[5, 9, 14, 3, 7]])
    full = truncated_target(target.model, target.model.config.num_hidden_layers)
    torch.testing.assert_close(full(ids).logits, target.model(ids).logits)
    short = truncated_target(target.model, 1)
    assert short.config.num_hidden_layers == 1
    torch.testing.assert_close(short.model.layers[0].mlp.up_proj.weight, target.model.model.layers[0].mlp.up_proj.weight)
    with pytest.raises(ValueError, match="num_layers"):
        truncated_target(target.model, 99)


def test_truncated_draft_with_frozen_embeddings_trains_only_its_layers(tmp_path, tiny_target, traces_dir):
    cfg = fit_config(tmp_path / "draft", init_layers_from_target=True, train_embeddings=False)
    report = train_draft(cfg, tiny_target, traces_dir)
    assert math.isfinite(report["final_loss"])
    trained = dict(AutoModelForCausalLM.from_pretrained(tmp_path / "draft").named_parameters())
    start = dict(build_draft_model(tiny_target.model, cfg).named_parameters())
    frozen = {"model.embed_tokens.weight", "lm_head.weight"}
    for name, tensor in trained.items():
        moved = not torch.equal(start[name], tensor)
        assert moved == (name not in frozen), name
    torch.testing.assert_close(trained["lm_head.weight"], tiny_target.model.lm_head.weight)


def test_reduced_vocabulary_draft_trains_only_its_rows_and_saves_them(tmp_path, tiny_target, traces_dir):
    from specops.data.traces import TraceShards
    from specops.drafters.draft_lm import load_draft, load_draft_vocab
    from specops.train.vocab import frequent_vocabulary

    cfg = fit_config(tmp_path / "draft", init_layers_from_target=True, draft_vocab_size=4)
    report = train_draft(cfg, tiny_target, traces_dir)
    assert math.isfinite(report["final_loss"]) and report["draft_vocab_size"] == 4
    vocab = load_draft_vocab(tmp_path / "draft")
    expected, coverage = frequent_vocabulary(TraceShards(traces_dir / "train"), 4, tiny_target)
    assert torch.equal(vocab, expected) and report["draft_vocab_coverage"] == round(coverage, 4) < 1
    head = AutoModelForCausalLM.from_pretrained(tmp_path / "draft").lm_head.weight
    start = tiny_target.model.lm_head.weight
    outside = torch.ones(len(head), dtype=torch.bool)
    outside[vocab] = False
    assert torch.equal(head[outside], start[outside])  # rows the draft never proposes get no gradient
    assert not torch.equal(head[vocab], start[vocab])
    model, loaded_vocab = load_draft(tmp_path / "draft", torch.bfloat16)  # in the dtype a bf16 target asks for
    assert model.dtype == torch.bfloat16 and not model.training and torch.equal(loaded_vocab, vocab)
    with pytest.raises(FileNotFoundError, match="no config.json"):
        load_draft(tmp_path)
    # A full-vocabulary run into the same folder removes the stale vocabulary.
    train_draft(fit_config(tmp_path / "draft", init_layers_from_target=True), tiny_target, traces_dir)
    assert load_draft_vocab(tmp_path / "draft") is None


@pytest.mark.parametrize(("overrides", "match"), [
    ({"draft_vocab_size": 8, "loss": "tvd"}, "forward_kl"),
    ({"draft_vocab_size": 8, "strategy": "deepspeed_stage_3"}, "shards"),
    ({"draft_vocab_size": 0}, ">= 1"),
])
def test_reduced_vocabulary_settings_are_checked(overrides, match):
    with pytest.raises(ValueError, match=match):
        fit_config(Path("unused"), **overrides)
