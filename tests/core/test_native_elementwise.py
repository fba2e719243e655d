"""The native decoder's bf16 row kernels (specops/core/native_elementwise.cpp), on this CPU's AVX-512 loops and on
the plain loops other CPUs take (SPECOPS_NATIVE_PLAIN=1, in a process of its own).

- Rotary and the residual add are ATen's ops bit for bit (the Python loop's `rotate` and `+`), widths whose
  halves are and are not whole vectors, tails included.
- RMSNorm and silu(gate) * up are within one bf16 rounding of a float64 reference. Mutants: a norm without its
  epsilon, SiLU's exp off by 5%.
- Every row of passes of 1-70 rows is the row alone (1 and 2 threads). Mutant: a process that takes a norm with
  bf16 statistics for passes of more than 8 rows and the kernel below.
(tests/core/test_native.py checks the kernels inside whole passes against the Python loop.)
"""

from __future__ import annotations

import os
from collections.abc import Callable

import pytest
import torch

from specops.core import native
from specops.core.llama import rotate, silu_mul
from tests.core.test_native import assert_on_plain_loops

pytestmark = pytest.mark.skipif(os.environ.get(native.ENV) == "0", reason="SPECOPS_NATIVE=0: the Python loop only")
ROW_COUNTS = [1, 2, 7, 16, 33, 70]
EPS = 1e-5


def draw(*shape: int, seed: int = 0, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale).bfloat16()


def rotated_by_aten(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int,
                    kv_heads: int) -> tuple[torch.Tensor, ...]:
    """The Python loop's rotary (LlamaForward._layers_python): q, k rotated and v, each [heads, n, D]."""
    n, d = qkv.shape[0], cos.shape[1]
    qk = rotate(qkv[:, : (heads + kv_heads) * d].view(n, heads + kv_heads, d).transpose(0, 1), cos, sin)
    return qk[:heads], qk[heads:], qkv[:, (heads + kv_heads) * d:].view(n, kv_heads, d).transpose(0, 1)


