"""Stage train_acceptance: the SpecDec++ acceptance head of a trained draft LM (arXiv 2405.19715).

Data. The frozen draft runs over each trace sequence, teacher-forced on the target's response. At
every position whose next token is a response token, the draft proposes x (the argmax of its q, or
a sample from q at temperature 1) and x gets the probability that the target accepts it, computed
from the target's stored top-k log-probs p:

    soft    min(1, p(x) / q(x))    token-wise rejection sampling at temperature 1 (SpecDec++'s label)
    greedy  1 if x = argmax p      the greedy verifier's decision

p(x) is taken as 0 when x is outside the stored top-k. Its true value is at most the k-th stored
probability, so there the soft label can be too low by at most p_k / q(x); the greedy label is exact
(the argmax is always stored). Teacher forcing gives the conditioning the policy needs: acceptance
of a token given that the draft tokens before it were accepted, i.e. given a context the target
itself produced. (The paper's reference code also mixes draft tokens into contexts; we do not.)

Loss. Weighted BCE as in SpecDec++'s reference code: a rejection weighs `rejection_weight` (its best
head used 6), an acceptance 1, normalized by the total weight (see `weighted_bce`). Acceptances
dominate a good draft's positions; the weight keeps the head from settling on "always accept". The
head undoes the resulting odds shift when it predicts (specops/drafters/acceptance_head.py).

Loop. Plain torch rather than Lightning: the draft is frozen, so its features are computed once under
inference_mode and the head (at most ~100k parameters) trains on an in-memory tensor of
N positions x (H + 2) floats in seconds. A trainer, strategies and checkpointing would add nothing.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedModel

from specops.core.target import Target
from specops.data.traces import MANIFEST, TraceShards, next_token_mask
from specops.drafters.acceptance_head import AcceptanceHead, AcceptanceHeadConfig, acceptance_features
from specops.drafters.draft_lm import load_draft, vocab_logits
from specops.train.calibration import calibration, plot_calibration
from specops.train.train_draft import check_traces

log = logging.getLogger(__name__)

INFO_FILE = "specops_training.json"
PROPOSALS = ("argmax", "sample")
LABELS = ("soft", "greedy")
TRACE_FIELDS = ("input_ids", "loss_mask", "topk_ids", "topk_logprobs")


@dataclass
class TrainAcceptanceConfig:
    """params.yaml section `train_acceptance`."""

    hidden_units: int = 128
    """Width of the head's hidden layer; 0 makes it a logistic regression on the features."""
    proposal: str = "argmax"
    """How the draft proposes the token to label: argmax (greedy drafting) or sample (from q at temperature 1)."""
    label: str = "soft"
    """soft: min(1, p(x)/q(x)), acceptance by rejection sampling at temperature 1 (SpecDec++); greedy:
    1 if x is the target's argmax. Train for the verifier you serve: greedy (with proposal argmax) for
    temperature 0."""
    rejection_weight: float = 6.0
    """BCE weight of a rejection (an acceptance weighs 1); SpecDec++'s best head used 6."""
    lr: float = 1e-3
    """AdamW learning rate (constant)."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    batch_size: int = 256
    """Positions per optimizer step."""
    epochs: int = 20
    """Passes over the training positions."""
    calibration_bins: int = 10
    """Equal-width bins of the calibration plot and its expected calibration error."""
    seed: int = 0
    """Seeds the head's initialization, the data order and sampled proposals."""
    out_dir: str = "models/acceptance_head"
    """Where the head is written (config.json + model.safetensors); a bundle ships it as acceptance_head/."""
    plot: str = "metrics/plots/acceptance_calibration.png"
    """The calibration plot (predicted vs observed acceptance on the val split, else train)."""

    def __post_init__(self) -> None:
        if self.proposal not in PROPOSALS:
            raise ValueError(f"train_acceptance.proposal '{self.proposal}' is unknown. Choose one of: {', '.join(PROPOSALS)}.")
        if self.label not in LABELS:
            raise ValueError(f"train_acceptance.label '{self.label}' is unknown. Choose one of: {', '.join(LABELS)}.")
        if self.rejection_weight <= 0 or self.lr <= 0:
            raise ValueError("train_acceptance: rejection_weight and lr must be > 0.")
        if min(self.batch_size, self.epochs, self.calibration_bins) < 1 or self.hidden_units < 0:
            raise ValueError("train_acceptance: batch_size, epochs and calibration_bins must be >= 1, hidden_units >= 0.")


