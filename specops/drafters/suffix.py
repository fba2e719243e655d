"""Suffix Decoding (Oliaro et al. 2024, arXiv 2411.04975; vLLM's `suffix` method from Arctic Inference).

Model-free drafting from what was already written. Two suffix tries count every substring of up to
`max_depth` tokens: a global one over the responses of past (and concurrent) requests, and a
per-request one over the prompt and the response so far. A step matches the context's tail in both,
for every match length that exists, and continues each match along the most frequent children: the
estimated probability of a drafted token is the product of count(child) / count(parent) along its
path, and a draft stops below `min_prob`. Longer matches earn longer drafts (at most
`factor * match length` tokens, the paper's adaptive speculation length), and the draft with the
highest score (the sum of its tokens' probabilities: the expected number accepted) wins. As a tree
(`suffix-tree`), the most probable nodes are expanded best-first.

It learns from served traffic with no training: every response goes into the global trie as it is
written, so a repeated or templated task drafts the earlier answer verbatim. The global trie is shared
by every fork of the drafter (the server's generation slots) and keeps the last `max_cached` responses,
the oldest removed first. A server starting (or hot-reloading) with a feedback log fills it with the
log's newest responses first (`remember`), so a restart does not forget the traffic.

Why our own and not arctic-inference's `SuffixDecodingCache`: arctic-inference 0.3.0 ships only an
sdist whose build needs torch >= 2.10 in an isolated build environment (pip would download the newest
CUDA torch, gigabytes) or, without isolation, nanobind, cmake, ninja, grpcio-tools and protobuf 5.29.6
in our environment, and its package pulls in vLLM plugins we do not use. A trie in Python is
~200 lines, costs well under a millisecond per step at depth 24, and is tested against a brute-force
reference (tests/drafters/test_suffix.py).
"""

from __future__ import annotations

import heapq
import itertools
import threading
from collections import OrderedDict

from specops.core.drafter import EMPTY, Draft, DrafterBase, TokenStop, refuse_stop
from specops.core.sampling import Randomness
from specops.core.types import SamplingParams


class _Node:
    """A trie node. Most nodes have at most one child (a suffix continues one way), so that child sits in
    two slots and a dict exists only from the second child on: a third of the memory of a dict per node."""

    __slots__ = ("count", "token", "child", "more")

    def __init__(self) -> None:
        self.count = 0
        self.token = -1  # the only child's token, while there is at most one
        self.child: _Node | None = None
        self.more: dict[int, _Node] | None = None  # every child, once there are two or more

    def get(self, token: int) -> _Node | None:
        if self.more is not None:
            return self.more.get(token)
        return self.child if token == self.token else None

    def attach(self, token: int) -> _Node:
        """A new child (count 0) for `token`, which has none yet."""
        node = _Node()
        if self.more is not None:
            self.more[token] = node
        elif self.child is None:
            self.token, self.child = token, node
        else:
            self.more = {self.token: self.child, token: node}
            self.token, self.child = -1, None
        return node

    def remove(self, token: int) -> None:
        if self.more is None:
            self.token, self.child = -1, None
            return
        del self.more[token]
        if len(self.more) == 1:
            (self.token, self.child), = self.more.items()
            self.more = None

    def items(self) -> list[tuple[int, _Node]]:
        if self.more is not None:
            return list(self.more.items())
        return [] if self.child is None else [(self.token, self.child)]


class SuffixTrie:
    """Occurrence counts of every substring of at most `max_depth` tokens of the sequences fed to it.

    A sequence grows token by token (`extend`): each token extends the substrings ending just before
    it by one node, so `active` holds one node per start position within the last max_depth tokens.
    count(s + t) <= count(s), so removing a sequence (decrementing its substrings) and dropping the
    nodes that reach zero drops whole subtrees."""

    def __init__(self, max_depth: int) -> None:
        if max_depth < 2:
            raise ValueError(f"suffix_max_depth must be >= 2 (a match and a token to draft), got {max_depth}.")
        self.max_depth = max_depth
        self.root = _Node()

    def extend(self, active: list[_Node], tokens: list[int], delta: int = 1) -> list[_Node]:
        """Feed `tokens` after the substrings whose end nodes are `active` (one per start position, longest
        first); returns the new active nodes. delta -1 removes what delta +1 added."""
        for token in tokens:
            grown = []
            for node in [*active[-(self.max_depth - 1):], self.root]:
                # _Node.get inlined: this loop runs max_depth times a token on every generation thread.
                child = node.more.get(token) if node.more is not None else node.child if node.token == token else None
                if child is None:
                    child = node.attach(token)
                child.count += delta
                if child.count <= 0:
                    node.remove(token)
                grown.append(child)
            active = grown
        return active

    def match(self, tail: list[int]) -> _Node | None:
        """The node of the substring `tail`, or None when it never occurred."""
        node = self.root
        for token in tail:
            child = node.get(token)
            if child is None:
                return None
            node = child
        return node


