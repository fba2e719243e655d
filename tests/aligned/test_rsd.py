"""Recursive rejection sampling over sampled sibling candidates must preserve the target distribution.

Same method as tests/serving/test_verify_distribution.py: exact fp64 toy distributions p (target)
and q (draft) for every context; each step drafts a tree whose two root children are drawn from q
without replacement and each has one child drawn from q; the first L emitted tokens are compared
with the exact target distribution by a chi-square test. A naive multi-candidate rule (each sibling
tested against the unchanged p and q) must fail the same test, proving the test can catch a bad rule.
"""

from __future__ import annotations

import torch

from serving.sampling import sample
from serving.verify import verify_tree_rsd
from tests.serving.test_verify_distribution import p_of, p_value, q_of

L, N = 3, 12_000


def draw_without_replacement(q: torch.Tensor, n: int, generator: torch.Generator) -> list[int]:
    q = q.clone()
    drawn = []
    for _ in range(n):
        token = sample(q / q.sum(), generator)
        drawn.append(token)
        q[token] = 0
    return drawn


def naive_rule(tokens, parents, q, p, generator=None):
    """Wrong: tests every sibling against the original p and q and falls back to p, no residual."""
    path, current = [], -1
    while True:
        for child in [i for i, parent in enumerate(parents) if parent == current]:
            x = int(tokens[child])
            if torch.rand(1, generator=generator, dtype=p.dtype) < p[current + 1, x] / q[current + 1, x]:
                path.append(child)
                current = child
                break
        else:
            return path, sample(p[current + 1], generator)


def run_tree(rule, generator: torch.Generator) -> tuple[int, ...]:
    ctx: tuple[int, ...] = ()
    while len(ctx) < L:
        a, b = draw_without_replacement(q_of(ctx), 2, generator)
        a2 = sample(q_of(ctx + (a,)), generator)
        b2 = sample(q_of(ctx + (b,)), generator)
        tokens, parents = [a, b, a2, b2], [-1, -1, 0, 1]
        contexts = [ctx, ctx + (a,), ctx + (b,), ctx + (a, a2), ctx + (b, b2)]
        p = torch.stack([p_of(c) for c in contexts])
        q = torch.stack([q_of(c) for c in contexts])
        path, nxt = rule(torch.tensor(tokens), parents, q, p, generator)
        ctx = ctx + tuple(tokens[i] for i in path) + (nxt,)
    return ctx[:L]


def test_rsd_preserves_the_target_distribution():
    generator = torch.Generator().manual_seed(7)
    assert p_value([run_tree(verify_tree_rsd, generator) for _ in range(N)]) > 1e-3


def test_naive_multi_candidate_rule_is_caught():
    generator = torch.Generator().manual_seed(7)
    assert p_value([run_tree(naive_rule, generator) for _ in range(N)]) < 1e-6


def test_rsd_stubs():
    p = torch.tensor([[0.2, 0.3, 0.5], [1.0, 0.0, 0.0]], dtype=torch.float64)
    same = verify_tree_rsd(torch.tensor([1]), [-1], p.clone(), p, torch.Generator().manual_seed(0))
    assert same[0] == [0]  # q == p: the first sibling is always accepted
    one_hot = torch.tensor([[0.0, 0.0, 1.0], [1.0, 0.0, 0.0]], dtype=torch.float64)
    q = torch.tensor([[0.5, 0.5, 0.0], [1.0, 0.0, 0.0]], dtype=torch.float64)
    assert verify_tree_rsd(torch.tensor([0]), [-1], q, one_hot) == ([], 2)  # never accepted, residual = p
    try:
        verify_tree_rsd(torch.tensor([2]), [-1], q, one_hot)
    except ValueError as error:
        assert "without replacement" in str(error)
    else:
        raise AssertionError("a candidate with zero draft mass must be refused")
