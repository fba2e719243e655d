"""Feedback from any OpenAI-compatible server, end to end on tiny models: `specops proxy` in front of our server
(standing in for vLLM) logs the traffic, and `specops retrain` distills the champion on the proxy's log alone and
registers the challenger."""

from __future__ import annotations

import json
from pathlib import Path

import mlflow
import pyarrow.parquet as pq
import pytest
from mlflow import MlflowClient

from specops.cli import main
from specops.pipeline.osd_steps import WINDOW_PARQUET, osd_config
from specops.pipeline.params import read_params
from specops.server.config import ServerConfig
from tests.pipeline.osd.conftest import MODEL, prompt_text
from tests.server.conftest import start_live
from tests.server.test_openai_api import client
from tests.server.test_proxy import start_proxy

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def test_proxy_logged_traffic_retrains_the_champion(project, osd_assets):
    uri = mlflow.get_tracking_uri()
    upstream = start_live(ServerConfig(model_uri=f"models:/{MODEL}@champion", tracking_uri=uri, poll_s=0,
                                       feedback_db=str(project / "upstream" / "log.db"), api_key=None),
                          target=osd_assets["target"])
    # The tokenizer comes from the target's folder, as `specops proxy --target` loads it.
    proxy = start_proxy(upstream.url, project / "proxied", target=str(osd_assets["root"] / "target"),
                        upstream_api_key=None)
    try:
        api = client(proxy.url)
        for i in range(12):
            body = {"model": "specops", "messages": [{"role": "user", "content": prompt_text(200 + i)}],
                    "max_tokens": 10, "temperature": 0}
            if i % 2:
                assert api.chat.completions.create(**body).choices[0].message.content is not None
            else:
                assert "".join(c.choices[0].delta.content or "" for c in api.chat.completions.create(stream=True, **body))
    finally:
        proxy.stop()
        upstream.stop()

    db = Path(proxy.config.feedback_db)
    assert main(["retrain", "--params", "params.yaml", "--feedback-db", str(db), "--tracking-uri", uri]) == 0
    summary = json.loads(Path("metrics/osd_retrain.json").read_text())
    assert summary["status"] == "retrained" and summary["window"]["rows"] == 12
    window = pq.read_table(Path(osd_config(read_params("params.yaml")).window_dir) / WINDOW_PARQUET).to_pylist()
    assert {row["drafter"] for row in window} == {"upstream"} and all(row["output_ids"] for row in window)
    version = summary["challenger_version"]
    assert version == "2"
    tags = MlflowClient().get_model_version(MODEL, version).tags
    assert (tags["osd.parent_version"], tags["osd.rows"], tags["osd.window_last_id"]) == ("1", "12", "12")
