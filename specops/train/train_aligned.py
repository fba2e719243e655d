"""Stage train_aligned: teach a GRIFFIN-style aligned head (specops.drafters.aligned_head.model) from the traces.

Data: the traces' hidden states at `collect.hidden_layers` (the head reads exactly those layers, in
that order), token ids, the target's top-k next-token log-probs and the response mask.

Per batch, the head unrolls `ttt_steps` drafting steps at every position at once (the training-time
test of EAGLE-3, arXiv 2503.01840, and GRIFFIN, arXiv 2502.11018): step 0 reads the target's
features, step j reads the features step j-1 produced. Each step pays, weighted by step_decay**j,
  * soft cross-entropy against the target's top-k mapped into the draft vocabulary, and
  * SmoothL1 feature regression of its feature output towards the fused target feature of the next
    position (the input it replaces at the next drafting step),
at the positions that predict a response token and are still token-aligned (GRIFFIN): the true token
was in the draft's top-`alignment_top_k` at every earlier step. See specops.train.aligned_losses.

The draft vocabulary (EAGLE-3/FR-Spec) is the `draft_vocab_size` most frequent response tokens of
the train traces plus the target's EOS tokens. The result is models/aligned_head/ (config.json,
model.safetensors) plus specops_training.json with the target fingerprint, config and report.
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from pytorch_lightning.loggers import Logger
from torch.utils.data import Dataset

from specops.core.target import Target
from specops.data.traces import TraceShards
from specops.drafters.aligned_head.model import AlignedHead, AlignedHeadConfig, save_head
from specops.train.aligned_losses import (
    feature_regression,
    next_alignment,
    soft_cross_entropy,
    teacher_in_draft_vocab,
    topk_hits,
)
from specops.train.train_draft import check_traces
from specops.train.trainer import TraceDataModule, TrainerConfig, adamw, fit
from specops.train.vocab import frequent_vocabulary, target_to_draft

log = logging.getLogger(__name__)

INFO_FILE = "specops_training.json"
FIELDS = ("input_ids", "loss_mask", "topk_ids", "topk_logprobs", "hidden_states")


@dataclass
class TrainAlignedConfig(TrainerConfig):
    """params.yaml section `train_aligned`."""

    draft_vocab_size: int | None = 8192
    """Tokens the head can propose: the most frequent response tokens of the traces (EAGLE-3/FR-Spec).
    null drafts over the target's whole vocabulary through its frozen LM head (slower per step)."""
    token_guided_fusion: bool = True
    """GRIFFIN's token-guided fusion of the next token's embedding into the feature. vLLM/SGLang
    export needs false."""
    token_enhanced_head: bool = True
    """GRIFFIN's token-enhanced head: separate outputs for the logits and the next step's feature.
    vLLM/SGLang export needs false."""
    intermediate_size: int | None = None
    """MLP width of the head's layer (and of the fusion); null takes the target's."""
    ttt_steps: int = 3
    """Drafting steps unrolled per position in training (training-time test); 1 trains on true features only."""
    alignment_top_k: int = 3
    """GRIFFIN's alignment mask keeps a position at step j only while the true token was in the
    draft's top-k at every earlier step; match it to the draft tree's branching."""
    feature_weight: float = 0.2
    """Weight of the feature regression next to the cross-entropy (weight 1)."""
    step_decay: float = 0.8
    """Step j's losses weigh step_decay**j (EAGLE-3): early drafts matter most."""
    lr: float = 5e-4
    """AdamW peak learning rate, reached after the warm-up."""
    max_seq_len: int = 512
    """Head positions per sequence; longer sequences are cut (the start is kept)."""
    gradient_clip_val: float = 0.5
    """Gradient norm clipping; 0 disables it."""
    out_dir: str = "models/aligned_head"
    """Where the head folder is written."""

    def __post_init__(self) -> None:
        self.check_trainer("train_aligned")
        if min(self.ttt_steps, self.alignment_top_k) < 1:
            raise ValueError("train_aligned: ttt_steps and alignment_top_k must be >= 1.")
        if self.draft_vocab_size is not None and self.draft_vocab_size < 1:
            raise ValueError(f"train_aligned.draft_vocab_size must be >= 1 or null, got {self.draft_vocab_size}.")
        if self.feature_weight < 0 or not 0 < self.step_decay <= 1:
            raise ValueError("train_aligned: feature_weight must be >= 0 and step_decay in (0, 1].")


