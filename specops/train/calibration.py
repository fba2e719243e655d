"""Calibration of predicted probabilities: reliability bins, expected calibration error and the plot."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import matplotlib
import torch

matplotlib.use("Agg")  # files only; no display on servers and CI
import matplotlib.pyplot as plt  # noqa: E402


@dataclass
class Calibration:
    """Equal-width bins over [0, 1]; empty bins are left out."""

    predicted: list[float]  # mean predicted probability in each bin
    observed: list[float]  # mean observed outcome (a soft label is an expected outcome) in each bin
    counts: list[int]
    ece: float  # expected calibration error: sum over bins of count/N * |predicted - observed|
    bins: int

    def to_dict(self) -> dict[str, object]:
        return {"predicted": self.predicted, "observed": self.observed, "counts": self.counts, "ece": self.ece,
                "bins": self.bins}


def calibration(predicted: torch.Tensor, observed: torch.Tensor, bins: int) -> Calibration:
    """predicted [N] probabilities, observed [N] outcomes in [0, 1] -> reliability bins."""
    if bins < 1:
        raise ValueError(f"bins must be >= 1, got {bins}")
    if predicted.shape != observed.shape or predicted.numel() == 0:
        raise ValueError(f"Need two equal, non-empty shapes; got {tuple(predicted.shape)} and {tuple(observed.shape)}.")
    index = (predicted * bins).long().clamp(0, bins - 1)  # [N]; p = 1 falls in the last bin
    counts = torch.bincount(index, minlength=bins)  # [bins]
    kept = counts > 0
    mean_predicted = torch.bincount(index, weights=predicted.double(), minlength=bins)[kept] / counts[kept]
    mean_observed = torch.bincount(index, weights=observed.double(), minlength=bins)[kept] / counts[kept]
    ece = float((counts[kept] / predicted.numel() * (mean_predicted - mean_observed).abs()).sum())
    return Calibration(mean_predicted.tolist(), mean_observed.tolist(), counts[kept].tolist(), ece, bins)


def plot_calibration(result: Calibration, path: Path | str, title: str) -> Path:
    """Reliability diagram (observed vs predicted, with the diagonal) above a histogram of predictions."""
    path = Path(path)
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(5, 6), sharex=True, gridspec_kw={"height_ratios": [3, 1]})
    top.plot([0, 1], [0, 1], color="gray", linestyle="--", linewidth=0.8, label="perfect calibration")
    top.plot(result.predicted, result.observed, marker="o", label=f"head (ECE {result.ece:.3f})")
    top.set(ylabel="observed acceptance", xlim=(0, 1), ylim=(0, 1.02), title=title)
    top.grid(alpha=0.3)
    top.legend(fontsize=8)
    bottom.bar(result.predicted, result.counts, width=0.8 / result.bins, color="tab:blue", alpha=0.6)
    bottom.set(xlabel="predicted P(accept)", ylabel="positions")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
