"""The native decoder (specops/core/native_decoder.cpp) is LlamaForward's Python loop bit for bit: the same
logits, layer outputs and cache writes, over every kind of pass the runtime makes (one row padded to MIN_ROWS,
several sequences padded to one cache length, caches on both sides of PAD_LIMIT, one call per length, tree
branches, prompts through SDPA's causal and masked kernels, DEL's early layers, a draft's final hidden
states), in bf16 and fp32. Mutant that must fail: a loop that scales the attention scores by the scale rounded
to bf16 (what C++'s Tensor::mul_(Scalar) does, a bug the first build had)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from unittest import mock

import pytest
import torch

from specops.core import native
from specops.core.llama import Branches, LlamaForward, Segment, hidden_slots, llama_forward
from tests.conftest import tiny_llama

pytestmark = pytest.mark.skipif(os.environ.get(native.ENV) == "0", reason="SPECOPS_NATIVE=0: the Python loop only")
HIDDEN = 96  # every product on oneDNN in bf16 (specops.core.batching.batch_invariant)


def test_the_native_decoder_is_built_here():
    """make setup builds it (python -m specops.core.native); a machine without a compiler runs the Python loop."""
    assert native.extension() is not None


def sequence(forward: LlamaForward, length: int, rows: int, start: int, seed: int,
             tree: Branches | None = None, positions: list[int] | None = None) -> Segment:
    """`rows` random tokens at slots start.. (or `positions`) of a cache of `length` slots filled with random
    keys and values (a tree's: one cache per branch)."""
    generator = torch.Generator().manual_seed(seed)
    keys, values = forward.new_cache(length)
    if tree is not None:
        branches = int(tree.owner.max()) + 1
        keys, values = [k.expand(branches, *k.shape).clone() for k in keys], [v.expand(branches, *v.shape).clone()
                                                                               for v in values]
    for cache in (*keys, *values):
        cache.copy_(torch.randn(cache.shape, generator=generator))
    pos = torch.tensor(positions) if positions is not None else torch.arange(start, start + rows)
    return Segment(torch.randint(0, 90, (rows,), generator=generator), pos, keys, values, *forward.tables(length), tree)


TREE = Branches(owner=torch.tensor([0, 0, 1, 0]), write_branch=torch.tensor([0, 0, 0, 1, 1]),
                write_row=torch.tensor([0, 1, 3, 0, 2]))  # root, two children (rows 1, 2), a grandchild (3) of row 1
CASES: dict[str, Callable[[LlamaForward], list[Segment]]] = {
    "one row": lambda f: [sequence(f, 128, 1, 40, 0)],
    "five rows": lambda f: [sequence(f, 128, 5, 40, 0)],
    "three lengths": lambda f: [sequence(f, 128, 4, 40, 0), sequence(f, 192, 1, 150, 1), sequence(f, 128, 2, 9, 2)],
    "uniform": lambda f: [sequence(f, 128, 3, 20 * j, j) for j in range(4)],
    "across PAD_LIMIT": lambda f: [sequence(f, 960, 2, 900, 0), sequence(f, 1088, 3, 1030, 1)],
    "tree beside a chain": lambda f: [sequence(f, 128, 4, 60, 0, TREE, [60, 61, 61, 62]), sequence(f, 192, 2, 80, 1)],
    "prompt": lambda f: [sequence(f, 256, 100, 0, 0)],
    "prompt chunk": lambda f: [sequence(f, 256, 70, 30, 0)],
}


def native_and_python(model, make: Callable[[LlamaForward], list[Segment]], run: str = "forward",
                      python_attention: Callable | None = None) -> bool:
    """The pass `make` builds, run twice on identical copies: through the native decoder and through the
    Python loop (its attention replaced by `python_attention`, if given); are logits, layer outputs and caches
    all equal?"""
    forward = llama_forward(model)[0]
    results, caches = [], []
    for use_native in (True, False):
        segments = make(forward)
        forward.use_native = use_native
        patched = (mock.patch.object(LlamaForward, "masked_attention", python_attention)
                   if python_attention and not use_native else contextlib.nullcontext())
        try:
            with torch.inference_mode(), patched:
                if run == "forward":
                    out = forward.forward_many(segments)
                elif run == "hidden":
                    out = forward.forward_many(segments, head=False)
                else:  # DEL's first layer
                    out = [forward.early(*segments[0].args(), layers=1)]
        finally:
            forward.use_native = True
        results.append([t for result in out for t in (result if isinstance(result, tuple) else (result,))])
        caches.append([t for s in segments for t in (*s.keys, *s.values)])
    return all(torch.equal(a, b) for a, b in zip(*results, strict=True)) and all(
        torch.equal(a, b) for a, b in zip(*caches, strict=True))


@pytest.fixture(scope="module", params=["bfloat16", "float32"])
def model(request):
    return tiny_llama(0, hidden=HIDDEN, dtype=getattr(torch, request.param), max_positions=2048)


@pytest.mark.parametrize("case", list(CASES))
def test_native_passes_are_the_python_loop_bit_for_bit(model, case):
    assert native_and_python(model, CASES[case])


@pytest.mark.parametrize("run", ["hidden", "early"])
def test_final_hidden_states_and_early_layers_are_the_python_loop_bit_for_bit(model, run):
    assert native_and_python(model, CASES["three lengths"] if run == "hidden" else CASES["five rows"], run)


def test_one_call_per_cache_length_is_the_python_loop_bit_for_bit(monkeypatch):
    monkeypatch.setattr(LlamaForward, "pads_exactly", False)
    assert native_and_python(tiny_llama(0, hidden=HIDDEN, dtype=torch.bfloat16), CASES["three lengths"])


def test_scores_scaled_by_a_rounded_scale_differ():
    """Mutant: the Python loop's attention scaling its scores by d ** -0.5 rounded to bf16 first."""
    model = tiny_llama(0, hidden=HIDDEN, dtype=torch.bfloat16)

    def rounded(self, q, keys, values, hidden):
        b, _, w, d = q.shape
        groups = self.heads // self.kv_heads
        scale = torch.tensor(d ** -0.5, dtype=q.dtype)
        scores = torch.matmul(q.reshape(b, self.kv_heads, groups * w, d), keys.transpose(-1, -2)).mul_(scale)
        scores = scores.view(b, self.kv_heads, groups, w, -1).masked_fill_(hidden, float("-inf"))
        weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        return torch.matmul(weights.view(b, self.kv_heads, groups * w, -1), values).view(b, self.heads, w, d)

    assert native_and_python(model, CASES["five rows"])
    assert not native_and_python(model, CASES["five rows"], python_attention=rounded)


def test_the_mask_helper_hides_what_a_row_does_not_see():
    visible = torch.tensor([[True, True, False]])[None, None]
    assert hidden_slots(visible).tolist() == [[[[[False, False, True]]]]]


def test_autograd_runs_the_python_loop():
    """With autograd recording, passes go through the Python loop (the extension records no graph)."""
    forward = llama_forward(tiny_llama(0, hidden=HIDDEN))[0]
    with torch.no_grad():
        assert forward._native() is not None
    with torch.enable_grad():
        assert forward._native() is None
