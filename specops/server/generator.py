"""Text in, text out: a `TextGenerator` around the speculative loop, built from options or a bundle."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

from specops.core.batching import PassBatcher, batch_invariant
from specops.core.drafter import Drafter
from specops.core.loop import SpeculativeGenerator
from specops.core.prefix_cache import PrefixCache
from specops.core.target import Target, encode_prompt, load_target
from specops.core.types import SamplingParams
from specops.drafters.acceptance_head import HEAD_COMPONENT
from specops.drafters.draft_lm import DraftLMDrafter
from specops.drafters.factory import build_drafter, build_policy, resolve_verifier
from specops.drafters.kinds import DRAFTERS, DecodingConfig
from specops.lossy.modes import LOSSY_MODES, OFF, LossyModels
from specops.lossy.router import COMPONENT as ROUTER_COMPONENT
from specops.server.bundle import Bundle, BundleError, load_bundle


class TextGenerator:
    """Text in, text out: tokenization, chat template and a speculative generator per verifier."""

    def __init__(self, target: Target, drafter: Drafter | None, config: DecodingConfig) -> None:
        self.target = target
        self.drafter = drafter
        self.config = config
        self.policy = build_policy(config, target, drafter)  # built once: goodput times the models here
        self.batcher: PassBatcher | None = None  # set on forks that decode beside others (specops.server.worker)
        self.prefix_cache: PrefixCache | None = None  # shared by a server's forks (specops.server.worker)
        self._lossy: LossyModels | None = None
        if config.lossy_mode not in LOSSY_MODES:
            raise ValueError(f"Unknown lossy_mode '{config.lossy_mode}'. Choose one of: {', '.join(LOSSY_MODES)}.")
        if config.lossy_mode != OFF:  # fail at load, not at the first request
            self.lossy_models().router(config.lossy_mode)

    @property
    def batchable(self) -> bool:
        """Whether its generations may share batched target passes without changing a bit of their output:
        the eager static runtime in bf16, on a model whose products all run on oneDNN (specops.core.batching)."""
        return bool(self.config.static_width) and not self.config.compiled and batch_invariant(self.target.model)

    def fork(self, batcher: PassBatcher | None, prefix_cache: PrefixCache | None = None) -> TextGenerator:
        """A generator for one more concurrent generation: the same models, its own drafter and policy state
        (drafters reset theirs at each generation's start), its passes batched through `batcher`, its prompts
        prefilled through `prefix_cache` (shared with the other forks)."""
        twin = copy.copy(self)
        twin.drafter = copy.copy(self.drafter)
        twin.policy = copy.deepcopy(self.policy)
        twin.batcher = batcher
        twin.prefix_cache = prefix_cache
        return twin

    def lossy_models(self) -> LossyModels:
        if self._lossy is None:
            if not isinstance(self.drafter, DraftLMDrafter):
                raise ValueError(f"The lossy modes draft with a draft LM; this generator's drafter is "
                                 f"'{self.config.drafter}'.")
            if self.config.router_dir is None:
                raise ValueError("The lossy modes need router_dir: the train_router stage's output folder.")
            self._lossy = LossyModels(self.target, self.drafter.model, self.config.router_dir, self.drafter.vocab)
        return self._lossy

    def generator(self, sampling: SamplingParams, lossy_mode: str | None = None,
                  lossy_threshold: float | None = None) -> SpeculativeGenerator:
        """lossy_mode/lossy_threshold, when given, override serving.yaml's for this request. A lossy default
        applies to greedy requests only; asking for a lossy mode while sampling is an error (in `stream`)."""
        mode = lossy_mode if lossy_mode is not None else (self.config.lossy_mode if sampling.greedy else OFF)
        if mode != OFF:
            threshold = lossy_threshold if lossy_threshold is not None else self.config.lossy_threshold
            return self.lossy_models().generator(mode, threshold, self.config.draft_tokens)
        return SpeculativeGenerator(self.target, self.drafter, resolve_verifier(self.config.verifier, sampling),
                                    self.config.draft_tokens, policy=self.policy, static_width=self.config.static_width,
                                    compiled=self.config.compiled, prefill_chunk=self.config.prefill_chunk,
                                    batcher=self.batcher,
                                    prefill_cache=self.prefix_cache if self.config.static_width else None)

    def generate_text(self, prompt: str | list[dict[str, str]], max_new_tokens: int = 64, temperature: float = 0.0,
                      top_p: float = 1.0, seed: int | None = None, raw: bool = False, lossy_mode: str | None = None,
                      lossy_threshold: float | None = None) -> dict[str, Any]:
        sampling = SamplingParams(temperature=temperature, top_p=top_p)
        ids = encode_prompt(self.target.tokenizer, prompt, raw=raw)
        result = self.generator(sampling, lossy_mode, lossy_threshold).generate(ids, max_new_tokens, sampling, seed)
        text = self.target.tokenizer.decode(result.token_ids, skip_special_tokens=True)
        return {"text": text, "token_ids": result.token_ids, "finish_reason": result.finish_reason,
                "stats": result.stats.to_dict()}


def _router_dir(bundle: Bundle, router_dir: str | None) -> str | None:
    """serving.yaml's router_dir, relative to the bundle (default: its router component). A path that leaves
    the bundle is refused: it would serve routers that no checksum covers."""
    if router_dir is None:
        return str(bundle.extra_dirs[ROUTER_COMPONENT]) if ROUTER_COMPONENT in bundle.extra_dirs else None
    path = (bundle.root / router_dir).resolve()  # an absolute router_dir replaces the root here
    if not path.is_relative_to(bundle.root.resolve()):
        raise BundleError(f"Bundle {bundle.root}: serving.yaml's router_dir '{router_dir}' is outside the bundle; "
                          "ship the routers as its router/ component instead.")
    return str(path)


def generator_from_bundle(bundle: Bundle | str | Path, target: Target | None = None) -> TextGenerator:
    """A generator for a bundle and the target it was built for; the fingerprint must match.

    Pass an already verified `Bundle` (a hot reload has one) to skip hashing its files again; a path is
    verified here, once the target is known."""
    if not isinstance(bundle, Bundle):
        bundle = load_bundle(bundle)  # the one pass that hashes its files
    if target is None:
        target = load_target(bundle.target_source, bundle.target_dtype)
    bundle.check_target(target.fingerprint)
    config = DecodingConfig.from_serving(bundle.serving)
    config.router_dir = _router_dir(bundle, config.router_dir)
    head = bundle.extra_dirs.get(HEAD_COMPONENT) if DRAFTERS[bundle.drafter_kind].acceptance_head else None
    drafter = build_drafter(bundle.drafter_kind, target, config, bundle.drafter_dir, head)
    return TextGenerator(target, drafter, config)
