"""The drafter registry, the decoding config and the method spec: what the layers above name drafters by.

Torch-free on purpose: the CLI builds its parser from these names, so `specops --help` stays light.

`DRAFTERS` is a plain dict from kind to what the kind is: the weights folder it loads (a draft LM or
an aligned head), whether it drafts a tree, whether draft-length policies set its length and whether
it takes an acceptance head. `MethodSpec.parse("draft-lm+specdecpp@6")` reads a benchmark method once
into a typed object; `MethodSpec.decoding()` turns it into the `DecodingConfig` the factory builds from.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal

from specops.core.policies import POLICIES
from specops.core.types import DEFAULT_DRAFT_TOKENS, DEFAULT_PREFILL_CHUNK, check_runtime, static_tree_refusal

Weights = Literal["draft_lm", "aligned_head", "exit_heads", "specialists"]  # the weights folder a kind loads (a bundle's drafter/)


@dataclass(frozen=True)
class DrafterKind:
    name: str
    weights: Weights | None = None  # None: needs no trained weights
    tree: bool = False  # drafts a tree (verified by the tree walk) rather than a chain
    policies: bool = False  # draft-length policies other than "fixed" may set its length
    acceptance_head: bool = False  # may take a SpecDec++ acceptance head (specdecpp, goodput_head)
    size: Literal["draft_tokens", "tree_nodes", "recycling_nodes", "del_exit_layer"] = "draft_tokens"  # what "@N" sets

    def weights_from(self, draft_lm: str | Path | None, aligned_head: str | Path | None,
                     exit_heads: str | Path | None = None, specialists: str | Path | None = None) -> str | Path | None:
        """The folder this kind loads, out of a draft-LM, an aligned-head, an exit-heads and a specialists
        folder (None: needs none)."""
        return {"draft_lm": draft_lm, "aligned_head": aligned_head, "exit_heads": exit_heads,
                "specialists": specialists, None: None}[self.weights]


DRAFTERS: dict[str, DrafterKind] = {kind.name: kind for kind in (
    DrafterKind("none"),
    DrafterKind("prompt-lookup", policies=True),
    DrafterKind("recycling", tree=True, size="recycling_nodes"),
    DrafterKind("hybrid", tree=True, size="recycling_nodes"),  # Token Recycling + a prompt-lookup branch
    DrafterKind("suffix"),  # Suffix Decoding: past responses and the request so far (specops/drafters/suffix.py)
    DrafterKind("suffix-tree", tree=True, size="tree_nodes"),
    DrafterKind("draft-lm", weights="draft_lm", policies=True, acceptance_head=True),
    DrafterKind("draft-lm-tree", weights="draft_lm", tree=True, size="tree_nodes"),
    # The draft LM behind a Suffix Decoding front (specops/drafters/suffix_front.py)
    DrafterKind("draft-lm-suffix", weights="draft_lm", policies=True, acceptance_head=True),
    DrafterKind("aligned_head", weights="aligned_head"),
    DrafterKind("aligned_head_tree", weights="aligned_head", tree=True, size="tree_nodes"),
    # DEL: the target's first layers and a trained exit head (specops/drafters/del_exit.py); "del@8" fixes the exit layer.
    DrafterKind("del", weights="exit_heads", size="del_exit_layer"),
    # CoSine: specialized draft LMs (train_specialists) behind a router; -tree fuses their trees (specops/drafters/cosine.py)
    DrafterKind("cosine", weights="specialists"),
    DrafterKind("cosine-tree", weights="specialists", tree=True, size="tree_nodes"),
    # CoSine's router behind a Suffix Decoding front: a model-free specialist for what repeats (the request so
    # far, past responses) takes the steps it is confident of, the routed draft LMs the others.
    DrafterKind("cosine-suffix", weights="specialists"),
)}
DRAFT_LM_KINDS = tuple(k for k, d in DRAFTERS.items() if d.weights == "draft_lm")
ALIGNED_KINDS = tuple(k for k, d in DRAFTERS.items() if d.weights == "aligned_head")


def drafter_kind(name: str) -> DrafterKind:
    if name not in DRAFTERS:
        raise ValueError(f"Unknown drafter '{name}'. Choose one of: {', '.join(DRAFTERS)}.")
    return DRAFTERS[name]


@dataclass
class DecodingConfig:
    """How a generator decodes; serving.yaml in a bundle and the CLI flags both fill this."""

    drafter: str = "recycling"  # one of DRAFTERS
    verifier: str = "auto"  # greedy | rejection | block | coupled | auto (greedy at temperature 0, rejection otherwise)
    draft_tokens: int = DEFAULT_DRAFT_TOKENS  # chain drafters: tokens per step; tree drafters: maximum accepted depth
    prompt_lookup_max_ngram: int = 3
    recycling_nodes: int = 12  # size of the Token Recycling tree (tuned for a 2-core CPU by sweep)
    # Draft length policy, one of POLICIES (specops/core/policies.py): fixed drafts draft_tokens every step;
    # heuristic starts there; specdecpp, goodput and goodput_head never draft more than draft_tokens.
    policy: str = "fixed"
    # specdecpp: end a draft once P(some drafted token is rejected) exceeds this. Higher drafts longer.
    stop_threshold: float = 0.5
    # aligned_head_tree and draft-lm-tree: nodes of the dynamic draft tree (EAGLE-2), and the top-k tokens
    # taken from each expanded node (also how many nodes a level expands). Size the tree by the verify
    # cost curve.
    tree_nodes: int = 12
    tree_top_k: int = 4
    # suffix and suffix-tree (Suffix Decoding): the tries count substrings of up to suffix_max_depth tokens;
    # a context match of m tokens may draft suffix_factor * m tokens (tree: nodes); a drafted token's
    # estimated probability must stay >= suffix_min_prob; the global trie keeps the last suffix_max_cached
    # responses. Depth, factor and probability are vLLM's defaults (suffix_decoding_*); its 10,000 cached
    # responses suit its C++ tree, while ours is a Python trie of about 1.2 kB per cached token at depth 24
    # (measured on the quickstart's 338 collected responses): 1,000 responses of 256 tokens take about 300 MB.
    suffix_max_depth: int = 24
    suffix_factor: float = 1.0
    suffix_min_prob: float = 0.1
    suffix_max_cached: int = 1000
    # draft-lm-suffix and cosine-suffix: the suffix tries' draft is taken (and the draft LMs not run) when the
    # tries expect at least this many of its tokens to be accepted (the sum of their estimated probabilities).
    suffix_front_min_score: float = 1.0
    # Draft-LM kinds (specops/drafters/draft_lm.py; LongSpec): the draft's KV cache holds at most draft_window
    # tokens, the context's first draft_sinks (attention sinks) and its most recent, at positions below
    # draft_window, so its memory and cost per token stop growing with the context and it runs at positions
    # it was trained on: set it no larger than the draft's training length (train_draft's max_seq_len).
    # 0 keeps every context token (the draft's positions then reach the context's length).
    draft_window: int = 0
    draft_sinks: int = 4
    # del (specops/drafters/del_exit.py): the exit layer to draft from, one of the exit heads' layers;
    # 0 picks the layer and the draft length (at most draft_tokens) per step from tracked acceptance (DEL).
    del_exit_layer: int = 0
    # cosine and cosine-tree (specops/drafters/cosine.py): each specialist's score is its top-1 hit rate on the
    # committed tokens, every older token weighing cosine_decay times less (a window of ~1 / (1 - decay)
    # tokens); cosine drafts with the best-scoring one, cosine-tree weighs each one's tree candidates by
    # softmax(scores / cosine_temperature) (a hit rate better by the temperature weighs e times more).
    cosine_decay: float = 0.98
    cosine_temperature: float = 0.1
    # Lossy acceleration, opt-in: "off" keeps the output identical to the target's. One of
    # specops.lossy.modes.LOSSY_MODES: autojudge accepts mismatching draft tokens its classifier deems
    # unimportant (arXiv 2504.20039); arbitrage keeps whole draft steps its router deems as good as the
    # target's (arXiv 2512.05033). Both need the draft-lm drafter, greedy decoding and router_dir; a
    # sampled request under a lossy default is served losslessly (its stats say lossy: false).
    lossy_mode: str = "off"
    # Accept when the router's P(this costs quality) is below it: 0 is lossless; None takes the trained default.
    lossy_threshold: float | None = None
    router_dir: str | None = None  # train_router's output folder; a bundle fills it from its router/ component
    # The target runtime: 0 is the dynamic KV cache; N > 0 the static runtime (specops.core.kv.StaticLM),
    # every pass N rows wide, so speculative output is bitwise plain decoding's through it in bf16 too.
    # Chains of at most N - 1 tokens; trees of that depth in bf16, eager (not compiled), with a cache per leaf.
    static_width: int = 0
    # Run the static runtime's passes through torch.compile (specops.core.llama): a minute or two to
    # compile once a process, then about 2x faster passes on a CPU. Needs static_width > 0 and a C++ compiler.
    compiled: bool = False
    # Tokens per prefill pass (0: the whole prompt in one): a cancelled request stops between two passes.
    # Prompts longer than this round differently from a one-pass prefill, the same for plain and speculative.
    prefill_chunk: int = DEFAULT_PREFILL_CHUNK

    def __post_init__(self) -> None:
        check_runtime(self.static_width, self.compiled, self.prefill_chunk)
        if self.draft_window and self.draft_window <= self.draft_sinks:
            raise ValueError(f"draft_window must be 0 (off) or larger than draft_sinks ({self.draft_sinks}), "
                             f"got {self.draft_window}.")
        tree = self.drafter in DRAFTERS and DRAFTERS[self.drafter].tree
        if tree and (reason := static_tree_refusal(self.compiled)):
            raise ValueError(f"'{self.drafter}' drafts trees: {reason}; drop compiled, or use a chain drafter.")

    @classmethod
    def from_serving(cls, serving: dict[str, Any]) -> DecodingConfig:
        """A bundle's serving.yaml; an unknown key is an error that names it (nothing is silently ignored)."""
        unknown = sorted(set(serving) - set(cls.__dataclass_fields__))
        if unknown:
            raise ValueError(f"serving.yaml has unknown key(s): {', '.join(unknown)}. "
                             f"Known: {', '.join(cls.__dataclass_fields__)}.")
        return cls(**serving)


