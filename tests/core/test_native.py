"""The native decoder (specops/core/native_decoder.cpp) and its attention kernel (native_attention.cpp).

- The C++ loop is the Python loop op for op but for attention and, in bf16, the norms and SiLU: with the Python
  loop's attention replaced by the kernel (and its bf16 norms and SiLU by the row kernels, LAYER_OPS; rotary,
  the adds and the cache writes stay ATen's, which the C++ loop's row kernels match), every kind of pass the runtime makes (one row padded to MIN_ROWS, sequences of several cache
  lengths, caches on both sides of PAD_LIMIT, tree branches, prompts through SDPA's causal and masked kernels,
  DEL's early layers, a draft's final hidden states) gives the same logits, layer outputs and cache writes bit
  for bit, bf16 and fp32. Mutant: the Python loop's RMSNorm statistics in the model dtype.
- The kernel is softmax attention (against a float64 reference, on this CPU's AVX-512 path and on the plain
  loops other CPUs take), and a row's result depends on nothing but its query and its visible slots: bitwise
  the same beside other rows or sequences, with other contents past its visible end, in a longer cache, in a
  tree's branch cache. Mutant: rows that see one slot past their own.
- The two runtimes agree up to rounding, and grad mode does not switch a pass from one to the other.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from unittest import mock

import pytest
import torch

from specops.core import native
from specops.core.llama import (
    Branches,
    LlamaForward,
    Segment,
    _AttentionPlan,
    llama_forward,
    rms_norm,
    silu_mul,
)
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
    "prompt chunk beside a row": lambda f: [sequence(f, 256, 70, 30, 0), sequence(f, 128, 1, 50, 1)],
}


def kernel_attend(plan: _AttentionPlan, q: torch.Tensor, layer: int) -> torch.Tensor:
    """_AttentionPlan.attend with the native kernel for every row, the prompts' too (what the C++ loop runs)."""
    forward, kernel, segments = plan.forward, native.extension(), plan.segments
    att = q.new_zeros(forward.heads, plan.n, forward.head_dim)
    kernel.attend_rows(q.contiguous(), att, [s.keys[layer] for s in segments], [s.values[layer] for s in segments],
                       [rows.start for rows in plan.rows],
                       [forward.visible_ends(s.pos, s.keys[0].shape[-2]) for s in segments],
                       [None if s.branches is None else s.branches.owner for s in segments])
    return att


def kernel_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The layers' RMSNorm as the C++ loop runs it: the row kernel for bf16, ATen's ops for fp32."""
    return native.extension().rms_norm_rows(x, weight, eps) if x.dtype == torch.bfloat16 else rms_norm(x, weight, eps)


def kernel_silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    return native.extension().silu_mul_rows(gate_up) if gate_up.dtype == torch.bfloat16 else silu_mul(gate_up)


KERNEL_LAYER_OPS = (kernel_norm, kernel_silu_mul)


def run_pass(model, make: Callable[[LlamaForward], list[Segment]], run: str, use_native: bool,
             patches: contextlib.AbstractContextManager) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The pass `make` builds through one loop: its outputs, and the caches it left."""
    forward = llama_forward(model)[0]
    segments = make(forward)
    forward.use_native = use_native
    try:
        with torch.inference_mode(), patches:
            if run == "forward":
                out = forward.forward_many(segments)
            elif run == "hidden":
                out = forward.forward_many(segments, head=False)
            else:  # DEL's first layer
                out = [forward.early(*segments[0].args(), layers=1)]
    finally:
        forward.use_native = True
    tensors = [t for result in out for t in (result if isinstance(result, tuple) else (result,))]
    return tensors, [t for s in segments for t in (*s.keys, *s.values)]


