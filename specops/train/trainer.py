"""Lightning settings shared by the training stages, the one place a Trainer is built from them, the
trace data module they all read, and `fit`, which trains with best-validation selection and resume.

A run of `fit`:
  1. Checkpoints go to checkpoint_dir/<stage>/<key>, the key a hash of the stage's whole config and
     its input files (the trace manifests, which hold every shard's sha256), so a rerun with the same
     settings and data resumes from last.ckpt, and any change starts afresh. The folder is outside
     DVC's outputs, so it survives an interrupted `dvc repro`; a successful run removes the stage's
     folder, since the stage's output is then the exported weights, and a leftover last.ckpt would
     make a rerun forced by a code change (which the key does not see) skip training. For the same
     reason, after a code edit mid-run, delete the folder to start over rather than resume.
  2. Validation runs every val_every_n_steps optimizer steps and after the last; ModelCheckpoint keeps
     the best (lowest val/loss) and the last checkpoint.
  3. The stage exports the best checkpoint's weights (`Fitted.weights`), read from the file, or from
     the folder of ZeRO shards a DeepSpeed checkpoint is.
Mid-epoch resume is exact: the train loader counts the batches it handed out, the checkpoint keeps the
count, and the resumed epoch skips them, so with the same seed a resumed run takes the same steps as
an uninterrupted one (bitwise on the CPU).
"""

from __future__ import annotations

import csv
import hashlib
import json
import logging
import math
import shutil
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import Callback, LearningRateMonitor, ModelCheckpoint
from pytorch_lightning.loggers import Logger
from pytorch_lightning.utilities import rank_zero_warn
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from specops.data.traces import MANIFEST
from specops.train.strategies import STRATEGIES, checkpoint_state_dict, full_state_dict, make_strategy

log = logging.getLogger(__name__)

LR_SCHEDULES = ("constant", "linear", "cosine")
VAL_LOSS = "val/loss"
LAST = "last.ckpt"


@dataclass
class TrainerConfig:
    """Fields every Lightning training stage's params section shares (stages may change the defaults)."""

    lr: float = 3e-4
    """AdamW peak learning rate, reached after the warm-up."""
    lr_schedule: str = "cosine"
    """After the warm-up: constant (stays at lr), linear or cosine (decay to lr x min_lr_ratio at the run's
    last optimizer step)."""
    warmup_ratio: float = 0.05
    """Share of the run's optimizer steps over which the learning rate rises linearly to lr."""
    min_lr_ratio: float = 0.1
    """Floor of the linear and cosine decays, as a fraction of lr."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    batch_size: int = 8
    """Sequences per batch and device."""
    accumulate_grad_batches: int = 1
    """Batches whose gradients make one optimizer step: the effective batch is batch_size x this x devices x
    num_nodes. DeepSpeed gets it through its config, and then it must divide the batches of an epoch."""
    epochs: int = 1
    """Passes over the train traces (max_steps stops earlier when set)."""
    max_steps: int = -1
    """Optimizer steps cap; -1 means epochs decide."""
    max_seq_len: int = 1024
    """Longer sequences are cut at this many tokens (the start is kept, as the drafter sees it at inference)."""
    gradient_clip_val: float = 1.0
    """Gradient norm clipping (DeepSpeed gets it through its config); 0 disables it."""
    val_every_n_steps: int = 50
    """Validate, and checkpoint, every this many optimizer steps and after the last one. The exported
    weights are those of the lowest validation loss. Without a val split, only the checkpoint."""
    checkpoint_dir: str | None = ".cache/checkpoints"
    """Where an unfinished run's checkpoints wait to be resumed: <dir>/<stage>/<hash of config and data>.
    null turns checkpoints off: no resume, and the last weights are exported."""
    curves_dir: str | None = None
    """Training curves for `dvc plots`: train.csv (step, loss, lr per optimizer step) and val.csv (step,
    loss per validation); null writes none."""
    strategy: str = "auto"
    """Lightning strategy: auto, ddp, fsdp, deepspeed_stage_2 or deepspeed_stage_3 (see specops.train.strategies)."""
    deepspeed_config: str | None = None
    """DeepSpeed JSON replacing specops/train/deepspeed/zero{2,3}.json; only with a deepspeed strategy."""
    precision: str = "32-true"
    """Lightning precision, e.g. 32-true, bf16-mixed, 16-mixed."""
    accelerator: str = "auto"
    """Lightning accelerator: auto, cpu, gpu."""
    devices: int = 1
    """Devices (processes) per node."""
    num_nodes: int = 1
    """Machines."""
    log_every_n_steps: int = 10
    """How often the training losses are logged."""
    seed: int = 0
    """Seeds the model's initialization and the data order."""

    def check_trainer(self, section: str) -> None:
        """Raise a ValueError naming `section` for settings Lightning would reject later, mid-run."""
        if self.strategy not in STRATEGIES:
            raise ValueError(f"{section}.strategy '{self.strategy}' is unknown. Choose one of: {', '.join(STRATEGIES)}.")
        if self.deepspeed_config and not self.strategy.startswith("deepspeed"):
            raise ValueError(f"{section}.deepspeed_config is set but the strategy is not a deepspeed one.")
        if min(self.batch_size, self.max_seq_len, self.epochs, self.accumulate_grad_batches, self.val_every_n_steps) < 1:
            raise ValueError(f"{section}: batch_size, max_seq_len, epochs, accumulate_grad_batches and "
                             "val_every_n_steps must be >= 1.")
        if self.lr_schedule not in LR_SCHEDULES:
            raise ValueError(f"{section}.lr_schedule '{self.lr_schedule}' is unknown. "
                             f"Choose one of: {', '.join(LR_SCHEDULES)}.")
        if not 0 <= self.warmup_ratio < 1 or not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"{section}: warmup_ratio must be in [0, 1) and min_lr_ratio in [0, 1], "
                             f"got {self.warmup_ratio} and {self.min_lr_ratio}.")


