"""Online speculative decoding (OSD; Liu et al., ICML 2024, arXiv 2310.07177): distill the serving
draft model on the traffic it failed on.

A draft trained offline drifts away from what users actually ask. OSD keeps updating it on the
observed queries: while serving, it buffers the tokens where the draft's proposal was rejected,
with the target's distribution there, and every few iterations distills them into the draft.
`specops retrain` (specops/pipeline/retrain.py) is that update, run by a scheduler on a window of the
feedback log. Here, its training part:

1. The window's served sequences come with the target's top-k distributions, recomputed by one
   target forward each (specops/data/feedback_traces.py).
2. Which positions the draft got wrong. The feedback log keeps acceptance per step, not per
   position (and a tree drafter's steps do not map to positions at all), so they are derived: the
   parent draft reads each served sequence teacher-forced, and under greedy verification a token
   drafted at position t is accepted exactly when it equals the target's argmax after the same
   prefix. So `focus: rejected` distills where the draft's argmax differs from the target's.
   (For sampled requests this is a proxy; their acceptance is probabilistic.)
3. The loss, forward KL by default (any of specops.train.losses.LOSSES), averaged over those positions,
   plus `replay_weight` x the same loss averaged over sequences of the original training traces,
   which keeps the draft from forgetting the distribution it was first trained for.
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch
from pytorch_lightning.loggers import Logger
from torch.utils.data import ConcatDataset, DataLoader, Dataset
from transformers import AutoModelForCausalLM, PreTrainedModel

from specops.core.target import Target, TargetFingerprint
from specops.data.traces import TraceShards, next_token_mask
from specops.drafters.draft_lm import load_draft_vocab
from specops.train.losses import LOSSES
from specops.train.strategies import full_state_dict
from specops.train.train_draft import (
    DISTILL_FIELDS,
    DistillDataset,
    DraftDistillation,
    collate,
    draft_logits,
    save_draft,
)
from specops.train.trainer import RunTracker, TrainerConfig, build_trainer

log = logging.getLogger(__name__)

FOCUS = ("rejected", "all")


@dataclass
class OSDConfig(TrainerConfig):
    """params.yaml section `osd`: online retraining of the champion draft LM on served traffic. The
    Lightning fields (strategy, precision, batch_size, ...) are specops.train.trainer.TrainerConfig's."""

    feedback_db: str = "feedback/feedback.db"
    """The server's feedback log (its --feedback-db), read-only here."""
    watermark_file: str = "feedback/osd_watermark.json"
    """Id of the last feedback row a finished retrain consumed; one file per feedback database."""
    lock_file: str = "feedback/osd.lock"
    """Held while a retrain runs; a second retrain exits at once with code 75."""
    min_rows: int = 32
    """Fewer new requests than this: nothing to do yet, they wait for a later run."""
    max_rows: int = 2000
    """At most this many requests per retrain, oldest first; the newer ones wait for the next run."""
    heldout_fraction: float = 0.2
    """Share of the window's requests kept out of training to evaluate on (at least one)."""
    split_salt: str = "osd"
    """Mixed into the hash that picks the held-out requests."""
    focus: str = "rejected"
    """Served positions to distill: 'rejected' (where the parent draft's argmax is not the target's: OSD)
    or 'all' (every served position)."""
    loss: str = "forward_kl"
    """Distillation loss, one of specops.train.losses.LOSSES: forward_kl, reverse_kl, jsd, tvd."""
    replay_ratio: float = 1.0
    """Sequences from the original training traces (collect.out_dir/train) per served sequence; 0 disables replay."""
    replay_weight: float = 1.0
    """Weight of the replay loss next to the served one; each is a mean over its own positions."""
    lr: float = 1e-4
    """AdamW learning rate: lower than train_draft's, the draft only needs to adapt."""
    lr_schedule: str = "constant"
    """Constant, without warm-up: a retrain is a few dozen steps of adaptation, which a decay would only shrink."""
    warmup_ratio: float = 0.0
    epochs: int = 2
    """Passes over the served + replay sequences."""
    max_seq_len: int = 512
    log_every_n_steps: int = 1  # a retrain is a few dozen steps
    checkpoint_dir: str | None = None
    """Must stay null: a retrain keeps no checkpoints (it is a few dozen steps on one window, has no val
    split to select by, and a failed one reruns on the same window)."""
    train_embeddings: bool = False
    """Also train the embeddings and LM head. Off by default: the copied target head is already right,
    and on a CPU the vocabulary-sized head dominates the backward pass."""
    eval_prompts: int = 8
    """Prompts per evaluation slice: held-out traffic, and the original test split (evaluate.split)."""
    eval_max_new_tokens: int = 64
    """Tokens generated per prompt and drafter in the evaluation."""
    window_dir: str = "data/osd/window"
    """The exported window: window.parquet and window.json (id range, parent version, checksum)."""
    traces_dir: str = "data/osd/traces"
    """Trace shards of the window's training requests."""
    out_dir: str = "models/osd_draft"
    """The retrained draft (a Hugging Face folder)."""
    bundle_dir: str = "models/osd_bundle"
    """The challenger bundle, as registered."""
    eval_out: str = "metrics/osd_eval.json"
    """Challenger and champion on both slices (an out of osd/dvc.yaml, as are every step's reports)."""
    plot: str = "metrics/osd/acceptance_per_position.png"
    """Per-position acceptance of both drafters on the held-out traffic."""
    decision_file: str = "metrics/osd_promotion.json"
    """The gate's decision."""
    report_file: str = "metrics/osd_retrain.json"
    """Summary of the last `specops retrain`: window, watermark, versions, decision."""

    def __post_init__(self) -> None:
        if self.focus not in FOCUS:
            raise ValueError(f"osd.focus '{self.focus}' is unknown. Choose one of: {', '.join(FOCUS)}.")
        if self.loss not in LOSSES:
            raise ValueError(f"osd.loss '{self.loss}' is unknown. Choose one of: {', '.join(LOSSES)}.")
        self.check_trainer("osd")
        if self.checkpoint_dir is not None:
            raise ValueError("osd.checkpoint_dir must be null: a retrain keeps no checkpoints and does not resume.")
        if self.min_rows < 2 or self.max_rows < self.min_rows:
            raise ValueError(f"osd: need 2 <= min_rows <= max_rows (a window is split into training and held-out "
                             f"requests), got min_rows={self.min_rows}, max_rows={self.max_rows}.")
        if not 0 < self.heldout_fraction < 1:
            raise ValueError(f"osd.heldout_fraction must be in (0, 1), got {self.heldout_fraction}.")
        if self.replay_ratio < 0 or self.replay_weight < 0:
            raise ValueError("osd.replay_ratio and osd.replay_weight must be >= 0.")
        if min(self.eval_prompts, self.eval_max_new_tokens) < 1:
            raise ValueError("osd: eval_prompts and eval_max_new_tokens must be >= 1.")


