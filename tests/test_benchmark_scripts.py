"""The measuring scripts' own logic: benchmarks/batched_pass.py's cases, passes, prefills and --checkout (another
checkout's forward beside this one's), and load_test.py's rounds, plot and --checkout (a server run from
another checkout's code)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
import torch
from PIL import Image

from benchmarks.batched_pass import (
    AttentionLoops,
    checkout_forward,
    compare,
    compare_attention,
    lengths_of,
    pass_of,
    prefill_of,
    product_flops,
    repacked_forward,
)
from benchmarks.load_test import (
    against,
    code_version,
    combine,
    level_prompts,
    parse_args,
    plot,
    process_cpu_s,
)
from specops.core.llama import llama_forward
from tests.conftest import tiny_llama


def test_a_case_is_its_lengths_repeated():
    assert lengths_of("256,320x2") == [256, 320, 256, 320]
    assert lengths_of("192") == [192]
    for bad in ("300", "64", "256,100x2"):  # not a multiple of 64, or no room past its prompt
        with pytest.raises(SystemExit):
            lengths_of(bad)


def test_a_pass_runs_every_sequence_s_rows():
    run = pass_of(tiny_llama(0, dtype=torch.bfloat16, hidden=128), [128, 192, 128], rows=3)
    with torch.inference_mode():
        results = run()
    assert [logits.shape[0] for logits, _ in results] == [3, 3, 3]


def test_a_prefill_is_timed_on_the_same_slots_and_its_products_counted():
    model = tiny_llama(0, dtype=torch.bfloat16, hidden=128)
    run = prefill_of(model, 70)
    with torch.inference_mode():
        first, again = run(), run()
    assert first.shape[0] == 70 and torch.equal(first, again)  # each run prefills the prompt from slot 0
    config = model.config
    kv = config.num_key_value_heads * config.hidden_size // config.num_attention_heads
    per_layer = 2 * config.hidden_size ** 2 + 2 * kv * config.hidden_size + 3 * config.hidden_size * config.intermediate_size
    assert product_flops(model) == 2 * config.num_hidden_layers * per_layer


def test_a_case_s_attention_is_timed_through_the_kernel_and_through_aten():
    """--attention: one layer's attention both ways, per case; the two agree up to bf16 rounding (the kernel's
    own exactness is tests/core/test_native.py's)."""
    model = tiny_llama(0, dtype=torch.bfloat16, hidden=128)
    with torch.inference_mode():
        rows = compare_attention(model, ["128", "128,192"], [1, 3], 2)
    assert [row["case"] for row in rows] == ["128 x1 rows", "128 x3 rows", "128,192 x1 rows", "128,192 x3 rows"]
    assert all(row["kernel_us"] > 0 and row["aten_us"] > 0 for row in rows)
    assert all(row["max_abs_difference"] < 0.05 for row in rows), rows


MUTANTS = {"rotates the other way": ("return x * cos + torch.cat(", "return x * cos - torch.cat("),
           "writes no values (its rows read the slots another forward's pass would have written)":
           ("segment.values[i].index_copy_(1, segment.pos, v[:, rows])", "pass")}


@pytest.mark.parametrize("mutant", [None, *MUTANTS])
def test_a_checkout_s_forward_is_timed_beside_this_one_and_compared_bit_for_bit(request, tmp_path, mutant):
    """The same llama.py in another folder: every case bitwise equal; a mutant of it: none (the comparison
    must be able to fail, each forward on caches of its own). The mutants change the Python loop, so both
    forwards run it (the native decoder is that loop bit for bit: tests/core/test_native.py)."""
    text = (Path(__file__).parents[1] / "specops" / "core" / "llama.py").read_text()
    if mutant is not None:
        request.getfixturevalue("python_loop")
        old, new = MUTANTS[mutant]
        assert text.count(old) == 1
        text = text.replace(old, new)
    (tmp_path / "specops" / "core").mkdir(parents=True)
    (tmp_path / "specops" / "core" / "llama.py").write_text(text)
    model = tiny_llama(0, dtype=torch.bfloat16, hidden=128)
    with torch.inference_mode():
        rows = compare(model, checkout_forward(model, tmp_path), ["128", "128,192"], [1, 3], [20], repeats=2)
    assert [row["case"] for row in rows] == ["128 x1 rows", "128 x3 rows", "128,192 x1 rows", "128,192 x3 rows",
                                             "prefill of 20"]
    assert all(row["this_ms"] > 0 and row["checkout_ms"] > 0 for row in rows)
    assert [row["bitwise_equal"] for row in rows] == [mutant is None] * len(rows)


