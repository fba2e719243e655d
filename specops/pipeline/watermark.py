"""The OSD watermark: the id of the last feedback row that a finished retrain consumed.

A small JSON file replaced atomically (a temporary file in the same folder, fsynced, renamed over the
old one, then the folder fsynced), so a crash at any moment leaves either the old watermark or the
new one on disk, never a torn mix. `specops retrain` writes it only once the gate has decided on the
challenger trained from the window: a retrain that fails before that leaves it where it was, and
the next run exports the same rows again together with the newer ones. Nothing is skipped, and a
window is consumed at most once. Row ids, not timestamps, make the window exact (see
specops.server.feedback.export_after).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from pathlib import Path

from specops.core.durable import write_text_durably


class WatermarkError(RuntimeError):
    """The watermark file cannot be trusted for this feedback database; the message says why and what to do."""


@dataclass(frozen=True)
class Watermark:
    log_id: int
    """The feedback log these ids count in (specops.server.feedback.LogState.log_id, drawn when it was created)."""
    last_id: int = 0
    """Feedback rows with a larger id have not been trained on yet (0: none has)."""
    feedback_db: str | None = None
    """Where that log was when the watermark was written, for people; log_id is the identity."""
    model_version: str | None = None
    """The registry version trained from the rows up to last_id."""
    updated_at: str | None = None
    """When it was written (UTC, ISO 8601)."""


def read_watermark(path: Path | str, log_id: int, feedback_db: Path | str) -> Watermark:
    """The watermark of feedback log `log_id`; a fresh one (0) when the file does not exist yet."""
    path = Path(path)
    if not path.is_file():
        return Watermark(log_id=log_id, feedback_db=str(feedback_db))
    try:
        data = json.loads(path.read_text())
        watermark = Watermark(**{f.name: data[f.name] for f in fields(Watermark) if f.name in data})
    except (json.JSONDecodeError, TypeError) as error:
        raise WatermarkError(f"Watermark file {path} is unreadable ({error}). It is only ever replaced "
                             "atomically, so it was edited by hand: restore it, or delete it to retrain on "
                             "every row still in the feedback log.") from error
    if watermark.log_id != log_id:
        raise WatermarkError(f"Watermark file {path} counts rows of another feedback log (written for "
                             f"{watermark.feedback_db}), not of {feedback_db}: that database was recreated, or "
                             "several share one watermark file. Give each its own osd.watermark_file, or delete "
                             "this one to retrain on every row of the new log.")
    return watermark


def write_watermark(path: Path | str, watermark: Watermark) -> None:
    """Replace the file atomically and durably (see the module docstring)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text_durably(path, json.dumps(asdict(watermark), indent=2) + "\n")
