"""Fixtures for the training tests: a character-level chat tokenizer, a tiny random Llama target,
and prompts and traces made from them once per session. Nothing is downloaded."""

from __future__ import annotations

import json
import os
import string
from pathlib import Path

import pytest
import torch
from tokenizers import Regex, Tokenizer, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from specops.core.target import Target, target_from_model
from specops.data.collect import CollectConfig, collect
from specops.data.prompts import PrepareConfig, prepare

os.environ.setdefault("HF_HUB_OFFLINE", "1")

SPECIALS = ["<pad>", "<unk>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
HIDDEN = 32
LAYERS = 2


def char_tokenizer() -> PreTrainedTokenizerFast:
    """One token per printable ASCII character plus ChatML specials: ~100 tokens, exact token counts."""
    vocab = {token: i for i, token in enumerate(SPECIALS + sorted(set(string.printable)))}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    wrapped = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>", eos_token="<|im_end|>",
                                      additional_special_tokens=["<|im_start|>"])
    wrapped.chat_template = CHAT_TEMPLATE
    return wrapped


def tiny_llama(vocab: int, eos: int, seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN, num_hidden_layers=LAYERS,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         bos_token_id=None, eos_token_id=eos, pad_token_id=0, tie_word_embeddings=False)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():  # random init gives near-uniform logits; sharpen them so argmaxes rarely tie
        model.lm_head.weight.mul_(8.0)
    model.generation_config.eos_token_id = eos
    model.generation_config.pad_token_id = 0
    return model


@pytest.fixture(scope="package", autouse=True)
def one_torch_thread():
    """Tiny models run ~30x faster on one thread than on two when other jobs share the machine's cores."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def chat_tokenizer() -> PreTrainedTokenizerFast:
    return char_tokenizer()


@pytest.fixture(scope="session")
def tiny_target(chat_tokenizer: PreTrainedTokenizerFast) -> Target:
    model = tiny_llama(len(chat_tokenizer), chat_tokenizer.convert_tokens_to_ids("<|im_end|>"))
    return target_from_model(model, chat_tokenizer, name="tiny-char-llama")


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


USER_PROMPTS = [f"question {i}: what is {i} + {i * 3}?" for i in range(24)]


@pytest.fixture(scope="session")
def prompts_dir(tmp_path_factory: pytest.TempPathFactory, chat_tokenizer: PreTrainedTokenizerFast) -> Path:
    root = tmp_path_factory.mktemp("prompts")
    user = write_jsonl(root / "user.jsonl", [{"prompt": p} for p in USER_PROMPTS])
    cfg = PrepareConfig(sharegpt_max=0, humaneval=False, user_files=[str(user)], val_fraction=0.25, test_fraction=0.1,
                        out_dir=str(root / "out"))
    prepare(cfg, chat_tokenizer)
    return root / "out"


def collect_config(out_dir: Path, **overrides) -> CollectConfig:
    settings = dict(max_new_tokens=6, top_k_logits=8, hidden_layers=[0, -1], shard_size=3, out_dir=str(out_dir))
    return CollectConfig(**{**settings, **overrides})


@pytest.fixture(scope="session")
def traces_dir(tmp_path_factory: pytest.TempPathFactory, tiny_target: Target, prompts_dir: Path) -> Path:
    out = tmp_path_factory.mktemp("traces")
    collect(collect_config(out), tiny_target, prompts_dir)
    return out
