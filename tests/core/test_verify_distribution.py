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

from specops.core.sampling import sample
from specops.core.verify import _draft_probs, verify_block, verify_rejection, verify_tree

V, N = 3, 8_000


def toy_dist(context: tuple[int, ...], salt: int, sharpness: float, keep: int = V) -> torch.Tensor:
    """A fixed pseudo-random distribution per context; with keep < V only its `keep` most likely tokens
    have mass (as top-k leaves them), so p and q can have different supports."""
    g = torch.Generator().manual_seed(zlib.crc32(repr((context, salt)).encode()))
    probs = torch.softmax(sharpness * torch.randn(V, generator=g, dtype=torch.float64), 0)
    if keep < V:
        probs[probs.argsort()[: V - keep]] = 0
        probs = probs / probs.sum()
    return probs


class Toy:
    """Target p and a sharper, different draft q (many rejections, large residuals); `keep` = 2 gives
    both zero-support tokens: drafted tokens with p(x) = 0 and target tokens with q(x) = 0."""

    def __init__(self, keep: int = V) -> None:
        self.keep = keep

    def p(self, ctx: tuple[int, ...]) -> torch.Tensor:
        return toy_dist(ctx, 0, 1.5, self.keep)

    def q(self, ctx: tuple[int, ...]) -> torch.Tensor:
        return toy_dist(ctx, 1, 2.5, self.keep)


FULL, TRUNCATED = Toy(), Toy(keep=2)


def exact_target(toy: Toy, length: int) -> dict[tuple[int, ...], float]:
    out = {}
    for seq in itertools.product(range(V), repeat=length):
        prob = 1.0
        for i in range(length):
            prob *= float(toy.p(seq[:i])[seq[i]])
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


def run_chain(rule, generator, k_max: int, toy: Toy = FULL) -> tuple[int, ...]:
    """Generate k_max + 1 tokens: the first step drafts k_max tokens, so every rule sees a full draft."""
    length = k_max + 1
    ctx: tuple[int, ...] = ()
    while len(ctx) < length:
        k = min(k_max, length - len(ctx) - 1)
        draft, q_rows = [], []
        for _ in range(k):
            q = toy.q(ctx + tuple(draft))
            q_rows.append(q)
            draft.append(sample(q, generator))
        p = torch.stack([toy.p(ctx + tuple(draft[:i])) for i in range(k + 1)])
        q = torch.stack(q_rows) if q_rows else torch.zeros(0, V, dtype=torch.float64)
        n, nxt = rule(torch.tensor(draft, dtype=torch.long), q, p, generator)
        ctx = ctx + tuple(draft[:n]) + (nxt,)
    return ctx[:length]


def run_tree(walk, generator, toy: Toy = FULL) -> tuple[int, ...]:
    """A fixed tree of deterministic candidates: two children at depth 1, one grandchild each."""
    ctx: tuple[int, ...] = ()
    while len(ctx) < 3:
        tokens = [0, 1, 2, 0]
        parents = [-1, -1, 0, 1]
        paths = [(), (0,), (1,), (0, 2), (1, 0)]
        p = torch.stack([toy.p(ctx + path) for path in paths])
        path, nxt = walk(torch.tensor(tokens), parents, p, greedy=False, generator=generator)
        ctx = ctx + tuple(tokens[i] for i in path) + (nxt,)
    return ctx[:3]


def p_value(samples: list[tuple[int, ...]], toy: Toy = FULL) -> float:
    exact = exact_target(toy, len(samples[0]))
    if any(exact[s] == 0 for s in samples):  # a token the target never emits
        return 0.0
    keys = [key for key in sorted(exact) if exact[key] > 0]
    observed = [sum(1 for s in samples if s == key) for key in keys]
    expected = [exact[key] * len(samples) for key in keys]
    return float(chisquare(observed, expected).pvalue)


def report(name: str, p: float) -> float:
    print(f"\n{name}: p = {p:.3g}")
    return p


def root_row_walk(tokens, parents, p, greedy, generator=None):
    """A broken tree walk: every level drawn from the root's distribution."""
    return verify_tree(tokens, parents, p[:1].expand(p.shape[0], -1), greedy, generator)


@pytest.mark.parametrize("k", [2, 3])
@pytest.mark.parametrize("rule", [verify_rejection, verify_block], ids=["rejection", "block"])
def test_chain_rules_preserve_target_distribution(rule, k):
    generator = torch.Generator().manual_seed(1234)
    samples = [run_chain(rule, generator, k) for _ in range(N)]
    assert report(f"{rule.__name__} k={k}", p_value(samples)) > 1e-3


@pytest.mark.parametrize("rule", [verify_rejection, verify_block], ids=["rejection", "block"])
def test_chain_rules_with_zero_support(rule):
    """p(x) = 0 for some drafted tokens and q(x) = 0 for some tokens the target wants."""
    contexts = [c for n in range(3) for c in itertools.product(range(V), repeat=n)]
    assert any(bool(((TRUNCATED.q(c) > 0) & (TRUNCATED.p(c) == 0)).any()) for c in contexts)
    assert any(bool(((TRUNCATED.p(c) > 0) & (TRUNCATED.q(c) == 0)).any()) for c in contexts)
    generator = torch.Generator().manual_seed(4321)
    samples = [run_chain(rule, generator, 2, TRUNCATED) for _ in range(N)]
    assert report(f"{rule.__name__} zero support", p_value(samples, TRUNCATED)) > 1e-3


@pytest.mark.parametrize("toy", [FULL, TRUNCATED], ids=["full", "zero-support"])
def test_tree_rule_preserves_target_distribution(toy):
    generator = torch.Generator().manual_seed(99)
    samples = [run_tree(verify_tree, generator, toy) for _ in range(N)]
    assert report(f"verify_tree {toy.keep}", p_value(samples, toy)) > 1e-3


def test_wrong_rule_is_caught():
    generator = torch.Generator().manual_seed(1234)
    samples = [run_chain(wrong_rejection, generator, 2) for _ in range(N)]
    assert report("mutant: resample from p", p_value(samples)) < 1e-6


def test_block_with_token_wise_interior_weights_is_caught(monkeypatch):
    """Block verification with h_i replaced by w_i for 2 <= i < k: only K >= 3 has such an h_i."""
    import specops.core.verify as verify

    right = verify.block_continue_probs

    def interior_w(w, p, q):
        h = right(w, p, q)
        h[2: q.shape[0]] = w[2: q.shape[0]]
        return h

    monkeypatch.setattr(verify, "block_continue_probs", interior_w)
    generator = torch.Generator().manual_seed(1234)
    samples = [run_chain(verify_block, generator, 3) for _ in range(N)]
    assert report("mutant: block h_i = w_i for i >= 2", p_value(samples)) < 1e-6


def test_wrong_tree_walk_is_caught():
    generator = torch.Generator().manual_seed(99)
    samples = [run_tree(root_row_walk, generator) for _ in range(N)]
    assert report("mutant: tree walk on the root's row", p_value(samples)) < 1e-6
