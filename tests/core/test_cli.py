"""The CLI on a tiny local model folder: JSON output and clear errors with a non-zero exit."""

from __future__ import annotations

import json

import pytest

from specops.cli import main
from tests.conftest import tiny_llama


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, tokenizer):
    path = tmp_path_factory.mktemp("tiny-target")
    tiny_llama(seed=0, max_positions=64).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def other_vocab_draft(tmp_path_factory):
    path = tmp_path_factory.mktemp("other-vocab-draft")
    tiny_llama(seed=3, vocab=80, layers=1, hidden=32).save_pretrained(path)
    return path


def run(capsys, *argv):
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.mark.parametrize("drafter", ["none", "prompt-lookup", "recycling"])
def test_generate_json(capsys, model_dir, drafter):
    code, out, _ = run(capsys, "generate", "--target", str(model_dir), "--prompt", "w1 w2 w3 w1 w2",
                       "--max-new-tokens", "12", "--drafter", drafter, "--json")
    assert code == 0
    result = json.loads(out)
    assert set(result) >= {"text", "token_ids", "stats"}
    assert 1 <= len(result["token_ids"]) <= 12
    for key in ("steps", "drafted", "accepted", "mean_accepted_length", "tokens_per_s"):
        assert key in result["stats"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--prompt", "   "], "empty"),
        (["--prompt", "w1", "--max-new-tokens", "-3"], "max-new-tokens"),
        (["--prompt", " ".join(["w5"] * 70)], "context"),
        (["--prompt", "w1", "--drafter", "draft-lm"], "draft model"),
    ],
)
def test_generate_bad_input(capsys, model_dir, args, message):
    code, out, err = run(capsys, "generate", "--target", str(model_dir), *args)
    assert code != 0
    assert message in err
    assert "Traceback" not in err


def test_draft_model_with_other_vocabulary_is_refused(capsys, model_dir, other_vocab_draft):
    code, _, err = run(capsys, "generate", "--target", str(model_dir), "--prompt", "w1", "--drafter", "draft-lm",
                       "--draft-model", str(other_vocab_draft))
    assert code != 0 and "vocabulary" in err


def test_missing_target_names_the_fix(capsys, tmp_path):
    code, _, err = run(capsys, "generate", "--target", str(tmp_path / "nope"), "--prompt", "hi")
    assert code != 0 and "not found" in err


def test_corrupt_gguf_names_the_file(capsys, tmp_path):
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF" + b"\0" * 64)
    code, _, err = run(capsys, "generate", "--target", str(bad), "--prompt", "hi")
    assert code != 0 and "broken.gguf" in err and "corrupt" in err


def test_every_command_explains_itself(capsys):
    """`--help` of every subcommand prints (a help text with a bare % once broke `specops serve --help`)."""
    from specops.cli import build_parser

    parser = build_parser()
    commands = next(a for a in parser._actions if a.dest == "command").choices
    for name in commands:
        with pytest.raises(SystemExit) as done:
            parser.parse_args([name, "--help"])
        assert done.value.code == 0 and "usage:" in capsys.readouterr().out, name