def _best_child(node: _Node) -> tuple[int, _Node] | None:
    if node.more is None:  # most nodes: one child or none
        return None if node.child is None else (node.token, node.child)
    # Ties go to the smaller token id, so a draft never depends on insertion order.
    return max(node.more.items(), key=lambda item: (item[1].count, -item[0]))


def speculate_path(node: _Node, max_tokens: int, min_prob: float) -> tuple[list[int], float]:
    """The chain of most frequent children below `node`: (tokens, score = the sum of their probabilities)."""
    tokens, prob, score = [], 1.0, 0.0
    while len(tokens) < max_tokens:
        best = _best_child(node)
        if best is None:
            break
        token, child = best
        prob *= child.count / node.count
        if prob < min_prob:
            break
        tokens.append(token)
        score += prob
        node = child
    return tokens, score


def speculate_tree(node: _Node, max_nodes: int, max_depth: int, min_prob: float) -> tuple[list[int], list[int], float]:
    """The `max_nodes` most probable continuations below `node`, best-first, at most `max_depth` deep:
    (tokens, parents in topological order with -1 for the root's children, score)."""
    tokens: list[int] = []
    parents: list[int] = []
    score = 0.0
    order = itertools.count()  # a heap tiebreak: first pushed, first expanded
    heap: list[tuple[float, int, int, int, int, _Node]] = []

    def push(parent_node: _Node, parent: int, prob: float, depth: int) -> None:
        if depth > max_depth:
            return
        for token, child in parent_node.items():
            p = prob * child.count / parent_node.count
            if p >= min_prob:
                heapq.heappush(heap, (-p, next(order), token, parent, depth, child))

    push(node, -1, 1.0, 1)
    while heap and len(tokens) < max_nodes:
        negative, _, token, parent, depth, child = heapq.heappop(heap)
        tokens.append(token)
        parents.append(parent)
        score -= negative
        push(child, len(tokens) - 1, -negative, depth + 1)
    return tokens, parents, score


def speculate(trie: SuffixTrie, context: list[int], max_tokens: int, factor: float, min_prob: float,
              tree_nodes: int = 0, tails: list[_Node] | None = None) -> tuple[Draft, float]:
    """The best draft over every match length of the context's tail (paper, section 4.2): a match of
    length m may draft factor * m tokens, at most max_tokens (a tree: factor * m nodes, at most tree_nodes,
    max_tokens deep); the highest score wins. `tails`: the trie's active nodes after the whole context was
    fed to it (`SuffixTrie.extend`), which are the tails' matches, so none is walked from the root again."""
    best, best_score = EMPTY, 0.0
    for length in range(1, min(len(context), trie.max_depth - 1) + 1):
        node = tails[-length] if tails is not None else trie.match(context[-length:])
        if node is None:
            break  # a longer tail contains this one, so it never occurred either
        budget = int(factor * length + 1e-6)  # the adaptive speculation length: tokens (chain) or nodes (tree)
        if tree_nodes:
            tokens, parents, score = speculate_tree(node, min(tree_nodes, budget), max_tokens, min_prob)
            draft = Draft(tokens, parents=parents) if tokens else EMPTY
        else:
            chain, score = speculate_path(node, min(max_tokens, budget), min_prob)
            draft = Draft(chain) if chain else EMPTY
        if score >= best_score and draft.tokens:
            best, best_score = draft, score
    return best, best_score


