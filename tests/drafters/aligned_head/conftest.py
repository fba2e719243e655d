"""Fixtures for the aligned-head tests: tiny heads over tiny Llama targets, traces with hidden states
from the training tests' character-level chat target, and one short training run shared by the tests."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import PreTrainedModel

from specops.core.target import Target, target_from_model
from specops.data.collect import collect
from specops.data.prompts import PrepareConfig, prepare
from specops.drafters.aligned_head.model import AlignedHead, AlignedHeadConfig
from specops.train.train_aligned import TrainAlignedConfig, train_aligned
from tests.train.conftest import USER_PROMPTS, char_tokenizer, collect_config, write_jsonl
from tests.train.conftest import tiny_llama as tiny_chat_llama


def make_head(model: PreTrainedModel, layers: list[int], draft_vocab: int | None = None, tgf: bool = True,
              teh: bool = True, seed: int = 0) -> AlignedHead:
    """A random head for `model`; with draft_vocab, the draft vocabulary is every other target id.
    A random TGF gets a non-zero down projection, so the fusion path is exercised."""
    tc = model.config
    cfg = AlignedHeadConfig(
        hidden_size=tc.hidden_size, target_vocab_size=tc.vocab_size, hidden_layers=layers,
        num_target_layers=tc.num_hidden_layers, num_attention_heads=tc.num_attention_heads,
        num_key_value_heads=tc.num_key_value_heads, head_dim=tc.hidden_size // tc.num_attention_heads,
        intermediate_size=2 * tc.hidden_size, draft_vocab_size=draft_vocab, token_guided_fusion=tgf,
        token_enhanced_head=teh)
    torch.manual_seed(seed)
    head = AlignedHead(cfg)
    if draft_vocab is not None:
        head.set_draft_vocab(torch.arange(0, 2 * draft_vocab, 2))
    if head.tgf is not None:
        torch.nn.init.normal_(head.tgf.down_proj.weight, std=0.05)
    return head.eval()


@pytest.fixture(scope="session")
def chat_target() -> Target:
    tokenizer = char_tokenizer()
    model = tiny_chat_llama(len(tokenizer), tokenizer.convert_tokens_to_ids("<|im_end|>"))
    return target_from_model(model, tokenizer, name="tiny-char-llama")


@pytest.fixture(scope="session")
def aligned_traces(tmp_path_factory: pytest.TempPathFactory, chat_target: Target) -> Path:
    """train/val traces with the outputs of both decoder layers."""
    root = tmp_path_factory.mktemp("aligned_traces")
    user = write_jsonl(root / "user.jsonl", [{"prompt": p} for p in USER_PROMPTS])
    prepare(PrepareConfig(sharegpt_max=0, humaneval=False, user_files=[str(user)], val_fraction=0.25,
                          test_fraction=0.1, out_dir=str(root / "prompts")), chat_target.tokenizer)
    collect(collect_config(root / "traces", hidden_layers=[0, 1], max_new_tokens=12), chat_target, root / "prompts")
    return root / "traces"


def fit_config(out_dir: Path, **overrides) -> TrainAlignedConfig:
    settings = dict(draft_vocab_size=40, ttt_steps=3, batch_size=4, epochs=3, max_steps=6, lr=1e-2, accelerator="cpu",
                    log_every_n_steps=1, out_dir=str(out_dir))
    return TrainAlignedConfig(**{**settings, **overrides})


@pytest.fixture(scope="session")
def trained(tmp_path_factory: pytest.TempPathFactory, chat_target: Target, aligned_traces: Path):
    """(config, report) of one short training run of a GRIFFIN head (TGF and TEH on)."""
    cfg = fit_config(tmp_path_factory.mktemp("aligned_head") / "head")
    return cfg, train_aligned(cfg, chat_target, aligned_traces)