def lr_factor(step: int, total: int, warmup: int, schedule: str, min_ratio: float) -> float:
    """The learning rate of optimizer step `step` (0-based) of `total`, as a fraction of the peak.

    Warm-up: (step + 1) / warmup for the first `warmup` steps, so the first step already moves the
    weights. Then `schedule` over the remaining steps: constant 1, or linear / cosine from 1 down to
    `min_ratio` at step `total` (steps past it stay there).
    """
    if step < warmup:
        return (step + 1) / warmup
    if schedule == "constant":
        return 1.0
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    shape = 1 - progress if schedule == "linear" else 0.5 * (1 + math.cos(math.pi * progress))
    return min_ratio + (1 - min_ratio) * shape


def adamw(parameters: Any, cfg: TrainerConfig, total_steps: int) -> dict[str, Any]:
    """`configure_optimizers`' answer: AdamW with cfg's schedule over `total_steps` optimizer steps, stepped
    per optimizer step (a pure function of the step, so a resumed scheduler needs only its step count)."""
    optimizer = torch.optim.AdamW(parameters, lr=cfg.lr, weight_decay=cfg.weight_decay)
    factor = partial(lr_factor, total=total_steps, warmup=round(cfg.warmup_ratio * total_steps),
                     schedule=cfg.lr_schedule, min_ratio=cfg.min_lr_ratio)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
    return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


