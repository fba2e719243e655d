"""The feedback log for online speculative decoding (OSD): what was served, and where the drafter failed.

One SQLite row per finished request, in WAL mode with synchronous=FULL: a row is on disk when
`append` returns, and the server calls it before the response ends, so every response a client
received completely has its row even if the process is killed right after. When a row cannot be written
(a full disk), its request fails with 503 and requests are refused until a `probe` write succeeds
(FeedbackGate, used by the server's worker and by the proxy), so the promise holds rather than answers going
unlogged. Token ids are always stored; prompt text only when configured. A retention cap drops the oldest rows
and counts them. `export` writes rows to Parquet for the retraining pipeline.
"""

from __future__ import annotations

import json
import logging
import sqlite3
import threading
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, ClassVar

import pyarrow as pa
import pyarrow.parquet as pq

log = logging.getLogger(__name__)

FEEDBACK_RETRY_S = 1.0  # while the log cannot be written, how often a probe write is tried

SCHEMA = """
CREATE TABLE IF NOT EXISTS requests (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    request_id TEXT NOT NULL UNIQUE,
    created_at REAL NOT NULL,          -- unix seconds, UTC
    bundle_version TEXT,               -- bundle hash; NULL when serving without a bundle
    model_version TEXT,                -- MLflow registry version; NULL without a registry
    drafter TEXT NOT NULL,
    endpoint TEXT NOT NULL,
    prompt_ids TEXT NOT NULL,          -- JSON list of token ids
    output_ids TEXT NOT NULL,          -- JSON list of token ids
    sampling TEXT NOT NULL,            -- JSON: temperature, top_p, top_k, seed, max_tokens
    steps TEXT NOT NULL,               -- JSON list of [drafted, accepted] per target step
    finish_reason TEXT NOT NULL,
    prompt_text TEXT                   -- only with log_prompt_text
);
CREATE INDEX IF NOT EXISTS requests_created_at ON requests (created_at);
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value INTEGER NOT NULL);
INSERT OR IGNORE INTO meta (key, value) VALUES ('dropped_rows', 0);
-- Drawn once when the log is created: a consumer's watermark (OSD) names the log it counts ids in, so
-- a database recreated at the same path is never read as the old one.
INSERT OR IGNORE INTO meta (key, value) VALUES ('log_id', random());
"""

EXPORT_SCHEMA = pa.schema([
    ("id", pa.int64()),  # AUTOINCREMENT: grows with every row, never reused; OSD's watermark is an id
    ("request_id", pa.string()),
    ("created_at", pa.timestamp("us", tz="UTC")),
    ("bundle_version", pa.string()),
    ("model_version", pa.string()),
    ("drafter", pa.string()),
    ("endpoint", pa.string()),
    ("prompt_ids", pa.list_(pa.int32())),
    ("output_ids", pa.list_(pa.int32())),
    ("sampling", pa.string()),
    ("step_drafted", pa.list_(pa.int32())),
    ("step_accepted", pa.list_(pa.int32())),
    ("finish_reason", pa.string()),
    ("prompt_text", pa.string()),
])


@dataclass(frozen=True)
class FeedbackRecord:
    request_id: str
    created_at: float  # unix seconds
    bundle_version: str | None
    model_version: str | None
    drafter: str
    endpoint: str
    prompt_ids: list[int]
    output_ids: list[int]
    sampling: dict[str, Any]
    per_step: list[tuple[int, int]]  # GenerationStats.per_step: (drafted, accepted)
    finish_reason: str
    prompt_text: str | None = None


def connect(path: Path | str) -> sqlite3.Connection:
    """A connection in autocommit mode (transactions are explicit) with WAL and full fsync."""
    conn = sqlite3.connect(path, isolation_level=None, check_same_thread=False, timeout=30)
    conn.execute("PRAGMA journal_mode=WAL")  # readers (export) never block the server's writes
    conn.execute("PRAGMA synchronous=FULL")  # fsync the WAL on commit: a row survives power loss too
    return conn


