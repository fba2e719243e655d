"""EAGLE-2's dynamic draft tree (arXiv 2406.16858), for any drafter that can run a set of drafted
tokens through its own KV cache under an attention mask.

From the last committed token take the top-K tokens; at each depth run the drafter once on the K best
nodes of the newest level (by cumulative draft log-probability) and give each its top-K children;
finally keep the `tree_nodes` best nodes of the whole tree. The candidates are deterministic, so
`verify_tree` is lossless at any temperature. The aligned head and the draft LM both grow their trees
here; only how they run a level differs (the `Expand` callback).
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from dataclasses import dataclass

import torch

from specops.core.drafter import Draft

Children = list[tuple[int, float]]  # (target token id, draft log-probability), best first


@dataclass
class TreeNode:
    token: int  # target id
    parent: int  # node index, -1 for a child of the last committed token
    depth: int  # 1 for children of the last committed token
    score: float  # cumulative draft log-probability


# Run the drafter on the nodes `expand` (indices into `nodes`, all of depth `depth`), appended to its
# cache in that order, each attending to the row of `visible` [n, cache length after appending];
# return each node's children.
Expand = Callable[[list[TreeNode], list[int], torch.Tensor, int], list[Children]]


def top_children(logprobs: torch.Tensor, k: int,
                 to_target: Callable[[torch.Tensor], torch.Tensor] | None = None) -> list[Children]:
    """logprobs [n, V] -> the top-k (token, log-probability) of each row; `to_target` maps column
    indices to target ids when the columns are a draft vocabulary."""
    top = logprobs.topk(min(k, logprobs.shape[-1]), dim=-1)
    ids = top.indices if to_target is None else to_target(top.indices)
    return [list(zip(row_ids, row_scores, strict=True)) for row_ids, row_scores in zip(ids.tolist(), top.values.tolist(),
                                                                                    strict=True)]


def grow_tree(root_children: Children, expand: Expand, max_depth: int, top_k: int, tree_nodes: int,
              cache_length: int) -> Draft:
    """A tree of at most `tree_nodes` nodes and `max_depth` levels. `cache_length` is the drafter's
    cache length before drafting; `expand` appends each level's expanded nodes after it, in order,
    and the caller crops them afterwards."""
    return select_best(grow_nodes(root_children, expand, max_depth, top_k, cache_length), tree_nodes)


def grow_nodes(root_children: Children, expand: Expand, max_depth: int, top_k: int,
               cache_length: int) -> list[TreeNode]:
    """Every node `grow_tree` chooses from, parents before children (CoSine fuses several drafters' pools)."""
    nodes = [TreeNode(t, -1, 1, s) for t, s in root_children]
    entry: dict[int, int] = {}  # node -> its index in the drafter's cache, once expanded
    length = cache_length
    for depth in range(1, max_depth):
        level = [i for i, node in enumerate(nodes) if node.depth == depth]
        chosen = heapq.nlargest(top_k, level, key=lambda i: nodes[i].score)
        if not chosen:
            break
        visible = torch.zeros(len(chosen), length + len(chosen), dtype=torch.bool)
        visible[:, :cache_length] = True
        for row, i in enumerate(chosen):
            parent = nodes[i].parent
            while parent >= 0:  # ancestors were expanded at earlier depths
                visible[row, entry[parent]] = True
                parent = nodes[parent].parent
            entry[i] = length + row
            visible[row, entry[i]] = True
        for i, children in zip(chosen, expand(nodes, chosen, visible, depth), strict=True):
            nodes.extend(TreeNode(t, i, depth + 1, nodes[i].score + s) for t, s in children)
        length += len(chosen)
    return nodes


def select_best(nodes: list[TreeNode], tree_nodes: int) -> Draft:
    """The tree_nodes best nodes; a parent scores at least as high as its children and sorts first on
    ties (shallower), so taking nodes in this order keeps every parent."""
    order = sorted(range(len(nodes)), key=lambda i: (-nodes[i].score, nodes[i].depth, i))
    chosen: set[int] = set()
    for i in order:
        if len(chosen) == tree_nodes:
            break
        if nodes[i].parent < 0 or nodes[i].parent in chosen:
            chosen.add(i)
    kept = sorted(chosen, key=lambda i: (nodes[i].depth, i))  # topological: parents first
    index = {node: position for position, node in enumerate(kept)}
    return Draft(tokens=[nodes[i].token for i in kept],
                 parents=[index[nodes[i].parent] if nodes[i].parent >= 0 else -1 for i in kept])
