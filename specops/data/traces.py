"""The trace format: what the collect stage writes and every trainer reads.

    data/traces/{split}/manifest.json            the plan (config, target, prompt list) and finished shards
    data/traces/{split}/shard-00000.safetensors  sequences concatenated along the token axis

Tensors of a shard (N tokens in all, S sequences, K = top_k_logits, L = len(hidden_layers), H = hidden size):

    input_ids      [N]        int32    prompt + response token ids
    loss_mask      [N]        uint8    1 on response tokens: the tokens the target generated itself
    seq_offsets    [S+1]      int64    sequence s is rows seq_offsets[s]:seq_offsets[s+1]
    topk_ids       [N, K]     int32    the target's K most likely next tokens, best first; row t predicts token t+1
    topk_logprobs  [N, K]     float32 or float16: their log-probabilities under the full-vocabulary softmax
    hidden_states  [N, L, H]  float16  chosen layers (absent when hidden_layers is empty)

Hidden-layer convention: entry i of `hidden_layers` is the output of decoder layer i (0-based), which is
`outputs.hidden_states[i + 1]` in Hugging Face models. For the last layer HF returns it after the final
norm, i.e. exactly the lm_head's input. Negative entries count from the end: -1 is the last layer.

The safetensors header carries string metadata: format, version, top_k, hidden_layers (JSON, resolved to
non-negative indices), target (JSON fingerprint), prompt_ids (JSON list, one per sequence) and the
collect settings. Nothing is pickled.

Shards and the manifest are replaced durably (specops.core.durable): a crash or power cut leaves the
previous manifest, which names only shards whose bytes are on disk. Readers check every shard against
the sha256 its manifest records, so a corrupted shard is an error, not silently different training data.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from specops.core.durable import replace_durably, write_text_durably
from specops.core.target import sha256_file

FORMAT = "specops-traces"
VERSION = 1
MANIFEST = "manifest.json"
FIELDS = ("input_ids", "loss_mask", "topk_ids", "topk_logprobs", "hidden_states")
LOGPROB_DTYPES = {"float32": torch.float32, "float16": torch.float16}


class TraceError(RuntimeError):
    """Traces on disk cannot be trusted (unreadable manifest, corrupted shard); the message says what to rerun."""


def resolve_layers(layers: list[int], num_layers: int) -> list[int]:
    """Non-negative decoder-layer indices; -1 is the last layer."""
    resolved = []
    for layer in layers:
        if not -num_layers <= layer < num_layers:
            raise ValueError(f"hidden layer {layer} is out of range for a model with {num_layers} decoder layers.")
        resolved.append(layer % num_layers)
    return resolved


def hf_hidden_index(layer: int) -> int:
    """Index into HF `outputs.hidden_states` (embeddings first) of decoder layer `layer`'s output."""
    return layer + 1


def shard_name(index: int) -> str:
    return f"shard-{index:05d}.safetensors"


@dataclass
class SequenceTrace:
    """One regenerated sequence, as a backend returns it (T = prompt + response tokens)."""

    prompt_id: str
    input_ids: torch.Tensor  # [T] int64
    n_prompt: int  # the first n_prompt tokens are the prompt, the rest the target's response
    topk_ids: torch.Tensor  # [T, K] int64
    topk_logprobs: torch.Tensor  # [T, K] float32
    hidden_states: torch.Tensor | None  # [T, L, H] float16, or None without hidden layers


def write_shard(path: Path, traces: list[SequenceTrace], metadata: dict[str, str], logprobs_dtype: str) -> dict[str, Any]:
    """Write one shard (at least one sequence) atomically and durably. Returns its manifest entry."""
    lengths = [len(t.input_ids) for t in traces]
    offsets = torch.zeros(len(traces) + 1, dtype=torch.int64)
    offsets[1:] = torch.tensor(lengths, dtype=torch.int64).cumsum(0)
    masks = [torch.arange(len(t.input_ids)) >= t.n_prompt for t in traces]
    tensors = {
        "input_ids": torch.cat([t.input_ids for t in traces]).to(torch.int32),
        "loss_mask": torch.cat(masks).to(torch.uint8),
        "seq_offsets": offsets,
        "topk_ids": torch.cat([t.topk_ids for t in traces]).to(torch.int32),
        "topk_logprobs": torch.cat([t.topk_logprobs for t in traces]).to(LOGPROB_DTYPES[logprobs_dtype]),
    }
    if traces[0].hidden_states is not None:
        tensors["hidden_states"] = torch.cat([t.hidden_states for t in traces]).to(torch.float16)
    header = {**metadata, "prompt_ids": json.dumps([t.prompt_id for t in traces])}
    tmp = path.with_name(path.name + ".tmp")
    save_file(tensors, str(tmp), metadata=header)
    replace_durably(tmp, path)
    return {"file": path.name, "sequences": len(traces), "tokens": int(offsets[-1]),
            "response_tokens": int(tensors["loss_mask"].sum()), "sha256": sha256_file(path)}