class FeedbackLog:
    def __init__(self, path: Path | str, max_rows: int, log_prompt_text: bool = False) -> None:
        if max_rows < 1:
            raise ValueError(f"max_rows must be >= 1, got {max_rows}")
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.max_rows = max_rows
        self.log_prompt_text = log_prompt_text
        self._lock = threading.Lock()  # one writer at a time: the worker, and close() from shutdown
        self._conn = connect(self.path)
        self._conn.executescript(SCHEMA)

    def append(self, record: FeedbackRecord) -> int:
        """Commit one row, then apply the retention cap; returns how many old rows were dropped."""
        row = (record.request_id, record.created_at, record.bundle_version, record.model_version, record.drafter,
               record.endpoint, json.dumps(record.prompt_ids), json.dumps(record.output_ids),
               json.dumps(record.sampling, sort_keys=True), json.dumps([list(step) for step in record.per_step]),
               record.finish_reason, record.prompt_text if self.log_prompt_text else None)
        with self._lock:
            self._conn.execute("BEGIN IMMEDIATE")
            try:
                self._conn.execute(
                    "INSERT INTO requests (request_id, created_at, bundle_version, model_version, drafter, endpoint, "
                    "prompt_ids, output_ids, sampling, steps, finish_reason, prompt_text) "
                    "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)", row)
                # Everything older than the newest max_rows rows goes; ids only grow, so this is the oldest.
                dropped = self._conn.execute(
                    "DELETE FROM requests WHERE id <= "
                    "(SELECT id FROM requests ORDER BY id DESC LIMIT 1 OFFSET ?)", (self.max_rows,)).rowcount
                if dropped:
                    self._conn.execute("UPDATE meta SET value = value + ? WHERE key = 'dropped_rows'", (dropped,))
                self._conn.execute("COMMIT")
            except BaseException:
                if self._conn.in_transaction:  # a failed COMMIT may already have ended it
                    self._conn.execute("ROLLBACK")
                raise
        return dropped

    def probe(self) -> None:
        """One small committed write: after a failed append (disk full, ...), whether writes work again."""
        with self._lock:
            self._conn.execute("INSERT OR REPLACE INTO meta (key, value) VALUES ('last_probe', ?)", (int(time.time()),))

    def count(self) -> int:
        with self._lock:
            return self._conn.execute("SELECT COUNT(*) FROM requests").fetchone()[0]

    def dropped(self) -> int:
        with self._lock:
            return self._conn.execute("SELECT value FROM meta WHERE key = 'dropped_rows'").fetchone()[0]

    def recent_outputs(self, limit: int) -> list[list[int]]:
        """The output token ids of the newest `limit` rows, oldest first (what a restarted Suffix Decoding
        drafter learns from)."""
        with self._lock:
            rows = self._conn.execute("SELECT output_ids FROM requests ORDER BY id DESC LIMIT ?", (limit,)).fetchall()
        return [json.loads(row[0]) for row in reversed(rows)]

    def close(self) -> None:
        with self._lock:
            self._conn.close()


@dataclass(frozen=True)
class Refusal:
    """The 503 that completion requests get while the log cannot be written."""

    failure: str  # the failed write's error
    status: ClassVar[int] = 503
    type: ClassVar[str] = "server_error"
    code: ClassVar[str] = "feedback_unavailable"

    @property
    def message(self) -> str:
        return f"The feedback log cannot be written ({self.failure}), and every answer must be logged: retry later."


class FeedbackGate:
    """The log's promise kept: once a row cannot be written, completion requests are refused until a probe
    write, tried at most every FEEDBACK_RETRY_S, succeeds. The server's worker threads and the proxy share this
    rule; it is thread-safe, and its writes block (fsync), so an event loop calls them in a thread."""

    def __init__(self, log: FeedbackLog) -> None:
        self.log = log
        self._failure: str | None = None  # the last failed write's error; None while the log writes
        self._retry_at = 0.0  # time.monotonic() of the next probe
        self._lock = threading.Lock()  # one caller probes at a time; the others see its outcome

    def refusal(self) -> Refusal | None:
        """The 503 to answer now; None while the log can be written."""
        failure = self._failure  # read once: another thread may clear it meanwhile
        return None if failure is None else Refusal(failure)

    def retry_due(self) -> bool:
        return self._failure is not None and time.monotonic() >= self._retry_at

    def retry(self) -> None:
        """While refusing, try a probe write if FEEDBACK_RETRY_S has passed since the last try."""
        if not self.retry_due():
            return
        with self._lock:
            if not self.retry_due():
                return
            try:
                self.log.probe()
            except sqlite3.Error as error:
                self._failed(error)
                return
            self._failure = None
        log.info("The feedback log can be written again; serving resumes.")

    def append(self, records: list[FeedbackRecord]) -> int:
        """Commit the rows, each fsynced; returns how many old rows the retention cap dropped. A failed write
        raises its sqlite3.Error, and requests are refused from then on until a probe write succeeds."""
        try:
            return sum(self.log.append(record) for record in records)
        except sqlite3.Error as error:
            with self._lock:
                self._failed(error)
            raise

    def _failed(self, error: sqlite3.Error) -> None:
        self._retry_at = time.monotonic() + FEEDBACK_RETRY_S
        self._failure = str(error)


