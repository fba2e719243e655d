"""Build drafters and generators from names, options and bundles."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from transformers import AutoModelForCausalLM

from serving.drafters.base import Drafter
from serving.drafters.draft_lm import DraftLMDrafter
from serving.drafters.prompt_lookup import PromptLookupDrafter
from serving.drafters.recycling import RecyclingDrafter
from serving.speculative import SpeculativeGenerator
from serving.target import DTYPES, Target, encode_prompt, load_target
from serving.types import SamplingParams

DRAFTER_KINDS = ("none", "prompt-lookup", "recycling", "draft-lm")


@dataclass
class DecodingConfig:
    """How a generator decodes; serving.yaml in a bundle and the CLI flags both fill this."""

    drafter: str = "recycling"  # one of DRAFTER_KINDS
    verifier: str = "auto"  # greedy | rejection | block | auto (greedy at temperature 0, rejection otherwise)
    draft_tokens: int = 6  # chain drafters: tokens per step; tree drafters: maximum accepted depth
    prompt_lookup_max_ngram: int = 3
    recycling_nodes: int = 12  # size of the Token Recycling tree (tuned for a 2-core CPU by sweep)
    extra: dict[str, Any] = field(default_factory=dict)


def load_draft_model(path: str | Path, dtype: str = "float32"):
    path = Path(path)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"Draft model folder {path} has no config.json; pass a Hugging Face model folder.")
    return AutoModelForCausalLM.from_pretrained(path, dtype=DTYPES[dtype]).eval()


def build_drafter(kind: str, target: Target, config: DecodingConfig, draft_model_path: str | Path | None = None,
                  ) -> Drafter | None:
    if kind == "none":
        return None
    if kind == "prompt-lookup":
        return PromptLookupDrafter(max_ngram=config.prompt_lookup_max_ngram)
    if kind == "recycling":
        return RecyclingDrafter(target.vocab_size, num_nodes=config.recycling_nodes)
    if kind == "draft-lm":
        if draft_model_path is None:
            raise ValueError("The draft-lm drafter needs a draft model folder (--draft-model PATH).")
        # The draft runs in the target's dtype: bf16 halves its cost too.
        dtype = next((name for name, d in DTYPES.items() if d == target.model.dtype), "float32")
        return DraftLMDrafter(load_draft_model(draft_model_path, dtype), target.vocab_size)
    raise ValueError(f"Unknown drafter '{kind}'. Choose one of: {', '.join(DRAFTER_KINDS)}.")


def resolve_verifier(verifier: str, sampling: SamplingParams) -> str:
    if verifier == "auto":
        return "greedy" if sampling.greedy else "rejection"
    return verifier


class TextGenerator:
    """Text in, text out: tokenization, chat template and a speculative generator per verifier."""

    def __init__(self, target: Target, drafter: Drafter | None, config: DecodingConfig) -> None:
        self.target = target
        self.drafter = drafter
        self.config = config

    def generator(self, sampling: SamplingParams) -> SpeculativeGenerator:
        return SpeculativeGenerator(self.target, self.drafter, resolve_verifier(self.config.verifier, sampling),
                                    self.config.draft_tokens)

    def generate_text(self, prompt: str | list[dict[str, str]], max_new_tokens: int = 64, temperature: float = 0.0,
                      top_p: float = 1.0, seed: int | None = None, raw: bool = False) -> dict[str, Any]:
        sampling = SamplingParams(temperature=temperature, top_p=top_p)
        ids = encode_prompt(self.target.tokenizer, prompt, raw=raw)
        result = self.generator(sampling).generate(ids, max_new_tokens, sampling, seed)
        text = self.target.tokenizer.decode(result.token_ids, skip_special_tokens=True)
        return {"text": text, "token_ids": result.token_ids, "finish_reason": result.finish_reason,
                "stats": result.stats.to_dict()}


def generator_from_bundle(bundle_path: str | Path, target: Target | None = None) -> TextGenerator:
    """Load a verified bundle and the target it was built for; the fingerprint must match."""
    from serving.bundle import load_bundle

    bundle = load_bundle(bundle_path)
    if target is None:
        target = load_target(bundle.target_source, bundle.target_dtype)
    bundle = load_bundle(bundle_path, expected_fingerprint=target.fingerprint)
    known = {f for f in DecodingConfig.__dataclass_fields__ if f != "extra"}
    config = DecodingConfig(**{k: v for k, v in bundle.serving.items() if k in known},
                            extra={k: v for k, v in bundle.serving.items() if k not in known})
    drafter = build_drafter(bundle.drafter_kind, target, config, bundle.drafter_dir)
    return TextGenerator(target, drafter, config)
