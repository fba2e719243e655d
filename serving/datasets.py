"""Readers for the prompt sources: ShareGPT, HumanEval and user JSONL files.

Every reader yields (row, error): exactly one of them is None, so callers count malformed rows
instead of crashing on them or dropping them silently.
"""

from __future__ import annotations

import gzip
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from serving.assets import humaneval_jsonl_gz, sharegpt_json

Messages = list[dict[str, str]]
ROLES = {"system", "user", "assistant"}


def humaneval_message(code: str) -> str:
    return f"Complete the following Python function. Reply with the code only.\n\n```python\n{code}```"


def read_humaneval(path: Path | None = None) -> Iterator[tuple[dict[str, Any] | None, str | None]]:
    with gzip.open(path or humaneval_jsonl_gz(), "rt") as handle:
        for line in handle:
            task = json.loads(line)
            yield {"messages": [{"role": "user", "content": humaneval_message(task["prompt"])}],
                   "task_id": task["task_id"], "test": task["test"], "entry_point": task["entry_point"],
                   "code_prompt": task["prompt"]}, None


def read_sharegpt(path: Path | None = None, from_end: bool = False) -> Iterator[tuple[dict[str, Any] | None, str | None]]:
    """The first human turn of each conversation, in file order (or reversed, for held-out prompts)."""
    conversations = json.loads(Path(path or sharegpt_json()).read_text())
    for conversation in reversed(conversations) if from_end else conversations:
        turns = conversation.get("conversations") if isinstance(conversation, dict) else None
        if not isinstance(turns, list) or not turns:
            yield None, "no conversations"
            continue
        first = turns[0]
        text = first.get("value") if isinstance(first, dict) else None
        if not isinstance(first, dict) or first.get("from") != "human":
            yield None, "first turn not human"
        elif not isinstance(text, str) or not text.strip():
            yield None, "empty text"
        else:
            yield {"messages": [{"role": "user", "content": text}], "sharegpt_id": conversation.get("id")}, None


def parse_user_row(data: Any) -> tuple[dict[str, Any] | None, str | None]:
    """A user JSONL object: {"prompt": str} or {"messages": [{"role", "content"}, ...]}, optional "answer"."""
    if not isinstance(data, dict):
        return None, "not an object"
    if "prompt" in data:
        if not isinstance(data["prompt"], str) or not data["prompt"].strip():
            return None, "empty or non-string prompt"
        messages: Messages = [{"role": "user", "content": data["prompt"]}]
    elif "messages" in data:
        messages = data["messages"]
        valid = isinstance(messages, list) and messages and all(
            isinstance(m, dict) and m.get("role") in ROLES and isinstance(m.get("content"), str) for m in messages)
        if not valid:
            return None, "malformed messages"
        if not any(m["content"].strip() for m in messages):
            return None, "empty messages"
    else:
        return None, "neither prompt nor messages"
    row: dict[str, Any] = {"messages": messages}
    if "answer" in data:
        row["answer"] = data["answer"]
    return row, None


def read_user_jsonl(path: Path) -> Iterator[tuple[dict[str, Any] | None, str | None]]:
    with open(path) as handle:
        for line in handle:
            if not line.strip():
                continue
            try:
                data = json.loads(line)
            except json.JSONDecodeError:
                yield None, "invalid JSON"
                continue
            yield parse_user_row(data)


def bench_prompts(dataset: str, n: int) -> list[Messages]:
    """n prompts for a benchmark. ShareGPT prompts come from the end of the file, which the pipeline's
    prepare stage (taking conversations from the start) never trains on."""
    if dataset == "humaneval":
        rows = read_humaneval()
    elif dataset == "sharegpt":
        rows = read_sharegpt(from_end=True)
    else:
        path = Path(dataset)
        if not path.is_file():
            raise FileNotFoundError(f"Dataset '{dataset}' is neither 'humaneval', 'sharegpt' nor an existing JSONL file.")
        rows = read_user_jsonl(path)
    prompts = []
    for row, _error in rows:
        if row is not None:
            prompts.append(row["messages"])
            if len(prompts) == n:
                break
    if not prompts:
        raise ValueError(f"No valid prompts in dataset '{dataset}'.")
    return prompts
