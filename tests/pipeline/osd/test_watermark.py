"""The watermark: written atomically, bound to its database, advanced only once a round's gate decided,
so a crashed round neither loses nor duplicates feedback rows."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from mlflow import MlflowClient

import specops.pipeline.retrain as retrain_module
from specops.pipeline.retrain import dry_run, load_params, retrain
from specops.pipeline.watermark import Watermark, WatermarkError, read_watermark, write_watermark
from specops.server.feedback import log_state
from tests.pipeline.osd.conftest import MODEL, log_requests

DB = Path("feedback/feedback.db")
WATERMARK = Path("feedback/osd_watermark.json")


def window_ids() -> list[int]:
    return pq.read_table("data/osd/window/window.parquet", columns=["id"]).column("id").to_pylist()


def test_watermark_round_trip_refuses_another_log_and_hand_edits(tmp_path):
    path = tmp_path / "w.json"
    assert read_watermark(path, 11, "a.db") == Watermark(log_id=11, feedback_db="a.db")
    mark = Watermark(log_id=11, last_id=7, feedback_db="a.db", model_version="3", updated_at="t")
    write_watermark(path, mark)
    assert read_watermark(path, 11, "moved/a.db") == mark  # the log's id is its identity, not its path
    assert [p.name for p in tmp_path.iterdir()] == ["w.json"]  # no temporary file left behind
    with pytest.raises(WatermarkError, match="another feedback log"):
        read_watermark(path, 12, "a.db")
    path.write_text("{not json")
    with pytest.raises(WatermarkError, match="edited by hand"):
        read_watermark(path, 11, "a.db")


@pytest.mark.slow
def test_crashed_rounds_neither_lose_nor_duplicate_rows(project, osd_assets, monkeypatch):
    target = osd_assets["target"]
    log_requests(DB, 0, 6, target)

    # 1. A round that dies after exporting (here: in training) leaves the watermark alone.
    def crash(*args, **kwargs):
        raise RuntimeError("killed mid-training")

    with monkeypatch.context() as patch:
        patch.setattr("specops.train.osd_distill.osd_distill", crash)
        with pytest.raises(RuntimeError, match="killed mid-training"):
            retrain(load_params("params.yaml"))
    assert window_ids() == [1, 2, 3, 4, 5, 6]
    assert not WATERMARK.exists()

    # 2. More traffic; the next round takes the old rows and the new ones, and succeeds through the gate,
    #    but is killed right before writing the watermark.
    log_requests(DB, 6, 3, target)

    def killed_before_write(path, watermark):
        raise KeyboardInterrupt("killed before the watermark write")

    with monkeypatch.context() as patch:
        patch.setattr(retrain_module, "write_watermark", killed_before_write)
        with pytest.raises(KeyboardInterrupt):
            retrain(load_params("params.yaml"))
    assert window_ids() == list(range(1, 10))
    decision = json.loads(Path("metrics/osd_promotion.json").read_text())
    assert decision["challenger_version"] == "2"
    assert not WATERMARK.exists()

    # 3. The registry knows version 2 consumed rows 1..9: the next round resumes after them.
    plan = dry_run(load_params("params.yaml"))
    assert plan["watermark"]["last_id"] == 9 and plan["watermark"]["recovered_from_registry"]
    assert plan["pending_rows"] == 0 and not plan["would_retrain"]
    assert retrain(load_params("params.yaml"))["status"] == "nothing to do"
    assert json.loads(WATERMARK.read_text())["last_id"] == 9

    # 4. Only rows newer than the watermark form the next window: none is trained on twice.
    log_requests(DB, 9, 4, target)
    with monkeypatch.context() as patch:
        patch.setattr("specops.data.feedback_traces.write_feedback_traces", crash)
        with pytest.raises(RuntimeError):
            retrain(load_params("params.yaml"))
    assert window_ids() == [10, 11, 12, 13]
    assert json.loads(WATERMARK.read_text())["last_id"] == 9


def test_a_recreated_or_restored_database_is_never_read_with_the_old_watermark(project, osd_assets):
    log_requests(DB, 0, 2, osd_assets["target"])
    log_id = log_state(DB, 0).log_id
    # A round on an earlier log of the same path consumed rows up to 50: not this log's business.
    MlflowClient().set_model_version_tag(MODEL, "1", "osd.feedback_log_id", str(log_id + 1))
    MlflowClient().set_model_version_tag(MODEL, "1", "osd.window_last_id", "50")
    assert dry_run(load_params("params.yaml"))["watermark"]["last_id"] == 0
    write_watermark(WATERMARK, Watermark(log_id=log_id + 1, last_id=50))
    with pytest.raises(WatermarkError, match="another feedback log"):
        dry_run(load_params("params.yaml"))
    # The same log restored from a backup that predates the watermark: new ids would fall below it.
    write_watermark(WATERMARK, Watermark(log_id=log_id, last_id=50))
    with pytest.raises(WatermarkError, match="went back in time"):
        dry_run(load_params("params.yaml"))
    os.remove(WATERMARK)
    assert dry_run(load_params("params.yaml"))["pending_rows"] == 2
