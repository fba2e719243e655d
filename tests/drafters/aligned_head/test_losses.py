"""Each loss and the alignment mask against a plain loop-by-loop reference."""

from __future__ import annotations

import math

import torch

from specops.train.aligned_losses import (
    feature_regression,
    next_alignment,
    soft_cross_entropy,
    teacher_in_draft_vocab,
    topk_hits,
)

G = torch.Generator().manual_seed(0)


def test_teacher_is_mapped_and_renormalized_inside_the_draft_vocab():
    to_draft = torch.tensor([-1, 0, -1, 1, 2, -1])  # target ids 1, 3, 4 are draft ids 0, 1, 2
    ids = torch.tensor([[1, 2, 3], [0, 2, 5]])
    logprobs = torch.tensor([[0.5, 0.3, 0.1], [0.6, 0.2, 0.1]]).log()
    draft_ids, probs = teacher_in_draft_vocab(ids, logprobs, to_draft)
    assert draft_ids[0].tolist() == [0, 0, 1]
    torch.testing.assert_close(probs[0], torch.tensor([0.5 / 0.6, 0.0, 0.1 / 0.6]))
    assert probs[1].tolist() == [0.0, 0.0, 0.0]  # nothing of this row can be drafted


def test_soft_cross_entropy_matches_reference():
    logits = torch.randn(2, 3, 7, generator=G)
    ids = torch.randint(0, 7, (2, 3, 4), generator=G)
    probs = torch.rand(2, 3, 4, generator=G)
    probs = probs / probs.sum(-1, keepdim=True)
    probs[1, 2] = 0  # a row with no teacher mass inside the draft vocabulary is skipped
    mask = torch.tensor([[True, False, True], [True, True, True]])
    terms = [-sum(float(probs[b, t, k]) * float(logits[b, t].log_softmax(-1)[ids[b, t, k]]) for k in range(4))
             for b in range(2) for t in range(3) if mask[b, t] and probs[b, t].sum() > 0]
    assert math.isclose(float(soft_cross_entropy(logits, ids, probs, mask)), sum(terms) / len(terms), rel_tol=1e-5)
    empty = soft_cross_entropy(logits.requires_grad_(), ids, probs, torch.zeros(2, 3, dtype=torch.bool))
    assert float(empty.detach()) == 0.0 and empty.requires_grad


def test_feature_regression_matches_reference():
    predicted, target = torch.randn(2, 3, 5, generator=G) * 2, torch.randn(2, 3, 5, generator=G)
    mask = torch.tensor([[True, True, False], [False, True, False]])

    def smooth_l1(d: float) -> float:
        return 0.5 * d * d if abs(d) < 1 else abs(d) - 0.5

    rows = [sum(smooth_l1(float(predicted[b, t, h] - target[b, t, h])) for h in range(5)) / 5
            for b in range(2) for t in range(3) if mask[b, t]]
    assert math.isclose(float(feature_regression(predicted, target, mask)), sum(rows) / len(rows), rel_tol=1e-5)


def test_topk_hits_matches_reference():
    logits = torch.randn(4, 6, 10, generator=G)
    labels = torch.randint(-1, 10, (4, 6), generator=G)
    hits = topk_hits(logits, labels, 3)
    for b in range(4):
        for t in range(6):
            expected = int(labels[b, t]) >= 0 and int(labels[b, t]) in logits[b, t].topk(3).indices.tolist()
            assert bool(hits[b, t]) == expected


def test_alignment_mask_keeps_only_chains_whose_tokens_were_all_in_the_topk():
    """A_j[t] = AND_{i<j} hit_i[t-j+i], and False where no draft of j steps reaches t (t < j)."""
    steps, B, T = 4, 3, 9
    hits = torch.rand(steps, B, T, generator=G) < 0.7
    aligned = torch.ones(B, T, dtype=torch.bool)
    for j in range(steps):
        for b in range(B):
            for t in range(T):
                expected = t >= j and all(bool(hits[i, b, t - j + i]) for i in range(j))
                assert bool(aligned[b, t]) == expected, (j, b, t)
        aligned = next_alignment(aligned, hits[j])
