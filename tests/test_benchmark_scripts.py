"""The measuring scripts' own logic: benchmarks/batched_pass.py's cases and passes, and load_test.py's
--checkout (a server run from another checkout's code)."""

from __future__ import annotations

import pytest
import torch

from benchmarks.batched_pass import lengths_of, pass_of
from benchmarks.load_test import parse_args
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


def test_a_checkout_names_a_server_and_a_folder_with_the_package(tmp_path):
    (tmp_path / "specops").mkdir()
    args = parse_args(["--servers", "new=--drafter none", "old=--drafter none", "--checkout", f"old={tmp_path}"])
    assert args.checkout == {"old": tmp_path.resolve()}
    for wrong in (f"other={tmp_path}", f"old={tmp_path / 'specops'}", "old="):
        with pytest.raises(SystemExit):
            parse_args(["--servers", "old=--drafter none", "--checkout", wrong])
