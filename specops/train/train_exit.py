"""Stage train_exit: DEL's exit heads (arXiv 2504.05598; specops/drafters/del_exit.py).

Data. The traces store the target's top-k next-token log-probs but not the hidden states of the exit
layers (collect keeps [1, 14, 26] for the aligned head), so the target's first max(exit_layers) layers
run here over each trace sequence, forward only, through the same lean forward DEL drafts with
(specops.core.llama.LlamaForward.early). The outputs at the exit layers, at every position whose next
token is a response token, are the features; the teacher is the stored top-k renormalized over the
draft vocabulary (EAGLE-3/FR-Spec), as train_draft's. The target is frozen, so features are computed
once and the heads (a few million parameters) train on in-memory tensors: plain torch, like
train_acceptance, no Lightning.

Heads start as the target's own final norm and LM-head rows of the draft vocabulary, with a zero
adapter: exactly the untrained early exit. The report gives each layer's top-1 agreement with the
target before and after training on the val split; the trained agreement is written to the heads'
config as DEL's prior acceptance per layer.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from specops.core.llama import LlamaForward, llama_forward
from specops.core.target import Target
from specops.data.traces import MANIFEST, TraceShards, next_token_mask
from specops.drafters.del_exit import ExitHeads
from specops.train.aligned_losses import soft_cross_entropy, teacher_in_draft_vocab
from specops.train.train_draft import check_traces
from specops.train.vocab import frequent_vocabulary, target_to_draft

log = logging.getLogger(__name__)

INFO_FILE = "specops_training.json"
TRACE_FIELDS = ("input_ids", "loss_mask", "topk_ids", "topk_logprobs")
HELD_OUT = 32  # train sequences past max_sequences that measure the heads when no val split was collected


@dataclass
class TrainExitConfig:
    """params.yaml section `train_exit`."""

    exit_layers: list[int] = field(default_factory=lambda: [2, 4, 6, 8])
    """Decoder layers run before each head (e: the output of layer e - 1). Shallow ones: a draft token costs
    e of the target's 30 layers plus the head, while a bf16 verification of up to 5 tokens costs about one
    plain pass (~40 layer-times with the full head), so cheap drafts pay at low acceptance. On 48 quickstart
    sequences, held-out top-1 agreement after training was 0.26/0.26/0.27/0.30 at layers 4/6/8/12 (0.05-0.08
    untrained): deeper layers agree little more and cost much more (docs/results.md, 2026-11-27)."""
    draft_vocab_size: int = 8192
    """The heads propose the N most frequent response tokens (FR-Spec) plus EOS: an 8192-row head costs
    ~0.45 ms in bf16 here, the full 49k-row head ~2.3 ms."""
    max_sequences: int | None = 96
    """Train sequences used (the first ones): the target's early layers run over each, which bounds the
    stage's time; None uses the whole split (the quickstart's 338: val agreement 0.30-0.34 at layers 2-8
    instead of 0.23-0.27, in 131 s instead of ~45; docs/results.md, DEL's oracle bound)."""
    epochs: int = 3
    """Passes over the training positions."""
    batch_size: int = 256
    """Positions per optimizer step (every head sees the same positions)."""
    lr: float = 1e-3
    """AdamW learning rate (constant)."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    seed: int = 0
    """Seeds the data order."""
    out_dir: str = "models/exit_heads"
    """Where the heads go (config.json + model.safetensors); a bundle ships them as exit_heads/."""

    def __post_init__(self) -> None:
        if not self.exit_layers or self.exit_layers != sorted(set(self.exit_layers)) or self.exit_layers[0] < 1:
            raise ValueError(f"train_exit.exit_layers must be ascending, distinct and >= 1, got {self.exit_layers}.")
        if min(self.draft_vocab_size, self.epochs, self.batch_size) < 1 or (self.max_sequences or 1) < 1:
            raise ValueError("train_exit: draft_vocab_size, epochs, batch_size and max_sequences must be >= 1.")
        if self.lr <= 0:
            raise ValueError("train_exit.lr must be > 0.")


@dataclass
class ExitExamples:
    features: torch.Tensor  # [M, E, H] float32: the target's output after each exit layer
    teacher_ids: torch.Tensor  # [M, K] draft-vocabulary ids
    teacher_probs: torch.Tensor  # [M, K] renormalized over the draft vocabulary
    target_next: torch.Tensor  # [M] the target's argmax (a target id)

    def __len__(self) -> int:
        return self.features.shape[0]


def sequence_features(forward: LlamaForward, ids: torch.Tensor, exit_layers: list[int]) -> torch.Tensor:
    """The target's outputs after each exit layer at every position of one sequence: ids [T] -> [T, E, H]."""
    keys, values = forward.new_cache(len(ids))
    cos, sin = forward.tables(len(ids))
    layers = forward.early(ids, torch.arange(len(ids)), keys, values, cos, sin, exit_layers[-1])  # [T, e_max, H]
    return layers[:, [e - 1 for e in exit_layers]].float()


