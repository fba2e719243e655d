"""Readers for the prompt sources: ShareGPT, HumanEval and user JSONL files.

The formats are defined once, here, so benchmarks, serving tools and the pipeline's prepare stage
read the same prompts the same way. A reader yields candidates: a usable row (messages plus
source extras) or the reason string why a row is unusable, so callers count malformed rows
instead of crashing on them or dropping them silently.
"""

from __future__ import annotations

import gzip
import json
import logging
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from specops.core.assets import humaneval_jsonl_gz, sharegpt_json

log = logging.getLogger(__name__)

Messages = list[dict[str, str]]
Candidate = dict[str, Any] | str
ROLES = {"system", "user", "assistant"}


def humaneval_message(code: str) -> str:
    return f"Complete the following Python function. Reply with the code only.\n\n```python\n{code}```"


def humaneval_reply(code: str, solution: str) -> str:
    """The canonical solution as an answer to `humaneval_message`: the completed function, code only."""
    return f"```python\n{code}{solution}```"


def read_humaneval(path: Path | None = None) -> Iterator[Candidate]:
    with gzip.open(path or humaneval_jsonl_gz(), "rt") as handle:
        for line in handle:
            task = json.loads(line)
            yield {"messages": [{"role": "user", "content": humaneval_message(task["prompt"])}],
                   "task_id": task["task_id"], "test": task["test"], "entry_point": task["entry_point"],
                   "code_prompt": task["prompt"], "reply": humaneval_reply(task["prompt"], task["canonical_solution"])}


def iter_json_array(path: Path, chunk_chars: int = 1 << 20) -> Iterator[Any]:
    """The elements of a top-level JSON array, one at a time, reading the file in chunks.

    Raises json.JSONDecodeError at the first element that cannot be parsed, after yielding all
    elements before it: the ShareGPT file shipped on PyPI is cut off mid-conversation, so loading it
    whole fails while streaming still yields every complete conversation.
    """
    decoder = json.JSONDecoder()
    with open(path, encoding="utf-8") as handle:
        buffer = handle.read(chunk_chars).lstrip()
        if not buffer.startswith("["):
            raise json.JSONDecodeError("expected a JSON array", buffer, 0)
        pos = 1
        while True:
            while pos < len(buffer) and buffer[pos] in " \t\r\n,":
                pos += 1
            if pos < len(buffer) and buffer[pos] == "]":
                return
            try:
                value, end = decoder.raw_decode(buffer, pos)
                if end == len(buffer):  # a value touching the end may go on (a number); a valid array has more
                    raise json.JSONDecodeError("value may continue", buffer, end)
            except json.JSONDecodeError:
                # Usually the element just continues in the next chunk; only at the end of the file is it an error.
                more = handle.read(chunk_chars)
                if not more:
                    raise
                buffer, pos = buffer[pos:] + more, 0
                continue
            yield value
            pos = end


def sharegpt_candidate(conversation: Any) -> Candidate:
    """The first human turn of a ShareGPT conversation as a single user message, and the assistant's
    answer to it as `reply` when the next turn is one (collect can teacher-force it instead of regenerating)."""
    turns = conversation.get("conversations") if isinstance(conversation, dict) else None
    if not isinstance(turns, list):
        return "no conversations"
    first = next((i for i, t in enumerate(turns) if isinstance(t, dict) and t.get("from") in ("human", "user")), None)
    if first is None:
        return "no human turn"
    human, answer = turns[first], (turns[first + 1:first + 2] or [None])[0]
    text = human.get("value")
    if not isinstance(text, str):
        return "non-string text"
    if not text.strip():
        return "empty text"
    row: dict[str, Any] = {"messages": [{"role": "user", "content": text}]}
    if isinstance(answer, dict) and answer.get("from") in ("gpt", "assistant") \
            and isinstance(answer.get("value"), str) and answer["value"].strip():
        row["reply"] = answer["value"]
    if isinstance(conversation.get("id"), str):
        row["sharegpt_id"] = conversation["id"]
    return row


def read_sharegpt(path: Path | None = None) -> Iterator[Candidate]:
    path = path or sharegpt_json()
    try:
        for conversation in iter_json_array(path):
            yield sharegpt_candidate(conversation)
    except json.JSONDecodeError as error:
        log.warning("%s: unreadable from char %d on (%s); using the conversations before it.", path, error.pos, error.msg)
        yield "invalid JSON (rest of file unreadable)"


