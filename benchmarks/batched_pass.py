"""Where a batched target pass's time goes: `LlamaForward.forward_many` over sequences of given cache lengths
and rows, the target in bf16 (as the server batches it), timed alone; optionally with torch's profiler.

Where the native decoder is built, each sequence attends over its own cache in place (native_attention.cpp);
in the Python loop the sequences attend in one call per layer, their caches padded to the longest
(specops.core.llama._AttentionPlan; one call per cache length where LlamaForward.pads_exactly fails).
`--attention` times one layer's attention of each case both ways, side by side: the kernel against the Python
loop's ATen attention, with the largest difference between their outputs (they round differently).

`--prefills` times a prompt's prefill (which a server runs alone on its pass thread) at those lengths, with
the rate of its weight products in GFLOP/s beside that of one large bf16 product on the same threads: how
close to what the cores do at best a prefill already runs.

`--checkout PATH` times another checkout's forward (its specops/core/llama.py, e.g. `git worktree add PATH
COMMIT`) beside this one's on the same weights and caches, the two interleaved in one process, and checks
that their outputs are bitwise equal: a change meant to be faster and to round alike, measured as both.
`--onednn` does the same against this checkout's forward on oneDNN's packed products instead of our kernel's
(specops.core.packed_linear; they round otherwise, so bitwise equal is false there), and `--dot-products`
against our kernel's AVX-512 dot products where this one runs on AMX tiles (rounded otherwise too), and
`--attention-loops` against the attention kernel's AVX-512 loops where its bf16 rows take AMX tiles.

    .venv/bin/python benchmarks/batched_pass.py --cases 320 320x8 256,320,384,448x2 --rows 1 5 --prefills 128 256
    .venv/bin/python benchmarks/batched_pass.py --cases 320 320x8 --rows 1 5 --prefills 192 --checkout /tmp/old
    .venv/bin/python benchmarks/batched_pass.py --cases 320 320x8 256,320,384,448x2 --rows 1 3 5 --attention
    .venv/bin/python benchmarks/batched_pass.py --cases 320 320x8 --rows 1 3 --prefills 64 192 --onednn
    .venv/bin/python benchmarks/batched_pass.py --cases 320 320x8 --rows 1 3 --prefills 64 192 --dot-products
    .venv/bin/python benchmarks/batched_pass.py --cases 320 320x8 --rows 1 5 --prefills 64 192 --attention-loops
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time
import types
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from specops.core import native, packed_linear
from specops.core.kv import StaticLM
from specops.core.llama import LlamaForward, Segment, _AttentionPlan, llama_forward
from specops.core.packed_linear import pack, tiles
from specops.core.target import load_target

try:  # imported as benchmarks.batched_pass (the tests), or run as a script from benchmarks/
    from benchmarks.load_test import code_version
except ModuleNotFoundError:
    from load_test import code_version  # type: ignore[no-redef]

EMPTY_SLOTS = 80  # a cache's slots past its prompt: 64 new tokens and the runtime's room (static_cache_length)


def lengths_of(case: str) -> list[int]:
    """"256,320x2" -> [256, 320, 256, 320]: the comma-separated lengths, the list repeated."""
    spec, _, times = case.partition("x")
    lengths = [int(n) for n in spec.split(",")] * int(times or 1)
    if any(n <= EMPTY_SLOTS or n % 64 for n in lengths):
        raise SystemExit(f"Cache lengths are multiples of 64 above {EMPTY_SLOTS}, got {case}.")
    return lengths


def caches_of(model: torch.nn.Module, lengths: list[int]) -> list[StaticLM]:
    """A cache per length, its prompt filling all but its last EMPTY_SLOTS slots."""
    caches = []
    for length in lengths:
        lm = StaticLM(model, 5, length)
        lm.prefill([10 + i % 50 for i in range(length - EMPTY_SLOTS)])
        caches.append(lm)
    return caches


def pass_of(model: torch.nn.Module, lengths: list[int], rows: int) -> Callable[[], object]:
    """One pass of `rows` rows per sequence, a sequence per length (caches_of: the rows are written past the
    prompt and not kept), warmed up: runs_of's, through this checkout's forward, returning its logits and
    layer outputs."""
    run = runs_of(model, lengths, rows, [llama_forward(model)[0]])[0]
    return lambda: run()[0]  # type: ignore[index]


def runs_of(model: torch.nn.Module, lengths: list[int], rows: int,
            forwards: list[LlamaForward]) -> list[Callable[[], object]]:
    """One pass of `rows` rows per sequence through each of `forwards` (another checkout's takes this
    checkout's Segment, which it reads by field name), each on its own copy of the caches and with its own
    rotary tables, so that a forward writing a wrong slot or table cannot hide behind the other's writes: a
    run returns the logits and layer outputs, and the keys and values it left."""
    caches, runs = caches_of(model, lengths), []
    for forward in forwards:
        segments = [Segment(torch.full((rows,), 42), torch.arange(lm.length, lm.length + rows),
                            [k.clone() for k in lm.keys], [v.clone() for v in lm.values],
                            *forward.tables(lm.keys[0].shape[1])) for lm in caches]
        runs.append(warmed(lambda forward=forward, segments=segments: (
            forward.forward_many(segments), [s.keys for s in segments], [s.values for s in segments])))
    return runs


def attention_runs(model: torch.nn.Module, lengths: list[int], rows: int) -> list[Callable[[], torch.Tensor]]:
    """Layer 0's attention of one pass of `rows` rows per sequence (caches_of's caches, random queries): through
    the native kernel, as the C++ loop calls it, and through the Python loop's ATen attention
    (_AttentionPlan.attend: the caches stacked and padded), each warmed up, returning [heads, rows, D]."""
    kernel = native.extension()
    if kernel is None:
        raise SystemExit("--attention times the native decoder's kernel, which is not built here (make setup).")
    forward = llama_forward(model)[0]
    segments = [Segment(torch.full((rows,), 42), torch.arange(lm.length, lm.length + rows), lm.keys, lm.values,
                        *forward.tables(lm.keys[0].shape[1])) for lm in caches_of(model, lengths)]
    n = rows * len(segments)
    q = torch.randn(forward.heads, n, forward.head_dim, generator=torch.Generator().manual_seed(0)).to(forward.dtype)
    plan = _AttentionPlan(forward, segments, [rows] * len(segments), n)
    ends = [forward.visible_ends(s.pos, s.keys[0].shape[-2]) for s in segments]
    starts = [j * rows for j in range(len(segments))]

    def through_kernel() -> torch.Tensor:
        out = q.new_zeros(q.shape)
        kernel.attend_rows(q, out, [s.keys[0] for s in segments], [s.values[0] for s in segments], starts, ends,
                           [None] * len(segments))
        return out

    return [warmed(through_kernel), warmed(lambda: plan.attend(q, 0))]  # type: ignore[list-item]


def compare_attention(model: torch.nn.Module, cases: list[str], rows: list[int], repeats: int) -> list[dict]:
    """The kernel against ATen's attention, case by case: both medians in µs, ATen/kernel, the largest difference."""
    out = []
    for case in cases:
        for n in rows:
            runs = attention_runs(model, lengths_of(case), n)
            (kernel_s, aten_s), _ = side_by_side(runs, repeats)  # type: ignore[arg-type]
            difference = (runs[0]().float() - runs[1]().float()).abs().max().item()
            out.append({"case": f"{case} x{n} rows", "kernel_us": round(kernel_s * 1e6, 1),
                        "aten_us": round(aten_s * 1e6, 1), "aten_over_kernel": round(aten_s / kernel_s, 2),
                        "max_abs_difference": difference})
            print(f"attention, {case} x{n} rows: kernel {kernel_s * 1e6:.1f} us, ATen {aten_s * 1e6:.1f} us, "
                  f"ATen/kernel {aten_s / kernel_s:.2f}, largest difference {difference:.2e}", flush=True)
    return out


