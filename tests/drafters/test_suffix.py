"""Suffix Decoding's tries and drafts against brute-force references: substring counts recounted from the
sequences, drafts recomputed from those counts. Exactness of the loop with the drafter is tested with
every other drafter (tests/core/test_greedy_equality.py, test_static_runtime.py, test_loop_distribution.py)."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from specops.core.sampling import Randomness
from specops.core.types import SamplingParams
from specops.drafters.suffix import SuffixCache, SuffixDrafter, SuffixTrie, _Node, speculate

DEPTH = 5


def substring_counts(sequences: list[list[int]], depth: int) -> Counter:
    counts: Counter = Counter()
    for seq in sequences:
        for start in range(len(seq)):
            for end in range(start + 1, min(start + depth, len(seq)) + 1):
                counts[tuple(seq[start:end])] += 1
    return counts


def trie_counts(node: _Node, prefix: tuple[int, ...] = ()) -> Counter:
    counts: Counter = Counter()
    for token, child in node.items():
        assert child.count > 0  # removal drops nodes that reach zero
        counts[prefix + (token,)] = child.count
        counts.update(trie_counts(child, prefix + (token,)))
    return counts


def fed(sequences: list[list[int]], depth: int = DEPTH) -> SuffixTrie:
    trie = SuffixTrie(depth)
    for seq in sequences:
        active: list = []
        for begin in range(0, len(seq), 3):  # in pieces, as a response grows step by step
            active = trie.extend(active, seq[begin:begin + 3])
    return trie


def random_sequences(rng: random.Random, n: int, vocab: int = 4) -> list[list[int]]:
    return [[rng.randrange(vocab) for _ in range(rng.randrange(1, 14))] for _ in range(n)]


def test_trie_counts_every_substring_up_to_its_depth():
    rng = random.Random(0)
    for _ in range(30):
        sequences = random_sequences(rng, 4)
        assert trie_counts(fed(sequences).root) == substring_counts(sequences, DEPTH)


def test_removing_a_sequence_leaves_the_others_counts():
    rng = random.Random(1)
    for _ in range(30):
        sequences = random_sequences(rng, 4)
        trie = fed(sequences)
        trie.extend([], sequences[1], delta=-1)
        assert trie_counts(trie.root) == substring_counts(sequences[:1] + sequences[2:], DEPTH)


def reference_draft(sequences: list[list[int]], context: list[int], max_tokens: int, factor: float,
                    min_prob: float) -> list[int]:
    """The best chain from recounted substrings: for every match length, follow the most frequent
    continuation while the running probability stays >= min_prob; the highest sum of probabilities wins
    (ties: the longer match)."""
    counts = substring_counts(sequences, DEPTH)
    best: list[int] = []
    best_score = 0.0
    for length in range(1, min(len(context), DEPTH - 1) + 1):
        path = tuple(context[-length:])
        if counts[path] == 0:
            break
        tokens: list[int] = []
        prob, score = 1.0, 0.0
        while len(tokens) < min(max_tokens, int(factor * length + 1e-6)) and len(path) < DEPTH:
            options = [(counts[path + (t,)], -t) for t in range(8) if counts[path + (t,)]]
            if not options:
                break
            count, negative = max(options)
            prob *= count / counts[path]
            if prob < min_prob:
                break
            tokens.append(-negative)
            score += prob
            path += (-negative,)
        if tokens and score >= best_score:
            best, best_score = tokens, score
    return best


@pytest.mark.parametrize("factor", [0.5, 1.0, 2.0])
def test_chain_draft_is_the_reference_draft(factor):
    rng = random.Random(2)
    for _ in range(60):
        sequences = random_sequences(rng, 3, vocab=3)
        context = [rng.randrange(3) for _ in range(rng.randrange(1, 8))]
        draft, _ = speculate(fed(sequences), context, 4, factor, 0.2)
        assert draft.tokens == reference_draft(sequences, context, 4, factor, 0.2), (sequences, context)


def test_drafts_from_the_active_nodes_are_the_drafts_from_the_root():
    """A request's own trie drafts from the nodes its last extend left (`tails`) instead of matching every
    tail from the root: the same drafts, chains and trees. A tails list shifted by one position (each
    length's match taken one shorter) drafts otherwise somewhere, so the check can fail."""
    rng = random.Random(5)
    shifted_differs = False
    for _ in range(80):
        context = [rng.randrange(3) for _ in range(rng.randrange(1, 30))]
        trie = SuffixTrie(DEPTH)
        active: list = []
        for begin in range(0, len(context), 2):  # step by step, as a request's trie is fed
            active = trie.extend(active, context[begin:begin + 2])
        for nodes in (0, 3):
            expected = speculate(trie, context, 4, 1.0, 0.2, nodes)
            assert speculate(trie, context, 4, 1.0, 0.2, nodes, tails=active) == expected, context
            shifted = speculate(trie, context, 4, 1.0, 0.2, nodes, tails=[*active[1:], active[-1]])
            shifted_differs |= shifted != expected
    assert shifted_differs


def test_a_tree_holds_the_chain_and_respects_its_bounds():
    rng = random.Random(3)
    for _ in range(60):
        sequences = random_sequences(rng, 3, vocab=3)
        context = [rng.randrange(3) for _ in range(rng.randrange(1, 8))]
        trie = fed(sequences)
        chain, _ = speculate(trie, context, 3, 4.0, 0.1)
        tree, _ = speculate(trie, context, 3, 4.0, 0.1, tree_nodes=6)
        assert len(tree.tokens) <= 6 and tree.depth <= 3
        assert all(parent < node for node, parent in enumerate(tree.parents or []))  # topological
        if chain.tokens:  # the chain's first token is the most frequent continuation: a child of the tree's root
            assert chain.tokens[0] in [t for t, parent in zip(tree.tokens, tree.parents or [], strict=True) if parent == -1]


def test_a_repeated_request_drafts_its_earlier_answer():
    """What the global trie is for: the second time a prompt is served, the first answer is drafted."""
    drafter = SuffixDrafter(SuffixCache(16, 64), 0, 1.0, 0.1)
    prompt, answer = [1, 2, 3, 4], [9, 8, 7, 6, 5, 4, 3, 2, 1, 0]
    random_source: Randomness = None  # type: ignore[assignment]  # deterministic drafter: never drawn from
    drafter.reset()
    drafter.propose(prompt, 4, SamplingParams(), random_source)
    drafter.finish(prompt + answer)
    drafter.reset()
    drafter.propose(prompt, 4, SamplingParams(), random_source)
    # A match of m tokens drafts up to m (suffix_factor 1): the draft grows with the match.
    assert drafter.propose(prompt + answer[:2], 6, SamplingParams(), random_source).tokens == answer[2:4]
    assert drafter.propose(prompt + answer[:5], 6, SamplingParams(), random_source).tokens == answer[5:10]


def test_the_oldest_responses_leave_the_cache():
    cache = SuffixCache(4, 2)
    for tokens in ([1, 2, 3], [4, 5, 6], [7, 8, 9]):
        cache.extend(cache.start(), tokens)
    assert cache.responses == 2
    assert trie_counts(cache.trie.root) == substring_counts([[4, 5, 6], [7, 8, 9]], 4)


def test_forks_share_the_cache_not_the_request():
    import copy

    drafter = SuffixDrafter(SuffixCache(8, 64), 0, 1.0, 0.1)
    twin = copy.copy(drafter)
    twin.reset()
    assert twin.cache is drafter.cache and twin.local is not drafter.local


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="suffix_max_depth must be >= 2"):
        SuffixTrie(1)
    with pytest.raises(ValueError, match="suffix_factor must be > 0"):
        SuffixDrafter(SuffixCache(8, 64), 0, 0.0, 0.1)
    with pytest.raises(ValueError, match="suffix_min_prob must be in"):
        SuffixDrafter(SuffixCache(8, 64), 0, 1.0, 0.0)
    with pytest.raises(ValueError, match="suffix_max_cached"):
        SuffixCache(8, 0)