def acceptance_labels(tokens: torch.Tensor, log_q: torch.Tensor, topk_ids: torch.Tensor, topk_logprobs: torch.Tensor,
                      kind: str) -> torch.Tensor:
    """P(the target accepts each proposed token): tokens [M], log q(token) [M], the target's top-k [M, K] -> [M].

    See the module docstring for the two kinds and the top-k truncation.
    """
    if kind == "greedy":
        argmax = topk_ids.gather(-1, topk_logprobs.argmax(-1, keepdim=True)).squeeze(-1)  # [M]
        return (tokens == argmax).float()
    if kind != "soft":
        raise ValueError(f"Unknown label kind '{kind}'. Choose one of: {', '.join(LABELS)}.")
    p = (topk_logprobs.float().exp() * (topk_ids == tokens[:, None])).sum(-1)  # [M]; 0 outside the top-k
    return (p / log_q.float().exp()).clamp(max=1.0)


def weighted_bce(logits: torch.Tensor, labels: torch.Tensor, rejection_weight: float) -> torch.Tensor:
    """SpecDec++'s weighted BCE with soft labels: logits [M], labels [M] in [0, 1] -> scalar.

        L = sum_i [ y_i * -log s(z_i) + w (1 - y_i) * -log(1 - s(z_i)) ] / sum_i [ y_i + w (1 - y_i) ]

    (log-sigmoid keeps it finite for any logit).
    """
    weights = labels + rejection_weight * (1 - labels)  # [M]
    per_position = -(labels * torch.nn.functional.logsigmoid(logits)
                     + rejection_weight * (1 - labels) * torch.nn.functional.logsigmoid(-logits))  # [M]
    return per_position.sum() / weights.sum().clamp_min(1e-12)


@dataclass
class Examples:
    features: torch.Tensor  # [N, H + 2]
    labels: torch.Tensor  # [N]

    def __len__(self) -> int:
        return len(self.labels)


def sequence_examples(draft: PreTrainedModel, item: dict[str, torch.Tensor], cfg: TrainAcceptanceConfig,
                      generator: torch.Generator, vocab: torch.Tensor | None = None) -> Examples:
    """The draft's proposal, head features and label at every position of one trace sequence."""
    rows = next_token_mask(item["loss_mask"])  # [T]: row t predicts token t+1, a response token
    # The LM head runs on the M labelled rows only: over a 49k vocabulary it is most of a small draft's cost.
    if vocab is None:
        out = draft(input_ids=item["input_ids"][None], output_hidden_states=True, logits_to_keep=rows.nonzero()[:, 0])
        hidden, logits = out.hidden_states[-1][0][rows], out.logits[0].float()  # [M, H], [M, V]
    else:  # the same restricted logits the drafter proposes from
        hidden = draft.base_model(input_ids=item["input_ids"][None]).last_hidden_state[0][rows]  # [M, H]
        rows_w = draft.get_output_embeddings().weight[vocab]
        logits = vocab_logits(hidden, rows_w, vocab, draft.config.vocab_size).float()  # [M, V], -inf outside
    log_q = logits.log_softmax(-1)  # [M, V]
    if cfg.proposal == "argmax":
        tokens = log_q.argmax(-1)  # [M]
    else:
        tokens = torch.multinomial(log_q.exp(), 1, generator=generator).squeeze(-1)  # [M]
    labels = acceptance_labels(tokens, log_q.gather(-1, tokens[:, None]).squeeze(-1), item["topk_ids"][rows],
                               item["topk_logprobs"][rows], cfg.label)
    return Examples(acceptance_features(hidden, logits, tokens), labels)


def split_examples(draft: PreTrainedModel, split_dir: Path, cfg: TrainAcceptanceConfig,
                   generator: torch.Generator, vocab: torch.Tensor | None = None) -> Examples:
    shards = TraceShards(split_dir, fields=TRACE_FIELDS)
    with torch.inference_mode():
        parts = [sequence_examples(draft, shards[i], cfg, generator, vocab) for i in range(len(shards))]
    if not parts or not sum(len(p) for p in parts):
        raise ValueError(f"{split_dir} holds no response positions: nothing to train the acceptance head on.")
    return Examples(torch.cat([p.features for p in parts]), torch.cat([p.labels for p in parts]))


