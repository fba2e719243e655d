"""The head's labels, loss, calibration correction and calibration bins, against plain references."""

from __future__ import annotations

import math

import pytest
import torch

from specops.drafters.acceptance_head import AcceptanceHead, AcceptanceHeadConfig
from specops.train.calibration import calibration
from specops.train.train_acceptance import acceptance_labels, weighted_bce


def reference_bce(logits: list[float], labels: list[float], rejection_weight: float) -> float:
    """The weighted BCE written out position by position."""
    loss = weight = 0.0
    for z, y in zip(logits, labels, strict=True):
        s = 1.0 / (1.0 + math.exp(-z))
        loss += -(y * math.log(s) + rejection_weight * (1 - y) * math.log(1 - s))
        weight += y + rejection_weight * (1 - y)
    return loss / weight


@pytest.mark.parametrize("rejection_weight", [1.0, 6.0])
def test_weighted_bce_matches_the_plain_reference(rejection_weight):
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(50, generator=generator, dtype=torch.float64) * 3
    labels = torch.rand(50, generator=generator, dtype=torch.float64)
    labels[:10] = 1.0  # hard acceptances and rejections too
    labels[10:20] = 0.0
    got = weighted_bce(logits, labels, rejection_weight)
    assert float(got) == pytest.approx(reference_bce(logits.tolist(), labels.tolist(), rejection_weight), rel=1e-12)


def test_weighted_bce_stays_finite_at_extreme_logits():
    loss = weighted_bce(torch.tensor([200.0, -200.0]), torch.tensor([0.0, 1.0]), 6.0)
    assert math.isfinite(float(loss)) and float(loss) > 100


def test_labels_soft_and_greedy_by_hand():
    tokens = torch.tensor([3, 7, 5])
    topk_ids = torch.tensor([[3, 1], [2, 7], [0, 1]])
    topk_logprobs = torch.tensor([[0.6, 0.3], [0.5, 0.2], [0.9, 0.05]]).log()
    log_q = torch.tensor([0.3, 0.4, 0.5]).log()
    # 3: p 0.6 >= q 0.3, always accepted; 7: p/q = 0.2/0.4; 5: outside the top-k, so p is taken as 0.
    soft = acceptance_labels(tokens, log_q, topk_ids, topk_logprobs, "soft")
    torch.testing.assert_close(soft, torch.tensor([1.0, 0.5, 0.0]))
    greedy = acceptance_labels(tokens, log_q, topk_ids, topk_logprobs, "greedy")  # argmaxes: 3, 2, 0
    assert greedy.tolist() == [1.0, 0.0, 0.0]
    with pytest.raises(ValueError, match="Unknown label kind"):
        acceptance_labels(tokens, log_q, topk_ids, topk_logprobs, "hard")


@pytest.mark.parametrize("rejection_weight", [1.0, 6.0])
def test_head_undoes_the_weightings_odds_shift(rejection_weight):
    """With labels of mean y, the weighted BCE is minimal at logit(y) - log(w); the head maps it back to y."""
    labels = torch.tensor([1.0, 1.0, 1.0, 0.0, 0.7], dtype=torch.float64)
    y = float(labels.mean())
    logit = torch.tensor(math.log(y / (1 - y)) - math.log(rejection_weight), dtype=torch.float64, requires_grad=True)
    weighted_bce(logit.expand(5), labels, rejection_weight).backward()
    assert abs(float(logit.grad)) < 1e-12  # the minimum
    head = AcceptanceHead(AcceptanceHeadConfig(hidden_size=4, rejection_weight=rejection_weight))
    assert float(head.calibrated(logit.detach())) == pytest.approx(y)


def test_calibration_bins_and_ece_by_hand():
    predicted = torch.tensor([0.05, 0.15, 0.12, 0.95])
    observed = torch.tensor([0.0, 1.0, 0.0, 1.0])
    result = calibration(predicted, observed, bins=10)
    assert result.counts == [1, 2, 1]
    assert result.predicted == pytest.approx([0.05, 0.135, 0.95])
    assert result.observed == pytest.approx([0.0, 0.5, 1.0])
    assert result.ece == pytest.approx(0.25 * 0.05 + 0.5 * 0.365 + 0.25 * 0.05)
    with pytest.raises(ValueError, match="non-empty"):
        calibration(torch.tensor([]), torch.tensor([]), bins=10)