class RunTracker(Callback):
    """Per-step bookkeeping of a fit:
      * the train loss (mean over the step's accumulated batches) and learning rate of every optimizer
        step, and the val metrics of every validation, kept in the checkpoints (a resumed run's curves
        are whole) and written as CSV to `curves_dir`;
      * one more validation after the last optimizer step (Lightning validates there when asked to
        stop), so the final weights are a candidate for the best;
      * refuses an accumulation DeepSpeed would count differently from Lightning (see `check_accumulation`).
    """

    def __init__(self, cfg: TrainerConfig, section: str) -> None:
        self.curves_dir = Path(cfg.curves_dir) if cfg.curves_dir else None
        self.section = section
        self.train: list[dict[str, float]] = []  # {step, loss, lr}
        self.val: list[dict[str, float]] = []  # {step, loss, ...}: the val/ metrics without the prefix
        self.start_step = 0
        self.total_steps = 0
        self._losses: list[float] = []
        self._lr = float("nan")

    def state_dict(self) -> dict[str, Any]:
        return {"train": self.train, "val": self.val}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.train, self.val = state_dict["train"], state_dict["val"]

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        check_accumulation(trainer, self.section)
        self.start_step, self.total_steps = trainer.global_step, trainer.estimated_stepping_batches

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        self._lr = optimizer.param_groups[0]["lr"]  # the step's own: the scheduler moves it right after

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        # Lightning divides each batch's loss by accumulate_grad_batches before backward.
        self._losses.append(float(outputs["loss"]) * trainer.accumulate_grad_batches)
        if trainer.global_step > (self.train[-1]["step"] if self.train else self.start_step):
            self.train.append({"step": trainer.global_step, "loss": sum(self._losses) / len(self._losses),
                               "lr": self._lr})
            self._losses = []
            if trainer.global_step >= self.total_steps:
                trainer.should_stop = True

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # Runs before ModelCheckpoint's hook (Lightning orders checkpoint callbacks last), so the
        # checkpoint it saves already holds this row.
        metrics = {name.removeprefix("val/"): float(value) for name, value in trainer.callback_metrics.items()
                   if name.startswith("val/")}
        self.val.append({"step": trainer.global_step, **metrics})
        self.write(trainer)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.write(trainer)

    def write(self, trainer: pl.Trainer) -> None:
        if self.curves_dir is None or not trainer.is_global_zero:
            return
        self.curves_dir.mkdir(parents=True, exist_ok=True)
        for name, rows in (("train.csv", self.train), ("val.csv", self.val)):
            with open(self.curves_dir / name, "w", newline="") as f:
                writer = csv.DictWriter(f, list(rows[0]) if rows else ["step", "loss"])
                writer.writeheader()
                writer.writerows(rows)

    def best(self) -> dict[str, float] | None:
        """The first validation with the lowest loss: the one ModelCheckpoint keeps (it replaces only on a
        strictly lower loss)."""
        return min(self.val, key=lambda row: row["loss"]) if self.val else None


def check_accumulation(trainer: pl.Trainer, section: str) -> None:
    """Lightning restarts accumulation at each epoch and steps on an epoch's last batch; DeepSpeed counts
    batches across epochs and never steps early. They agree only when accumulation divides an epoch."""
    acc, batches = trainer.accumulate_grad_batches, trainer.num_training_batches
    if batches % acc == 0:
        return
    if trainer.strategy.handles_gradient_accumulation:
        raise ValueError(f"{section}.accumulate_grad_batches {acc} does not divide the {batches} batches of an epoch, "
                         "so DeepSpeed's optimizer steps would drift from Lightning's (and from the learning-rate "
                         "schedule). Choose an accumulate_grad_batches that divides it, or change batch_size.")
    if trainer.max_epochs != 1:
        rank_zero_warn(f"{section}.accumulate_grad_batches {acc} does not divide the {batches} batches of an epoch: "
                       "after the first epoch, a validation can fall mid-accumulation, and resuming from its "
                       "checkpoint restarts that step's accumulation.")


def build_trainer(cfg: TrainerConfig, logger: Logger | None, has_val: bool, tracker: RunTracker,
                  checkpoint: ModelCheckpoint | None = None) -> pl.Trainer:
    callbacks: list[Callback] = [tracker] + ([checkpoint] if checkpoint else [])
    if logger is not None:
        callbacks.append(LearningRateMonitor(logging_interval="step"))
    return pl.Trainer(
        strategy=make_strategy(cfg.strategy, cfg.deepspeed_config), accelerator=cfg.accelerator, devices=cfg.devices,
        num_nodes=cfg.num_nodes, precision=cfg.precision, max_epochs=cfg.epochs, max_steps=cfg.max_steps,
        accumulate_grad_batches=cfg.accumulate_grad_batches, gradient_clip_val=cfg.gradient_clip_val or None,
        # Counted in batches across epochs (check_val_every_n_epoch=None), so short runs validate too.
        val_check_interval=cfg.val_every_n_steps * cfg.accumulate_grad_batches, check_val_every_n_epoch=None,
        log_every_n_steps=cfg.log_every_n_steps, logger=logger if logger is not None else False, callbacks=callbacks,
        enable_checkpointing=checkpoint is not None, enable_model_summary=False, num_sanity_val_steps=0,
        limit_val_batches=1.0 if has_val else 0,
    )


