"""Build the lossy generators: opt-in only (per request or in serving.yaml), greedy only, never the default.

A router folder (the train_router stage's output, a bundle's router/ component) holds one
subfolder per mode: autojudge/ and arbitrage/. Routers are loaded once and checked against the
target they were mined on; a generator per request is then cheap.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
from transformers import PreTrainedModel

from specops.core.loop import SpeculativeGenerator
from specops.core.target import Target
from specops.core.types import DEFAULT_DRAFT_TOKENS
from specops.lossy.arbitrage import ArbitrageGenerator, RouterDecision, boundary_ids
from specops.lossy.autojudge import JudgeGenerator
from specops.lossy.router import LinearRouter, RouterLoadError

OFF = "off"
LOSSY_MODES = (OFF, "autojudge", "arbitrage")


def check_threshold(threshold: float) -> float:
    if not (math.isfinite(threshold) and threshold >= 0):
        raise ValueError(f"A lossy threshold must be a finite number >= 0 (0 is lossless), got {threshold}.")
    return float(threshold)


class LossyModels:
    """The routers of a router folder for one target and draft model, loaded on first use."""

    def __init__(self, target: Target, draft_model: PreTrainedModel, router_dir: str | Path,
                 draft_vocab: torch.Tensor | None = None) -> None:
        self.target = target
        self.draft_model = draft_model
        self.draft_vocab = draft_vocab
        self.router_dir = Path(router_dir)
        self._routers: dict[str, LinearRouter] = {}
        self._boundaries: dict[str, frozenset[int]] = {}

    def router(self, mode: str) -> LinearRouter:
        if mode not in self._routers:
            router = LinearRouter.load(self.router_dir / mode, kind=mode)
            mined_on = router.config.target.get("weights_sha256")
            if mined_on != self.target.fingerprint.weights_sha256:
                raise RouterLoadError(f"The {mode} router in {self.router_dir / mode} was mined on another target "
                                      f"({router.config.target.get('name')}); retrain it with train_router.")
            self._routers[mode] = router
        return self._routers[mode]

    def boundaries(self, delimiter: str) -> frozenset[int]:
        if delimiter not in self._boundaries:  # one pass over the vocabulary, so only once
            self._boundaries[delimiter] = boundary_ids(self.target.tokenizer, delimiter)
        return self._boundaries[delimiter]

    def generator(self, mode: str, threshold: float | None = None, draft_tokens: int = DEFAULT_DRAFT_TOKENS) -> SpeculativeGenerator:
        """A generator for `mode`; threshold None takes the one chosen at training (router config)."""
        if mode not in LOSSY_MODES or mode == OFF:
            raise ValueError(f"Unknown lossy mode '{mode}'. Choose one of: {', '.join(LOSSY_MODES[1:])}.")
        router = self.router(mode)
        chosen = check_threshold(router.config.threshold if threshold is None else threshold)
        if mode == "autojudge":
            return JudgeGenerator(self.target, self.draft_model, router, chosen, draft_tokens, self.draft_vocab)
        width = 2 * self.draft_model.config.hidden_size + 2  # specops/lossy/arbitrage.py step_features
        if router.config.input_dim != width:
            raise RouterLoadError(f"The arbitrage router reads {router.config.input_dim} features but this draft "
                                  f"model gives {width}: it was trained with another draft.")
        steps = router.config.extra
        return ArbitrageGenerator(self.target, self.draft_model, RouterDecision(router, chosen),
                                  self.boundaries(steps["delimiter"]), steps["max_step_tokens"], self.draft_vocab)