def user_candidate(data: Any) -> Candidate:
    """A user JSONL object: {"prompt": str} or {"messages": [{"role", "content"}, ...]}, optional "answer"
    (a reference for the exact_match scorer) and "reply" (an answer collect can teacher-force)."""
    if not isinstance(data, dict):
        return "not an object"
    if "prompt" in data:
        if not isinstance(data["prompt"], str) or not data["prompt"].strip():
            return "empty or non-string prompt"
        messages: Messages = [{"role": "user", "content": data["prompt"]}]
    elif "messages" in data:
        messages = data["messages"]
        valid = isinstance(messages, list) and messages and all(
            isinstance(m, dict) and m.get("role") in ROLES and isinstance(m.get("content"), str) for m in messages)
        if not valid:
            return "malformed messages"
        if not any(m["content"].strip() for m in messages):
            return "empty messages"
        if messages[-1]["role"] != "user":
            return "last message not from the user"
    else:
        return "neither prompt nor messages"
    row: dict[str, Any] = {"messages": messages}
    for key in ("answer", "reply"):
        if key in data:
            if not isinstance(data[key], str):
                return f"{key} not a string"
            row[key] = data[key]
    return row


def read_user_jsonl(path: Path) -> Iterator[Candidate]:
    """Rows of a user JSONL file. Blank lines are not rows; undecodable lines are counted, not fatal."""
    with open(path, "rb") as handle:
        for raw in handle:
            if not raw.strip():
                continue
            try:
                data = json.loads(raw.decode("utf-8"))
            except UnicodeDecodeError:
                yield "invalid UTF-8"
                continue
            except json.JSONDecodeError:
                yield "invalid JSON"
                continue
            yield user_candidate(data)


# Rows a long-context prompt's history is drawn from: enough HumanEval tasks (all 164) or ShareGPT
# conversations to fill 7k tokens several times over without repeating one.
LONG_CONTEXT_POOL = 400


def long_context_prompts(dataset: str, length: int, n: int, count_tokens: Callable[[Messages], int]) -> list[Messages]:
    """n conversations of at most `length` tokens (as `count_tokens` counts a chat prompt) that end in a
    question to answer: earlier questions with their answers (HumanEval tasks and their canonical
    solutions, or ShareGPT first turns and their replies), then a last question whose answer is not in
    them. Prompt i asks row i and fills its history from the rows after it, in order, skipping those that
    would overflow, so every length of a run shares its last questions. length 0: the question alone."""
    if dataset not in ("humaneval", "sharegpt"):
        raise ValueError(f"Long-context prompts are built from 'humaneval' or 'sharegpt', not '{dataset}'.")
    source = read_humaneval() if dataset == "humaneval" else reversed(list(read_sharegpt()))
    rows = [row for row in source if isinstance(row, dict) and "reply" in row][:LONG_CONTEXT_POOL]
    if len(rows) <= n:
        raise ValueError(f"{dataset} has {len(rows)} rows with an answer; {n} prompts need more.")
    prompts = []
    for i in range(n):
        question, history = rows[i]["messages"], []
        for row in (rows[j % len(rows)] for j in range(i + 1, i + len(rows)) if length):
            turn = [*row["messages"], {"role": "assistant", "content": row["reply"]}]
            if count_tokens(history + turn + question) <= length:
                history += turn
        prompts.append(history + question)
    return prompts


def bench_prompts(dataset: str, n: int) -> list[Messages]:
    """n prompts for a benchmark. ShareGPT prompts come from the end of the file, which the pipeline's
    prepare stage (taking conversations from the start) does not reach at its default sizes."""
    if dataset == "humaneval":
        rows: Iterator[Candidate] = read_humaneval()
    elif dataset == "sharegpt":
        rows = reversed(list(read_sharegpt()))
    else:
        path = Path(dataset)
        if not path.is_file():
            raise FileNotFoundError(f"Dataset '{dataset}' is neither 'humaneval', 'sharegpt' nor an existing JSONL file.")
        rows = read_user_jsonl(path)
    prompts = [row["messages"] for row in rows if isinstance(row, dict)][:n]
    if not prompts:
        raise ValueError(f"No valid prompts in dataset '{dataset}'.")
    return prompts
