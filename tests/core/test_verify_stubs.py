"""Stub logits where the draft is always, never or sometimes accepted, with exact expected tokens."""

from __future__ import annotations

import pytest
import torch

from specops.core.sampling import PositionNoise, logits_to_probs
from specops.core.types import SamplingParams
from specops.core.verify import VERIFIERS, verify_tree

V = 10


def one_hot_rows(tokens: list[int]) -> torch.Tensor:
    return torch.nn.functional.one_hot(torch.tensor(tokens), V).to(torch.float64)


@pytest.mark.parametrize("name", list(VERIFIERS))
@pytest.mark.parametrize(
    ("draft", "target_argmax", "expected"),
    [
        ([3, 4, 5], [3, 4, 5, 6], (3, 6)),  # always: all accepted plus the bonus token
        ([3, 4, 5], [7, 4, 5, 6], (0, 7)),  # never: the first token is rejected and corrected
        ([3, 4, 5], [3, 4, 8, 6], (2, 8)),  # sometimes: two accepted, the third corrected
        ([], [9], (0, 9)),  # nothing drafted: one plain decoding step
    ],
)
def test_rules_on_deterministic_stubs(name, draft, target_argmax, expected):
    p = one_hot_rows(target_argmax)
    generator = PositionNoise(0, V) if name == "coupled" else torch.Generator().manual_seed(0)
    assert VERIFIERS[name](torch.tensor(draft, dtype=torch.long), None, p, generator) == expected


@pytest.mark.parametrize("name", ["rejection", "block"])
def test_zero_probability_draft_token_is_always_rejected(name):
    p = torch.full((3, V), 1.0 / (V - 1), dtype=torch.float64)
    p[:, 0] = 0.0
    q = torch.zeros(2, V, dtype=torch.float64)
    q[:, 0] = 1.0
    for seed in range(20):
        n, token = VERIFIERS[name](torch.tensor([0, 0]), q, p, torch.Generator().manual_seed(seed))
        assert n == 0 and token != 0


def test_tree_greedy_walk_takes_the_matching_branch():
    tokens = torch.tensor([1, 2, 3, 4])
    parents = [-1, -1, 1, 1]  # root -> {1, 2}; 2 -> {3, 4}
    p = one_hot_rows([2, 0, 4, 0, 0])  # root wants 2; node "2" wants 4; node "4" wants 0
    assert verify_tree(tokens, parents, p, greedy=True) == ([1, 3], 0)
    assert verify_tree(tokens, parents, one_hot_rows([5, 0, 0, 0, 0]), greedy=True) == ([], 5)


def test_sampling_transform_matches_plain_reference():
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0, 0.0]], dtype=torch.float64)
    params = SamplingParams(temperature=0.7, top_k=4, top_p=0.8)
    scaled = (logits[0] / 0.7).tolist()
    keep = sorted(range(5), key=lambda i: -scaled[i])[:4]  # top-k
    probs = torch.softmax(torch.tensor([scaled[i] for i in keep]), 0).tolist()
    kept, mass = [], 0.0
    for i, prob in zip(keep, probs, strict=True):  # top-p: keep tokens until the mass before them reaches 0.8
        if mass >= 0.8:
            break
        kept.append(i)
        mass += prob
    expected = torch.zeros(5, dtype=torch.float64)
    expected[kept] = torch.softmax(torch.tensor([scaled[i] for i in kept], dtype=torch.float64), 0)
    torch.testing.assert_close(logits_to_probs(logits, params)[0], expected)
    assert logits_to_probs(logits, SamplingParams()).tolist() == [[1.0, 0.0, 0.0, 0.0, 0.0]]


def test_position_noise_is_keyed_by_position_and_forgets_committed_ones():
    noise = PositionNoise(1, V)
    fifth = noise.at(5).clone()
    later = noise.shifted(3)
    later.rows(3)  # positions 3, 4, 5
    assert torch.equal(later.shifted(5).at(5), fifth)  # the same draw however it is reached
    assert sorted(later.shifted(5)._cache) == [5]  # committed positions left the cache
    assert torch.equal(PositionNoise(1, V).at(4), later.rows(2)[1]) and not torch.equal(fifth, noise.at(4))


def test_the_fast_argmax_is_torchs_argmax_including_ties():
    """specops.core.sampling.argmax upcasts bf16/fp16 for speed; it must pick exactly torch's index, the first
    maximum, on rows full of ties, and must not round wider dtypes (a mutant that cast everything to fp32
    would tie two fp64 scores 1e-12 apart and pick the first, the smaller)."""
    from specops.core.sampling import argmax

    g = torch.Generator().manual_seed(0)
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        scores = torch.randint(0, 4, (64, 49152), generator=g).to(dtype)  # every row has thousands of tied maxima
        scores[3] = float("-inf")
        scores[3, 17] = 0
        assert torch.equal(argmax(scores), scores.argmax(-1)), dtype
        assert int(argmax(scores[3])) == 17
    close = torch.tensor([1.0, 1.0 + 1e-12], dtype=torch.float64)
    assert int(argmax(close)) == 1
