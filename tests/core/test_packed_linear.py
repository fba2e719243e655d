"""Packed bf16 products (specops.core.packed_linear): F.linear's values bit for bit, and the lean forward uses them."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from specops.core.llama import _Packed, llama_forward
from specops.core.packed_linear import linear, pack
from specops.core.types import ONEDNN_MIN_WORK
from tests.conftest import tiny_llama

# SmolLM2-135M's products (q|k|v, o, gate|up, down, the 8k-row draft head) and the tiny test models' (hidden 48, 64).
SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536), (8192, 576), (96, 48), (192, 48), (48, 96), (256, 64)]
ROWS = [1, 2, 3, 5, 8, 17, 40, 130, 512]  # up to a batched pass of 8 trees of 64 rows


def mismatches(product, threads: int) -> list[tuple[int, int, int]]:
    """(out, in, rows) where `product(x, weight, pack(weight))` is not F.linear(x, weight) bit for bit, for a
    row anywhere in the pass (every row of x[:rows] is compared)."""
    torch.manual_seed(0)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        found = []
        for out_features, in_features in SHAPES:
            weight = (torch.randn(out_features, in_features) * 0.05).bfloat16()
            packed = pack(weight)
            assert packed is not None
            x = torch.randn(max(ROWS), in_features).bfloat16()
            found += [(out_features, in_features, rows) for rows in ROWS
                      if not torch.equal(product(x[:rows], weight, packed), F.linear(x[:rows], weight))]
        return found
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("threads", [1, 2])
def test_packed_products_are_f_linear_bit_for_bit(threads):
    assert mismatches(linear, threads) == []


def test_a_product_summed_in_another_order_fails_the_check():
    """The must-fail mutant: the product over each half of the inputs, rounded to bf16, then added."""
    def halves(x, weight, packed):
        half = x.shape[-1] // 2
        return F.linear(x[..., :half], weight[:, :half]) + F.linear(x[..., half:], weight[:, half:])

    assert mismatches(halves, 2)


def test_only_bf16_weights_large_enough_for_onednn_are_packed():
    assert pack(torch.zeros(64, 64, dtype=torch.bfloat16)) is None  # 64 x 64 = ONEDNN_MIN_WORK: F.linear stays
    assert ONEDNN_MIN_WORK == 64 * 64
    assert pack(torch.zeros(65, 64, dtype=torch.bfloat16)) is not None
    assert pack(torch.zeros(576, 576)) is None  # float32 keeps F.linear (and SmallBatchLinear)
    with torch.backends.mkldnn.flags(enabled=False):  # F.linear would not run on oneDNN
        assert pack(torch.zeros(65, 64, dtype=torch.bfloat16)) is None


def test_a_weight_whose_packed_product_disagrees_is_left_to_f_linear(monkeypatch):
    """pack checks each weight once against F.linear: a packed kernel that sums otherwise is not used."""
    import specops.core.packed_linear as packed_linear

    weight = torch.randn(96, 48).bfloat16()
    assert pack(weight) is not None
    real = packed_linear._packed_product
    monkeypatch.setattr(packed_linear, "_packed_product", lambda x, packed: real(x, packed) * 1.01)
    assert pack(weight) is None


def test_autograd_gets_f_linear():
    weight = torch.randn(96, 48, dtype=torch.bfloat16, requires_grad=True)
    packed = pack(weight)
    x = torch.randn(3, 48, dtype=torch.bfloat16)
    linear(x, weight, packed).float().sum().backward()
    assert weight.grad is not None and weight.grad.abs().sum() > 0


def test_the_lean_forward_runs_on_packed_weights_with_the_same_logits():
    """A bf16 pass with the packed weights equals the pass through F.linear bit for bit; packed copies of
    perturbed weights change it (so the packed path is the one that runs)."""
    model = tiny_llama(0, hidden=64, dtype=torch.bfloat16)
    forward = llama_forward(model)[0]
    assert all(p is not None for p in forward.packed.qkv + forward.packed.gate_up + forward.packed.down)

    def logits(packed: _Packed) -> torch.Tensor:
        forward.packed = packed
        keys, values = forward.new_cache(64)
        with torch.inference_mode():
            return forward.forward(torch.arange(3, 12), torch.arange(9), keys, values, *forward.tables(64))[0]

    original = forward.packed
    try:
        packed = logits(original)
        assert torch.equal(packed, logits(_Packed.none(forward.num_layers)))
        perturbed = _Packed(original.qkv, original.o, original.gate_up,
                            [pack(w * 1.5) for w in forward.down])  # type: ignore[misc]
        assert not torch.equal(packed, logits(perturbed))
    finally:
        forward.packed = original
