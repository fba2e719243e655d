"""PNG plots for the evaluate stage (logged to MLflow and shown by `dvc plots`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only; no display on servers and CI
import matplotlib.pyplot as plt  # noqa: E402


def acceptance_per_position(methods: dict[str, dict[str, Any]], path: Path) -> Path:
    fig, ax = plt.subplots(figsize=(7, 4))
    for name, row in methods.items():
        rates = row.get("acceptance_per_position") or []
        if rates:
            ax.plot(range(1, len(rates) + 1), rates, marker="o", label=name)
    ax.set(xlabel="draft position", ylabel="P(accepted | drafted)", ylim=(0, 1.02),
           title="Acceptance per draft position")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return _save(fig, path)


def speedup_per_method(methods: dict[str, dict[str, Any]], path: Path) -> Path:
    names = list(methods)
    speedups = [methods[n]["speedup_vs_ar"] for n in names]
    colors = ["tab:green" if methods[n]["identical_to_plain"] else "tab:red" for n in names]
    fig, ax = plt.subplots(figsize=(max(6, 0.9 * len(names)), 4))
    ax.bar(names, speedups, color=colors)
    ax.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
    for i, value in enumerate(speedups):
        ax.text(i, value, f"{value:.2f}x", ha="center", va="bottom", fontsize=8)
    ax.set(ylabel="speedup vs HF greedy", title="Speedup per method (green: bitwise our plain decoding, same dtype)")
    ax.tick_params(axis="x", rotation=30)
    return _save(fig, path)


def speed_quality(report: dict[str, Any], modes: list[str], path: Path) -> Path:
    """The lossy_eval trade-off: one line per lossy mode over its thresholds, plus the lossless point."""
    fig, ax = plt.subplots(figsize=(7, 4.5))
    lossless = report["lossless"]
    ax.scatter([lossless["speedup_vs_ar"]], [lossless["quality"]], marker="*", s=160, color="black",
               label="lossless speculative", zorder=3)
    for mode in modes:
        points = sorted(report.get(mode, []), key=lambda p: p["threshold"])
        if not points:
            continue
        xs, ys = [p["speedup_vs_ar"] for p in points], [p["quality"] for p in points]
        ax.plot(xs, ys, marker="o", label=mode)
        for p in points:
            ax.annotate(f"{p['threshold']:g}", (p["speedup_vs_ar"], p["quality"]), fontsize=7,
                        textcoords="offset points", xytext=(3, 3))
    ax.axvline(1.0, color="gray", linewidth=0.8, linestyle="--")
    ax.set(xlabel="speedup vs autoregressive greedy", ylabel=f"quality ({report['scorer']})",
           title="Lossy modes: speed vs quality (labels: threshold)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return _save(fig, path)


def _save(fig: Any, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
