"""Lightning training strategies by name, including a DeepSpeed strategy that also runs on the CPU.

Lightning's DeepSpeedStrategy refuses any accelerator but CUDA, yet DeepSpeed itself runs ZeRO 0-3 on
the CPU (its CPU accelerator over gloo). `CPUDeepSpeedStrategy` lifts Lightning's three CUDA
assumptions and changes nothing else, so a CPU test runs the code a GPU job runs: Lightning's
DeepSpeed wiring, `deepspeed.initialize`, the ZeRO optimizer, DeepSpeed's backward and step.
  1. setup_environment: skip the CUDA-only check when the accelerator is the CPU.
  2. setup_distributed: skip the check that devices are cuda:0..n-1 (CPU devices have no index).
  3. root_device: cpu:<local rank>, because DeepSpeed takes the process's rank from the device index
     and, given none, assumes it is alone.
A single CPU process also skips DeepSpeed's shared-memory all-reduce kernel: it only speeds up
several processes on one host, and compiling it costs ~30 s on first use.

The optimizer is the LightningModule's torch AdamW, handed to ZeRO (`zero_allow_untested_optimizer`).
DeepSpeed's fused CPUAdam would JIT-compile C++ on first use and pays off only with optimizer offload
of large models. Anything DeepSpeed does compile goes to TORCH_EXTENSIONS_DIR, by default
.cache/torch_extensions in the project, so it is built once per checkout.

The JSON configs in specops/train/deepspeed/ hold only the ZeRO settings. Lightning fills in the rest from
the Trainer: precision (fp16/bf16 sections), gradient clipping, micro batch size, accumulation.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch
from lightning_fabric.utilities.seed import reset_seed
from pytorch_lightning.accelerators import CPUAccelerator
from pytorch_lightning.strategies import DDPStrategy, DeepSpeedStrategy, Strategy

DEEPSPEED_DIR = Path(__file__).resolve().parent / "deepspeed"
EXTENSIONS_DIR = Path(".cache") / "torch_extensions"  # under the working directory: installed packages are read-only


class CPUDeepSpeedStrategy(DeepSpeedStrategy):
    """Lightning's DeepSpeedStrategy, unchanged on GPUs, made to also run on the CPU (see the module docstring)."""

    def setup_environment(self) -> None:
        if isinstance(self.accelerator, CPUAccelerator):
            DDPStrategy.setup_environment(self)  # the parent's parent: everything but the CUDA check
        else:
            super().setup_environment()

    def setup_distributed(self) -> None:
        if self.root_device.type != "cpu":
            super().setup_distributed()
            return
        reset_seed()
        self.set_world_ranks()
        if self.world_size == 1:
            import deepspeed.ops

            deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
        self._init_deepspeed_distributed()

    @property
    def root_device(self) -> torch.device:
        device = super().root_device
        return torch.device("cpu", self.local_rank) if device.type == "cpu" else device


def deepspeed_strategy(stage: int, config_path: str | None) -> CPUDeepSpeedStrategy:
    """A DeepSpeed strategy from a JSON config (default: specops/train/deepspeed/zero{stage}.json)."""
    path = Path(config_path) if config_path else DEEPSPEED_DIR / f"zero{stage}.json"
    config = json.loads(path.read_text())
    found = config.get("zero_optimization", {}).get("stage")
    if found != stage:
        raise ValueError(f"{path} sets ZeRO stage {found}, but the strategy asks for stage {stage}.")
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(EXTENSIONS_DIR.resolve()))
    return CPUDeepSpeedStrategy(config=config)


STRATEGIES: dict[str, Callable[[str | None], str | Strategy]] = {
    "auto": lambda config_path: "auto",
    "ddp": lambda config_path: "ddp",
    "fsdp": lambda config_path: "fsdp",
    "deepspeed_stage_2": partial(deepspeed_strategy, 2),
    "deepspeed_stage_3": partial(deepspeed_strategy, 3),
}


def make_strategy(name: str, deepspeed_config: str | None = None) -> str | Strategy:
    """The Trainer's `strategy` argument for a params name; `deepspeed_config` overrides the repo's JSON."""
    if name not in STRATEGIES:
        raise ValueError(f"Unknown strategy '{name}'. Choose one of: {', '.join(STRATEGIES)}.")
    return STRATEGIES[name](deepspeed_config)


def full_state_dict(model: torch.nn.Module, strategy: Strategy) -> dict[str, torch.Tensor]:
    """The model's complete tensors on the CPU, gathering ZeRO-3 partitions. Collective: call it on every rank."""
    if isinstance(strategy, DeepSpeedStrategy) and strategy.zero_stage_3:
        import deepspeed

        with deepspeed.zero.GatheredParameters(list(model.parameters()), modifier_rank=None):
            return {name: tensor.detach().cpu().clone() for name, tensor in model.state_dict().items()}
    return {name: tensor.detach().cpu().clone() for name, tensor in model.state_dict().items()}
