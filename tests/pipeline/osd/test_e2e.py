"""End to end on tiny models: a real server on 127.0.0.1 serves the registry's champion and logs its
requests; `specops retrain` distills the champion on them, registers and promotes the challenger; the
server hot-reloads it and still answers exactly what the target alone would."""

from __future__ import annotations

import json
import time
from pathlib import Path

import httpx
import mlflow
import pytest
import torch
from mlflow import MlflowClient

from specops.cli import main
from specops.server.config import ServerConfig
from tests.pipeline.osd.conftest import MODEL, prompt_text
from tests.server.conftest import start_live

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def chat(url: str, text: str, max_tokens: int = 10) -> dict:
    body = {"messages": [{"role": "user", "content": text}], "max_tokens": max_tokens, "temperature": 0}
    response = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()


def served_version(url: str) -> str:
    return httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["model_version"]


def test_serve_retrain_promote_hot_reload(project, osd_assets, capsys):
    target = osd_assets["target"]
    db, uri = project / "served" / "log.db", mlflow.get_tracking_uri()
    config = ServerConfig(model_uri=f"models:/{MODEL}@champion", tracking_uri=uri, poll_s=0.2, feedback_db=str(db),
                          api_key=None)
    # As a scheduler runs it: the feedback path and tracking URI come from its environment, not params.yaml.
    command = ["retrain", "--params", "params.yaml", "--feedback-db", str(db), "--tracking-uri", uri]
    live = start_live(config, target=target)
    try:
        assert served_version(live.url) == "1"
        for i in range(12):
            chat(live.url, prompt_text(200 + i))

        capsys.readouterr()
        assert main([*command, "--dry-run"]) == 0
        plan = json.loads(capsys.readouterr().out)
        assert plan["would_retrain"] and plan["window_rows"] == 12 and plan["champion"]["version"] == "1"
        assert main(command) == 0
        summary = json.loads(Path("metrics/osd_retrain.json").read_text())
        assert summary["status"] == "retrained" and summary["window"]["rows"] == 12
        assert summary["promoted"], summary["reason"]
        traffic = summary["evaluation"]["traffic"]
        assert traffic["challenger"]["acceptance_rate"] > traffic["champion"]["acceptance_rate"]
        version = summary["challenger_version"]
        assert version == summary["champion_version"] == "2"
        tags = MlflowClient().get_model_version(MODEL, version).tags
        assert (tags["osd.parent_version"], tags["osd.rows"], tags["osd.window_last_id"]) == ("1", "12", "12")
        assert json.loads(Path("feedback/osd_watermark.json").read_text())["last_id"] == 12

        deadline = time.monotonic() + 30
        while served_version(live.url) != version:
            assert time.monotonic() < deadline, "the server did not hot-reload the new champion"
            time.sleep(0.2)

        # Lossless after the reload: greedy output equals the target's own greedy decoding.
        for i in range(3):
            text = prompt_text(300 + i)
            reply = chat(live.url, text, max_tokens=12)
            assert reply["system_fingerprint"].startswith("bundle-") and reply["usage"]["drafted"] > 0
            ids = target.tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                                       add_generation_prompt=True, return_tensors="pt")
            ids = ids["input_ids"] if hasattr(ids, "keys") else ids
            with torch.inference_mode():
                out = target.model.generate(ids, max_new_tokens=12, do_sample=False)[0, ids.shape[1]:]
            expected = target.tokenizer.decode(out, skip_special_tokens=True)
            assert reply["choices"][0]["message"]["content"] == expected
    finally:
        live.stop()