def aten_exact() -> list[bool]:
    """Rotary (D 64 and 24: halves of whole vectors and not) and the add against ATen's, bitwise."""
    kernel, results = native.extension(), []
    for d, heads, kv_heads in ((64, 9, 3), (24, 4, 2)):
        for n in (1, 5, 40):
            qkv = draw(n, (heads + 2 * kv_heads) * d, seed=n)
            angles = torch.randn(n, d // 2, generator=torch.Generator().manual_seed(d)) * 3
            cos, sin = (f(torch.cat([angles, angles], -1)).bfloat16() for f in (torch.cos, torch.sin))
            ours = kernel.rotate_rows(qkv, cos, sin, heads, kv_heads)
            results.append(all(torch.equal(a, b) for a, b in zip(ours, rotated_by_aten(qkv, cos, sin, heads, kv_heads),
                                                                 strict=True)))
    for n, width in ((1, 576), (9, 96), (4, 37)):
        x, y = draw(n, width, seed=1), draw(n, width, seed=2, scale=0.01)
        results.append(torch.equal(kernel.add_rows(x, y), x + y))
    return results


def norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """llama.rms_norm with the statistics in float64: the scaled rows rounded to bf16, times the weight."""
    h = x.double()
    h = (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).bfloat16().double()
    return weight.double() * h


def silu_mul_reference(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.double().chunk(2, -1)
    return (gate * torch.sigmoid(gate)).bfloat16().double() * up


def within_a_rounding(ours: torch.Tensor, reference: torch.Tensor) -> bool:
    """Each element within two bf16 steps of the reference's: the inner rounding may land a step away where the
    float32 and float64 sums straddle a boundary, and the outer one rounds again (plus a floor near zero)."""
    return bool(((ours.double() - reference).abs() <= reference.abs() * 2.0**-6 + 1e-30).all())


def norm_and_silu_errors(norm: Callable, silu: Callable) -> list[bool]:
    """The norm (widths 576, 96, 37) and silu(gate) * up (widths 1536, 96, 19; gates far into both tails) within
    a rounding of their references."""
    results = []
    for width in (576, 96, 37):
        x, weight = draw(33, width, seed=width, scale=3.0), draw(width, seed=1)
        x[0] = 0  # a zero row: eps alone keeps it finite
        x[1] *= 1e-3
        results.append(within_a_rounding(norm(x, weight, EPS), norm_reference(x, weight, EPS)))
    for width in (1536, 96, 19):
        gate_up = draw(33, 2 * width, seed=width, scale=4.0)
        gate_up[0, :width] = torch.linspace(-100, 100, width).bfloat16()
        results.append(within_a_rounding(silu(gate_up), silu_mul_reference(gate_up)))
    return results


def kernel_ops() -> tuple[Callable, Callable]:
    kernel = native.extension()
    return kernel.rms_norm_rows, kernel.silu_mul_rows


def check_all() -> None:
    """Everything above on this process's loops (the plain ones in a SPECOPS_NATIVE_PLAIN=1 process)."""
    assert all(aten_exact())
    assert all(norm_and_silu_errors(*kernel_ops()))
    assert all(rows_alone(*row_ops()))


def row_ops() -> list[Callable[[torch.Tensor], torch.Tensor]]:
    """Each kernel as a function of a pass's rows [n, W] (the other operands fixed), returning one tensor whose
    first dimension runs over the pass's rows."""
    kernel = native.extension()
    weight, cos, sin = draw(192, seed=3), draw(1, 64, seed=4), draw(1, 64, seed=5)
    return [
        lambda x: kernel.rms_norm_rows(x, weight, EPS),
        lambda x: kernel.silu_mul_rows(x),
        lambda x: kernel.add_rows(x, x.flip(-1).contiguous()),
        lambda x: torch.cat(kernel.rotate_rows(x, cos.expand(x.shape[0], 64).contiguous(),
                                               sin.expand(x.shape[0], 64).contiguous(), 1, 1)).transpose(0, 1),
    ]


def rows_alone(*ops: Callable[[torch.Tensor], torch.Tensor]) -> list[bool]:
    """For each op: every row of passes of ROW_COUNTS rows [n, 192] equals that row run alone, at 1 and 2 threads."""
    results, threads = [], torch.get_num_threads()
    try:
        for op in ops:
            same = True
            for count in (1, 2):
                torch.set_num_threads(count)
                for n in ROW_COUNTS:
                    x = draw(n, 192, seed=n, scale=2.0)
                    together = op(x)
                    same &= all(torch.equal(together[r], op(x[r:r + 1].contiguous())[0]) for r in range(n))
            results.append(same)
    finally:
        torch.set_num_threads(threads)
    return results


def test_rotary_and_the_add_are_aten_s_bit_for_bit():
    assert all(aten_exact())


def test_norm_and_silu_are_within_a_rounding_of_float64():
    assert all(norm_and_silu_errors(*kernel_ops()))


def test_a_norm_without_its_epsilon_or_an_exp_off_by_five_percent_fails():
    """Mutants: the norm with eps 0 (its zero row turns to NaN), SiLU with e^-g 5% too large."""
    norm, silu = kernel_ops()
    results = norm_and_silu_errors(lambda x, w, eps: norm(x, w, 0.0), silu)
    assert not all(results[:3]) and all(results[3:])

    def off_silu(gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.double().chunk(2, -1)
        return (gate / (1 + 1.05 * torch.exp(-gate))).bfloat16().double() * up

    assert not all(norm_and_silu_errors(norm, off_silu)[3:])


def test_every_row_is_the_row_alone():
    assert all(rows_alone(*row_ops()))


def test_a_process_that_switches_norms_by_pass_size_fails():
    """Mutant: the kernel's norm up to 8 rows, one with its statistics in bf16 above."""
    norm_op = row_ops()[0]
    weight = draw(192, seed=3)

    def bf16_statistics(x: torch.Tensor) -> torch.Tensor:
        return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS))

    assert not all(rows_alone(lambda x: norm_op(x) if x.shape[0] <= 8 else bf16_statistics(x)))


def test_the_plain_loops_hold_too():
    assert_on_plain_loops("from specops.core import native; assert not native.extension().elementwise_vector(); "
                          "from tests.core.test_native_elementwise import check_all; check_all()")


def test_silu_mul_is_the_python_loop_s_gated_mlp_up_to_rounding():
    gate_up = draw(5, 2 * 96, seed=9, scale=3.0)
    assert torch.allclose(native.extension().silu_mul_rows(gate_up).float(), silu_mul(gate_up).float(), rtol=2**-7,
                          atol=1e-6)
