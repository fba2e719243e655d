"""Served requests -> trace shards: the target's distributions on the sequences it actually served.

A feedback window (specops.server.feedback.export_after's Parquet) holds every request's prompt and output
token ids. One target forward over prompt + output (`specops.data.collect.score`) gives the target's
top-k next-token log-probs at every position, written in the trace format of `specops.data.traces`, so
the draft trainers read served traffic exactly as they read collected traces.

The window is split by request: a fixed share, chosen by a salted hash of the request ids, is held
out of training and only evaluated on (specops/eval/osd_eval.py).
"""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
from tqdm import tqdm

from specops.core.target import Target
from specops.data.collect import score
from specops.data.traces import FORMAT, VERSION, shard_name, write_manifest, write_shard

WINDOW_COLUMNS = ("id", "request_id", "prompt_ids", "output_ids", "step_drafted", "step_accepted")
SHARD_SIZE = 64  # sequences per shard; a window is rewritten whole, so this only bounds file sizes


def read_window(path: Path) -> list[dict[str, Any]]:
    """The rows of an exported window, oldest first, with the columns retraining needs."""
    if not path.is_file():
        raise FileNotFoundError(f"No feedback window at {path}: `specops retrain` exports it before its steps run.")
    return pq.read_table(path, columns=list(WINDOW_COLUMNS)).to_pylist()


def split_window(rows: list[dict[str, Any]], heldout_fraction: float, salt: str
                 ) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(train, held-out) rows. The held-out rows are the first round(fraction * n) (at least one) in the
    order of sha256(salt + request_id): random-looking, yet the same for the same window every time."""
    if len(rows) < 2:
        raise ValueError(f"A window of {len(rows)} row(s) cannot be split into training and held-out requests.")
    ranked = sorted(rows, key=lambda row: hashlib.sha256((salt + row["request_id"]).encode()).hexdigest())
    n_heldout = min(len(rows) - 1, max(1, round(heldout_fraction * len(rows))))
    heldout_ids = {row["request_id"] for row in ranked[:n_heldout]}
    train = [row for row in rows if row["request_id"] not in heldout_ids]
    return train, [row for row in rows if row["request_id"] in heldout_ids]


def served_acceptance(rows: list[dict[str, Any]]) -> float | None:
    """Accepted / drafted tokens over the rows, as the serving drafter did; None when nothing was drafted."""
    drafted = sum(sum(row["step_drafted"]) for row in rows)
    return sum(sum(row["step_accepted"]) for row in rows) / drafted if drafted else None


def write_feedback_traces(rows: list[dict[str, Any]], target: Target, out_dir: Path, top_k: int,
                          window_sha256: str) -> dict[str, Any]:
    """Score every row with a non-empty output and write out_dir as one complete trace split."""
    usable = [row for row in rows if row["output_ids"]]
    if not usable:
        raise ValueError("No request of the window has any output token: nothing to learn from.")
    out_dir.mkdir(parents=True, exist_ok=True)
    for stale in out_dir.glob("shard-*.safetensors*"):
        stale.unlink()
    plan = {"format": FORMAT, "version": VERSION, "source": "feedback", "window_sha256": window_sha256,
            "top_k": top_k, "logprobs_dtype": "float32", "hidden_layers": [], "n_prompts": len(usable),
            "target": target.fingerprint.to_dict()}
    metadata = {key: value if isinstance(value, str) else json.dumps(value) for key, value in plan.items()
                if key != "n_prompts"}
    n_shards = math.ceil(len(usable) / SHARD_SIZE)
    manifest: dict[str, Any] = {"plan": plan, "n_shards": n_shards, "shards": [], "complete": False}
    bar = tqdm(total=len(usable), unit="seq", desc="score served requests", dynamic_ncols=True)
    for index in range(n_shards):
        traces = []
        for row in usable[index * SHARD_SIZE:(index + 1) * SHARD_SIZE]:
            traces.append(score(target.model, row["request_id"], row["prompt_ids"], row["output_ids"], top_k, []))
            bar.update(1)
        manifest["shards"].append({"index": index, **write_shard(out_dir / shard_name(index), traces, metadata,
                                                                  "float32")})
    bar.close()
    manifest["complete"] = True
    write_manifest(out_dir, manifest)
    return {"sequences": len(usable), "empty_outputs": len(rows) - len(usable),
            "response_tokens": sum(entry["response_tokens"] for entry in manifest["shards"]),
            "tokens": sum(entry["tokens"] for entry in manifest["shards"])}
