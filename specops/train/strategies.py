"""Lightning training strategies by name, including a DeepSpeed strategy that also runs on the CPU.

Lightning's DeepSpeedStrategy refuses any accelerator but CUDA, yet DeepSpeed itself runs ZeRO 0-3 on
the CPU (its CPU accelerator over gloo). `CPUDeepSpeedStrategy` lifts Lightning's three CUDA
assumptions and fixes one accumulation bug, and changes nothing else, so a CPU test runs the code a
GPU job runs: Lightning's DeepSpeed wiring, `deepspeed.initialize`, the ZeRO optimizer, DeepSpeed's
backward and step.
  1. setup_environment: skip the CUDA-only check when the accelerator is the CPU.
  2. setup_distributed: skip the check that devices are cuda:0..n-1 (CPU devices have no index).
  3. root_device: cpu:<local rank>, because DeepSpeed takes the process's rank from the device index
     and, given none, assumes it is alone.
  4. backward (every device): Lightning already divides each batch's loss by accumulate_grad_batches,
     and DeepSpeed's backward divides it again (Lightning-AI/pytorch-lightning#6170), which shrinks the
     gradients by accumulate_grad_batches and so moves the gradient clipping threshold.
A single CPU process also skips DeepSpeed's shared-memory all-reduce kernel: it only speeds up
several processes on one host, and compiling it costs ~30 s on first use.

The optimizer is the LightningModule's torch AdamW, handed to ZeRO (`zero_allow_untested_optimizer`).
DeepSpeed's fused CPUAdam would JIT-compile C++ on first use and pays off only with optimizer offload
of large models. Anything DeepSpeed does compile goes to TORCH_EXTENSIONS_DIR, by default
.cache/torch_extensions in the project, so it is built once per checkout.

The JSON configs in specops/train/deepspeed/ hold only the ZeRO settings. Lightning fills in the rest from
the Trainer: precision (fp16/bf16 sections), gradient clipping, micro batch size, accumulation. A JSON
that sets those itself is refused (TRAINER_KEYS): Lightning would reject the accumulation mid-run and
let the JSON's clipping silently win over the params.

Checkpoints: Lightning saves a DeepSpeed checkpoint as a folder (ZeRO shards of the weights and the
optimizer), not one file; `checkpoint_state_dict` reads either, so the stages export the best weights
alike under every strategy (from a folder: its fp32 master weights, whatever the training precision).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch
from lightning_fabric.utilities.seed import reset_seed
from pytorch_lightning.accelerators import CPUAccelerator
from pytorch_lightning.strategies import DDPStrategy, DeepSpeedStrategy, Strategy

DEEPSPEED_DIR = Path(__file__).resolve().parent / "deepspeed"
EXTENSIONS_DIR = Path(".cache") / "torch_extensions"  # under the working directory: installed packages are read-only
DEEPSPEED_TAG = "checkpoint"  # the tag Lightning's DeepSpeedStrategy.save_checkpoint saves under
# DeepSpeed settings Lightning derives from the Trainer, and the params field each comes from.
TRAINER_KEYS = {"gradient_accumulation_steps": "accumulate_grad_batches", "gradient_clipping": "gradient_clip_val",
                "train_micro_batch_size_per_gpu": "batch_size", "train_batch_size": "batch_size"}


class CPUDeepSpeedStrategy(DeepSpeedStrategy):
    """Lightning's DeepSpeedStrategy made to also run on the CPU, and to scale accumulated gradients as
    Lightning does (see the module docstring)."""

    def backward(self, closure_loss: torch.Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        return super().backward(closure_loss, optimizer, *args, scale_wrt_gas=False, **kwargs)

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
    for key, setting in TRAINER_KEYS.items():
        if key in config:
            raise ValueError(f"{path} sets {key}; set the stage's {setting} in params.yaml instead "
                             "(Lightning passes it to DeepSpeed).")
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


def checkpoint_state_dict(path: Path) -> dict[str, torch.Tensor]:
    """The LightningModule's complete tensors, on the CPU, from a checkpoint Lightning saved: a file, or the
    folder of ZeRO shards of a DeepSpeed strategy (consolidated from its fp32 master weights)."""
    if path.is_dir():
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        return get_fp32_state_dict_from_zero_checkpoint(str(path), tag=DEEPSPEED_TAG)
    return torch.load(path, map_location="cpu", weights_only=True)["state_dict"]
