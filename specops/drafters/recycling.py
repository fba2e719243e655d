"""Token Recycling (Luo et al. 2024, arXiv 2408.08696).

The target's top-k next tokens at every verified position are "recycled" into an adjacency matrix
A [V, k]: A[t] = the target's best guesses for what follows token t. A draft is a static tree
template filled by breadth-first lookups in A, verified in one pass with tree attention. A is
updated from every verify pass and persists across requests.

The paper's 80-node template suits GPUs, where verifying 80 tokens costs about as much as 1. On a
CPU the cost grows with the node count, so the template size is a parameter chosen by a sweep.
"""

from __future__ import annotations

import heapq

import torch

from specops.core.drafter import Draft, DrafterBase, TokenStop, refuse_stop
from specops.core.kv import tree_depths
from specops.core.sampling import Randomness
from specops.core.types import SamplingParams
from specops.drafters.prompt_lookup import PromptLookupDrafter

# Prior probability that the target's next token is its rank-r guess in A; shapes the template.
RANK_PRIOR = (0.45, 0.15, 0.08, 0.05, 0.035, 0.025, 0.02, 0.015)


def build_tree_template(num_nodes: int, branching: int = len(RANK_PRIOR)) -> tuple[list[int], list[int]]:
    """The `num_nodes` most likely paths under RANK_PRIOR, breadth-first: (parents, ranks).

    Best-first expansion of the path tree where a path's score is the product of its ranks' priors.
    """
    branching = min(branching, len(RANK_PRIOR))
    heap: list[tuple[float, tuple[int, ...]]] = [(-RANK_PRIOR[r], (r,)) for r in range(branching)]
    heapq.heapify(heap)
    chosen: list[tuple[int, ...]] = []
    while heap and len(chosen) < num_nodes:
        negative_score, path = heapq.heappop(heap)
        chosen.append(path)
        for r in range(branching):
            heapq.heappush(heap, (negative_score * RANK_PRIOR[r], path + (r,)))
    chosen.sort(key=lambda path: (len(path), path))
    index = {path: i for i, path in enumerate(chosen)}
    parents = [index[path[:-1]] if len(path) > 1 else -1 for path in chosen]
    ranks = [path[-1] for path in chosen]
    return parents, ranks


def merge_chain(tokens: list[int], parents: list[int], chain: list[int]) -> tuple[list[int], list[int]]:
    """Insert a chain of tokens (hanging off the root) into a tree as into a trie: shared prefixes
    reuse existing nodes, the rest is appended, so the node order stays topological."""
    tokens, parents = list(tokens), list(parents)
    children = {(parent, token): node for node, (token, parent) in reversed(list(enumerate(zip(tokens, parents, strict=True))))}
    node = -1
    for token in chain:
        child = children.get((node, token))
        if child is None:
            tokens.append(token)
            parents.append(node)
            child = children[(node, token)] = len(tokens) - 1
        node = child
    return tokens, parents


class RecyclingDrafter(DrafterBase):
    """Token Recycling; with `lookup`, the prompt-lookup continuation (if any) is merged into the tree
    as one more branch: code and chat repeat their context, which the adjacency matrix alone misses."""

    name = "recycling"

    def __init__(self, vocab_size: int, num_nodes: int = 16, top_k: int = len(RANK_PRIOR),
                 lookup: PromptLookupDrafter | None = None) -> None:
        self.lookup = lookup
        self.top_k = top_k
        self.parents, ranks = build_tree_template(num_nodes, top_k)
        self.ranks = torch.tensor(ranks)
        # Start with "token t follows t"-free rows of token 0; they are overwritten on first sight.
        self.adjacency = torch.zeros(vocab_size, top_k, dtype=torch.long)
        depth_of = [d - 1 for d in tree_depths(self.parents)]  # 0 = child of the last committed token
        # Nodes grouped by depth, so each level is one gather from the adjacency matrix.
        self.levels = [torch.tensor([i for i, d in enumerate(depth_of) if d == level])
                       for level in range(max(depth_of) + 1)]
        self.parent_index = torch.tensor(self.parents)
        self.depths = depth_of

    def reset(self) -> None:
        pass  # the adjacency matrix is knowledge about the target, kept across requests

    def observe(self, tokens: list[int], logits: torch.Tensor) -> None:
        self.adjacency[torch.tensor(tokens)] = logits.topk(self.top_k, dim=-1).indices

    def propose(self, context: list[int], k: int, sampling: SamplingParams,
                generator: Randomness, stop: TokenStop | None = None) -> Draft:
        refuse_stop(self, stop)
        if k <= 0:
            return Draft(tokens=[])
        tokens = torch.empty(len(self.parents), dtype=torch.long)
        for nodes in self.levels:
            parent_tokens = torch.where(self.parent_index[nodes] < 0, context[-1],
                                        tokens[self.parent_index[nodes].clamp_min(0)])
            tokens[nodes] = self.adjacency[parent_tokens, self.ranks[nodes]]
        # k bounds the depth (how many tokens may be accepted); nodes are breadth-first, so the nodes
        # up to that depth are a prefix of the template and still a valid tree.
        n = sum(1 for d in self.depths if d < k)
        tree, parents = tokens[:n].tolist(), self.parents[:n]
        if self.lookup is not None:
            chain = self.lookup.propose(context, k, sampling, generator).tokens
            tree, parents = merge_chain(tree, parents, chain)
        return Draft(tokens=tree, parents=parents)