class SuffixCache:
    """The global trie over served responses, shared by every fork of a drafter; thread-safe."""

    def __init__(self, max_depth: int, max_cached: int) -> None:
        if max_cached < 1:
            raise ValueError(f"suffix_max_cached must be >= 1, got {max_cached}.")
        self.trie = SuffixTrie(max_depth)
        self.max_cached = max_cached
        self.lock = threading.Lock()
        self._responses: OrderedDict[int, tuple[list[int], list[_Node]]] = OrderedDict()
        self._ids = itertools.count()

    def add(self, tokens: list[int]) -> None:
        """A finished response."""
        self.extend(self.start(), tokens)

    def start(self) -> int:
        """A new response slot; the oldest response leaves once more than max_cached are kept."""
        with self.lock:
            key = next(self._ids)
            self._responses[key] = ([], [])
            while len(self._responses) > self.max_cached:
                _, (tokens, _) = self._responses.popitem(last=False)
                self.trie.extend([], tokens, delta=-1)
            return key

    def extend(self, key: int, tokens: list[int]) -> None:
        with self.lock:
            entry = self._responses.get(key)
            if entry is None or not tokens:  # evicted while it was still being written
                return
            entry[0].extend(tokens)
            self._responses[key] = (entry[0], self.trie.extend(entry[1], tokens))

    def speculate(self, context: list[int], max_tokens: int, factor: float, min_prob: float,
                  tree_nodes: int) -> tuple[Draft, float]:
        with self.lock:
            return speculate(self.trie, context, max_tokens, factor, min_prob, tree_nodes)

    @property
    def responses(self) -> int:
        return len(self._responses)


class SuffixDrafter(DrafterBase):
    """`tree_nodes` 0 drafts chains (the static runtime verifies those), > 0 trees of that many nodes."""

    def __init__(self, cache: SuffixCache, tree_nodes: int, factor: float, min_prob: float) -> None:
        if factor <= 0:
            raise ValueError(f"suffix_factor must be > 0, got {factor}.")
        if not 0 < min_prob <= 1:
            raise ValueError(f"suffix_min_prob must be in (0, 1], got {min_prob}.")
        self.name = "suffix-tree" if tree_nodes else "suffix"
        self.cache = cache
        self.tree_nodes = tree_nodes
        self.factor = factor
        self.min_prob = min_prob
        self.reset()

    def reset(self) -> None:
        # Rebinds rather than clears: a fork (copy.copy) shares `cache` but must not share these.
        self.local = SuffixTrie(self.cache.trie.max_depth)
        self.local_active: list[_Node] = []
        self.response: int | None = None  # the global cache's slot for this response, from the first step
        self.fed = 0  # context tokens already in the tries

    def _feed(self, context: list[int]) -> None:
        """Put the tokens committed since the last call into the per-request trie and, past the prompt
        (the first context a generation proposes from), into the global one."""
        new = context[self.fed:]
        if self.response is None:
            self.response = self.cache.start()
        elif new:
            self.cache.extend(self.response, new)
        self.local_active = self.local.extend(self.local_active, new)
        self.fed = len(context)

    def propose(self, context: list[int], k: int, sampling: SamplingParams, generator: Randomness,
                stop: TokenStop | None = None) -> Draft:
        refuse_stop(self, stop)
        return self.scored(context, k)[0]

    def scored(self, context: list[int], k: int) -> tuple[Draft, float]:
        """The best of the per-request and global tries' drafts, with its score (the sum of its tokens'
        estimated probabilities: how many of them the tries expect to be accepted)."""
        self._feed(context)
        local = speculate(self.local, context, k, self.factor, self.min_prob, self.tree_nodes, self.local_active)
        shared = self.cache.speculate(context, k, self.factor, self.min_prob, self.tree_nodes)
        return local if local[1] >= shared[1] else shared

    def finish(self, context: list[int]) -> None:
        self._feed(context)  # the last step's tokens, which no proposal saw

    @property
    def remembers(self) -> int:  # type: ignore[override]  # DrafterBase's is a plain 0
        return self.cache.max_cached

    def remember(self, responses: list[list[int]]) -> None:
        for tokens in responses:
            self.cache.add(tokens)