def warmed(run: Callable[[], object]) -> Callable[[], object]:
    """`run`, run three times first: the allocator, oneDNN's primitives."""
    for _ in range(3):
        run()
    return run


def prefill_of(model: torch.nn.Module, tokens: int) -> Callable[[], object]:
    """A prompt of `tokens` tokens prefilled from slot 0 of a cache of its own, warmed up: forward_prefill_of's,
    through this checkout's forward, returning its layer outputs."""
    run = forward_prefill_of(llama_forward(model)[0], tokens)
    return lambda: run()[0]  # type: ignore[index]


def forward_prefill_of(forward: LlamaForward, tokens: int) -> Callable[[], object]:
    """A prompt of `tokens` tokens through `forward.prefill` into a cache of its own, warmed up."""
    keys, values = forward.new_cache(tokens + EMPTY_SLOTS)
    tables = forward.tables(tokens + EMPTY_SLOTS)
    ids = torch.tensor([10 + i % 50 for i in range(tokens)])
    return warmed(lambda: (forward.prefill(ids, torch.arange(tokens), keys, values, *tables), keys, values))


def checkout_forward(model: torch.nn.Module, checkout: Path) -> LlamaForward:
    """`model`'s eager forward as another checkout's specops/core/llama.py builds it (loaded under a name of
    its own; what it imports, such as the packed products, is this checkout's)."""
    path = checkout / "specops" / "core" / "llama.py"
    if not path.is_file():
        raise SystemExit(f"{checkout} has no specops/core/llama.py.")
    module = types.ModuleType("checkout_llama")
    module.__file__ = str(path)
    sys.modules[module.__name__] = module  # its dataclasses look their module up while they are built
    # From the source, not through importlib's loader: its cached bytecode is reused for a file changed within
    # the same second at the same size (a one-character mutant), and it would write into the other checkout.
    exec(compile(path.read_text(), str(path), "exec"), module.__dict__)
    return module.LlamaForward(model).eval()