@torch.inference_mode()
def rejected_positions(draft: PreTrainedModel, input_ids: torch.Tensor, target_argmax: torch.Tensor,
                       served: torch.Tensor, vocab: torch.Tensor | None = None) -> torch.Tensor:
    """[T] bool: the served positions where greedy verification rejects the draft's proposal.

    input_ids [T]; target_argmax [T], the target's most likely token after each prefix (topk_ids[:, 0]);
    served [T], the rows whose next token the target generated. Row t predicts token t+1, and a
    draft token there is accepted exactly when the draft's argmax equals the target's. `vocab`: the
    draft vocabulary the draft proposes from, if it has one.
    """
    proposal = draft_logits(draft, input_ids[None], vocab=vocab)[0].argmax(-1)  # [T]
    if vocab is not None:
        proposal = vocab[proposal]
    return served & (proposal != target_argmax)


class ServedSequences(Dataset):
    """The window's training sequences, each with its distillation mask (every served position, or
    only the rejected ones) and replay=False."""

    def __init__(self, split_dir: Path, draft: PreTrainedModel, focus: str, max_seq_len: int,
                 vocab: torch.Tensor | None = None) -> None:
        self.shards = TraceShards(split_dir, fields=DISTILL_FIELDS)
        self.max_seq_len = max_seq_len
        self.served_positions = 0
        self.masks: list[tuple[int, torch.Tensor]] = []  # (sequence, mask) for sequences with a position to learn
        draft.eval()
        for index in range(len(self.shards)):
            item = self._item(index)
            served = item["served"]
            mask = served if focus == "all" else rejected_positions(draft, item["input_ids"], item["topk_ids"][:, 0],
                                                                    served, vocab)
            self.served_positions += int(served.sum())
            if mask.any():  # a sequence with nothing to learn would only cost a forward pass
                self.masks.append((index, mask))

    def _item(self, index: int) -> dict[str, torch.Tensor]:
        item = self.shards[index]
        # Shift before cutting, as DistillDataset does: the last kept row still predicts a served token.
        item["served"] = next_token_mask(item.pop("loss_mask"))
        return {name: tensor[: self.max_seq_len] for name, tensor in item.items()}

    @property
    def focus_positions(self) -> int:
        return sum(int(mask.sum()) for _, mask in self.masks)

    def __len__(self) -> int:
        return len(self.masks)

    def __getitem__(self, index: int) -> dict[str, Any]:
        sequence, mask = self.masks[index]
        item = self._item(sequence)
        item.pop("served")
        return {**item, "mask": mask, "replay": False}


