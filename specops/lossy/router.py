"""The lossy modes' classifier: a logistic regression on standardized features.

One class serves both lossy modes. It predicts P(accepting the draft here costs quality):
  - AutoJudge (arXiv 2504.20039): P(a mismatching draft token is *important*), features at the mismatch;
  - Arbitrage (arXiv 2512.05033): P(the target's step is meaningfully better than the draft's step).
A draft token or step is accepted when that probability is below the threshold, so threshold 0
accepts nothing lossy (lossless) and larger thresholds trade quality for speed.

Saved as config.json + model.safetensors (mean, scale, weight, bias); nothing is pickled.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

FORMAT = "specops-router"
VERSION = 1
CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
COMPONENT = "router"  # the bundle folder holding one subfolder per lossy mode
KINDS = ("autojudge", "arbitrage")


class RouterLoadError(ValueError):
    """A router folder is missing, malformed or was trained for another setup; the message says which."""


@dataclass
class RouterConfig:
    kind: str  # one of KINDS
    input_dim: int  # feature width (see specops/lossy/autojudge.py and specops/lossy/arbitrage.py for the layout)
    threshold: float  # default acceptance threshold, chosen by the training sweep
    scorer: str  # the quality scorer whose changes defined the labels (specops/train/scorers.py)
    target: dict[str, str] = field(default_factory=dict)  # fingerprint of the target it was mined on
    extra: dict[str, Any] = field(default_factory=dict)  # mode settings the features depend on (step delimiter)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise RouterLoadError(f"Unknown router kind '{self.kind}'. Choose one of: {', '.join(KINDS)}.")
        if self.input_dim < 1:
            raise RouterLoadError(f"Router input_dim must be >= 1, got {self.input_dim}.")


class LinearRouter(torch.nn.Module):
    """features [n, D] -> P(accepting the draft costs quality) [n]."""

    def __init__(self, config: RouterConfig) -> None:
        super().__init__()
        self.config = config
        d = config.input_dim
        self.register_buffer("mean", torch.zeros(d))
        self.register_buffer("scale", torch.ones(d))
        self.linear = torch.nn.Linear(d, 1)

    def logits(self, features: torch.Tensor) -> torch.Tensor:
        if features.shape[-1] != self.config.input_dim:
            raise ValueError(f"The {self.config.kind} router reads {self.config.input_dim} features, got "
                             f"{features.shape[-1]}: it was trained with other models.")
        return self.linear((features.float() - self.mean) / self.scale).squeeze(-1)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(self.logits(features))

    def save(self, directory: str | Path) -> Path:
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        tensors = {"mean": self.mean, "scale": self.scale, "weight": self.linear.weight.detach()[0],
                   "bias": self.linear.bias.detach()}
        save_file({k: v.contiguous().float() for k, v in tensors.items()}, str(directory / WEIGHTS_FILE))
        config = {"format": FORMAT, "version": VERSION, **asdict(self.config)}
        (directory / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
        return directory

    @classmethod
    def load(cls, directory: str | Path, kind: str | None = None) -> LinearRouter:
        """Load a saved router; with `kind`, refuse one trained for the other lossy mode."""
        directory = Path(directory)
        if not (directory / CONFIG_FILE).is_file() or not (directory / WEIGHTS_FILE).is_file():
            raise RouterLoadError(f"{directory} is not a router folder (needs {CONFIG_FILE} and {WEIGHTS_FILE}); "
                                  "run the train_router stage.")
        data = json.loads((directory / CONFIG_FILE).read_text())
        if data.pop("format", None) != FORMAT or data.pop("version", None) != VERSION:
            raise RouterLoadError(f"{directory / CONFIG_FILE} is not a {FORMAT} v{VERSION} config.")
        try:
            config = RouterConfig(**data)
        except TypeError as error:  # missing or unknown keys
            raise RouterLoadError(f"{directory / CONFIG_FILE}: {error}") from error
        if kind is not None and config.kind != kind:
            raise RouterLoadError(f"{directory} holds a {config.kind} router, not a {kind} one.")
        router = cls(config)
        tensors = load_file(str(directory / WEIGHTS_FILE))
        d = config.input_dim
        shapes = {"mean": (d,), "scale": (d,), "weight": (d,), "bias": (1,)}
        wrong = [name for name, shape in shapes.items() if name not in tensors or tuple(tensors[name].shape) != shape]
        if wrong:
            raise RouterLoadError(f"{directory / WEIGHTS_FILE}: {', '.join(wrong)} missing or not sized for "
                                  f"input_dim {d}.")
        with torch.no_grad():
            router.mean.copy_(tensors["mean"])
            router.scale.copy_(tensors["scale"])
            router.linear.weight.copy_(tensors["weight"][None])
            router.linear.bias.copy_(tensors["bias"])
        return router.eval()
