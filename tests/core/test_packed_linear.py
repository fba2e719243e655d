"""Packed bf16 products (specops.core.packed_linear), and the lean forward uses them.

- Ours (native_linear.cpp) is a plain reference bit for bit: per output one float32 sum over the inputs in
  order, each pair's odd product added before its even one (vdpbf16ps), rounded to bf16 once; so a row's
  result is the same in a pass of any rows, at 1 and 2 threads. Mutant: the pairs' products added even first.
- On AMX tiles (where the CPU has them) a row's result is the same in a pass of any rows too, at 1 and 2
  threads, and within a bf16 rounding of the exact product. Mutant: the tiles for large passes and the dot
  products for small ones.
- oneDNN's packing is F.linear's values bit for bit (up to 32 rows on an AMX CPU, where F.linear takes another
  primitive above). Mutant: the product summed over two halves.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from specops.core import native
from specops.core.llama import _Packed, llama_forward
from specops.core.packed_linear import linear, native_kernel, pack, tiles
from specops.core.types import ONEDNN_MIN_WORK
from tests.conftest import tiny_llama

# SmolLM2-135M's products (q|k|v, o, gate|up, down, the 8k-row draft head) and the tiny test models' (hidden 48, 64).
SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536), (8192, 576), (96, 48), (192, 48), (48, 96), (256, 64)]
ROWS = [1, 2, 3, 5, 8, 17, 40, 130, 512]  # up to a batched pass of 8 trees of 64 rows
# On a CPU with AMX tiles F.linear's bf16 product takes another oneDNN primitive above 32 rows (measured on this
# repo's Xeon: rows then round otherwise than alone); oneDNN's packed product does not switch.
CPU_FLAGS = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").is_file() else ""
AMX_CPU = "amx_bf16" in CPU_FLAGS
F_LINEAR_ROWS = [rows for rows in ROWS if rows <= 32 or not AMX_CPU]


def f_linear(x, weight, packed):
    return F.linear(x, weight)


def mismatches(product, threads: int, ours: bool = False, reference=f_linear,
               rows_of=ROWS, on_tiles: bool = False) -> list[tuple[int, int, int]]:
    """(out, in, rows) where `product(x, weight, packed)` is not `reference(x, weight, packed)` bit for bit, for
    packed = pack(weight, ours, on_tiles) and a row anywhere in the pass (every row of x[:rows] is compared)."""
    torch.manual_seed(0)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        found = []
        for out_features, in_features in SHAPES:
            weight = (torch.randn(out_features, in_features) * 0.05).bfloat16()
            packed = pack(weight, ours, on_tiles)
            assert packed is not None and packed.is_mkldnn != ours and (packed.dim() == 5) == (ours and on_tiles)
            x = torch.randn(max(rows_of), in_features).bfloat16()
            found += [(out_features, in_features, rows) for rows in rows_of
                      if not torch.equal(product(x[:rows], weight, packed), reference(x[:rows], weight, packed))]
        return found
    finally:
        torch.set_num_threads(before)


def one_by_one(x, weight, packed):
    return torch.cat([linear(row[None], weight, packed) for row in x])


@pytest.mark.parametrize("threads", [1, 2])
def test_onednn_packed_products_are_f_linear_bit_for_bit(threads):
    assert mismatches(linear, threads, rows_of=F_LINEAR_ROWS) == []


def test_a_product_summed_in_another_order_fails_the_check():
    """The must-fail mutant: the product over each half of the inputs, rounded to bf16, then added."""
    def halves(x, weight, packed):
        half = x.shape[-1] // 2
        return F.linear(x[..., :half], weight[:, :half]) + F.linear(x[..., half:], weight[:, half:])

    assert mismatches(halves, 2, rows_of=F_LINEAR_ROWS)


def in_order(x: torch.Tensor, weight: torch.Tensor, packed: object = None, odd_first: bool = True) -> torch.Tensor:
    """Our kernel's sums, plainly: per output a float32 sum over the input pairs in order, each pair's two
    products (exact in float32) added odd first as vdpbf16ps adds them, then rounded to bf16."""
    products = x.float()[:, None, :] * weight.float()[None, :, :]
    total = torch.zeros(x.shape[0], weight.shape[0])
    for pair in range(x.shape[1] // 2):
        first, second = (2 * pair + 1, 2 * pair) if odd_first else (2 * pair, 2 * pair + 1)
        total = total + products[..., first]
        total = total + products[..., second]
    return total.bfloat16()


needs_ours = pytest.mark.skipif(native_kernel() is None, reason="our kernel runs only where the extension is "
                                                                   "built, on AVX-512 bf16 (test_our_kernel_runs_here)")
REFERENCE_ROWS = [1, 2, 3, 5, 7, 8, 13, 40]  # every tile the kernel takes (6 rows and 1 to 5), and several of them


def test_our_kernel_runs_here():
    """Where the extension is built on a CPU with AVX-512 bf16 (this repo's machines), pack takes our kernel."""
    if os.environ.get(native.ENV) == "0" or "avx512_bf16" not in CPU_FLAGS:
        pytest.skip("no extension, or no AVX-512 bf16: oneDNN's packing runs")
    weight = torch.randn(960, 576).bfloat16()
    assert native_kernel() is not None and not pack(weight).is_mkldnn
    assert pack(weight, ours=False).is_mkldnn


@needs_ours
@pytest.mark.parametrize("threads", [1, 2])
def test_our_kernel_is_the_plain_sum_in_order_bit_for_bit(threads):
    assert mismatches(linear, threads, ours=True, reference=in_order, rows_of=REFERENCE_ROWS) == []


@needs_ours
@pytest.mark.parametrize("threads", [1, 2])
def test_a_row_of_our_kernel_is_the_same_in_a_pass_of_any_rows(threads):
    """Every row of passes of 1 to 512 rows against the same rows one at a time (the reference above is
    row by row, so this is what it implies, on the row counts too large for it)."""
    assert mismatches(linear, threads, ours=True, reference=one_by_one) == []


@needs_ours
def test_pairs_added_even_first_fail_the_check():
    """The must-fail mutant of the reference: each pair's products added in the other order."""
    assert mismatches(linear, 2, ours=True, reference=lambda x, w, p: in_order(x, w, odd_first=False),
                      rows_of=REFERENCE_ROWS)


needs_tiles = pytest.mark.skipif(native_kernel() is None or not native_kernel().amx_supported(),
                                 reason="AMX tiles run only on a CPU with AMX bf16 (test_the_tiles_run_here)")


def test_the_tiles_run_here(monkeypatch):
    """On a CPU with AMX bf16 (this repo's Xeon) pack takes the tiles unless SPECOPS_AMX=0, for every weight."""
    if native_kernel() is None or not AMX_CPU or os.environ.get("SPECOPS_AMX") == "0":
        pytest.skip("no extension, no AMX, or SPECOPS_AMX=0: the dot products run")
    weight = torch.randn(960, 576).bfloat16()
    assert tiles() and pack(weight).dim() == 5 and pack(weight, on_tiles=False).dim() == 4
    tiles.cache_clear()
    monkeypatch.setenv("SPECOPS_AMX", "0")
    try:
        assert not tiles() and pack(weight).dim() == 4
    finally:
        tiles.cache_clear()


@needs_tiles
@pytest.mark.parametrize("threads", [1, 2])
def test_a_row_on_the_tiles_is_the_same_in_a_pass_of_any_rows(threads):
    """Every row of passes of 1 to 512 rows (one tile of 16 rows and part of another, many) against the same
    rows one at a time, and the shapes whose inputs end mid-tile (48, 96: padded with zeros)."""
    assert mismatches(linear, threads, ours=True, on_tiles=True, reference=one_by_one) == []


@needs_tiles
def test_a_process_mixing_the_tiles_and_the_dot_products_fails_the_check():
    """The must-fail mutant: the tiles for passes of more than 8 rows, the dot products for fewer (faster
    either side, were the two to round alike; they do not)."""
    def mixed(x, weight, packed):
        return linear(x, weight, packed if x.shape[0] > 8 else pack(weight, on_tiles=False))

    assert mismatches(mixed, 2, ours=True, on_tiles=True, reference=one_by_one)


@needs_tiles
def test_the_tiles_are_within_a_bf16_rounding_of_the_exact_product():
    """The tiles' sums are the hardware's (each pair's two products added exactly, then 16 pairs combined in an
    order Intel does not document), so against an fp64 product, not bit for bit: every output within half a
    bf16 step of the exact value (its one rounding to bf16) plus a float32 accumulation's worst error (K steps
    of 2**-24 of the products' absolute sum)."""
    torch.manual_seed(0)
    for out_features, in_features in SHAPES:
        weight = (torch.randn(out_features, in_features) * 0.05).bfloat16()
        x = torch.randn(40, in_features).bfloat16()
        exact = x.double() @ weight.double().T
        absolute = x.double().abs() @ weight.double().abs().T
        bf16_step = 2.0 ** (torch.floor(torch.log2(exact.abs().clamp_min(1e-30))) - 7)
        bound = bf16_step / 2 + in_features * 2.0 ** -24 * absolute
        error = (linear(x, weight, pack(weight, on_tiles=True)).double() - exact).abs()
        assert bool((error <= bound).all()), (out_features, in_features, float((error - bound).max()))


@pytest.mark.parametrize("ours", [True, False])
def test_only_bf16_weights_large_enough_for_onednn_are_packed(ours):
    assert pack(torch.zeros(64, 64, dtype=torch.bfloat16), ours) is None  # 64 x 64 = ONEDNN_MIN_WORK: F.linear stays
    assert ONEDNN_MIN_WORK == 64 * 64
    assert pack(torch.zeros(80, 64, dtype=torch.bfloat16), ours) is not None
    assert pack(torch.zeros(576, 576), ours) is None  # float32 keeps F.linear (and SmallBatchLinear)


def test_onednn_packs_only_where_f_linear_runs_on_onednn():
    with torch.backends.mkldnn.flags(enabled=False):  # F.linear would not run on oneDNN
        assert pack(torch.zeros(65, 64, dtype=torch.bfloat16), ours=False) is None
    # A shape our kernel does not take (outputs not a multiple of 16) gets oneDNN's packing.
    assert pack(torch.zeros(65, 64, dtype=torch.bfloat16)).is_mkldnn


def test_a_weight_whose_packed_product_disagrees_is_left_to_f_linear(monkeypatch):
    """pack checks each weight once against F.linear: a packed kernel that sums otherwise is not used."""
    import specops.core.packed_linear as packed_linear

    weight = torch.randn(96, 48).bfloat16()
    assert pack(weight, ours=False) is not None
    real = packed_linear._packed_product
    monkeypatch.setattr(packed_linear, "_packed_product", lambda x, packed: real(x, packed) * 1.01)
    assert pack(weight, ours=False) is None


@pytest.mark.parametrize("ours", [True, False])
def test_autograd_gets_f_linear(ours):
    weight = torch.randn(96, 48, dtype=torch.bfloat16, requires_grad=True)
    packed = pack(weight, ours)
    x = torch.randn(3, 48, dtype=torch.bfloat16)
    linear(x, weight, packed).float().sum().backward()
    assert weight.grad is not None and weight.grad.abs().sum() > 0


@pytest.mark.parametrize("ours", [True, False])
def test_the_lean_forward_runs_on_packed_weights(ours):
    """A bf16 pass with oneDNN's packed weights equals the pass through F.linear bit for bit, with ours (which
    round otherwise) it is close; packed copies of perturbed weights change it (so the packed path is the one
    that runs)."""
    if ours and native_kernel() is None:
        pytest.skip("our kernel is not built here")
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
        kind = forward.packed_weights(ours)
        packed, plain = logits(kind), logits(_Packed.none(forward.num_layers))
        if ours:
            assert torch.allclose(packed.float(), plain.float(), atol=0.1)
        else:
            assert torch.equal(packed, plain)
        perturbed = _Packed(kind.qkv, kind.o, kind.gate_up,
                            [pack(w * 1.5, ours) for w in forward.down])  # type: ignore[misc]
        assert not torch.equal(packed, logits(perturbed))
    finally:
        forward.packed = original
