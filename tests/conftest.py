"""Tiny random-weight models and a tiny tokenizer, built in memory so tests run offline in seconds."""

from __future__ import annotations

import os

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

os.environ.setdefault("HF_HUB_OFFLINE", "1")
# Tiny models gain nothing from threads, and on a loaded 2-core machine OpenMP spin-waiting makes
# multi-threaded runs of them up to ~30x slower.
torch.set_num_threads(1)

VOCAB = 96
EOS = 2
CHAT_TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}> {{ m['content'] }} </s> {% endfor %}"
    "{% if add_generation_prompt %}<assistant> {% endif %}"
)


def tiny_tokenizer(vocab: int = VOCAB) -> PreTrainedTokenizerFast:
    words = ["<pad>", "<unk>", "</s>", "<user>", "<assistant>", "<system>"]
    words += [f"w{i}" for i in range(vocab - len(words))]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    wrapped = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>", eos_token="</s>")
    wrapped.chat_template = CHAT_TEMPLATE
    return wrapped


def tiny_llama(seed: int, vocab: int = VOCAB, layers: int = 2, hidden: int = 48, dtype=torch.float32,
               max_positions: int = 256) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_positions,
                         eos_token_id=EOS, bos_token_id=1, pad_token_id=0, tie_word_embeddings=False)
    model = LlamaForCausalLM(config).to(dtype).eval()
    # Random init gives near-uniform logits; sharpen them so generations have structure and rarely tie.
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    model.generation_config.eos_token_id = EOS
    model.generation_config.pad_token_id = 0
    return model


@pytest.fixture(scope="session")
def tokenizer() -> PreTrainedTokenizerFast:
    return tiny_tokenizer()


@pytest.fixture(scope="session")
def target(tokenizer):
    from specops.core.target import target_from_model

    return target_from_model(tiny_llama(seed=0), tokenizer, name="tiny-target")


@pytest.fixture(scope="session")
def draft_model():
    return tiny_llama(seed=1, layers=1, hidden=32)


@pytest.fixture(scope="session")
def draft_dir(tmp_path_factory, draft_model, tokenizer):
    """The tiny draft LM as a Hugging Face folder."""
    path = tmp_path_factory.mktemp("draft")
    draft_model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture
def python_loop(monkeypatch):
    """LlamaForward's decoder layers through its Python loop and ATen's attention, as on a machine without the
    native decoder: for tests of that runtime, and mutants that patch its Python helpers (_padded_stack, the
    attention groups), which the native decoder does not call (tests/core/test_native.py tests that one)."""
    from specops.core import native

    monkeypatch.setattr(native, "extension", lambda: None)