def build_head(cfg: TrainAcceptanceConfig, hidden_size: int) -> AcceptanceHead:
    """A freshly initialized head, seeded by cfg.seed (tests rebuild it to see what training changed)."""
    torch.manual_seed(cfg.seed)
    config = AcceptanceHeadConfig(hidden_size=hidden_size, hidden_units=cfg.hidden_units,
                                  rejection_weight=cfg.rejection_weight)
    return AcceptanceHead(config)


def fit(head: AcceptanceHead, data: Examples, cfg: TrainAcceptanceConfig) -> float:
    """AdamW over shuffled minibatches; returns the last epoch's mean loss."""
    order_rng = torch.Generator().manual_seed(cfg.seed)
    optimizer = torch.optim.AdamW(head.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    head.train()
    epoch_loss = float("nan")
    for _ in range(cfg.epochs):
        total = 0.0
        for batch in torch.randperm(len(data), generator=order_rng).split(cfg.batch_size):
            loss = weighted_bce(head(data.features[batch]), data.labels[batch], cfg.rejection_weight)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            total += float(loss.detach()) * len(batch)
        epoch_loss = total / len(data)
    return epoch_loss


def evaluate_head(head: AcceptanceHead, data: Examples, cfg: TrainAcceptanceConfig) -> dict[str, Any]:
    """Loss, Brier score and calibration of the head's (corrected) probabilities on `data`."""
    head.eval()
    with torch.no_grad():
        logits = head(data.features)
        predicted = head.calibrated(logits)
    result = calibration(predicted, data.labels, cfg.calibration_bins)
    return {
        "loss": float(weighted_bce(logits, data.labels, cfg.rejection_weight)),
        "brier": float(((predicted - data.labels) ** 2).mean()),
        "ece": result.ece,
        "observed_acceptance": float(data.labels.mean()),
        "predicted_acceptance": float(predicted.mean()),
        "calibration": result,
    }


def train_acceptance(cfg: TrainAcceptanceConfig, target: Target, draft_model_dir: Path | str,
                     traces_dir: Path | str) -> dict[str, Any]:
    """Train the head on traces_dir/train, check it on traces_dir/val (if collected), save it to
    cfg.out_dir and the calibration plot to cfg.plot; returns the report."""
    start = time.perf_counter()
    traces_dir = Path(traces_dir)
    check_traces(traces_dir, target)
    draft, vocab = load_draft(draft_model_dir)
    if draft.get_output_embeddings().weight.shape[0] != target.vocab_size:
        raise ValueError(f"The draft model in {draft_model_dir} does not share the target's vocabulary of "
                         f"{target.vocab_size} tokens: train its acceptance head with the target it drafts for.")
    proposal_rng = torch.Generator().manual_seed(cfg.seed)
    train = split_examples(draft, traces_dir / "train", cfg, proposal_rng, vocab)
    has_val = (traces_dir / "val" / MANIFEST).is_file()
    val = split_examples(draft, traces_dir / "val", cfg, proposal_rng, vocab) if has_val else None
    head = build_head(cfg, draft.config.hidden_size)
    train_loss = fit(head, train, cfg)
    checked = evaluate_head(head, val if val is not None else train, cfg)
    plot = plot_calibration(checked.pop("calibration"), cfg.plot,
                            f"Acceptance head calibration ({'val' if val is not None else 'train'}, {cfg.label} labels)")
    report = {
        "train_loss": train_loss, "eval_split": "val" if val is not None else "train", **checked,
        "positions": {"train": len(train), "val": len(val) if val is not None else 0},
        "parameters": sum(p.numel() for p in head.parameters()), "seconds": round(time.perf_counter() - start, 3),
        "plot": str(plot),
    }
    out_dir = head.save(cfg.out_dir)
    info = {"target": target.fingerprint.to_dict(), "draft_model": str(draft_model_dir), "config": asdict(cfg),
            "report": report}
    (out_dir / INFO_FILE).write_text(json.dumps(info, indent=2) + "\n")
    log.info("train_acceptance: %s", report)
    return report