def test_the_dot_products_are_timed_beside_the_tiles_and_round_otherwise():
    """--dot-products: this checkout's forward on our dot products beside the process's default; where AMX tiles
    run, the two round otherwise (so the comparison does compare two kernels: here on the prefill's rows; a tiny
    model's three decoding rows may round alike), elsewhere they are one kernel."""
    from specops.core.packed_linear import tiles

    model = tiny_llama(0, dtype=torch.bfloat16, hidden=128)
    other = repacked_forward(model, ours=True, on_tiles=False)
    assert all(packed is None or packed.dim() == 4 for packed in other.packed.qkv + other.packed.down)
    with torch.inference_mode():
        rows = compare(model, other, ["128"], [3], [20], repeats=1)
    assert all(row["bitwise_equal"] for row in rows) != tiles()


def test_the_attention_loops_are_timed_beside_the_tiles_and_round_otherwise():
    """--attention-loops: this checkout's forward with the attention kernel's AVX-512 loops beside its tiles; where
    bf16 rows take the tiles the two round otherwise, elsewhere they are one path; SPECOPS_AMX is as before."""
    from specops.core import native

    before = os.environ.get("SPECOPS_AMX")
    model = tiny_llama(0, dtype=torch.bfloat16, hidden=128)
    with torch.inference_mode():
        rows = compare(model, AttentionLoops(llama_forward(model)[0]), ["128"], [3], [20], repeats=1)
    assert os.environ.get("SPECOPS_AMX") == before
    assert all(row["bitwise_equal"] for row in rows) != (native.extension().attention_path() == "amx")


def test_a_checkout_without_the_forward_is_refused(tmp_path):
    with pytest.raises(SystemExit, match="has no specops/core/llama.py"):
        checkout_forward(tiny_llama(0, dtype=torch.bfloat16, hidden=128), tmp_path)


def test_a_process_s_cpu_seconds_grow_with_its_work_and_a_gone_one_has_none():
    before = process_cpu_s(os.getpid())
    sum(i * i for i in range(3_000_000))  # a few hundred ms of this process's CPU
    assert process_cpu_s(os.getpid()) > before > 0
    finished = subprocess.Popen(["true"])
    finished.wait()
    assert process_cpu_s(finished.pid) == 0.0


def test_each_level_gets_its_own_prompts_from_the_whole_pool():
    """Prompts that grow along the pool (as HumanEval's do): every level gets as many, none shared, and
    each level's lengths span the pool, so the levels' mean lengths stay within one level's step of each
    other (consecutive slices put the longest at the last level: means 3.5 against 27.5 here)."""
    pool, levels = list(range(32)), 4
    split = [level_prompts(pool, level, levels) for level in range(levels)]
    assert sorted(p for prompts in split for p in prompts) == pool and {len(prompts) for prompts in split} == {8}
    means = [sum(prompts) / len(prompts) for prompts in split]
    assert max(means) - min(means) <= levels - 1
    assert level_prompts(pool, 0, 1) == pool  # one level (the same prompts at every concurrency): the whole pool


def test_a_checkout_names_a_server_and_a_folder_with_the_package(tmp_path):
    (tmp_path / "specops").mkdir()
    args = parse_args(["--servers", "new=--drafter none", "old=--drafter none", "--checkout", f"old={tmp_path}"])
    assert args.checkout == {"old": tmp_path.resolve()}
    for wrong in (f"other={tmp_path}", f"old={tmp_path / 'specops'}", "old="):
        with pytest.raises(SystemExit):
            parse_args(["--servers", "old=--drafter none", "--checkout", wrong])


