"""Lightning settings shared by the training stages, and the one place a Trainer is built from them."""

from __future__ import annotations

from dataclasses import dataclass

import pytorch_lightning as pl
from pytorch_lightning.loggers import Logger

from training.strategies import STRATEGIES, make_strategy


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
    """Lightning strategy: auto, ddp, fsdp, deepspeed_stage_2 or deepspeed_stage_3 (see training.strategies)."""
    deepspeed_config: str | None = None
    """DeepSpeed JSON replacing training/deepspeed/zero{2,3}.json; only with a deepspeed strategy."""
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