def parse_since(text: str) -> datetime:
    """An ISO 8601 time; without a zone it is taken as UTC."""
    try:
        moment = datetime.fromisoformat(text)
    except ValueError as error:
        raise ValueError(f"--since '{text}' is not an ISO 8601 time such as 2025-01-31T12:00:00Z.") from error
    return moment if moment.tzinfo else moment.replace(tzinfo=UTC)


def _existing(db: Path | str) -> Path:
    db = Path(db)
    if not db.is_file():
        raise FileNotFoundError(f"Feedback database {db} does not exist; is the server logging to another path?")
    return db


def _write_parquet(db: Path | str, where: str, args: tuple[Any, ...], out: Path | str) -> int:
    """Write the rows matching an SQL condition (with its ORDER BY/LIMIT) to Parquet; returns the row count."""
    conn = connect(_existing(db))
    try:
        rows = conn.execute(
            "SELECT id, request_id, created_at, bundle_version, model_version, drafter, endpoint, prompt_ids, "
            f"output_ids, sampling, steps, finish_reason, prompt_text FROM requests WHERE {where}", args).fetchall()
    finally:
        conn.close()
    columns: dict[str, list[Any]] = {name: [] for name in EXPORT_SCHEMA.names}
    for (row_id, request_id, created_at, bundle_version, model_version, drafter, endpoint, prompt_ids, output_ids,
         sampling, steps, finish_reason, prompt_text) in rows:
        per_step = json.loads(steps)
        values = {
            "id": row_id, "request_id": request_id, "created_at": datetime.fromtimestamp(created_at, UTC),
            "bundle_version": bundle_version, "model_version": model_version, "drafter": drafter,
            "endpoint": endpoint, "prompt_ids": json.loads(prompt_ids), "output_ids": json.loads(output_ids),
            "sampling": sampling, "step_drafted": [d for d, _ in per_step],
            "step_accepted": [a for _, a in per_step], "finish_reason": finish_reason, "prompt_text": prompt_text,
        }
        for name, value in values.items():
            columns[name].append(value)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table(columns, schema=EXPORT_SCHEMA), out)
    return len(rows)


def export(db: Path | str, since: datetime | None, out: Path | str) -> int:
    """Write rows created at or after `since` (all rows for None) to a Parquet file; returns the row count."""
    start = 0.0 if since is None else (since if since.tzinfo else since.replace(tzinfo=UTC)).timestamp()
    return _write_parquet(db, "created_at >= ? ORDER BY id", (start,), out)


def export_after(db: Path | str, after_id: int, limit: int, out: Path | str) -> int:
    """Write the oldest `limit` rows whose id is above `after_id` to Parquet; returns the row count.

    Ids, unlike timestamps, never tie and never go back with the clock, so a consumer that remembers
    the last id it used reads every row exactly once (OSD retraining, specops/pipeline/retrain.py).
    """
    return _write_parquet(db, "id > ? ORDER BY id LIMIT ?", (after_id, limit), out)


@dataclass(frozen=True)
class LogState:
    """Where a consumer that has read every row up to `after_id` stands."""

    log_id: int  # drawn when the database was created (see SCHEMA)
    pending: int  # rows whose id is above after_id
    last_assigned: int  # the largest id ever assigned; survives the retention cap's deletions


def log_state(db: Path | str, after_id: int) -> LogState:
    conn = connect(_existing(db))
    try:
        log_id = conn.execute("SELECT value FROM meta WHERE key = 'log_id'").fetchone()
        pending = conn.execute("SELECT COUNT(*) FROM requests WHERE id > ?", (after_id,)).fetchone()[0]
        last = conn.execute("SELECT seq FROM sqlite_sequence WHERE name = 'requests'").fetchone()
    finally:
        conn.close()
    if log_id is None:
        raise RuntimeError(f"Feedback database {db} has no log id: an older specops created it. Start the server on "
                           "it once (it adds the id), then retry.")
    return LogState(log_id=log_id[0], pending=pending, last_assigned=last[0] if last else 0)