def test_a_server_s_code_is_its_commit_and_whether_it_was_changed(tmp_path):
    """What each round records per server: the checkout's commit, +changes once a tracked file differs
    (benchmarks/results once held a run labelled with a commit whose server had run other code)."""
    def git(*command: str) -> str:
        return subprocess.run(["git", "-C", str(tmp_path), *command], capture_output=True, text=True,
                              check=True).stdout.strip()

    assert code_version(tmp_path) == "unknown"
    git("init", "-q")
    (tmp_path / "code.py").write_text("x = 1\n")
    git("add", "code.py")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "c")
    commit = git("rev-parse", "--short", "HEAD")
    (tmp_path / "new.json").write_text("{}")  # untracked results do not count
    assert code_version(tmp_path) == commit
    (tmp_path / "code.py").write_text("x = 2\n")
    assert code_version(tmp_path) == f"{commit}+changes"


def test_rounds_combine_per_key_and_the_plot_shows_where_the_pass_thread_went(tmp_path):
    """Counts summed, numbers and each kind's pass-thread seconds their median over the rounds; the plot gets
    a third panel (the pass thread's time by kind) only where a server reported it."""
    def phase(tok_s: float, busy: dict[str, float]) -> dict:
        return {"requests": 32, "errors": 0, "wall_s": 10.0, "throughput_tok_s": tok_s, "latency_p50_s": 1.0,
                "latency_p99_s": 2.0, "pass_thread_s": busy, "error_samples": []}

    busy = [{"target": 6.0, "target_alone": 3.0}, {"target": 8.0, "target_alone": 2.0, "draft": 1.0},
            {"target": 7.0, "target_alone": 4.0}]
    rounds = [{"results": {"batched": {"1": phase(tok_s, kinds)}, "serial": {"1": phase(tok_s, {})}}}
              for tok_s, kinds in zip((100.0, 80.0, 90.0), busy, strict=True)]
    combined = combine(rounds)
    assert combined["batched"]["1"]["pass_thread_s"] == {"draft": 1.0, "target": 7.0, "target_alone": 3.0}
    assert combined["batched"]["1"]["throughput_tok_s"] == 90.0 and combined["batched"]["1"]["requests"] == 96
    widths = {}
    for name, results in (("with", combined), ("without", {"serial": combined["serial"]})):
        plot({"config": {"concurrency": [1]}, "results": results}, tmp_path / f"{name}.png")
        widths[name] = Image.open(tmp_path / f"{name}.png").size[0]
    assert widths["with"] > 1.4 * widths["without"]


def starved_rounds() -> list[dict]:
    """Three rounds of two servers at one level; in round 2 the batched server's phase lost a core."""
    def phase(tok_s: float, starved: bool) -> dict:
        return {"requests": 32, "errors": 0, "throughput_tok_s": tok_s, "cores_busy": 0.54 if starved else 0.96,
                "starved": starved, "error_samples": []}

    return [{"results": {"serial": {"8": phase(50.0, False)}, "batched": {"8": phase(tok_s, starved)}}}
            for tok_s, starved in ((150.0, False), (60.0, True), (140.0, False))]


def test_a_starved_phase_is_kept_but_left_out_of_medians_and_ratios():
    rounds = starved_rounds()
    combined = combine(rounds)["batched"]["8"]
    assert combined["throughput_tok_s"] == 145.0 and combined["cores_busy"] == 0.96
    assert combined["requests"] == 96 and combined["starved_rounds"] == [1]  # counts and the record keep every round
    assert combined["throughput_tok_s_rounds"] == [150.0, 60.0, 140.0]
    assert against(rounds, "serial")["batched"]["8"] == [3.0, 2.8]
    every_round_starved = [{"results": {n: {"8": {**p["8"], "starved": True}} for n, p in r["results"].items()}}
                           for r in rounds]
    assert combine(every_round_starved)["batched"]["8"]["throughput_tok_s"] == 140.0  # none unstarved: all count


def test_a_median_over_starved_phases_is_another_median(monkeypatch):
    """Mutant: the starved flag ignored (every phase kept)."""
    import benchmarks.load_test as load_test

    monkeypatch.setattr(load_test, "unstarved", lambda phases: phases)
    assert combine(starved_rounds())["batched"]["8"]["throughput_tok_s"] != 145.0