def side_by_side(runs: list[Callable[[], object]], repeats: int) -> tuple[list[float], bool]:
    """Each run's median seconds, timed interleaved (the order flipped every repeat, so neither always runs
    after the other), and whether their outputs were bitwise equal."""
    outputs = [run() for run in runs]
    equal = all(tensors_equal(outputs[0], other) for other in outputs[1:])
    times: list[list[float]] = [[] for _ in runs]
    for repeat in range(repeats):
        for i in (range(len(runs)) if repeat % 2 else reversed(range(len(runs)))):
            start = time.perf_counter()
            runs[i]()
            times[i].append(time.perf_counter() - start)
    return [statistics.median(t) for t in times], equal


def tensors_equal(a: object, b: object) -> bool:
    """Whether two nests of tuples and lists of tensors hold bitwise equal tensors."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    return (isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)) and len(a) == len(b)
            and all(tensors_equal(x, y) for x, y in zip(a, b, strict=True)))


def repacked_forward(model: torch.nn.Module, ours: bool, on_tiles: bool) -> LlamaForward:
    """`model`'s eager forward with its products packed otherwise than this process's default (packed_linear):
    on oneDNN's packed weights (`ours` False) or our dot products' (`on_tiles` False)."""
    forward = LlamaForward(model).eval()
    forward.packed = forward.packed_weights(ours, on_tiles)
    forward.packed_head = pack(forward.head, ours, on_tiles)  # type: ignore[misc]  # the cached property, set
    return forward


class AttentionLoops:
    """`forward` with the attention kernel's AVX-512 loops for its bf16 rows where it takes the AMX tiles
    (SPECOPS_AMX=0 while its passes run: the kernel reads it at each call, the products were packed before)."""

    def __init__(self, forward: LlamaForward) -> None:
        self.forward = forward

    def __getattr__(self, name: str) -> object:
        return getattr(self.forward, name)

    @contextlib.contextmanager
    def _loops(self) -> Iterator[None]:
        before = os.environ.get(packed_linear.AMX_ENV)
        os.environ[packed_linear.AMX_ENV] = "0"
        try:
            yield
        finally:
            if before is None:
                del os.environ[packed_linear.AMX_ENV]
            else:
                os.environ[packed_linear.AMX_ENV] = before

    def forward_many(self, *args: object, **kwargs: object) -> object:
        with self._loops():
            return self.forward.forward_many(*args, **kwargs)

    def prefill(self, *args: object) -> object:
        with self._loops():
            return self.forward.prefill(*args)


def compare(model: torch.nn.Module, other: LlamaForward, cases: list[str], rows: list[int], prefills: list[int],
            repeats: int) -> list[dict]:
    """This checkout's forward against `other` (another checkout's, or this one's on oneDNN's products), case
    by case: both medians, other/this ("checkout"), bitwise equal."""
    forwards = [llama_forward(model)[0], other]
    jobs = [(f"{case} x{n} rows", runs_of(model, lengths_of(case), n, forwards)) for case in cases for n in rows]
    jobs += [(f"prefill of {tokens}", [forward_prefill_of(forward, tokens) for forward in forwards])
             for tokens in prefills]
    out = []
    for name, runs in jobs:
        (this, other), equal = side_by_side(runs, repeats)
        out.append({"case": name, "this_ms": round(this * 1000, 2), "checkout_ms": round(other * 1000, 2),
                    "checkout_over_this": round(other / this, 3), "bitwise_equal": equal})
        print(f"{name}: this {this * 1000:.2f} ms, checkout {other * 1000:.2f} ms, checkout/this {other / this:.3f}, "
              f"bitwise equal: {equal}", flush=True)
    return out


def product_flops(model: torch.nn.Module) -> int:
    """FLOPs of the decoder's weight products per token (2 per weight; the LM head and attention left out)."""
    return 2 * sum(p.numel() for name, p in model.named_parameters()
                   if ".layers." in name and name.endswith("proj.weight"))


