"""The promotion gate: may a challenger bundle replace the champion? A pure function, no MLflow.

Both sides are described by the bundle's **eval snapshot**: the evaluate stage's numbers for the
bundle's default strategy (the one in its serving.yaml), measured on the test prompts:

    {
        "method": "draft-lm+greedy",     # str: the default strategy that was measured (informative)
        "speedup_vs_ar": 1.42,           # float: wall-clock speedup over plain autoregressive decoding
        "identical_to_plain": True,      # bool: every output is bitwise the target's own plain decoding
                                         # through the same runtime and dtype (lossless)
        "mean_accepted_length": 2.31,    # float: tokens committed per target forward pass
        "quality_drop": 0.004,           # float, lossy modes only: quality lost against the target, 0..1
    }

Extra keys are ignored. `GateConfig.metric` names the number compared (higher is better).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


class GateError(ValueError):
    """The metrics cannot be judged (a key is missing or has the wrong type); the message names it."""


@dataclass
class GateConfig:
    speedup_tolerance: float = 0.05
    """Relative slack: the challenger's `metric` may be at most this fraction below the champion's
    (0.05 = 5%), because wall-clock speedups on a shared CPU jitter by a few percent between runs."""
    metric: str = "speedup_vs_ar"
    """Eval-snapshot key compared between challenger and champion; higher is better."""
    require_lossless: bool = True
    """Refuse any challenger whose default strategy does not reproduce the target's output exactly."""
    max_quality_drop: float = 0.01
    """Only when require_lossless is false: the largest `quality_drop` a lossy challenger may have."""

    def __post_init__(self) -> None:
        if not 0 <= self.speedup_tolerance < 1:
            raise ValueError(f"speedup_tolerance must be in [0, 1), got {self.speedup_tolerance}")
        if not 0 <= self.max_quality_drop <= 1:
            raise ValueError(f"max_quality_drop must be in [0, 1], got {self.max_quality_drop}")


@dataclass(frozen=True)
class GateDecision:
    passed: bool
    reason: str


def _number(metrics: dict[str, Any], key: str, side: str) -> float:
    value = metrics.get(key)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise GateError(f"The {side}'s eval snapshot has no number under '{key}' (got {value!r}). "
                        f"Keys present: {', '.join(sorted(metrics)) or 'none'}.")
    return float(value)


def _flag(metrics: dict[str, Any], key: str, side: str) -> bool:
    value = metrics.get(key)
    # MLflow run metrics store booleans as 0.0/1.0, so accept those as well as true booleans.
    if isinstance(value, bool) or value in (0, 1):
        return bool(value)
    raise GateError(f"The {side}'s eval snapshot has no boolean under '{key}' (got {value!r}).")


def _quality_refusal(challenger: dict[str, Any], cfg: GateConfig) -> str | None:
    """Why the challenger's output quality is unacceptable, or None when it is acceptable."""
    method = challenger.get("method", "the default strategy")
    if _flag(challenger, "identical_to_plain", "challenger"):
        return None
    if cfg.require_lossless:
        return f"not lossless: {method} does not reproduce the target's output (identical_to_plain is false)"
    drop = _number(challenger, "quality_drop", "challenger")
    if drop > cfg.max_quality_drop:
        return f"lossy {method} loses too much quality: quality_drop {drop:.4f} > max_quality_drop {cfg.max_quality_drop:.4f}"
    return None


def decide(challenger: dict[str, Any], champion: dict[str, Any] | None, cfg: GateConfig) -> GateDecision:
    """Judge two eval snapshots (see the module docstring). champion None means there is none yet.

    1. The challenger must be lossless (or, with require_lossless off, within max_quality_drop).
    2. Without a champion, that is enough: the first acceptable challenger wins.
    3. Otherwise its `metric` must be >= champion's * (1 - speedup_tolerance).
    """
    refusal = _quality_refusal(challenger, cfg)
    if refusal:
        return GateDecision(False, refusal)
    ours = _number(challenger, cfg.metric, "challenger")
    if champion is None:
        return GateDecision(True, f"no champion yet: the first acceptable challenger wins ({cfg.metric} {ours:.3f})")
    theirs = _number(champion, cfg.metric, "champion")
    floor = theirs * (1 - cfg.speedup_tolerance)
    comparison = f"{cfg.metric} {ours:.3f} vs champion {theirs:.3f} (floor {floor:.3f} at {cfg.speedup_tolerance:.0%} tolerance)"
    if ours < floor:
        return GateDecision(False, f"slower than the champion beyond tolerance: {comparison}")
    return GateDecision(True, f"as fast as the champion within tolerance: {comparison}")
