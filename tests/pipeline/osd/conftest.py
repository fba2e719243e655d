"""A tiny OSD project: a tiny target saved as an HF folder, replay traces and a test split made from it,
a temporary MLflow registry whose champion bundle holds a tiny random draft LM, and a params.yaml
wired to all of them. Tests chdir into it, as `specops retrain` runs from a project root."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from specops.core.target import Target, load_target
from specops.data.collect import CollectConfig, collect_split
from specops.data.prompts import prompt_id
from specops.pipeline.registry import register_bundle
from specops.server.bundle import write_bundle
from specops.server.feedback import FeedbackLog, FeedbackRecord
from tests.conftest import tiny_llama, tiny_tokenizer
from tests.pipeline.registry.conftest import mlflow_store, mlflow_template_db  # noqa: F401  (fixtures)

MODEL = "osd-drafter"
WORDS = [f"w{i}" for i in range(6, 90)]


def prompt_text(i: int) -> str:
    return " ".join(WORDS[(i * 7 + j * 5) % len(WORDS)] for j in range(3 + i % 4))


def write_prompts(path: Path, first: int, n: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    rows = []
    for i in range(first, first + n):
        messages = [{"role": "user", "content": prompt_text(i)}]
        rows.append({"id": prompt_id(messages), "messages": messages})
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))


@pytest.fixture(scope="session")
def osd_assets(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The tiny target loaded from its folder (so its fingerprint is the file's, as `specops retrain`
    computes it), the parent draft folder, and replay traces + a test split made once per session."""
    root = tmp_path_factory.mktemp("osd-assets")
    tiny_llama(seed=0, max_positions=128).save_pretrained(root / "target")
    tiny_tokenizer().save_pretrained(root / "target")
    target = load_target(str(root / "target"))
    tiny_llama(seed=1, layers=1, hidden=32, max_positions=128).save_pretrained(root / "parent")
    tiny_tokenizer().save_pretrained(root / "parent")
    write_prompts(root / "prompts" / "train.jsonl", 0, 8)
    write_prompts(root / "prompts" / "test.jsonl", 100, 4)
    collect_split(CollectConfig(max_new_tokens=8, top_k_logits=8, hidden_layers=[], shard_size=4),
                  target, root / "prompts" / "train.jsonl", root / "traces" / "train")
    return {"root": root, "target": target}


@pytest.fixture
def project(tmp_path: Path, osd_assets: dict[str, Any], mlflow_store: Path,  # noqa: F811
            monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A project folder (the cwd) with params.yaml, the assets, and the champion registered as version 1."""
    root, target = osd_assets["root"], osd_assets["target"]
    import mlflow

    params = {
        "target": {"source": str(root / "target"), "dtype": "float32"},
        "metrics": {"dir": "metrics"},
        "mlflow": {"tracking_uri": mlflow.get_tracking_uri(), "model_name": MODEL},
        "prepare": {"out_dir": str(root / "prompts")},
        "collect": {"top_k_logits": 8, "out_dir": str(root / "traces")},
        "evaluate": {"split": "test"},
        "register": {"experiment": "osd", "artifact_root": str(mlflow_store)},
        # mean accepted length, not wall-clock speed: tiny models on a shared CPU time too noisily to gate on.
        "promote": {"gate": {"metric": "mean_accepted_length", "speedup_tolerance": 0.05}},
        "osd": {"min_rows": 4, "heldout_fraction": 0.25, "lr": 0.01, "epochs": 3, "batch_size": 4, "max_seq_len": 64,
                "accelerator": "cpu", "eval_prompts": 3, "eval_max_new_tokens": 8},
    }
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    bundle = write_bundle(tmp_path / "champion", drafter_dir=root / "parent", drafter_kind="draft-lm",
                          serving={"verifier": "auto", "draft_tokens": 3}, target_source=str(root / "target"),
                          target_dtype="float32", fingerprint=target.fingerprint,
                          metrics={"method": "draft-lm@3", "note": "tiny random draft"})
    _, version = register_bundle(bundle, model_name=MODEL, experiment="osd", artifact_root=str(mlflow_store),
                                 params={})
    from mlflow import MlflowClient

    MlflowClient().set_registered_model_alias(MODEL, "champion", version)
    monkeypatch.chdir(tmp_path)
    yield tmp_path


def served_rows(target: Target, first: int, n: int, max_new_tokens: int = 8) -> list[dict[str, Any]]:
    """Requests as a server records them: a chat prompt and the target's own greedy output."""
    import torch

    from specops.core.target import encode_prompt

    rows = []
    for i in range(first, first + n):
        ids = encode_prompt(target.tokenizer, prompt_text(i))
        with torch.inference_mode():
            out = target.model.generate(torch.tensor([ids]), max_new_tokens=max_new_tokens, do_sample=False)
        rows.append({"request_id": f"req-{i}", "prompt_ids": ids, "output_ids": out[0, len(ids):].tolist()})
    return rows


def log_requests(db: Path, first: int, n: int, target: Target) -> None:
    """n feedback rows, as the server's worker appends them."""
    log = FeedbackLog(db, max_rows=1000)
    for i, row in enumerate(served_rows(target, first, n)):
        log.append(FeedbackRecord(created_at=1e9 + first + i, bundle_version="b", model_version="1", drafter="draft-lm",
                                  endpoint="chat", sampling={"temperature": 0.0}, finish_reason="length",
                                  per_step=[(3, 1)] * len(row["output_ids"]), **row))
    log.close()
