"""Sampling must preserve the target distribution exactly.

A toy model gives exact fp64 next-token distributions p (target) and q (draft) for every context.
We run each verification rule in a minimal speculative loop, collect the first L tokens, and compare
their empirical distribution with the exact target distribution by a chi-square test. A deliberately
wrong rule (resampling from p instead of the residual) must fail the same test, which proves the
test has the power to catch a broken rule.
"""

from __future__ import annotations

import itertools
import zlib

import pytest
import torch
from scipy.stats import chisquare

from serving.sampling import sample
from serving.verify import _draft_probs, verify_block, verify_rejection, verify_tree

V, L, K, N = 3, 3, 2, 12_000


def toy_dist(context: tuple[int, ...], salt: int, sharpness: float) -> torch.Tensor:
    g = torch.Generator().manual_seed(zlib.crc32(repr((context, salt)).encode()))
    return torch.softmax(sharpness * torch.randn(V, generator=g, dtype=torch.float64), 0)


def p_of(ctx):
    return toy_dist(ctx, 0, 1.5)


def q_of(ctx):
    return toy_dist(ctx, 1, 2.5)  # a sharper, different draft: many rejections, large residuals


def exact_target() -> dict[tuple[int, ...], float]:
    out = {}
    for seq in itertools.product(range(V), repeat=L):
        prob = 1.0
        for i in range(L):
            prob *= float(p_of(seq[:i])[seq[i]])
        out[seq] = prob
    return out


def wrong_rejection(draft, q, p, generator=None):
    """Token-wise rule that forgets the residual: resamples from p after a rejection."""
    k = draft.shape[0]
    q_dense = _draft_probs(draft, q, p)
    for i in range(k):
        ratio = p[i, draft[i]] / q_dense[i, draft[i]]
        if torch.rand(1, generator=generator, dtype=p.dtype) >= ratio:
            return i, sample(p[i], generator)
    return k, sample(p[k], generator)


def run_chain(rule, generator) -> tuple[int, ...]:
    ctx: tuple[int, ...] = ()
    while len(ctx) < L:
        k = min(K, L - len(ctx) - 1)
        draft, q_rows = [], []
        for _ in range(k):
            q = q_of(ctx + tuple(draft))
            q_rows.append(q)
            draft.append(sample(q, generator))
        p = torch.stack([p_of(ctx + tuple(draft[:i])) for i in range(k + 1)])
        q = torch.stack(q_rows) if q_rows else torch.zeros(0, V, dtype=torch.float64)
        n, nxt = rule(torch.tensor(draft, dtype=torch.long), q, p, generator)
        ctx = ctx + tuple(draft[:n]) + (nxt,)
    return ctx[:L]


def run_tree(generator) -> tuple[int, ...]:
    """A fixed tree of deterministic candidates: two children at depth 1, one grandchild each."""
    ctx: tuple[int, ...] = ()
    while len(ctx) < L:
        tokens = [0, 1, 2, 0]
        parents = [-1, -1, 0, 1]
        paths = [(), (0,), (1,), (0, 2), (1, 0)]
        p = torch.stack([p_of(ctx + path) for path in paths])
        path, nxt = verify_tree(torch.tensor(tokens), parents, p, greedy=False, generator=generator)
        ctx = ctx + tuple(tokens[i] for i in path) + (nxt,)
    return ctx[:L]


def p_value(samples: list[tuple[int, ...]]) -> float:
    exact = exact_target()
    keys = sorted(exact)
    observed = [sum(1 for s in samples if s == key) for key in keys]
    expected = [exact[key] * len(samples) for key in keys]
    return float(chisquare(observed, expected).pvalue)


@pytest.mark.parametrize("rule", [verify_rejection, verify_block], ids=["rejection", "block"])
def test_chain_rules_preserve_target_distribution(rule):
    generator = torch.Generator().manual_seed(1234)
    samples = [run_chain(rule, generator) for _ in range(N)]
    assert p_value(samples) > 1e-3


def test_tree_rule_preserves_target_distribution():
    generator = torch.Generator().manual_seed(99)
    samples = [run_tree(generator) for _ in range(N)]
    assert p_value(samples) > 1e-3


def test_wrong_rule_is_caught():
    generator = torch.Generator().manual_seed(1234)
    samples = [run_chain(wrong_rejection, generator) for _ in range(N)]
    assert p_value(samples) < 1e-6