def read_manifest(split_dir: Path) -> dict[str, Any] | None:
    """The split's manifest, None when there is none; TraceError when it exists but cannot be read."""
    path = split_dir / MANIFEST
    if not path.is_file():
        return None
    try:
        manifest = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise TraceError(f"{path} is unreadable ({error}).") from error
    if not isinstance(manifest, dict) or not {"plan", "n_shards", "shards", "complete"} <= manifest.keys():
        raise TraceError(f"{path} is not a trace manifest (it lacks plan, n_shards, shards or complete).")
    return manifest


def write_manifest(split_dir: Path, manifest: dict[str, Any]) -> None:
    """Atomic and durable, so a kill leaves the previous manifest, which names only shards fully on disk."""
    write_text_durably(split_dir / MANIFEST, json.dumps(manifest, indent=1) + "\n")


# Shards this process has hashed, with the size and mtime they had: training opens a split several
# times (fit, validation, evaluation), and hashing large hidden-state shards once is enough.
_VERIFIED: set[tuple[str, str, int, int]] = set()


def check_shard(path: Path, entry: dict[str, Any]) -> str | None:
    """Why the shard at `path` is not the one its manifest `entry` recorded, or None when it is."""
    if not path.is_file():
        return f"{path} is missing"
    stat = path.stat()
    key = (str(path.resolve()), entry["sha256"], stat.st_size, stat.st_mtime_ns)
    if key in _VERIFIED:
        return None
    if sha256_file(path) != entry["sha256"]:
        return f"{path} does not match the sha256 in {MANIFEST} (corrupted or edited)"
    _VERIFIED.add(key)
    return None


def next_token_mask(loss_mask: torch.Tensor) -> torch.Tensor:
    """[..., T] response mask -> [..., T] mask of the positions whose *next* token is a response token.

    Row t of the top-k tensors predicts token t+1, so these are the positions to distill on.
    """
    shifted = torch.zeros_like(loss_mask)
    shifted[..., :-1] = loss_mask[..., 1:]
    return shifted


class TraceShards:
    """The sequences of one split, by index; each item reads only its own rows from the shard files."""

    def __init__(self, split_dir: Path | str, fields: tuple[str, ...] = FIELDS) -> None:
        self.dir = Path(split_dir)
        try:
            manifest = read_manifest(self.dir)
        except TraceError as error:
            raise TraceError(f"{error} Rerun the collect stage: it starts the split over.") from error
        if manifest is None:
            raise FileNotFoundError(f"No traces in {self.dir} (no {MANIFEST}). Run the collect stage first.")
        if not manifest["complete"]:
            done = len(manifest["shards"])
            raise RuntimeError(f"Traces in {self.dir} are incomplete ({done}/{manifest['n_shards']} shards). "
                               "Rerun the collect stage: it resumes where it stopped.")
        for entry in manifest["shards"]:  # hashing reads each shard once, at disk speed: cheap next to training
            problem = check_shard(self.dir / entry["file"], entry)
            if problem:
                raise TraceError(f"{problem}. Rerun the collect stage: it regenerates that shard.")
        self.files = [self.dir / entry["file"] for entry in manifest["shards"]]
        self.plan: dict[str, Any] = manifest["plan"]
        self.fields = fields
        # (file index, first row, end row) of every sequence, from the small seq_offsets tensors.
        self.spans: list[tuple[int, int, int]] = []
        self.prompt_ids: list[str] = []  # the prepared prompt row each sequence answers (its "id")
        for index, path in enumerate(self.files):
            with safe_open(str(path), framework="pt") as shard:
                missing = set(fields) - set(shard.keys())
                if missing:
                    raise KeyError(f"{path} has no {', '.join(sorted(missing))} (collect with hidden_layers to store them).")
                offsets = shard.get_tensor("seq_offsets").tolist()
                self.prompt_ids += json.loads(shard.metadata()["prompt_ids"])
            self.spans += [(index, start, end) for start, end in zip(offsets[:-1], offsets[1:], strict=True)]

    @property
    def target(self) -> dict[str, str]:
        """The fingerprint of the target that produced these traces."""
        return self.plan["target"]

    def __len__(self) -> int:
        return len(self.spans)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        """Tensors of one sequence: ids int64, loss_mask bool, topk_logprobs float32, hidden_states float16."""
        file_index, start, end = self.spans[index]
        with safe_open(str(self.files[file_index]), framework="pt") as shard:
            item = {name: shard.get_slice(name)[start:end] for name in self.fields}
        for name in ("input_ids", "topk_ids"):
            if name in item:
                item[name] = item[name].long()
        if "loss_mask" in item:
            item["loss_mask"] = item["loss_mask"].bool()
        if "topk_logprobs" in item:
            item["topk_logprobs"] = item["topk_logprobs"].float()
        return item