def response_features(forward: LlamaForward, shards: TraceShards, exit_layers: list[int],
                      sequences: range) -> Iterator[tuple[dict[str, torch.Tensor], torch.Tensor, torch.Tensor]]:
    """Per sequence of `sequences` with response positions (indices past the split's end are skipped): the
    trace item, its rows whose next token is a response token (row t predicts token t + 1), and the exit
    layers' features at those rows [n, E, H]."""
    for i in range(sequences.start, min(sequences.stop, len(shards))):
        item = shards[i]
        rows = next_token_mask(item["loss_mask"])
        if rows.any():
            with torch.inference_mode():
                features = sequence_features(forward, item["input_ids"], exit_layers)[rows]
            yield item, rows, features


def split_examples(forward: LlamaForward, shards: TraceShards, cfg: TrainExitConfig, to_draft: torch.Tensor,
                   sequences: range) -> ExitExamples:
    """Features and teacher of the `sequences` of one split."""
    parts: list[tuple[torch.Tensor, ...]] = []
    for item, rows, features in response_features(forward, shards, cfg.exit_layers, sequences):
        ids, probs = teacher_in_draft_vocab(item["topk_ids"][rows], item["topk_logprobs"][rows], to_draft)
        parts.append((features, ids, probs, item["topk_ids"][rows, 0]))
    if not parts:
        raise ValueError(f"{shards.dir} sequences {sequences.start}-{sequences.stop - 1} hold no response positions.")
    return ExitExamples(*(torch.cat(column) for column in zip(*parts, strict=True)))


def agreement(heads: ExitHeads, data: ExitExamples) -> list[float]:
    """Each head's top-1 agreement with the target's argmax: what greedy DEL accepts per token."""
    with torch.no_grad():
        return [float((heads.predict(data.features[:, i], i) == data.target_next).float().mean())
                for i in range(len(heads.config.exit_layers))]


def fit(heads: ExitHeads, data: ExitExamples, cfg: TrainExitConfig) -> float:
    """AdamW over shuffled minibatches, the heads' losses summed; returns the last epoch's mean loss per head."""
    order_rng = torch.Generator().manual_seed(cfg.seed)
    optimizer = torch.optim.AdamW(heads.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    everything = torch.ones(len(data), dtype=torch.bool)
    heads.train()
    epoch_loss = float("nan")
    for _ in range(cfg.epochs):
        total = 0.0
        for batch in torch.randperm(len(data), generator=order_rng).split(cfg.batch_size):
            loss = sum(soft_cross_entropy(heads(data.features[batch, i], i), data.teacher_ids[batch],
                                          data.teacher_probs[batch], everything[batch])
                       for i in range(len(cfg.exit_layers)))
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            total += float(loss.detach()) * len(batch)
        epoch_loss = total / len(data) / len(cfg.exit_layers)
    heads.eval()
    return epoch_loss


def train_exit(cfg: TrainExitConfig, target: Target, traces_dir: Path | str) -> dict[str, Any]:
    """Train the heads on traces_dir/train, measure them on held-out sequences, save them to cfg.out_dir."""
    start = time.perf_counter()
    traces_dir = Path(traces_dir)
    check_traces(traces_dir, target)
    if cfg.exit_layers[-1] >= target.model.config.num_hidden_layers:
        raise ValueError(f"train_exit.exit_layers must stay below the target's {target.model.config.num_hidden_layers} layers.")
    forward = llama_forward(target.model)[0]
    shards = TraceShards(traces_dir / "train", fields=TRACE_FIELDS)
    vocab, coverage = frequent_vocabulary(shards, cfg.draft_vocab_size, target)
    to_draft = target_to_draft(vocab, target.vocab_size)
    used = cfg.max_sequences or len(shards)
    train = split_examples(forward, shards, cfg, to_draft, range(used))
    # The agreement becomes DEL's prior, so it must be measured on sequences the heads did not see: the
    # val split, else unused train sequences, else (all used) the train positions, said so in the report.
    if (traces_dir / "val" / MANIFEST).is_file():
        eval_split = "val"
        val_shards = TraceShards(traces_dir / "val", fields=TRACE_FIELDS)
        val = split_examples(forward, val_shards, cfg, to_draft, range(len(val_shards)))
    elif used < len(shards):
        eval_split = f"train[{used}:{used + HELD_OUT}]"
        val = split_examples(forward, shards, cfg, to_draft, range(used, used + HELD_OUT))
    else:
        eval_split, val = "train (no held-out sequences: the agreement is optimistic)", train
    features_s = time.perf_counter() - start
    heads = ExitHeads.from_target(target.model, cfg.exit_layers, vocab)
    untrained = agreement(heads, val)
    train_loss = fit(heads, train, cfg)
    trained = agreement(heads, val)
    heads.config.prior_acceptance = [round(a, 4) for a in trained]
    report = {
        "train_loss": train_loss, "eval_split": eval_split,
        "agreement": dict(zip(map(str, cfg.exit_layers), trained, strict=True)),
        "agreement_untrained": dict(zip(map(str, cfg.exit_layers), untrained, strict=True)),
        "positions": {"train": len(train), "eval": len(val)},
        "draft_vocab_coverage": coverage, "features_seconds": round(features_s, 3),
        "parameters": sum(p.numel() for p in heads.parameters()), "seconds": round(time.perf_counter() - start, 3),
    }
    out_dir = heads.save(cfg.out_dir)
    info = {"target": target.fingerprint.to_dict(), "config": asdict(cfg), "report": report}
    (out_dir / INFO_FILE).write_text(json.dumps(info, indent=2) + "\n")
    log.info("train_exit: %s", report)
    return report