@dataclass(frozen=True)
class MethodSpec:
    """A method of `specops bench` and the evaluate stage: `kind[+policy][@size][:window=N]`.

    '@size' is what the kind's `size` names: Token Recycling tree nodes, dynamic-tree nodes (whose
    depth is draft_tokens) or chain draft tokens (the policy's k or bound). ':window=N' gives a draft-LM
    kind a draft window of N tokens (DecodingConfig.draft_window)."""

    kind: str
    policy: str = "fixed"
    size: int | None = None
    window: int | None = None

    @classmethod
    def parse(cls, spec: str) -> MethodSpec:
        body, colon, option = spec.partition(":")
        key, _, value = option.partition("=")
        if colon and (key != "window" or not value.isdigit()):
            raise ValueError(f"Method '{spec}': the only option after ':' is window=N (N tokens, 0: off).")
        method, at, size = body.partition("@")
        kind, plus, policy = method.partition("+")
        if kind not in DRAFTERS:
            raise ValueError(f"Unknown method '{spec}': the drafter must be one of {', '.join(DRAFTERS)}.")
        if plus and policy not in POLICIES:
            raise ValueError(f"Method '{spec}': the policy after + must be one of {', '.join(POLICIES)}.")
        if plus and not DRAFTERS[kind].policies:
            allowed = ", ".join(k for k, d in DRAFTERS.items() if d.policies)
            raise ValueError(f"Method '{spec}': draft length policies apply to {allowed} only.")
        if at and not (size.isdigit() and int(size) > 0):
            raise ValueError(f"Method '{spec}': the size after @ must be a positive integer.")
        if colon and DRAFTERS[kind].weights != "draft_lm":
            raise ValueError(f"Method '{spec}': a draft window applies to {', '.join(DRAFT_LM_KINDS)} only.")
        return cls(kind, policy or "fixed", int(size) if at else None, int(value) if colon else None)

    def __str__(self) -> str:
        return (self.kind + (f"+{self.policy}" if self.policy != "fixed" else "") + (f"@{self.size}" if self.size else "")
                + (f":window={self.window}" if self.window is not None else ""))

    @property
    def drafter(self) -> DrafterKind:
        return DRAFTERS[self.kind]

    def decoding(self, base: DecodingConfig | None = None) -> DecodingConfig:
        """`base` (greedy, defaults otherwise) with this method's drafter, policy and size."""
        config = replace(base or DecodingConfig(verifier="greedy"), drafter=self.kind, policy=self.policy)
        if self.size is not None:
            setattr(config, self.drafter.size, self.size)
        if self.window is not None:
            config = replace(config, draft_window=self.window)  # replace() checks it against draft_sinks
        return config