class ReplaySequences(Dataset):
    """A seeded sample of the original training traces, distilled on every response position (replay=True)."""

    def __init__(self, split_dir: Path, n: int, max_seq_len: int, seed: int) -> None:
        self.data = DistillDataset(split_dir, max_seq_len)
        order = torch.randperm(len(self.data), generator=torch.Generator().manual_seed(seed))
        self.indices = order[: min(n, len(self.data))].tolist()

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, index: int) -> dict[str, Any]:
        return {**self.data[self.indices[index]], "replay": True}


def collate_mixed(items: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    batch = collate(items)
    batch["replay"] = torch.tensor([item["replay"] for item in items])  # [B] bool
    return batch


class OSDDistillation(DraftDistillation):
    """DraftDistillation whose loss is mean(served positions) + replay_weight * mean(replay positions),
    so the served mistakes keep their weight however many replay positions a batch holds."""

    def __init__(self, draft: PreTrainedModel, loss: str, cfg: TrainerConfig, replay_weight: float,
                 vocab: torch.Tensor | None = None) -> None:
        super().__init__(draft, loss, cfg, vocab)
        self.replay_weight = replay_weight

    def _loss(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        logits = draft_logits(self.draft, batch["input_ids"], batch["attention_mask"], self.vocab)
        replay = batch["replay"][:, None]  # [B, 1], broadcast over positions
        served = self.divergence(logits, batch, batch["mask"] & ~replay)
        kept = self.divergence(logits, batch, batch["mask"] & replay)
        self.log_dict({"train/served_loss": served, "train/replay_loss": kept}, batch_size=len(replay))
        return served + self.replay_weight * kept


def check_target(split_dir: Path, target: Target) -> TraceShards:
    """The split's traces, refused when another target made them: the draft would learn the wrong distributions."""
    shards = TraceShards(split_dir, fields=())
    reason = target.fingerprint.mismatch(TargetFingerprint(**shards.target))
    if reason:
        raise ValueError(f"The traces in {split_dir} come from another target: {reason}.")
    return shards


def load_parent(drafter_dir: Path, train_embeddings: bool) -> PreTrainedModel:
    """The champion's draft LM in float32, with the embeddings and LM head frozen unless trained."""
    draft = AutoModelForCausalLM.from_pretrained(drafter_dir, dtype=torch.float32)
    if not train_embeddings:
        draft.get_input_embeddings().weight.requires_grad_(False)
        draft.get_output_embeddings().weight.requires_grad_(False)
    return draft


def osd_distill(cfg: OSDConfig, target: Target, parent_dir: Path, served_dir: Path, replay_dir: Path,
                logger: Logger | None = None) -> dict[str, Any]:
    """Distill the parent draft (an HF folder) on the served traces and a replay sample; save it to cfg.out_dir.

    Returns the training report. Both trace splits must come from `target` and share their top-k.
    """
    check_target(served_dir, target)
    pl.seed_everything(cfg.seed, workers=True, verbose=False)
    draft = load_parent(parent_dir, cfg.train_embeddings)
    vocab = load_draft_vocab(parent_dir)  # the child drafts from the parent's vocabulary
    if vocab is not None and cfg.loss != "forward_kl":
        raise ValueError(f"The parent draft in {parent_dir} has a draft vocabulary, which trains with forward_kl; "
                         f"osd.loss is '{cfg.loss}'.")
    served = ServedSequences(served_dir, draft, cfg.focus, cfg.max_seq_len, vocab)
    if not len(served):
        raise ValueError(f"The parent draft already agrees with the target on every served position in "
                         f"{served_dir}: nothing to distill (focus '{cfg.focus}').")
    parts: list[Dataset] = [served]
    replay_n = round(cfg.replay_ratio * len(served))
    if replay_n:
        replay_k = check_target(replay_dir, target).plan["top_k"]
        if replay_k != served.shards.plan["top_k"]:
            raise ValueError(f"The replay traces in {replay_dir} keep the top-{replay_k} and the served ones the "
                             f"top-{served.shards.plan['top_k']}; they are distilled in the same batches, so they "
                             "must match (collect.top_k_logits).")
        parts.append(ReplaySequences(replay_dir, replay_n, cfg.max_seq_len, cfg.seed))
    data = ConcatDataset(parts)
    draft.train()  # from_pretrained and the mask pass left it in eval mode; Lightning keeps modules' modes
    loader = DataLoader(data, batch_size=cfg.batch_size, shuffle=True, collate_fn=collate_mixed,
                        generator=torch.Generator().manual_seed(cfg.seed))
    module = OSDDistillation(draft, cfg.loss, cfg, cfg.replay_weight, vocab)
    if logger is not None:
        logger.log_hyperparams({**asdict(cfg), "target": target.fingerprint.name, "parent": str(parent_dir)})
    tracker = RunTracker(cfg, "osd")
    trainer = build_trainer(cfg, logger, has_val=False, tracker=tracker)
    start = time.perf_counter()
    trainer.fit(module, train_dataloaders=loader)
    report = {
        "served_sequences": len(served.shards), "focused_sequences": len(served),
        "served_positions": served.served_positions, "focus_positions": served.focus_positions,
        # Under greedy verification, the parent's per-token acceptance on this traffic.
        "parent_agreement": round(1 - served.focus_positions / max(served.served_positions, 1), 4)
        if cfg.focus == "rejected" else None,
        "replay_sequences": len(data) - len(served), "steps": trainer.global_step,
        "final_loss": tracker.train[-1]["loss"], "loss": cfg.loss, "focus": cfg.focus,
        "seconds": round(time.perf_counter() - start, 3),
    }
    state = full_state_dict(draft, trainer.strategy)
    if trainer.is_global_zero:
        info = {"target": target.fingerprint.to_dict(), "parent": str(parent_dir), "osd": asdict(cfg), "report": report}
        save_draft(state, draft, target, Path(cfg.out_dir), info, vocab)
    log.info("osd: %s", report)
    return report
