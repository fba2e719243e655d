"""Build drafters and draft-length policies from a `DecodingConfig` (specops.drafters.kinds)."""

from __future__ import annotations

from pathlib import Path

from specops.core.batching import batch_invariant
from specops.core.cost_model import measure_cost_model
from specops.core.drafter import Drafter
from specops.core.policies import (
    HEAD_POLICIES,
    POLICIES,
    DraftLengthPolicy,
    FixedPolicy,
    GoodputPolicy,
    HeadGoodputPolicy,
    HeuristicPolicy,
    SpecDecPPPolicy,
)
from specops.core.target import Target
from specops.core.types import SamplingParams
from specops.drafters.acceptance_head import HEAD_COMPONENT, AcceptanceHead
from specops.drafters.aligned_head.drafter import load_aligned_drafter
from specops.drafters.cosine import CosineSettings, load_cosine
from specops.drafters.del_exit import load_del_drafter, measure_exit_costs
from specops.drafters.draft_lm import DraftLMDrafter, load_draft
from specops.drafters.kinds import DRAFTERS, DecodingConfig, drafter_kind
from specops.drafters.prompt_lookup import PromptLookupDrafter
from specops.drafters.recycling import RecyclingDrafter
from specops.drafters.suffix import SuffixCache, SuffixDrafter
from specops.drafters.suffix_front import SuffixFrontDrafter

WEIGHTS_NEEDED = {"draft_lm": "a draft model folder (--draft-model PATH)",
                  "aligned_head": "an aligned head folder (--aligned-head PATH)",
                  "exit_heads": "an exit heads folder (--exit-heads PATH)",
                  "specialists": "a specialists folder (--specialists PATH)"}


def build_drafter(kind: str, target: Target, config: DecodingConfig, weights: str | Path | None = None,
                  acceptance_head_path: str | Path | None = None) -> Drafter | None:
    """`weights` is the folder the kind loads (DRAFTERS[kind].weights: a draft LM or an aligned head)."""
    spec = drafter_kind(kind)
    if acceptance_head_path is not None and not spec.acceptance_head:
        raise ValueError(f"An acceptance head stops the draft-lm drafter's chains; the '{kind}' drafter takes none.")
    if spec.weights is not None and weights is None:
        raise ValueError(f"The {kind} drafter needs {WEIGHTS_NEEDED[spec.weights]}.")
    nodes = config.tree_nodes if spec.tree else 0
    if spec.tree and config.static_width and not batch_invariant(target.model):
        raise ValueError(f"'{kind}' drafts trees, which the static runtime verifies exactly only on a target whose "
                         f"rows are batch-invariant: bf16, and large enough for oneDNN (this one is "
                         f"{target.model.dtype}; specops.core.batching.batch_invariant). Use static_width 0 (the "
                         "dynamic runtime, exact in fp32) or a chain drafter.")
    if kind == "none":
        return None
    if kind == "prompt-lookup":
        return PromptLookupDrafter(max_ngram=config.prompt_lookup_max_ngram)
    if kind in ("recycling", "hybrid"):  # hybrid: Token Recycling tree + the prompt-lookup branch merged in
        lookup = PromptLookupDrafter(max_ngram=config.prompt_lookup_max_ngram) if kind == "hybrid" else None
        return RecyclingDrafter(target.vocab_size, num_nodes=config.recycling_nodes, lookup=lookup)
    if kind in ("suffix", "suffix-tree"):
        return _suffix(config, nodes)
    if spec.weights == "draft_lm":
        head = AcceptanceHead.load(acceptance_head_path) if acceptance_head_path is not None else None
        model, vocab = load_draft(weights, target.model.dtype)  # bf16 halves the draft's cost too
        draft_lm = DraftLMDrafter(model, target.vocab_size, head, vocab, nodes, config.tree_top_k,
                                  config.draft_window, config.draft_sinks)
        if kind == "draft-lm-suffix":
            return SuffixFrontDrafter(_suffix(config, 0), draft_lm, config.suffix_front_min_score)
        return draft_lm
    if spec.weights == "aligned_head":
        return load_aligned_drafter(weights, target.model, nodes, config.tree_top_k)
    if spec.weights == "exit_heads":
        drafter = load_del_drafter(weights, target.model, config.del_exit_layer)
        # Its choice of exit layer and length weighs these times, measured here once, on this machine.
        drafter.costs = measure_exit_costs(drafter, target.model, config.static_width, config.compiled)
        return drafter
    if spec.weights == "specialists":
        settings = CosineSettings(config.cosine_decay, config.cosine_temperature, nodes)
        cosine = load_cosine(weights, target.vocab_size, target.model.dtype, settings, config.tree_top_k)
        if kind == "cosine-suffix":
            return SuffixFrontDrafter(_suffix(config, 0), cosine, config.suffix_front_min_score)
        return cosine
    raise AssertionError(f"DRAFTERS['{kind}'] has no constructor here")


def _suffix(config: DecodingConfig, tree_nodes: int) -> SuffixDrafter:
    return SuffixDrafter(SuffixCache(config.suffix_max_depth, config.suffix_max_cached), tree_nodes,
                         config.suffix_factor, config.suffix_min_prob)


def build_policy(config: DecodingConfig, target: Target, drafter: Drafter | None) -> DraftLengthPolicy:
    """The config's draft length policy; goodput measures its cost model here, once, on this machine."""
    name, k = config.policy, config.draft_tokens
    if name not in POLICIES:
        raise ValueError(f"Unknown policy '{name}'. Choose one of: {', '.join(POLICIES)}.")
    if name == "fixed":
        return FixedPolicy(k)
    if drafter is None or not drafter_kind(config.drafter).policies:
        allowed = " or ".join(k for k, d in DRAFTERS.items() if d.policies)
        raise ValueError(f"The '{name}' policy sets the draft length of {allowed}, not of the '{config.drafter}' drafter.")
    if name == "heuristic":
        return HeuristicPolicy(k)
    if name in HEAD_POLICIES and not drafter.predicts_acceptance:
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
