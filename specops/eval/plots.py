"""Plots of the evaluate stages: PNGs (logged to MLflow, one image per run) and, for the evaluate stage,
the data behind them, which DVC draws itself, so `dvc plots diff` overlays experiments and revisions."""

from __future__ import annotations

import csv
import shutil
from collections.abc import Iterable
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


def evaluation_plots(methods: dict[str, dict[str, Any]], out_dir: Path) -> list[Path]:
    """The evaluate stage's plots in out_dir; dvc.yaml declares each, with the fields DVC draws from the data."""
    return [acceptance_per_position(methods, out_dir / "acceptance_per_position.png"),
            speedup_per_method(methods, out_dir / "speedup.png"),
            acceptance_data(methods, out_dir / "acceptance_per_position"),
            speedup_data(methods, out_dir / "speedup.csv")]


def acceptance_data(methods: dict[str, dict[str, Any]], out_dir: Path) -> Path:
    """One CSV (position, acceptance) per method with drafts: DVC draws one chart per method, with a line per
    experiment or revision."""
    shutil.rmtree(out_dir, ignore_errors=True)  # a method no longer evaluated leaves no file behind
    out_dir.mkdir(parents=True)
    for name, row in methods.items():
        if rates := row.get("acceptance_per_position"):
            _write_csv(out_dir / f"{name}.csv", ("position", "acceptance"), enumerate(rates, start=1))
    return out_dir


def speedup_data(methods: dict[str, dict[str, Any]], path: Path) -> Path:
    """method, speedup_vs_ar: DVC's bar_horizontal template puts the experiments' bars side by side per method."""
    return _write_csv(path, ("method", "speedup_vs_ar"), ((name, row["speedup_vs_ar"]) for name, row in methods.items()))


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


def speedup_vs_length(series: dict[str, list[tuple[float, float]]], path: Path, ylabel: str) -> Path:
    """One line per method: (prompt tokens, speedup) points, with the break-even line at 1x."""
    fig, ax = plt.subplots(figsize=(7, 4))
    for name, points in series.items():
        ax.plot([x for x, _ in points], [y for _, y in points], marker="o", label=name)
    ax.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
    ax.set(xlabel="prompt tokens", ylabel=ylabel, title="Speedup as the prompt grows")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return _save(fig, path)


def _save(fig: Any, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _write_csv(path: Path, header: tuple[str, ...], rows: Iterable[tuple[Any, ...]]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(header)
        writer.writerows(rows)
    return path
