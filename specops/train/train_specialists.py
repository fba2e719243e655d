"""Stage train_specialists: CoSine's specialized drafters (arXiv 2503.10325), one per slice of the traces.

Each specialist starts from the general draft LM (train_draft's folder) and goes on distilling the target
on the traces of its own prompt sources only (e.g. `code`: HumanEval, `chat`: ShareGPT), with
train_draft's loss and trainer: cheaper than training each from scratch, and each keeps the general
draft's vocabulary (FR-Spec rows), so every specialist proposes over the same draft vocabulary. A trace
sequence's source comes from its prompt row (the traces keep each sequence's prompt id; the prepared
splits map it to a source). The cosine drafters (specops.drafters.cosine) route between them and fuse
their proposals.

Output: out_dir/<name>/ is a draft LM folder (train_draft's format) per specialist, and
out_dir/config.json names them in order, with their sources and training reports.
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
from pytorch_lightning.loggers import Logger
from transformers import AutoModelForCausalLM

from specops.core.target import Target
from specops.data.prompts import read_split
from specops.drafters.cosine import SPECIALISTS_FILE
from specops.drafters.draft_lm import load_draft_vocab
from specops.train.losses import LOSSES
from specops.train.train_draft import DistillDataset, DraftDistillation, check_traces, collate, save_draft
from specops.train.trainer import TraceDataModule, TrainerConfig, fit

log = logging.getLogger(__name__)

SPLITS = ("train", "val")


@dataclass
class TrainSpecialistsConfig(TrainerConfig):
    """params.yaml section `train_specialists`."""

    slices: dict[str, list[str]] = field(default_factory=lambda: {"code": ["humaneval"], "chat": ["sharegpt"]})
    """Specialist name -> the prompt sources (a prepared row's `source`) whose traces it trains on."""
    loss: str = "forward_kl"
    """Distillation loss, one of specops.train.losses.LOSSES (forward_kl with a draft vocabulary)."""
    train_embeddings: bool = False
    """Also train the input embeddings and the LM head (off: the general draft's, frozen)."""
    out_dir: str = "models/specialists"
    """Where out_dir/<name>/ and out_dir/config.json are written."""

    def __post_init__(self) -> None:
        self.check_trainer("train_specialists")
        if self.loss not in LOSSES:
            raise ValueError(f"train_specialists.loss '{self.loss}' is unknown. Choose one of: {', '.join(LOSSES)}.")
        if len(self.slices) < 2 or not all(self.slices.values()):
            raise ValueError("train_specialists.slices needs at least two specialists, each with at least one source.")


class SliceDataset(DistillDataset):
    """The sequences of one trace split whose prompt id is in `keep`."""

    def __init__(self, split_dir: Path, max_seq_len: int, keep: frozenset[str]) -> None:
        super().__init__(split_dir, max_seq_len)
        self.rows = [i for i, prompt_id in enumerate(self.shards.prompt_ids) if prompt_id in keep]

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> dict[str, Any]:
        return super().__getitem__(self.rows[index])


def prompt_sources(prompts_dir: Path) -> dict[str, str]:
    """Prompt id -> source, over the prepared train and val splits (the ones traces are collected from)."""
    return {row["id"]: row["source"] for split in SPLITS if (prompts_dir / f"{split}.jsonl").is_file()
            for row in read_split(prompts_dir / f"{split}.jsonl")}


def train_specialist(cfg: TrainSpecialistsConfig, name: str, target: Target, base_dir: Path, traces_dir: Path,
                     keep: frozenset[str], logger: Logger | None) -> dict[str, Any]:
    """Continue distilling the draft LM in base_dir on the sequences whose prompt is in `keep`;
    save it to out_dir/name and return its training report."""
    sequences = len(SliceDataset(traces_dir / "train", cfg.max_seq_len, keep))
    if not sequences:
        raise ValueError(f"train_specialists: no train traces for specialist '{name}' ({', '.join(cfg.slices[name])}).")
    cfg = replace(cfg, curves_dir=f"{cfg.curves_dir}/{name}" if cfg.curves_dir else None)
    pl.seed_everything(cfg.seed, workers=True, verbose=False)
    draft = AutoModelForCausalLM.from_pretrained(base_dir, dtype="float32").train()  # loads in eval mode
    vocab = load_draft_vocab(base_dir)
    if not cfg.train_embeddings:
        draft.get_input_embeddings().weight.requires_grad_(False)
        draft.get_output_embeddings().weight.requires_grad_(False)
    module = DraftDistillation(draft, cfg.loss, cfg, vocab)
    data = TraceDataModule(traces_dir, partial(SliceDataset, keep=keep), collate, cfg.batch_size, cfg.max_seq_len,
                           cfg.seed)
    fitted = fit(cfg, f"train_specialists-{name}", module, data, logger)
    report = {**fitted.report, "sources": cfg.slices[name], "sequences": sequences}
    state = fitted.weights(draft)
    if fitted.trainer.is_global_zero:
        info = {"target": target.fingerprint.to_dict(), "base": str(base_dir), "config": asdict(cfg), "report": report}
        save_draft(state, draft, target, Path(cfg.out_dir) / name, info, vocab)
    fitted.finish()
    return report


def train_specialists(cfg: TrainSpecialistsConfig, target: Target, base_dir: Path | str, prompts_dir: Path | str,
                      traces_dir: Path | str, logger: Logger | None = None) -> dict[str, Any]:
    """One specialist per slice (in cfg.slices' order), then out_dir/config.json; returns the reports."""
    traces_dir, base_dir = Path(traces_dir), Path(base_dir)
    check_traces(traces_dir, target)
    sources = prompt_sources(Path(prompts_dir))
    reports = {}
    for name, wanted in cfg.slices.items():
        keep = frozenset(prompt_id for prompt_id, source in sources.items() if source in wanted)
        reports[name] = train_specialist(cfg, name, target, base_dir, traces_dir, keep, logger)
        log.info("train_specialists: %s %s", name, reports[name])
    manifest = {"specialists": list(cfg.slices), "slices": cfg.slices, "reports": reports}
    (Path(cfg.out_dir) / SPECIALISTS_FILE).write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest
