"""The feedback log: row contents, WAL, retention, privacy switches, Parquet export and the CLI."""

from __future__ import annotations

import argparse
import json
import sqlite3
from datetime import UTC, datetime, timedelta

import httpx
import pyarrow.parquet as pq
import pytest

from specops.core.target import encode_prompt
from specops.server.commands import _config, register
from specops.server.feedback import FeedbackLog, FeedbackRecord, export, parse_since
from tests.server.conftest import PROMPTS, served

T0 = datetime(2025, 1, 1, tzinfo=UTC)


def record(i: int, when: datetime = T0, text: str | None = None) -> FeedbackRecord:
    return FeedbackRecord(request_id=f"r{i}", created_at=when.timestamp(), bundle_version="abc", model_version="3",
                          drafter="recycling", endpoint="chat", prompt_ids=[1, 2, i], output_ids=[i, 7],
                          sampling={"temperature": 0.0, "seed": i}, per_step=[(4, 1), (3, 0)], finish_reason="length",
                          prompt_text=text)


def test_row_holds_what_retraining_needs(start_server, target):
    live = start_server(model=served(target))
    body = {"messages": [{"role": "user", "content": PROMPTS[2]}], "max_tokens": 20, "temperature": 0, "seed": 11}
    reply = httpx.post(live.url + "/v1/chat/completions", json=body, timeout=30).json()
    with sqlite3.connect(live.config.feedback_db) as db:
        db.row_factory = sqlite3.Row
        row = dict(db.execute("SELECT * FROM requests").fetchone())
        mode = db.execute("PRAGMA journal_mode").fetchone()[0]

    assert mode == "wal"
    assert row["request_id"] == reply["id"]
    assert json.loads(row["prompt_ids"]) == encode_prompt(target.tokenizer, PROMPTS[2])
    output = json.loads(row["output_ids"])
    assert len(output) == reply["usage"]["completion_tokens"]
    assert target.tokenizer.decode(output, skip_special_tokens=True) == reply["choices"][0]["message"]["content"]
    steps = json.loads(row["steps"])
    assert sum(d for d, _ in steps) == reply["usage"]["drafted"]
    assert sum(a for _, a in steps) == reply["usage"]["accepted"]
    assert json.loads(row["sampling"]) == {"temperature": 0.0, "top_p": 1.0, "top_k": 0, "seed": 11,
                                           "max_tokens": 20, "stop": []}
    assert (row["drafter"], row["bundle_version"], row["endpoint"]) == ("recycling", None, "chat")
    assert row["prompt_text"] is None  # text is stored only when configured


def test_prompt_text_is_stored_only_when_configured(start_server, target):
    live = start_server(model=served(target), log_prompt_text=True)
    httpx.post(live.url + "/v1/completions", json={"prompt": "w5 w6", "max_tokens": 3}, timeout=30)
    with sqlite3.connect(live.config.feedback_db) as db:
        assert db.execute("SELECT prompt_text FROM requests").fetchone()[0] == "w5 w6"


def test_logging_can_be_switched_off(start_server, target, tmp_path):
    live = start_server(model=served(target), feedback=False, feedback_db=str(tmp_path / "off.db"))
    assert httpx.post(live.url + "/v1/completions", json={"prompt": "w5", "max_tokens": 3}, timeout=30).is_success
    assert not (tmp_path / "off.db").exists()


def test_retention_cap_drops_the_oldest_rows_and_counts_them(tmp_path):
    log = FeedbackLog(tmp_path / "f.db", max_rows=3, log_prompt_text=False)
    dropped = [log.append(record(i, text="secret")) for i in range(5)]
    log.close()
    reopened = FeedbackLog(tmp_path / "f.db", max_rows=3)
    with sqlite3.connect(tmp_path / "f.db") as db:
        kept = [r for (r,) in db.execute("SELECT request_id FROM requests ORDER BY id")]
        texts = {t for (t,) in db.execute("SELECT prompt_text FROM requests")}
    assert dropped == [0, 0, 0, 1, 1]
    assert kept == ["r2", "r3", "r4"]
    assert reopened.dropped() == 2 and reopened.count() == 3  # the count survives a restart
    assert texts == {None}
    reopened.close()


def test_export_writes_rows_since_a_time_to_parquet(tmp_path):
    log = FeedbackLog(tmp_path / "f.db", max_rows=100)
    for i in range(4):
        log.append(record(i, T0 + timedelta(hours=i)))
    log.close()
    assert export(tmp_path / "f.db", T0 + timedelta(hours=2), tmp_path / "out.parquet") == 2
    table = pq.read_table(tmp_path / "out.parquet").to_pylist()
    assert [row["request_id"] for row in table] == ["r2", "r3"]
    assert table[0]["prompt_ids"] == [1, 2, 2] and table[0]["output_ids"] == [2, 7]
    assert table[0]["step_drafted"] == [4, 3] and table[0]["step_accepted"] == [1, 0]
    assert table[0]["created_at"] == T0 + timedelta(hours=2)
    assert json.loads(table[0]["sampling"]) == {"temperature": 0.0, "seed": 2}
    assert export(tmp_path / "f.db", None, tmp_path / "all.parquet") == 4
    with pytest.raises(FileNotFoundError):
        export(tmp_path / "missing.db", None, tmp_path / "x.parquet")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specops")
    register(parser.add_subparsers(dest="command", required=True))
    return parser


def test_feedback_export_command(tmp_path, capsys):
    log = FeedbackLog(tmp_path / "f.db", max_rows=100)
    log.append(record(0, T0))
    log.append(record(1, T0 + timedelta(days=1)))
    log.close()
    args = _parser().parse_args(["feedback", "export", "--db", str(tmp_path / "f.db"), "--since",
                                 "2025-01-01T12:00:00", "--out", str(tmp_path / "x.parquet")])
    args.func(args)
    assert pq.read_table(tmp_path / "x.parquet").num_rows == 1
    assert "wrote 1 rows" in capsys.readouterr().out
    with pytest.raises(ValueError, match="ISO 8601"):
        parse_since("yesterday")


def test_serve_flags_fill_the_config_and_leave_defaults_to_it():
    args = _parser().parse_args(["serve", "--drafter", "none", "--queue-size", "3", "--no-feedback", "--port", "0"])
    config = _config(args)
    assert (config.drafter, config.queue_size, config.feedback, config.port) == ("none", 3, False, 0)
    assert config.timeout_s == 120.0 and config.host == "127.0.0.1"
    with pytest.raises(ValueError, match="--drafter applies without a bundle"):
        _config(_parser().parse_args(["serve", "--bundle", "b", "--drafter", "none"]))
    with pytest.raises(ValueError, match="models:/NAME@ALIAS"):
        _config(_parser().parse_args(["serve", "--model-uri", "models:/x/3"]))
    with pytest.raises(SystemExit):  # argparse refuses both sources at once
        _parser().parse_args(["serve", "--bundle", "b", "--model-uri", "models:/x@champion"])


def test_suffix_decoding_learns_the_logged_traffic_at_start(start_server, target, tmp_path):
    """A restarted server with the suffix drafter drafts from what the feedback log holds: a request whose
    answer was served before is drafted from it at once."""
    db = tmp_path / "feedback.db"
    first = start_server(model=served(target, "suffix"), feedback_db=str(db))
    body = {"messages": [{"role": "user", "content": PROMPTS[0]}], "max_tokens": 40, "temperature": 0}
    answer = httpx.post(first.url + "/v1/chat/completions", json=body, timeout=30).json()
    first.stop()

    restarted = start_server(model=served(target, "suffix"), feedback_db=str(db))
    again = httpx.post(restarted.url + "/v1/chat/completions", json=body, timeout=30).json()
    assert again["choices"][0]["message"]["content"] == answer["choices"][0]["message"]["content"]
    # Drafted from the remembered answer: far more accepted than the first time, when only the prompt was known.
    assert again["usage"]["accepted"] > answer["usage"]["accepted"] + 8