class ResumableSampler(DistributedSampler):
    """DistributedSampler whose next pass starts `start` indices in (then `start` goes back to 0)."""

    start = 0

    def __iter__(self) -> Iterator[int]:
        indices = list(super().__iter__())
        start, self.start = self.start, 0
        return iter(indices[start:])


class ResumableLoader(DataLoader):
    """A DataLoader Lightning checkpoints mid-epoch (it saves and restores any loader with state_dict and
    load_state_dict): it counts the batches of the current pass it handed out, and after load_state_dict
    its next pass skips them in the sampler, so the resumed epoch gets exactly the batches the
    interrupted one had left. Lightning does not prefetch from a loader with a length, so the count is
    the number of batches trained on."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.served = 0
        self.skip = 0

    def state_dict(self) -> dict[str, int]:
        return {"served": self.served}

    def load_state_dict(self, state_dict: dict[str, int]) -> None:
        # A checkpoint from an epoch's last batch resumes at the next epoch's start.
        self.skip = state_dict["served"] if state_dict["served"] < len(self) else 0

    def __iter__(self) -> Iterator[Any]:
        self.served, self.skip = self.skip, 0
        self.sampler.start = self.served * self.batch_size
        for batch in super().__iter__():
            self.served += 1
            yield batch


class TraceDataModule(pl.LightningDataModule):
    """Train (shuffled by seed, sharded across ranks) and optional validation batches from
    traces_dir/{train,val}; each stage brings its own dataset view of the shards and its collate."""

    def __init__(self, traces_dir: Path, dataset: Callable[[Path, int], Dataset],
                 collate: Callable[[list[Any]], Any], batch_size: int, max_seq_len: int, seed: int) -> None:
        super().__init__()
        self.traces_dir, self.dataset, self.collate = traces_dir, dataset, collate
        self.batch_size, self.max_seq_len, self.seed = batch_size, max_seq_len, seed
        self.has_val = (traces_dir / "val" / MANIFEST).is_file()
        self.loader: ResumableLoader | None = None
        self.loader_state: dict[str, int] | None = None

    @property
    def manifests(self) -> list[Path]:
        """The files that pin the data: each manifest lists its shards' sha256."""
        return [self.traces_dir / split / MANIFEST for split in ("train", "val") if (self.traces_dir / split / MANIFEST).is_file()]

    def setup(self, stage: str) -> None:
        self.train = self.dataset(self.traces_dir / "train", self.max_seq_len)
        self.val = self.dataset(self.traces_dir / "val", self.max_seq_len) if self.has_val else None

    def train_dataloader(self) -> DataLoader:
        # The same explicit sampler under every strategy, so the data order depends on the seed alone:
        # Lightning keeps a DistributedSampler it is given, and sets its epoch for reshuffling.
        sampler = ResumableSampler(self.train, num_replicas=self.trainer.world_size, rank=self.trainer.global_rank,
                                   shuffle=True, seed=self.seed)
        self.loader = ResumableLoader(self.train, batch_size=self.batch_size, sampler=sampler, collate_fn=self.collate)
        state, self.loader_state = self.loader_state, None
        if state:
            self.loader.load_state_dict(state)
        return self.loader

    # The loader's count also travels as the data module's state. Lightning restores a loader's own
    # state only into a loader made after the restore, and `estimated_stepping_batches` (the schedule's
    # length, asked for in configure_optimizers) makes it before; the data module is restored either way.
    def state_dict(self) -> dict[str, Any]:
        return self.loader.state_dict() if self.loader else {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if self.loader:
            self.loader.load_state_dict(state_dict)
        else:
            self.loader_state = state_dict

    def val_dataloader(self) -> DataLoader | list:
        if self.val is None:
            return []
        return DataLoader(self.val, batch_size=self.batch_size, collate_fn=self.collate)


def run_key(stage: str, cfg: TrainerConfig, inputs: list[Path]) -> str:
    """16 hex digits of the sha256 of the stage name, its whole config and its input files' bytes."""
    digest = hashlib.sha256(json.dumps({"stage": stage, "config": asdict(cfg)}, sort_keys=True, default=str).encode())
    for path in inputs:
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


@dataclass
class Fitted:
    """A finished fit. `report`: steps, seconds, final_loss (train, last step), val_loss (of the exported
    weights), best_step (theirs, when selected), final_val_loss, resumed_from_step (None for a fresh run)."""

    trainer: pl.Trainer
    module: pl.LightningModule
    report: dict[str, Any]
    val_metrics: dict[str, float]
    """The exported weights' val/ metrics; empty without a val split."""
    best_path: str
    stage_dir: Path | None

    def weights(self, model: torch.nn.Module) -> dict[str, torch.Tensor] | None:
        """The weights to export of `model`, a child of the LightningModule: the best checkpoint's, read on
        rank zero (None on the others), or without one the final weights (collective: call it on every rank)."""
        if not self.best_path:
            return full_state_dict(model, self.trainer.strategy)
        if not self.trainer.is_global_zero:
            return None
        prefix = next(name for name, child in self.module.named_children() if child is model) + "."
        state = checkpoint_state_dict(Path(self.best_path))
        return {name.removeprefix(prefix): tensor for name, tensor in state.items() if name.startswith(prefix)}

    def finish(self) -> None:
        """Drop the stage's checkpoints, once the weights are exported (see the module docstring)."""
        if self.stage_dir is not None and self.trainer.is_global_zero:
            shutil.rmtree(self.stage_dir, ignore_errors=True)


def checkpointing(cfg: TrainerConfig, run_dir: Path, has_val: bool) -> ModelCheckpoint:
    if not has_val:  # nothing to select by: only last.ckpt, for resume
        return ModelCheckpoint(dirpath=run_dir, save_top_k=0, save_last=True, every_n_train_steps=cfg.val_every_n_steps)
    return ModelCheckpoint(dirpath=run_dir, filename="best", monitor=VAL_LOSS, mode="min", save_top_k=1, save_last=True,
                           save_on_train_epoch_end=False, enable_version_counter=False)


def fit(cfg: TrainerConfig, stage: str, module: pl.LightningModule, data: TraceDataModule,
        logger: Logger | None) -> Fitted:
    """Train `module` on `data`, steps 1-2 of the module docstring; the result says what to export."""
    stage_dir = Path(cfg.checkpoint_dir) / stage if cfg.checkpoint_dir else None
    run_dir = stage_dir / run_key(stage, cfg, data.manifests) if stage_dir else None
    tracker = RunTracker(cfg, stage)
    checkpoint = checkpointing(cfg, run_dir, data.has_val) if run_dir else None
    trainer = build_trainer(cfg, logger, data.has_val, tracker, checkpoint)
    resume = run_dir / LAST if run_dir and (run_dir / LAST).exists() else None
    if resume:
        log.info("%s: resuming from %s (delete it to start over)", stage, resume)
    start = time.perf_counter()
    trainer.fit(module, datamodule=data, ckpt_path=resume)
    seconds = time.perf_counter() - start
    best_path = checkpoint.best_model_path if checkpoint and data.has_val else ""
    exported = tracker.best() if best_path else (tracker.val[-1] if tracker.val else None)
    report = {
        "steps": trainer.global_step, "seconds": round(seconds, 3), "final_loss": tracker.train[-1]["loss"],
        "val_loss": exported["loss"] if exported else None, "best_step": exported["step"] if best_path else None,
        "final_val_loss": tracker.val[-1]["loss"] if tracker.val else None,
        "resumed_from_step": tracker.start_step if resume else None,
    }
    val_metrics = {f"val/{name}": value for name, value in exported.items() if name != "step"} if exported else {}
    return Fitted(trainer, module, report, val_metrics, best_path, stage_dir)
