"""The measuring scripts' own logic: benchmarks/batched_pass.py's cases, passes and prefills, and load_test.py's
--checkout (a server run from another checkout's code)."""

from __future__ import annotations

import subprocess

import pytest
import torch

from benchmarks.batched_pass import lengths_of, pass_of, prefill_of, product_flops
from benchmarks.load_test import code_version, parse_args
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
