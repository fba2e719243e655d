"""Each loss against a slow reference written from the definitions (python loops, float64), plus
properties: zero for equal distributions, symmetry and bounds, lower bound of the full divergence."""

from __future__ import annotations

import math

import pytest
import torch

from specops.train.losses import LOSSES, TAIL_FLOOR
from specops.train.train_draft import TrainDraftConfig

B, T, V, K = 2, 5, 11, 4


def reference(name: str, student_logits, topk_ids, topk_logprobs, mask) -> float:
    """The documented K+1-bucket divergence, one position at a time."""
    values = []
    for b in range(student_logits.shape[0]):
        for t in range(student_logits.shape[1]):
            if not mask[b, t]:
                continue
            row = [float(x) for x in student_logits[b, t]]
            z = sum(math.exp(x) for x in row)
            q = [math.exp(row[int(i)]) / z for i in topk_ids[b, t]]
            p = [max(math.exp(float(lp)), TAIL_FLOOR) for lp in topk_logprobs[b, t]]
            p.append(max(1 - sum(p), TAIL_FLOOR))
            q.append(max(1 - sum(q), TAIL_FLOOR))
            p = [x / sum(p) for x in p]
            q = [x / sum(q) for x in q]
            m = [(x + y) / 2 for x, y in zip(p, q, strict=True)]

            def kl(a, c):
                return sum(x * math.log(x / y) for x, y in zip(a, c, strict=True))

            values.append({"forward_kl": kl(p, q), "reverse_kl": kl(q, p), "jsd": (kl(p, m) + kl(q, m)) / 2,
                           "tvd": sum(abs(x - y) for x, y in zip(p, q, strict=True)) / 2}[name])
    return sum(values) / max(len(values), 1)


def teacher_topk(teacher_logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    top = teacher_logits.log_softmax(-1).topk(k, dim=-1)
    return top.indices, top.values


@pytest.fixture
def batch():
    gen = torch.Generator().manual_seed(0)
    student = torch.randn(B, T, V, generator=gen, dtype=torch.float64) * 2
    ids, logprobs = teacher_topk(torch.randn(B, T, V, generator=gen, dtype=torch.float64) * 2, K)
    mask = torch.rand(B, T, generator=gen) < 0.6
    mask[0, 0] = True
    return student, ids, logprobs, mask


@pytest.mark.parametrize("name", sorted(LOSSES))
def test_matches_the_slow_reference(name, batch):
    got = LOSSES[name](*batch)
    torch.testing.assert_close(got.item(), reference(name, *batch), rtol=1e-10, atol=1e-12)  # both float64


@pytest.mark.parametrize("name", sorted(LOSSES))
def test_zero_when_the_student_is_the_teacher(name, batch):
    student, _, _, mask = batch
    ids, logprobs = teacher_topk(student, K)  # same distribution, truncated to top-k: the buckets coincide
    assert abs(LOSSES[name](student, ids, logprobs, mask).item()) < 1e-12


@pytest.mark.parametrize("name", sorted(LOSSES))
def test_positions_outside_the_mask_are_ignored(name, batch):
    student, ids, logprobs, mask = batch
    poisoned = student.clone()
    poisoned[~mask] = float("nan")
    assert LOSSES[name](poisoned, ids, logprobs, mask).item() == pytest.approx(LOSSES[name](*batch).item(), abs=1e-12)
    empty = torch.zeros_like(mask)
    student = student.clone().requires_grad_()
    loss = LOSSES[name](student, ids, logprobs, empty)
    loss.backward()
    assert loss.item() == 0 and torch.all(student.grad == 0)


def full_vocab(name: str, student_logits, teacher_logits, mask) -> float:
    """The divergence over the whole vocabulary, written directly with torch."""
    p, q = teacher_logits[mask].softmax(-1), student_logits[mask].softmax(-1)
    m = (p + q) / 2

    def kl(a, c):
        return (a * (a / c).log()).sum(-1)

    per = {"forward_kl": kl(p, q), "reverse_kl": kl(q, p), "jsd": (kl(p, m) + kl(q, m)) / 2,
           "tvd": (p - q).abs().sum(-1) / 2}[name]
    return per.mean().item()


@pytest.mark.parametrize("name", sorted(LOSSES))
def test_full_support_is_exact_and_top_k_is_a_lower_bound(name, batch):
    student, _, _, mask = batch
    teacher = torch.randn(B, T, V, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    exact = full_vocab(name, student, teacher, mask)
    # With K = V the tail buckets are empty; flooring them moves each distribution by ~TAIL_FLOOR.
    assert LOSSES[name](student, *teacher_topk(teacher, V), mask).item() == pytest.approx(exact, abs=10 * TAIL_FLOOR)
    assert LOSSES[name](student, *teacher_topk(teacher, K), mask).item() <= exact + 1e-12


def test_bounds_and_symmetry(batch):
    student, ids, logprobs, mask = batch
    teacher = torch.randn(B, T, V, generator=torch.Generator().manual_seed(2), dtype=torch.float64) * 5
    assert 0 <= LOSSES["tvd"](student * 20, ids, logprobs, mask).item() <= 1
    assert 0 <= LOSSES["jsd"](student * 20, ids, logprobs, mask).item() <= math.log(2)
    both_ways = [LOSSES["jsd"](a, *teacher_topk(b, V), mask).item() for a, b in ((student, teacher), (teacher, student))]
    assert both_ways[0] == pytest.approx(both_ways[1], abs=10 * TAIL_FLOOR)  # floors differ by side, see above
    assert LOSSES["forward_kl"](student, ids, logprobs, mask) != LOSSES["reverse_kl"](student, ids, logprobs, mask)


@pytest.mark.parametrize("name", sorted(LOSSES))
def test_gradients_are_finite_in_float32_with_a_peaked_teacher(name):
    # A teacher with all its mass on one token leaves its tail at 0 (floored); the student's logits
    # are bf16-sized; the gradient must stay finite and move the student towards the teacher.
    student = torch.randn(1, 3, V, dtype=torch.float32, requires_grad=True)
    teacher = torch.full((1, 3, V), -1e4, dtype=torch.float32)
    teacher[..., 0] = 0
    ids, logprobs = teacher_topk(teacher, K)
    loss = LOSSES[name](student, ids, logprobs, torch.ones(1, 3, dtype=torch.bool))
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(student.grad).all()
    assert torch.all(student.grad[..., 0] < 0)  # raising token 0's logit lowers the loss


def test_config_accepts_exactly_the_losses():
    for name in LOSSES:
        TrainDraftConfig(loss=name)
    with pytest.raises(ValueError, match="forward_kl, reverse_kl, jsd, tvd"):
        TrainDraftConfig(loss="kl")
