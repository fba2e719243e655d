"""The SpecDec++ acceptance head: P(the target accepts this draft token), read off the draft LM.

SpecDec++ (Huang, Guo & Wang, arXiv 2405.19715) adds a small head on the draft model's last hidden
state and stops a draft once the predicted probability that some drafted token is rejected exceeds
a threshold (see specops/core/policies.py).

Inputs. The paper's head reads the hidden state at the draft token's own position, which costs one
more draft forward before each stop decision. Ours reads the state that *proposed* the token (the
LM head's input h [H]) plus two features of the draft's distribution q = softmax(logits) at
temperature 1: q(x) of the drafted token x and q's entropy divided by log V. The stop decision
then needs no extra draft forward, and at greedy drafting x = argmax q is a function of h anyway.

Calibration. Training uses a BCE that weighs rejections `rejection_weight` times more than
acceptances (specops/train/train_acceptance.py). Its minimizer is the true probability with its odds divided
by that weight, so `accept_prob` adds log(rejection_weight) back to the logit: the policy multiplies
these probabilities, so they must mean what they say.

Saved as config.json + model.safetensors; nothing is pickled.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

FORMAT = "specops-acceptance-head"
VERSION = 1
CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
HEAD_COMPONENT = "acceptance_head"  # the bundle component folder holding a head
EXTRA_FEATURES = 2  # q(x) and the normalized entropy of q


@dataclass(frozen=True)
class AcceptanceHeadConfig:
    hidden_size: int  # the draft LM's hidden size (its LM head's input)
    hidden_units: int = 128  # MLP width; 0 makes the head a logistic regression
    rejection_weight: float = 1.0  # the BCE weight of rejections it was trained with (undone by accept_prob)

    def __post_init__(self) -> None:
        if self.hidden_size < 1 or self.hidden_units < 0:
            raise ValueError(f"Bad acceptance head sizes: hidden_size={self.hidden_size}, "
                             f"hidden_units={self.hidden_units}.")
        if self.rejection_weight <= 0:
            raise ValueError(f"rejection_weight must be > 0, got {self.rejection_weight}.")


def acceptance_features(hidden: torch.Tensor, logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """hidden [N, H], draft logits [N, V], drafted tokens [N] -> features [N, H + 2], float32."""
    log_q = logits.float().log_softmax(-1)  # [N, V]
    q_x = log_q.gather(-1, tokens[:, None]).exp()  # [N, 1]
    # entr(0) = 0: a draft with a reduced vocabulary gives the other tokens logit -inf.
    entropy = torch.special.entr(log_q.exp()).sum(-1, keepdim=True) / math.log(logits.shape[-1])  # [N, 1], in [0, 1]
    return torch.cat([hidden.float(), q_x, entropy], dim=-1)


class AcceptanceHead(nn.Module):
    """features [N, H + 2] -> acceptance logits [N] (uncorrected; see the module docstring)."""

    def __init__(self, config: AcceptanceHeadConfig) -> None:
        super().__init__()
        self.config = config
        width = config.hidden_size + EXTRA_FEATURES
        if config.hidden_units:
            self.net: nn.Module = nn.Sequential(nn.Linear(width, config.hidden_units), nn.SiLU(),
                                                nn.Linear(config.hidden_units, 1))
        else:
            self.net = nn.Linear(width, 1)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.net(features).squeeze(-1)

    def calibrated(self, logits: torch.Tensor) -> torch.Tensor:
        """Acceptance probabilities from raw logits, with the weighting's odds shift undone."""
        return torch.sigmoid(logits + math.log(self.config.rejection_weight))

    def accept_prob(self, hidden: torch.Tensor, logits: torch.Tensor, token: int) -> float:
        """P(accept) of one drafted token from the draft state that proposed it: hidden [H], logits [V]."""
        features = acceptance_features(hidden[None], logits[None], torch.tensor([token]))
        return float(self.calibrated(self(features))[0])

    def save(self, out_dir: Path | str) -> Path:
        out_dir = Path(out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        config = {"format": FORMAT, "version": VERSION, **asdict(self.config)}
        (out_dir / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
        save_file({name: t.detach().contiguous() for name, t in self.state_dict().items()}, str(out_dir / WEIGHTS_FILE))
        return out_dir

    @classmethod
    def load(cls, path: Path | str) -> AcceptanceHead:
        path = Path(path)
        if not (path / CONFIG_FILE).is_file() or not (path / WEIGHTS_FILE).is_file():
            raise FileNotFoundError(f"{path} is not an acceptance head folder: it needs {CONFIG_FILE} and "
                                    f"{WEIGHTS_FILE} (train one with `specops stage train_acceptance`).")
        config = json.loads((path / CONFIG_FILE).read_text())
        if config.pop("format", None) != FORMAT or config.pop("version", None) != VERSION:
            raise ValueError(f"{path / CONFIG_FILE} is not a version-{VERSION} {FORMAT} config.")
        unknown = sorted(set(config) - set(AcceptanceHeadConfig.__dataclass_fields__))
        if unknown:
            raise ValueError(f"{path / CONFIG_FILE} has unknown key(s): {', '.join(unknown)}.")
        head = cls(AcceptanceHeadConfig(**config))
        head.load_state_dict(load_file(str(path / WEIGHTS_FILE)))
        return head.eval()
