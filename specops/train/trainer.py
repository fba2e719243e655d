"""Lightning settings shared by the training stages, the one place a Trainer is built from them, and the
trace data module they all read."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
from pytorch_lightning.loggers import Logger
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from specops.data.traces import MANIFEST
from specops.train.strategies import STRATEGIES, make_strategy


@dataclass
class TrainerConfig:
    """Fields every Lightning training stage's params section shares (stages may change the defaults)."""

    lr: float = 3e-4
    """AdamW learning rate (constant)."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    batch_size: int = 8
    """Sequences per batch and device."""
    epochs: int = 1
    """Passes over the train traces (max_steps stops earlier when set)."""
    max_steps: int = -1
    """Optimizer steps cap; -1 means epochs decide."""
    max_seq_len: int = 1024
    """Longer sequences are cut at this many tokens (the start is kept, as the drafter sees it at inference)."""
    gradient_clip_val: float = 1.0
    """Gradient norm clipping (DeepSpeed gets it through its config); 0 disables it."""
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
        if min(self.batch_size, self.max_seq_len, self.epochs) < 1:
            raise ValueError(f"{section}: batch_size, max_seq_len and epochs must be >= 1.")


def build_trainer(cfg: TrainerConfig, logger: Logger | None, has_val: bool) -> pl.Trainer:
    return pl.Trainer(
        strategy=make_strategy(cfg.strategy, cfg.deepspeed_config), accelerator=cfg.accelerator, devices=cfg.devices,
        num_nodes=cfg.num_nodes, precision=cfg.precision, max_epochs=cfg.epochs, max_steps=cfg.max_steps,
        gradient_clip_val=cfg.gradient_clip_val or None, log_every_n_steps=cfg.log_every_n_steps,
        logger=logger if logger is not None else False, enable_checkpointing=False, enable_model_summary=False,
        num_sanity_val_steps=0, limit_val_batches=1.0 if has_val else 0,
    )


class TraceDataModule(pl.LightningDataModule):
    """Train (shuffled by seed, sharded across ranks) and optional validation batches from
    traces_dir/{train,val}; each stage brings its own dataset view of the shards and its collate."""

    def __init__(self, traces_dir: Path, dataset: Callable[[Path, int], Dataset],
                 collate: Callable[[list[Any]], Any], batch_size: int, max_seq_len: int, seed: int) -> None:
        super().__init__()
        self.traces_dir, self.dataset, self.collate = traces_dir, dataset, collate
        self.batch_size, self.max_seq_len, self.seed = batch_size, max_seq_len, seed
        self.has_val = (traces_dir / "val" / MANIFEST).is_file()

    def setup(self, stage: str) -> None:
        self.train = self.dataset(self.traces_dir / "train", self.max_seq_len)
        self.val = self.dataset(self.traces_dir / "val", self.max_seq_len) if self.has_val else None

    def train_dataloader(self) -> DataLoader:
        # The same explicit sampler under every strategy, so the data order depends on the seed alone:
        # Lightning keeps a DistributedSampler it is given, and sets its epoch for reshuffling.
        sampler = DistributedSampler(self.train, num_replicas=self.trainer.world_size, rank=self.trainer.global_rank,
                                     shuffle=True, seed=self.seed)
        return DataLoader(self.train, batch_size=self.batch_size, sampler=sampler, collate_fn=self.collate)

    def val_dataloader(self) -> DataLoader | list:
        if self.val is None:
            return []
        return DataLoader(self.val, batch_size=self.batch_size, collate_fn=self.collate)