def loops_agree(model, make: Callable[[LlamaForward], list[Segment]], run: str = "forward",
                python: contextlib.AbstractContextManager | None = None) -> bool:
    """The native decoder against the Python loop running the kernel's attention (and `python`'s patches):
    are outputs and caches bitwise equal?"""
    native_run = run_pass(model, make, run, True, contextlib.nullcontext())
    patches = contextlib.ExitStack()
    patches.enter_context(mock.patch.object(_AttentionPlan, "attend", kernel_attend))
    patches.enter_context(mock.patch("specops.core.llama.LAYER_OPS", KERNEL_LAYER_OPS))
    if python is not None:
        patches.enter_context(python)
    python_run = run_pass(model, make, run, False, patches)
    return all(torch.equal(a, b) for a, b in zip(native_run[0] + native_run[1], python_run[0] + python_run[1],
                                                  strict=True))


@pytest.fixture(scope="module", params=["bfloat16", "float32"])
def model(request):
    return tiny_llama(0, hidden=HIDDEN, dtype=getattr(torch, request.param), max_positions=2048)


@pytest.mark.parametrize("case", list(CASES))
def test_the_c_loop_is_the_python_loop_bit_for_bit(model, case):
    assert loops_agree(model, CASES[case])


@pytest.mark.parametrize("run", ["hidden", "early"])
def test_final_hidden_states_and_early_layers_are_the_python_loop_bit_for_bit(model, run):
    assert loops_agree(model, CASES["three lengths"] if run == "hidden" else CASES["five rows"], run)


def test_norm_statistics_in_bf16_differ():
    """Mutant: the Python loop's RMSNorm statistics in the model dtype, not float32."""
    model = tiny_llama(0, hidden=HIDDEN, dtype=torch.bfloat16)

    def bf16_statistics(x, weight, eps):
        return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))

    mutant = mock.patch("specops.core.llama.LAYER_OPS", (bf16_statistics, kernel_silu_mul))
    assert loops_agree(model, CASES["five rows"])
    assert not loops_agree(model, CASES["five rows"], python=mutant)


@pytest.mark.parametrize("case", ["three lengths", "tree beside a chain", "prompt chunk beside a row"])
def test_the_two_runtimes_agree_up_to_rounding(model, case):
    """The native decoder and the Python loop with ATen's attention: close, not bitwise (fp32: to 1e-4)."""
    native_out, _ = run_pass(model, CASES[case], "forward", True, contextlib.nullcontext())
    python_out, _ = run_pass(model, CASES[case], "forward", False, contextlib.nullcontext())
    tolerance = 1e-4 if model.dtype == torch.float32 else 0.25
    assert all(torch.allclose(a.float(), b.float(), atol=tolerance, rtol=0.05) for a, b in
               zip(native_out, python_out, strict=True))


def test_grad_mode_does_not_switch_runtimes():
    """Outside inference mode (a script's prefill) passes still run the native decoder, whose outputs need no
    graph: the runtimes round attention differently, and a sequence must not run on both."""
    forward = llama_forward(tiny_llama(0, hidden=HIDDEN))[0]
    with torch.enable_grad():
        assert forward._native() is not None
        out = forward.forward_many(CASES["five rows"](forward))[0][0]
    assert not out.requires_grad


# ---- the kernel alone ----