class AlignedDataset(Dataset):
    """Head positions t = 0..n-1 of each sequence: features f_0..f_n, next tokens x_{t+1}, the target's
    top-k for x_{t+2}, the label x_{t+2} (-1 past the end) and whether x_{t+2} is a response token."""

    def __init__(self, split_dir: Path, max_seq_len: int) -> None:
        self.shards = TraceShards(split_dir, fields=FIELDS)
        self.max_seq_len = max_seq_len

    def __len__(self) -> int:
        return len(self.shards)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        item = self.shards[index]
        ids, mask = item["input_ids"], item["loss_mask"]
        n = min(len(ids) - 1, self.max_seq_len)
        labels = torch.full((n,), -1, dtype=torch.long)
        valid = torch.zeros(n, dtype=torch.bool)
        known = min(n, len(ids) - 2)  # the last position has no x_{t+2}
        labels[:known] = ids[2:2 + known]
        valid[:known] = mask[2:2 + known]
        return {"features": item["hidden_states"][: n + 1], "tokens": ids[1:n + 1], "teacher_ids": item["topk_ids"][1:n + 1],
                "teacher_logprobs": item["topk_logprobs"][1:n + 1], "labels": labels, "valid": valid}


def collate(items: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Right-pad to the longest sequence; padding is never valid."""
    width = max(len(item["tokens"]) for item in items)
    B, (L, H), K = len(items), items[0]["features"].shape[1:], items[0]["teacher_ids"].shape[-1]
    batch = {
        "features": torch.zeros(B, width + 1, L, H, dtype=items[0]["features"].dtype),  # [B, W+1, L, H]
        "tokens": torch.zeros(B, width, dtype=torch.long),  # [B, W]
        "teacher_ids": torch.zeros(B, width, K, dtype=torch.long),  # [B, W, K]
        "teacher_logprobs": torch.full((B, width, K), float("-inf")),  # [B, W, K]
        "labels": torch.full((B, width), -1, dtype=torch.long),  # [B, W]
        "valid": torch.zeros(B, width, dtype=torch.bool),  # [B, W]
    }
    for row, item in enumerate(items):
        for name, tensor in item.items():
            batch[name][row, : len(tensor)] = tensor
    return batch


class AlignedTraining(pl.LightningModule):
    """The unrolled losses of the module docstring; the target's embeddings (and LM head, without a
    draft vocabulary) ride along as frozen buffers."""

    def __init__(self, head: AlignedHead, embed: torch.Tensor, target_lm_head: torch.Tensor | None,
                 cfg: TrainAlignedConfig) -> None:
        super().__init__()
        self.head, self.cfg = head, cfg
        self.register_buffer("embed", embed.detach().float(), persistent=False)  # [V, H]
        self.register_buffer("target_lm_head", None if target_lm_head is None else target_lm_head.detach().float(),
                             persistent=False)
        vocab = head.config.target_vocab_size
        to_draft = torch.arange(vocab) if head.draft_to_target is None else target_to_draft(head.draft_to_target, vocab)
        self.register_buffer("target_to_draft", to_draft, persistent=False)  # [V]: draft id or -1

    def losses(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        x0 = self.head.fuse(batch["features"][:, :-1])  # [B, W, H]
        next_feature = self.head.fuse(batch["features"][:, 1:]).detach()  # what step j+1 reads at t+1
        embeds = F.embedding(batch["tokens"], self.embed).to(x0.dtype)  # [B, W, H]
        teacher_ids, teacher_probs = teacher_in_draft_vocab(batch["teacher_ids"], batch["teacher_logprobs"],
                                                            self.target_to_draft)
        labels = torch.where(batch["labels"] >= 0, self.target_to_draft[batch["labels"].clamp_min(0)], -1)
        aligned = torch.ones_like(batch["valid"])
        out: dict[str, torch.Tensor] = {}
        total, weights = x0.new_zeros(()), 0.0
        for j, (token, feature) in enumerate(self.head.unroll(x0, embeds, self.cfg.ttt_steps)):
            mask = batch["valid"] & aligned
            logits = self.head.logits(token, self.target_lm_head)  # [B, W, N]
            ce = soft_cross_entropy(logits, teacher_ids, teacher_probs, mask)
            regression = feature_regression(feature, next_feature, mask)
            weight = self.cfg.step_decay ** j
            total = total + weight * (ce + self.cfg.feature_weight * regression)
            weights += weight
            with torch.no_grad():
                correct = (logits.argmax(-1) == labels)[mask]
                out[f"acc_step{j}"] = correct.float().mean() if correct.numel() else x0.new_zeros(())
                out[f"aligned_step{j}"] = mask.sum() / batch["valid"].sum().clamp_min(1)
                aligned = next_alignment(aligned, topk_hits(logits, labels, self.cfg.alignment_top_k))
            out[f"ce_step{j}"], out[f"feature_step{j}"] = ce.detach(), regression.detach()
        out["loss"] = total / weights
        return out

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        out = self.losses(batch)
        self.log_dict({f"train/{name}": value for name, value in out.items() if name != "loss"},
                      batch_size=len(batch["tokens"]))
        self.log("train/loss", out["loss"], prog_bar=True, batch_size=len(batch["tokens"]))
        return out["loss"]

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        out = self.losses(batch)
        self.log_dict({f"val/{name}": value for name, value in out.items()}, batch_size=len(batch["tokens"]),
                      sync_dist=True)

    def configure_optimizers(self) -> dict[str, Any]:
        return adamw(self.head.parameters(), self.cfg, self.trainer.estimated_stepping_batches)


def head_config(target: Target, cfg: TrainAlignedConfig, hidden_layers: list[int]) -> AlignedHeadConfig:
    """The head's shapes: the target's width, heads and RoPE base; the layers the traces hold."""
    tc = target.model.config
    rope = getattr(tc, "rope_parameters", None) or {}
    return AlignedHeadConfig(
        hidden_size=tc.hidden_size, target_vocab_size=target.vocab_size, hidden_layers=list(hidden_layers),
        num_target_layers=tc.num_hidden_layers, num_attention_heads=tc.num_attention_heads,
        num_key_value_heads=tc.num_key_value_heads,
        head_dim=getattr(tc, "head_dim", None) or tc.hidden_size // tc.num_attention_heads,
        intermediate_size=cfg.intermediate_size or tc.intermediate_size, rms_norm_eps=tc.rms_norm_eps,
        rope_theta=float(rope.get("rope_theta", getattr(tc, "rope_theta", 10000.0))),
        max_position_embeddings=tc.max_position_embeddings,
        draft_vocab_size=None if cfg.draft_vocab_size is None else min(cfg.draft_vocab_size, target.vocab_size),
        token_guided_fusion=cfg.token_guided_fusion, token_enhanced_head=cfg.token_enhanced_head,
    )


def build_head(target: Target, cfg: TrainAlignedConfig, train: TraceShards) -> tuple[AlignedHead, float]:
    """A seeded head; with a draft vocabulary its LM head starts as the target's rows for those tokens.
    Returns the head and the fraction of response tokens its vocabulary covers."""
    layers = train.plan["hidden_layers"]
    if not layers:
        raise ValueError("The traces hold no hidden states: collect them with collect.hidden_layers (for an "
                         "EAGLE-3 export, three layers below the last, e.g. specops.drafters.aligned_head.export.eagle3_default_layers).")
    torch.manual_seed(cfg.seed)
    head = AlignedHead(head_config(target, cfg, layers))
    if head.lm_head is None:
        return head, 1.0
    ids, coverage = frequent_vocabulary(train, head.config.draft_vocab_size, target)
    head.set_draft_vocab(ids)
    with torch.no_grad():
        head.lm_head.weight.copy_(target.model.get_output_embeddings().weight[ids].float())
    return head, coverage


def train_aligned(cfg: TrainAlignedConfig, target: Target, traces_dir: Path | str,
                  logger: Logger | None = None) -> dict[str, Any]:
    """Train a head on traces_dir/{train,val}, save it to cfg.out_dir; returns the training report."""
    traces_dir = Path(traces_dir)
    check_traces(traces_dir, target)
    pl.seed_everything(cfg.seed, workers=True, verbose=False)
    head, coverage = build_head(target, cfg, TraceShards(traces_dir / "train", fields=("input_ids", "loss_mask")))
    target_head = target.model.get_output_embeddings().weight if head.lm_head is None else None
    module = AlignedTraining(head, target.model.get_input_embeddings().weight, target_head, cfg)
    data = TraceDataModule(traces_dir, AlignedDataset, collate, cfg.batch_size, cfg.max_seq_len, cfg.seed)
    if logger is not None:
        logger.log_hyperparams({**asdict(cfg), "target": target.fingerprint.name})
    fitted = fit(cfg, "train_aligned", module, data, logger)
    val = fitted.val_metrics  # of the exported weights
    report = {
        **fitted.report,
        "val_acc_per_step": [val.get(f"val/acc_step{j}") for j in range(cfg.ttt_steps)] if val else None,
        "hidden_layers": head.config.hidden_layers,
        "draft_vocab_size": head.config.draft_vocab_size, "draft_vocab_coverage": round(coverage, 4),
        "parameters": sum(p.numel() for p in head.parameters()),
    }
    state = fitted.weights(head)  # the best validation's
    if fitted.trainer.is_global_zero:
        saved = AlignedHead(head.config)  # fresh: nothing of the strategy's wrapping reaches the file
        saved.load_state_dict({name: tensor.float() if tensor.is_floating_point() else tensor
                               for name, tensor in state.items()})
        out = save_head(saved, cfg.out_dir)
        info = {"target": target.fingerprint.to_dict(), "config": asdict(cfg), "report": report}
        (out / INFO_FILE).write_text(json.dumps(info, indent=2) + "\n")
    fitted.finish()
    log.info("train_aligned: %s", report)
    return report
