"""CoSine (arXiv 2503.10325): specialized drafters, a router between them, and their proposals fused.

Several draft LMs, each distilled on its own slice of the traces (specops.train.train_specialists: e.g.
a code and a chat specialist), draft for one target. Each step:

1. Every specialist catches up with the context by teacher forcing: it reads the newly committed tokens
   and its top-1 guess at each is scored against the token the target committed (the first step reads
   the prompt, which gives a prior before any response token exists).
2. Each specialist's score is its decayed top-1 hit rate over the committed tokens (`decayed_hits`): a
   context-only estimate of how much of its draft the target would accept now.
3. `cosine` (chains; both runtimes) lets the best-scoring specialist draft the chain (`route`).
   `cosine-tree` (trees; the fp32 dynamic runtime) fuses every specialist's dynamic-tree candidates into
   one tree (`fuse_trees`): a node's confidence is its specialist's cumulative draft log-probability plus
   that specialist's log-weight (a softmax of the scores, `fusion_log_weights`), a path two specialists
   both propose keeps the higher, and the `tree_nodes` most confident nodes are verified.

Lossless: the route and the weights are functions of the committed context alone, decided before
anything is drawn; the chain comes with the distribution it was drawn from, and the tree's candidates
are deterministic, so every verifier's rule holds step by step (tests/core/test_loop_distribution.py).
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from pathlib import Path

import torch

from specops.core.drafter import Draft, DrafterBase, TokenStop, refuse_stop
from specops.core.sampling import Randomness
from specops.core.types import SamplingParams
from specops.drafters.draft_lm import DraftLMDrafter, load_draft
from specops.drafters.dynamic_tree import TreeNode, select_best

# A specialists folder's index, {"specialists": [name, ...], ...}: as a bundle component's config.json, the
# folder ships as the bundle's drafter/ (one draft LM folder per specialist beside it).
SPECIALISTS_FILE = "config.json"


def decayed_hits(state: tuple[float, float], hits: list[bool], decay: float) -> tuple[float, float]:
    """(decayed hit count, decayed token count) after scoring `hits` in order; their ratio is the score.
    Each new token multiplies the weight of every older one by `decay`."""
    count, total = state
    for hit in hits:
        count, total = decay * count + hit, decay * total + 1.0
    return count, total


def score(state: tuple[float, float]) -> float:
    """The decayed hit rate; 0 before any token was scored."""
    count, total = state
    return count / total if total else 0.0


def route(scores: list[float]) -> int:
    """The specialist that drafts this step: the best score, the first on ties."""
    return max(range(len(scores)), key=lambda i: (scores[i], -i))


def fusion_log_weights(scores: list[float], temperature: float) -> list[float]:
    """log softmax(scores / temperature): how much each specialist's candidates are trusted."""
    return torch.tensor(scores, dtype=torch.float64).div(temperature).log_softmax(0).tolist()


def fuse_trees(pools: list[list[TreeNode]], log_weights: list[float], tree_nodes: int) -> Draft:
    """One tree of at most `tree_nodes` nodes out of several drafters' candidate pools (parents before
    children in each). A node is a token path; its confidence is the best over the pools proposing it of
    (cumulative draft log-probability + the pool's log-weight). Along a path that never grows, so the
    best nodes keep their parents (select_best)."""
    merged: list[TreeNode] = []
    index: dict[tuple[int, int], int] = {}  # (merged parent, token) -> merged node
    for pool, log_weight in zip(pools, log_weights, strict=True):
        where: list[int] = []  # pool node -> merged node
        for node in pool:
            parent = where[node.parent] if node.parent >= 0 else -1
            key = (parent, node.token)
            confidence = node.score + log_weight
            if key in index:
                merged[index[key]].score = max(merged[index[key]].score, confidence)
            else:
                index[key] = len(merged)
                merged.append(TreeNode(node.token, parent, node.depth, confidence))
            where.append(index[key])
    return select_best(merged, tree_nodes)


@dataclass(frozen=True)
class CosineSettings:
    """The router's and the fusion's settings, from DecodingConfig's cosine_decay, cosine_temperature and
    tree_nodes (0: route chains, cosine; > 0: fuse trees of that many nodes, cosine-tree)."""

    decay: float
    temperature: float
    tree_nodes: int

    def __post_init__(self) -> None:
        if not 0 < self.decay <= 1 or self.temperature <= 0 or self.tree_nodes < 0:
            raise ValueError(f"cosine needs 0 < decay <= 1, temperature > 0 and tree_nodes >= 0, got {self}.")


class CosineDrafter(DrafterBase):
    def __init__(self, specialists: list[DraftLMDrafter], names: list[str], settings: CosineSettings) -> None:
        if len(specialists) < 2 or len(names) != len(specialists):
            raise ValueError("The cosine drafters need at least two named specialists.")
        if any(s.tree_nodes or s.predicts_acceptance for s in specialists):
            raise ValueError("CoSine's specialists are chain draft LMs without acceptance heads; it grows trees itself.")
        self.specialists, self.names, self.settings = specialists, names, settings
        self.name = "cosine-tree" if settings.tree_nodes else "cosine"
        self.reset()

    def __copy__(self) -> CosineDrafter:
        """A fork (one per server generation slot) with its own specialists' caches and scores."""
        twin = object.__new__(CosineDrafter)
        twin.__dict__.update(self.__dict__)
        twin.specialists = [copy.copy(s) for s in self.specialists]
        twin.reset()
        return twin

    def reset(self) -> None:
        for specialist in self.specialists:
            specialist.reset()
        self.hits = [(0.0, 0.0)] * len(self.specialists)
        self.seen = 0  # context tokens scored so far (all but the first)
        self.routed = [0] * len(self.specialists)  # steps each specialist drafted (cosine) or led (cosine-tree)

    @property
    def peak_kv_bytes(self) -> int:  # type: ignore[override]
        """Every specialist keeps its own draft cache (each reads every committed token)."""
        return sum(specialist.peak_kv_bytes for specialist in self.specialists)

    def scores(self) -> list[float]:
        return [score(state) for state in self.hits]

    def _catch_up(self, context: list[int]) -> list[float]:
        """Step 1-2: every specialist reads the new committed tokens; their scores after them."""
        start = max(self.seen - 1, 0)
        for i, specialist in enumerate(self.specialists):
            guesses = specialist.guesses(context, start)
            specialist._measure()  # its cache grew by reading, whether or not it drafts this step
            truth = context[start + 1:]
            self.hits[i] = decayed_hits(self.hits[i], [g == t for g, t in zip(guesses, truth, strict=True)],
                                        self.settings.decay)
        self.seen = len(context)
        return self.scores()

    def propose(self, context: list[int], k: int, sampling: SamplingParams, generator: Randomness,
                stop: TokenStop | None = None) -> Draft:
        refuse_stop(self, stop)
        scores = self._catch_up(context)
        chosen = route(scores)
        self.routed[chosen] += 1
        if not self.settings.tree_nodes:
            return self.specialists[chosen].propose(context, k, sampling, generator)
        pools = [specialist.candidates(context, k) for specialist in self.specialists]
        return fuse_trees(pools, fusion_log_weights(scores, self.settings.temperature), self.settings.tree_nodes)


def specialist_names(folder: Path | str) -> list[str]:
    """The specialists a folder holds, in order (its config.json)."""
    path = Path(folder) / SPECIALISTS_FILE
    index = json.loads(path.read_text()) if path.is_file() else {}
    if "specialists" not in index:
        raise FileNotFoundError(f"{folder} is not a specialists folder (no {SPECIALISTS_FILE} naming them): pass "
                                "train_specialists' out_dir (e.g. models/specialists).")
    return list(index["specialists"])


def load_cosine(folder: Path | str, target_vocab_size: int, dtype: torch.dtype, settings: CosineSettings,
                tree_top_k: int) -> CosineDrafter:
    """The specialists of a train_specialists folder behind CoSine's router (and fusion, with tree_nodes)."""
    names = specialist_names(folder)
    specialists = []
    for name in names:
        model, vocab = load_draft(Path(folder) / name, dtype)
        specialists.append(DraftLMDrafter(model, target_vocab_size, None, vocab, 0, tree_top_k))
    return CosineDrafter(specialists, names, settings)