def attention_reference(q, keys, values, ends, owner=None) -> torch.Tensor:
    """Softmax attention in float64, row by row: q [heads, W, D], caches [kv_heads, L, D] (a tree's
    [branches, kv_heads, L, D] with owner [W])."""
    heads, kv_heads = q.shape[0], keys.shape[-3]
    out = torch.empty(q.shape, dtype=torch.float64)
    for h in range(heads):
        for r in range(q.shape[1]):
            k = keys[h // (heads // kv_heads)] if owner is None else keys[owner[r], h // (heads // kv_heads)]
            v = values[h // (heads // kv_heads)] if owner is None else values[owner[r], h // (heads // kv_heads)]
            scores = q[h, r].double() @ k[: ends[r]].double().T / q.shape[-1] ** 0.5
            out[h, r] = torch.softmax(scores, -1) @ v[: ends[r]].double()
    return out


KERNEL_SHAPES = [(64, 9, 3, 5, 200), (64, 9, 3, 1, 17), (24, 4, 2, 3, 40), (12, 4, 4, 2, 1), (70, 2, 1, 4, 33)]


def kernel_errors() -> list[float]:
    """The kernel's largest error against the float64 reference, per dtype and shape (D, heads, kv heads,
    rows, cache length), rows at the cache's last slots."""
    kernel, errors = native.extension(), []
    generator = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        for d, heads, kv_heads, rows, length in KERNEL_SHAPES:
            q, keys, values = (torch.randn(*shape, generator=generator).to(dtype) for shape in
                               ((heads, rows, d), (kv_heads, length, d), (kv_heads, length, d)))
            ends = torch.arange(length - rows + 1, length + 1).clamp(min=1)
            out = torch.zeros_like(q)
            kernel.attend_rows(q, out, [keys], [values], [0], [ends], [None])
            errors.append((out.double() - attention_reference(q, keys, values, ends)).abs().max().item())
    return errors


def assert_kernel_is_softmax_attention() -> None:
    errors = kernel_errors()
    half = len(errors) // 2
    assert max(errors[:half]) < 1e-5 and max(errors[half:]) < 2e-2, errors  # fp32, then bf16 (its output rounded)


def test_the_kernel_is_softmax_attention():
    assert native.extension().attention_path() in ("amx", "avx512", "plain")
    assert_kernel_is_softmax_attention()


def assert_in_own_process(code: str, **env: str) -> None:
    """`code` passes in a process of its own, with `env` set."""
    done = subprocess.run([sys.executable, "-c", code], env={**os.environ, **env}, capture_output=True, text=True,
                          timeout=300, cwd=Path(__file__).parents[2])  # the repository root, where `tests` imports from
    assert done.returncode == 0, done.stderr[-2000:]


def assert_on_plain_loops(code: str) -> None:
    """`code` passes in a process of its own on the paths a CPU without AVX-512 takes (SPECOPS_NATIVE_PLAIN=1)."""
    assert_in_own_process(code, SPECOPS_NATIVE_PLAIN="1")


def test_the_kernel_s_plain_loops_are_softmax_attention_too():
    assert_on_plain_loops("from specops.core import native; assert native.extension().attention_path() == 'plain'; "
                          "from tests.core.test_native import assert_kernel_is_softmax_attention as check; check()")


def test_the_kernel_s_avx512_loops_are_softmax_attention_and_row_invariant_too():
    """Where bf16 rows take the AMX tiles (this repo's Xeon), the AVX-512 loops still serve fp32 rows and CPUs
    without tiles: SPECOPS_AMX=0 puts bf16 rows on them too."""
    if native.extension().attention_path() != "amx":
        pytest.skip("bf16 rows take the AVX-512 loops (or plain loops) in this process already")
    assert_in_own_process("from specops.core import native; assert native.extension().attention_path() == 'avx512'; "
                          "from tests.core.test_native import assert_kernel_is_softmax_attention as check, invariances, "
                          "prompt_invariances; check(); assert all(invariances(lambda pos: pos + 1)); "
                          "assert all(prompt_invariances(lambda pos: pos + 1))", SPECOPS_AMX="0")


def invariances(ends_of: Callable[[torch.Tensor], torch.Tensor]) -> list[bool]:
    """One sequence's 5 rows (9 query heads, 3 kv heads, D 64, bf16) in a cache of 160 slots at slots
    100..104, with the ends `ends_of(pos)` gives: are its outputs bitwise the same (1) row by row alone,
    (2) beside another sequence, (3) with other contents in the slots past the rows, (4) in a cache of 320
    slots, (5) as a tree's branch cache (branch 1 of 2)?"""
    kernel = native.extension()
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(9, 5, 64, generator=generator).bfloat16()
    keys, values = (torch.randn(3, 160, 64, generator=generator).bfloat16() for _ in range(2))
    pos = torch.arange(100, 105)

    def attend(q, keys, values, pos, owner=None, start=0, others=()):
        out = torch.zeros(9, start + q.shape[1], 64, dtype=q.dtype)
        full_q = torch.cat([other[0] for other in others] + [q], 1) if others else q
        kernel.attend_rows(full_q.contiguous(), out, [o[1] for o in others] + [keys], [o[2] for o in others] + [values],
                           [0] * len(others) + [start], [o[3] for o in others] + [ends_of(pos)],
                           [None] * len(others) + [owner])
        return out[:, start:]

    base = attend(q, keys, values, pos)
    alone = torch.cat([attend(q[:, r:r + 1], keys, values, pos[r:r + 1]) for r in range(5)], 1)
    other = (torch.randn(9, 3, 64, generator=generator).bfloat16(), torch.randn(3, 90, 64).bfloat16(),
             torch.randn(3, 90, 64).bfloat16(), torch.tensor([40, 41, 42]))
    beside = attend(q, keys, values, pos, start=3, others=[other])
    scrambled_keys, scrambled_values = keys.clone(), values.clone()
    scrambled_keys[:, 105:] = torch.randn(3, 55, 64).bfloat16()
    scrambled_values[:, 105:] = torch.randn(3, 55, 64).bfloat16()
    scrambled = attend(q, scrambled_keys, scrambled_values, pos)
    longer_keys, longer_values = (torch.cat([cache, torch.randn(3, 160, 64).bfloat16()], 1) for cache in (keys, values))
    longer = attend(q, longer_keys, longer_values, pos)
    branch_keys, branch_values = (torch.stack([torch.randn(3, 160, 64).bfloat16(), cache]) for cache in (keys, values))
    branched = attend(q, branch_keys, branch_values, pos, owner=torch.ones(5, dtype=torch.long))
    return [torch.equal(base, other) for other in (alone, beside, scrambled, longer, branched)]


def prompt_invariances(ends_of: Callable[[torch.Tensor], torch.Tensor]) -> list[bool]:
    """A prompt's 40 rows at slots 0..39 of a cache of 64 (9 query heads, 3 kv heads, D 64, bf16; on the tiles a
    kv head's first 32 rows are six tiles of 16 queries, its last 8 two more), with the ends `ends_of(pos)` gives:
    are its outputs bitwise the same (1) row by row alone, (2) in two chunks of 17 and 23 rows, (3) with other
    contents in the slots past the prompt?"""
    kernel = native.extension()
    generator = torch.Generator().manual_seed(1)
    q = torch.randn(9, 40, 64, generator=generator).bfloat16()
    keys, values = (torch.randn(3, 64, 64, generator=generator).bfloat16() for _ in range(2))
    pos = torch.arange(40)

    def attend(rows: slice, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        part = q[:, rows].contiguous()
        out = torch.zeros_like(part)
        kernel.attend_rows(part, out, [keys], [values], [0], [ends_of(pos[rows])], [None])
        return out

    whole = attend(slice(0, 40), keys, values)
    alone = torch.cat([attend(slice(r, r + 1), keys, values) for r in range(40)], 1)
    chunks = torch.cat([attend(slice(0, 17), keys, values), attend(slice(17, 40), keys, values)], 1)
    scrambled_keys, scrambled_values = keys.clone(), values.clone()
    scrambled_keys[:, 40:] = torch.randn(3, 24, 64, generator=generator).bfloat16()
    scrambled_values[:, 40:] = torch.randn(3, 24, 64, generator=generator).bfloat16()
    scrambled = attend(slice(0, 40), scrambled_keys, scrambled_values)
    return [torch.equal(whole, other) for other in (alone, chunks, scrambled)]


def test_a_row_depends_only_on_its_query_and_its_visible_slots():
    assert all(invariances(lambda pos: pos + 1))


def test_a_prompt_row_depends_only_on_its_query_and_its_visible_slots():
    assert all(prompt_invariances(lambda pos: pos + 1))


def test_rows_that_see_one_slot_past_their_own_differ():
    """Mutant: ends one past each row's own slot; the next slot's contents then change its result."""
    assert not all(invariances(lambda pos: pos + 2))
    assert not all(prompt_invariances(lambda pos: pos + 2))


# ---- a thread's intra-op count ----

def counts_after_another_thread_sets_one(setter: Callable[[int], None]) -> list[int]:
    """A new thread sets 2 intra-op threads with `setter`; another thread then sets 1 (as a batched server's
    generation threads do per request) before the first runs any op; the first then runs the kernel and an ATen
    product: its count after each."""
    kernel, counts = native.extension(), []
    q = torch.randn(9, 4, 64).bfloat16()
    keys = torch.randn(3, 64, 64).bfloat16()
    set_here, set_there = threading.Event(), threading.Event()

    def first() -> None:
        setter(2)
        set_here.set()
        set_there.wait()
        kernel.attend_rows(q, torch.zeros_like(q), [keys], [keys], [0], [torch.arange(60, 64)], [None])
        counts.append(torch.get_num_threads())
        torch.randn(64, 64) @ torch.randn(64, 64)
        counts.append(torch.get_num_threads())

    def second() -> None:
        set_here.wait()
        torch.set_num_threads(1)
        set_there.set()

    before = torch.get_num_threads()
    threads = [threading.Thread(target=first), threading.Thread(target=second)]
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        torch.set_num_threads(before)  # the process-wide last value, which new threads start from
    return counts


def test_a_thread_s_count_stays_its_own():
    assert counts_after_another_thread_sets_one(native.set_threads) == [2, 2]


def test_torch_s_setter_alone_takes_another_thread_s_count():
    """Mutant: the count set before the thread's first op, without initialising first (what the pass thread did)."""
    assert counts_after_another_thread_sets_one(torch.set_num_threads) == [1, 1]


def test_libtorch_s_initialisation_alone_leaves_the_kernel_s():
    """Mutant: libtorch initialised first but not the extension, whose first parallel op then takes the 1."""
    def libtorch_only(n: int) -> None:
        torch.get_num_threads()
        torch.set_num_threads(n)

    assert counts_after_another_thread_sets_one(libtorch_only) == [1, 1]


def test_heads_wider_than_the_kernel_takes_run_the_python_loop():
    """head_dim 144: the Python loop runs the pass; made to run the native loop (the mutant), the kernel refuses."""
    model = tiny_llama(0, layers=1, hidden=576, dtype=torch.bfloat16)
    forward = llama_forward(model)[0]
    assert forward.head_dim > 128 and forward._native() is None
    with torch.inference_mode():
        assert forward.forward_many(CASES["five rows"](forward))[0][0].shape[0] == 5
        with mock.patch("specops.core.llama.NATIVE_MAX_HEAD_DIM", 1024), pytest.raises(RuntimeError, match="D <= 128"):
            forward.forward_many(CASES["five rows"](forward))


@pytest.mark.parametrize("venv_first", [True, False])
def test_a_process_loads_the_build_whatever_ninja_its_path_finds_first(venv_first):
    """Two ninjas (this venv's, the system's) hash a build's commands differently, so a process whose PATH found
    the other one rebuilt the whole extension (a minute; in `make test` a server killed mid-build left the
    build's lock). native builds with the environment's ninja whatever PATH says: a process with this venv's
    bin folder first on PATH, or left out of it, loads the build there is."""
    built = Path(native.extension().__file__)
    before = built.stat().st_mtime_ns
    venv_bin = str(Path(sys.executable).parent)
    others = [entry for entry in os.environ.get("PATH", "").split(os.pathsep) if entry != venv_bin]
    env = {**os.environ, "PATH": os.pathsep.join([venv_bin, *others] if venv_first else others)}
    done = subprocess.run([sys.executable, "-c", "from specops.core import native; assert native.extension()"],
                          env=env, capture_output=True, text=True, timeout=300, cwd=Path(__file__).parents[2])
    assert done.returncode == 0, done.stderr[-2000:]
    assert built.stat().st_mtime_ns == before  # loaded, not rebuilt