def peak_gflops(repeats: int) -> float:
    """One large bf16 product's rate: the cores' best on these threads (a 1024-row MLP up-projection)."""
    x, w = torch.randn(1024, 576, dtype=torch.bfloat16), torch.randn(4 * 1536, 576, dtype=torch.bfloat16)
    torch.nn.functional.linear(x, w)
    return 2 * x.shape[0] * w.numel() / median_seconds(lambda: torch.nn.functional.linear(x, w), repeats) / 1e9


def median_seconds(run: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", nargs="+", default=["320", "320x8", "256,320,384,448x2"],
                        help="one pass's cache lengths: comma-separated, xN repeats the list")
    parser.add_argument("--rows", nargs="+", type=int, default=[1, 5], help="rows per sequence")
    parser.add_argument("--prefills", nargs="*", type=int, default=[],
                        help="prompt lengths whose prefill to time (none by default)")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--profile", action="store_true", help="print torch's profile of the last case's passes")
    parser.add_argument("--attention", action="store_true",
                        help="also time each case's attention for one layer: the native kernel against ATen's")
    parser.add_argument("--checkout", type=Path, default=None,
                        help="time another checkout's forward beside this one's, interleaved, and compare outputs")
    parser.add_argument("--onednn", action="store_true",
                        help="time this checkout's forward beside itself on oneDNN's packed products instead of "
                             "our kernel's, interleaved (as --checkout)")
    parser.add_argument("--dot-products", action="store_true",
                        help="time this checkout's forward beside itself on our AVX-512 dot products instead of AMX "
                             "tiles, where this CPU has them, interleaved (as --checkout)")
    parser.add_argument("--attention-loops", action="store_true",
                        help="time this checkout's forward beside itself with the attention kernel's AVX-512 loops "
                             "instead of AMX tiles for bf16 rows, where this CPU has them, interleaved (as --checkout)")
    parser.add_argument("--out", default=None,
                        help="the JSON to write (default: benchmarks/results/batched_pass.json; with --checkout, "
                             "batched_pass_checkout.json)")
    args = parser.parse_args()
    others = {"_checkout": args.checkout is not None, "_onednn": args.onednn, "_dot_products": args.dot_products,
              "_attention_loops": args.attention_loops}
    if any(others.values()) and args.profile:
        parser.error("--profile profiles this checkout's passes alone; leave out --checkout, --onednn, "
                     "--dot-products and --attention-loops")
    if sum(others.values()) > 1:
        parser.error("--checkout, --onednn, --dot-products and --attention-loops each take the other side of the "
                     "comparison; give one")
    suffix = next((name for name, given in others.items() if given), "")
    args.out = args.out or f"benchmarks/results/batched_pass{suffix}.json"
    torch.set_num_threads(args.threads)
    model = load_target("smollm2", dtype="bfloat16").model
    if suffix:
        with torch.inference_mode():
            other = (checkout_forward(model, args.checkout.resolve()) if args.checkout is not None
                     else AttentionLoops(llama_forward(model)[0]) if args.attention_loops  # type: ignore[assignment]
                     else repacked_forward(model, ours=not args.onednn, on_tiles=not args.dot_products))
            compared = compare(model, other, args.cases, args.rows, args.prefills, args.repeats)
        checkout = ({"path": str(args.checkout), "code": code_version(args.checkout)} if args.checkout else
                    "this checkout on oneDNN's packed products" if args.onednn else
                    "this checkout with the attention kernel's AVX-512 loops" if args.attention_loops else
                    "this checkout on our kernel's dot products")
        Path(args.out).write_text(json.dumps({
            "threads": args.threads, "load_avg": os.getloadavg(), "this": code_version(Path(__file__).parent),
            "amx_tiles": tiles(),
            "checkout": checkout, "compared": compared}, indent=2) + "\n")
        print(f"wrote {args.out}")
        return
    results, profiled = [], []
    with torch.inference_mode():
        for case in args.cases:
            lengths = lengths_of(case)
            for rows in args.rows:
                seconds = median_seconds(pass_of(model, lengths, rows), args.repeats)
                results.append({"lengths": lengths, "distinct_lengths": len(set(lengths)), "rows": rows,
                                "median_ms": round(seconds * 1000, 2)})
                print(f"{len(lengths)} sequences over {len(set(lengths))} cache lengths, {rows} rows each: "
                      f"{seconds * 1000:.2f} ms", flush=True)
        prefills = []
        if args.prefills:
            flops, peak = product_flops(model), peak_gflops(args.repeats)
            print(f"one large bf16 product: {peak:.0f} GFLOP/s")
            for tokens in args.prefills:
                seconds = median_seconds(prefill_of(model, tokens), args.repeats)
                rate = flops * tokens / seconds / 1e9
                prefills.append({"tokens": tokens, "median_ms": round(seconds * 1000, 2),
                                 "tokens_per_s": round(tokens / seconds), "products_gflops": round(rate),
                                 "share_of_large_product": round(rate / peak, 3)})
                print(f"prefill of {tokens} tokens: {seconds * 1000:.1f} ms, {tokens / seconds:.0f} tokens/s, "
                      f"products at {rate:.0f} GFLOP/s ({rate / peak:.0%} of the large product's)", flush=True)
        if args.profile:
            from torch.profiler import ProfilerActivity, profile

            run = pass_of(model, lengths_of(args.cases[-1]), args.rows[-1])
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                for _ in range(5):
                    run()
            ops = sorted(prof.key_averages(), key=lambda op: op.self_cpu_time_total, reverse=True)
            total = sum(op.self_cpu_time_total for op in ops)
            profiled = [{"op": op.key, "self_cpu_share": round(op.self_cpu_time_total / total, 4), "calls": op.count}
                        for op in ops[:20]]
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20))
        attention = compare_attention(model, args.cases, args.rows, args.repeats) if args.attention else []
    Path(args.out).write_text(json.dumps({"threads": args.threads, "load_avg": os.getloadavg(), "results": results,
                                          "prefills": prefills, "attention": attention,
                                          "profile_of_last_case": profiled}, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
