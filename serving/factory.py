"""Build drafters and generators from names, options and bundles."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from serving.acceptance_head import HEAD_COMPONENT, AcceptanceHead
from serving.cost_model import measure_cost_model
from serving.drafters.aligned import ALIGNED_KINDS, load_aligned_drafter
from serving.drafters.base import Drafter
from serving.drafters.draft_lm import DraftLMDrafter, load_draft
from serving.drafters.prompt_lookup import PromptLookupDrafter
from serving.drafters.recycling import RecyclingDrafter
from serving.lossy import LOSSY_MODES, OFF, LossyModels
from serving.policies import (
    HEAD_POLICIES,
    POLICIES,
    DraftLengthPolicy,
    FixedPolicy,
    GoodputPolicy,
    HeadGoodputPolicy,
    HeuristicPolicy,
    SpecDecPPPolicy,
)
from serving.router import COMPONENT as ROUTER_COMPONENT
from serving.speculative import SpeculativeGenerator
from serving.target import Target, encode_prompt, load_target
from serving.types import DRAFT_LM_KINDS, SamplingParams

DRAFTER_KINDS = ("none", "prompt-lookup", "recycling", "hybrid", "draft-lm", "draft-lm-tree") + ALIGNED_KINDS
# Dynamic-tree drafters: their @SIZE is DecodingConfig.tree_nodes, their depth limit draft_tokens.
TREE_DRAFTERS = ("draft-lm-tree", "aligned_head_tree")
# Chain drafters whose length a draft length policy other than "fixed" may set (goodput's cost model
# times the draft LM; prompt lookup costs next to nothing).
POLICY_DRAFTERS = ("prompt-lookup", "draft-lm")


@dataclass
class DecodingConfig:
    """How a generator decodes; serving.yaml in a bundle and the CLI flags both fill this."""

    drafter: str = "recycling"  # one of DRAFTER_KINDS
    verifier: str = "auto"  # greedy | rejection | block | auto (greedy at temperature 0, rejection otherwise)
    draft_tokens: int = 6  # chain drafters: tokens per step; tree drafters: maximum accepted depth
    prompt_lookup_max_ngram: int = 3
    recycling_nodes: int = 12  # size of the Token Recycling tree (tuned for a 2-core CPU by sweep)
    # Draft length policy, one of POLICIES (serving/policies.py): fixed drafts draft_tokens every step;
    # heuristic starts there; specdecpp, goodput and goodput_head never draft more than draft_tokens.
    policy: str = "fixed"
    # specdecpp: end a draft once P(some drafted token is rejected) exceeds this. Higher drafts longer.
    stop_threshold: float = 0.5
    # aligned_head_tree and draft-lm-tree: nodes of the dynamic draft tree (EAGLE-2), and the top-k tokens
    # taken from each expanded node (also how many nodes a level expands). Size the tree by the verify
    # cost curve.
    tree_nodes: int = 12
    tree_top_k: int = 4
    # Lossy acceleration, opt-in: "off" keeps the output identical to the target's. One of
    # serving.lossy.LOSSY_MODES: autojudge accepts mismatching draft tokens its classifier deems
    # unimportant (arXiv 2504.20039); arbitrage keeps whole draft steps its router deems as good as the
    # target's (arXiv 2512.05033). Both need the draft-lm drafter, greedy decoding and router_dir; a
    # sampled request under a lossy default is served losslessly (its stats say lossy: false).
    lossy_mode: str = "off"
    # Accept when the router's P(this costs quality) is below it: 0 is lossless; None takes the trained default.
    lossy_threshold: float | None = None
    router_dir: str | None = None  # train_router's output folder; a bundle fills it from its router/ component
    extra: dict[str, Any] = field(default_factory=dict)


def build_drafter(kind: str, target: Target, config: DecodingConfig, draft_model_path: str | Path | None = None,
                  acceptance_head_path: str | Path | None = None) -> Drafter | None:
    if acceptance_head_path is not None and kind != "draft-lm":
        raise ValueError(f"An acceptance head stops the draft-lm drafter's chains; the '{kind}' drafter takes none.")
    if kind == "none":
        return None
    if kind == "prompt-lookup":
        return PromptLookupDrafter(max_ngram=config.prompt_lookup_max_ngram)
    if kind in ("recycling", "hybrid"):  # hybrid: Token Recycling tree + the prompt-lookup branch merged in
        lookup = PromptLookupDrafter(max_ngram=config.prompt_lookup_max_ngram) if kind == "hybrid" else None
        return RecyclingDrafter(target.vocab_size, num_nodes=config.recycling_nodes, lookup=lookup)
    if kind in DRAFT_LM_KINDS:
        if draft_model_path is None:
            raise ValueError(f"The {kind} drafter needs a draft model folder (--draft-model PATH).")
        head = AcceptanceHead.load(acceptance_head_path) if acceptance_head_path is not None else None
        model, vocab = load_draft(draft_model_path, target.model.dtype)  # bf16 halves the draft's cost too
        nodes = config.tree_nodes if kind in TREE_DRAFTERS else 0
        return DraftLMDrafter(model, target.vocab_size, head, vocab, nodes, config.tree_top_k)
    if kind in ALIGNED_KINDS:
        if draft_model_path is None:
            raise ValueError(f"The {kind} drafter needs an aligned head folder (--aligned-head PATH).")
        nodes = config.tree_nodes if kind in TREE_DRAFTERS else 0
        return load_aligned_drafter(draft_model_path, target.model, nodes, config.tree_top_k)
    raise ValueError(f"Unknown drafter '{kind}'. Choose one of: {', '.join(DRAFTER_KINDS)}.")


def build_policy(config: DecodingConfig, target: Target, drafter: Drafter | None) -> DraftLengthPolicy:
    """The config's draft length policy; goodput measures its cost model here, once, on this machine."""
    name, k = config.policy, config.draft_tokens
    if name not in POLICIES:
        raise ValueError(f"Unknown policy '{name}'. Choose one of: {', '.join(POLICIES)}.")
    if name == "fixed":
        return FixedPolicy(k)
    if drafter is None or config.drafter not in POLICY_DRAFTERS:
        raise ValueError(f"The '{name}' policy sets the draft length of {' or '.join(POLICY_DRAFTERS)}, "
                         f"not of the '{config.drafter}' drafter.")
    if name == "heuristic":
        return HeuristicPolicy(k)
    if name in HEAD_POLICIES and not getattr(drafter, "predicts_acceptance", False):
        raise ValueError(f"The {name} policy needs the draft-lm drafter with an acceptance head "
                         f"(--acceptance-head PATH, or a bundle with an {HEAD_COMPONENT}/ folder).")
    if name == "specdecpp":
        return SpecDecPPPolicy(k, config.stop_threshold)
    cost = measure_cost_model(target.model, drafter)
    return HeadGoodputPolicy(k, cost) if name == "goodput_head" else GoodputPolicy(k, cost)


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
        self.policy = build_policy(config, target, drafter)  # built once: goodput times the models here
        self._lossy: LossyModels | None = None
        if config.lossy_mode not in LOSSY_MODES:
            raise ValueError(f"Unknown lossy_mode '{config.lossy_mode}'. Choose one of: {', '.join(LOSSY_MODES)}.")
        if config.lossy_mode != OFF:  # fail at load, not at the first request
            self.lossy_models().router(config.lossy_mode)

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
                                    self.config.draft_tokens, policy=self.policy)

    def generate_text(self, prompt: str | list[dict[str, str]], max_new_tokens: int = 64, temperature: float = 0.0,
                      top_p: float = 1.0, seed: int | None = None, raw: bool = False, lossy_mode: str | None = None,
                      lossy_threshold: float | None = None) -> dict[str, Any]:
        sampling = SamplingParams(temperature=temperature, top_p=top_p)
        ids = encode_prompt(self.target.tokenizer, prompt, raw=raw)
        result = self.generator(sampling, lossy_mode, lossy_threshold).generate(ids, max_new_tokens, sampling, seed)
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
    if config.router_dir is None and ROUTER_COMPONENT in bundle.extra_dirs:
        config.router_dir = str(bundle.extra_dirs[ROUTER_COMPONENT])
    head = bundle.extra_dirs.get(HEAD_COMPONENT) if bundle.drafter_kind == "draft-lm" else None
    drafter = build_drafter(bundle.drafter_kind, target, config, bundle.drafter_dir, head)
    return TextGenerator(target, drafter, config)
