"""Stage train_draft: distill a small Llama draft model from the target's traces.

The draft shares the target's vocabulary and, optionally, starts from its embeddings: with hidden_size
equal to the target's, they are most of a small draft's parameters (28M of 36M for a 2-layer SmolLM2
draft) and come already trained. It learns the target's next-token distributions on the regenerated
responses, through one of the losses of `specops.train.losses`, at the positions whose next token the
target generated.

Precision: under DeepSpeed with bf16/fp16, Lightning casts every float tensor of a batch, the
teacher's log-probs included, to that dtype; prefer 32-true or bf16-mixed with `auto`/DDP when the
teacher's tail mass matters.

With `draft_vocab_size` (FR-Spec, arXiv 2502.14856) the loss runs over the N most frequent response
tokens only: the student's logits come from those N rows of its LM head, the teacher's top-k is
renormalized over them (as EAGLE-3 does), and the loss is the soft cross-entropy, i.e. forward KL over
the draft vocabulary up to the teacher's entropy. On a CPU this makes a training step ~4x cheaper for a
SmolLM2-sized draft, whose 49k-row head is most of its compute, and the drafter then proposes from the
same N rows at serving time (specops.drafters.draft_lm).

The result is a plain Hugging Face folder (config.json, model.safetensors, tokenizer) that any code
loads with `AutoModelForCausalLM.from_pretrained(out_dir)`, plus specops_training.json recording the
target fingerprint, the config and the report. Strategies come from `specops.train.strategies` (DeepSpeed
also runs on the CPU there, which is how CI tests it).
"""

from __future__ import annotations

import copy
import json
import logging
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from pytorch_lightning.loggers import Logger
from torch.utils.data import Dataset
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedModel

from specops.core.target import Target, TargetFingerprint
from specops.data.traces import TraceShards, next_token_mask
from specops.drafters.draft_lm import VOCAB_FILE, save_draft_vocab
from specops.train.aligned_losses import soft_cross_entropy, teacher_in_draft_vocab
from specops.train.losses import LOSSES
from specops.train.trainer import TraceDataModule, TrainerConfig, adamw, fit
from specops.train.vocab import frequent_vocabulary, target_to_draft

log = logging.getLogger(__name__)

INFO_FILE = "specops_training.json"
DISTILL_FIELDS = ("input_ids", "loss_mask", "topk_ids", "topk_logprobs")


@dataclass
class TrainDraftConfig(TrainerConfig):
    """params.yaml section `train_draft`."""

    hidden_size: int = 576
    """Draft width. Equal to the target's (576 for SmolLM2) to start from its embeddings."""
    num_layers: int = 2
    """Draft decoder layers: its cost per token grows with them, its acceptance too."""
    num_heads: int = 9
    """Attention heads; hidden_size must be divisible by it."""
    intermediate_size: int = 1536
    """MLP width."""
    init_embeddings_from_target: bool = True
    """Copy the target's input (and untied output) embeddings; needs hidden_size == the target's."""
    init_layers_from_target: bool = False
    """Start from a truncated target: its first num_layers decoder layers, final norm and embeddings
    (LayerSkip/DEL-style early exit), then distill. The layer shapes then come from the target, so
    hidden_size, num_heads and intermediate_size are ignored. A far better start than random weights
    when training time is minutes on a CPU."""
    train_embeddings: bool = True
    """Also train the input embeddings and the LM head. Off keeps the target's (copied) ones frozen:
    on a CPU the 49k-row head dominates the backward pass, and the copied head is already right."""
    loss: str = "forward_kl"
    """Distillation loss, one of specops.train.losses.LOSSES: forward_kl, reverse_kl, jsd, tvd."""
    draft_vocab_size: int | None = None
    """Train and draft over the N most frequent response tokens only (FR-Spec); None = the whole vocabulary.
    Needs loss forward_kl and a strategy that keeps parameters whole (not fsdp or deepspeed_stage_3)."""
    out_dir: str = "models/draft_lm"
    """Where the Hugging Face folder is written."""

    def __post_init__(self) -> None:
        if self.loss not in LOSSES:
            raise ValueError(f"train_draft.loss '{self.loss}' is unknown. Choose one of: {', '.join(LOSSES)}.")
        self.check_trainer("train_draft")
        if self.hidden_size % self.num_heads:
            raise ValueError(f"train_draft.hidden_size {self.hidden_size} is not divisible by num_heads {self.num_heads}.")
        if self.num_layers < 1:
            raise ValueError("train_draft.num_layers must be >= 1.")
        if self.draft_vocab_size is not None:
            if self.draft_vocab_size < 1:
                raise ValueError(f"train_draft.draft_vocab_size must be >= 1 or null, got {self.draft_vocab_size}.")
            if self.loss != "forward_kl":
                raise ValueError("train_draft.draft_vocab_size trains with forward_kl over the draft vocabulary; "
                                 f"loss '{self.loss}' needs the whole vocabulary (draft_vocab_size: null).")
            if self.strategy in ("fsdp", "deepspeed_stage_3"):
                raise ValueError(f"train_draft.draft_vocab_size reads rows of the LM head, which strategy "
                                 f"'{self.strategy}' shards; use ddp or deepspeed_stage_2, or draft_vocab_size: null.")


def build_draft_model(target_model: PreTrainedModel, cfg: TrainDraftConfig) -> LlamaForCausalLM:
    """A small Llama over the target's vocabulary, positions and special tokens, seeded by cfg.seed."""
    tc = target_model.config
    if cfg.init_layers_from_target:
        return truncated_target(target_model, cfg.num_layers)
    vocab = target_model.get_output_embeddings().weight.shape[0]
    config = LlamaConfig(
        vocab_size=vocab, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_heads,
        max_position_embeddings=tc.max_position_embeddings, rms_norm_eps=tc.rms_norm_eps,
        rope_parameters=getattr(tc, "rope_parameters", None), tie_word_embeddings=tc.tie_word_embeddings,
        bos_token_id=tc.bos_token_id, eos_token_id=tc.eos_token_id, pad_token_id=tc.pad_token_id,
    )
    torch.manual_seed(cfg.seed)
    draft = LlamaForCausalLM(config)
    draft.generation_config.eos_token_id = target_model.generation_config.eos_token_id
    draft.generation_config.pad_token_id = target_model.generation_config.pad_token_id
    if cfg.init_embeddings_from_target:
        if cfg.hidden_size != tc.hidden_size:
            raise ValueError(f"init_embeddings_from_target needs hidden_size == the target's ({tc.hidden_size}), "
                             f"got {cfg.hidden_size}. Change one of them.")
        with torch.no_grad():
            draft.get_input_embeddings().weight.copy_(target_model.get_input_embeddings().weight)
            if not tc.tie_word_embeddings:
                draft.get_output_embeddings().weight.copy_(target_model.get_output_embeddings().weight)
    return draft


def truncated_target(target_model: PreTrainedModel, num_layers: int) -> LlamaForCausalLM:
    """The target's first `num_layers` decoder layers with its embeddings, final norm and LM head."""
    if not 1 <= num_layers <= target_model.config.num_hidden_layers:
        raise ValueError(f"train_draft.num_layers must be in 1..{target_model.config.num_hidden_layers} "
                         f"to truncate the target, got {num_layers}.")
    config = LlamaConfig.from_dict({**target_model.config.to_dict(), "num_hidden_layers": num_layers})
    draft = LlamaForCausalLM(config)
    state = target_model.state_dict()
    missing, _ = draft.load_state_dict({k: v for k, v in state.items() if k in draft.state_dict()}, strict=False)
    if missing:
        raise ValueError(f"Cannot truncate the target: no weights for {missing[:3]}.")
    draft.generation_config.eos_token_id = target_model.generation_config.eos_token_id
    draft.generation_config.pad_token_id = target_model.generation_config.pad_token_id
    return draft.to(torch.float32)


class DistillDataset(Dataset):
    """Sequences of one trace split: token ids, the teacher's top-k, and the mask of positions to distill."""

    def __init__(self, split_dir: Path, max_seq_len: int) -> None:
        self.shards = TraceShards(split_dir, fields=DISTILL_FIELDS)
        self.max_seq_len = max_seq_len

    def __len__(self) -> int:
        return len(self.shards)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        item = self.shards[index]
        # Shift before cutting: the last kept row still predicts a real (cut-off) response token.
        item["mask"] = next_token_mask(item.pop("loss_mask"))
        return {name: tensor[: self.max_seq_len] for name, tensor in item.items()}


def collate(items: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Right-pad to the longest sequence; padding has attention_mask 0 and mask False."""
    lengths = [len(item["input_ids"]) for item in items]
    batch_size, width = len(items), max(lengths)
    k = items[0]["topk_ids"].shape[-1]
    batch = {
        "input_ids": torch.zeros(batch_size, width, dtype=torch.long),  # [B, T]
        "attention_mask": torch.zeros(batch_size, width, dtype=torch.long),  # [B, T]
        "mask": torch.zeros(batch_size, width, dtype=torch.bool),  # [B, T]
        "topk_ids": torch.zeros(batch_size, width, k, dtype=torch.long),  # [B, T, K]
        "topk_logprobs": torch.zeros(batch_size, width, k, dtype=torch.float32),  # [B, T, K]
    }
    for row, (item, length) in enumerate(zip(items, lengths, strict=True)):
        batch["attention_mask"][row, :length] = 1
        for name in ("input_ids", "mask", "topk_ids", "topk_logprobs"):
            batch[name][row, :length] = item[name]
    return batch


def draft_logits(draft: PreTrainedModel, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                 vocab: torch.Tensor | None = None) -> torch.Tensor:
    """[B, T, V] logits, or with a draft vocabulary [B, T, N] from those rows of the LM head only
    (column j is target id vocab[j])."""
    if vocab is None:
        return draft(input_ids=input_ids, attention_mask=attention_mask).logits
    hidden = draft.base_model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state  # [B, T, H]
    return F.linear(hidden, draft.get_output_embeddings().weight[vocab.to(hidden.device)])


class DraftDistillation(pl.LightningModule):
    """Distills the target's stored top-k distributions into the draft with a loss from LOSSES."""

    def __init__(self, draft: LlamaForCausalLM, loss: str, cfg: TrainerConfig, vocab: torch.Tensor | None = None) -> None:
        super().__init__()
        self.draft = draft
        self.loss_fn = LOSSES[loss]
        self.cfg = cfg
        self.vocab = vocab
        if vocab is not None:
            self.register_buffer("to_draft", target_to_draft(vocab, draft.config.vocab_size), persistent=False)

    def divergence(self, logits: torch.Tensor, batch: dict[str, torch.Tensor], mask: torch.Tensor) -> torch.Tensor:
        """The loss at the `mask` positions, from `draft_logits` of the batch."""
        if self.vocab is None:
            return self.loss_fn(logits, batch["topk_ids"], batch["topk_logprobs"], mask)
        ids, probs = teacher_in_draft_vocab(batch["topk_ids"], batch["topk_logprobs"], self.to_draft)
        return soft_cross_entropy(logits, ids, probs, mask)

    def _loss(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        logits = draft_logits(self.draft, batch["input_ids"], batch["attention_mask"], self.vocab)
        return self.divergence(logits, batch, batch["mask"])

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self._loss(batch)
        self.log("train/loss", loss, prog_bar=True, batch_size=len(batch["input_ids"]))
        return loss

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        self.log("val/loss", self._loss(batch), prog_bar=True, batch_size=len(batch["input_ids"]), sync_dist=True)

    def configure_optimizers(self) -> dict[str, Any]:
        trainable = [p for p in self.draft.parameters() if p.requires_grad]
        return adamw(trainable, self.cfg, self.trainer.estimated_stepping_batches)


def check_traces(traces_dir: Path, target: Target) -> None:
    """Refuse empty traces, and traces made by another target: the draft would learn the wrong distributions."""
    train = TraceShards(traces_dir / "train", fields=())
    if not len(train):
        raise ValueError(f"{traces_dir / 'train'} holds no sequences: nothing to train on.")
    reason = target.fingerprint.mismatch(TargetFingerprint(**train.target))
    if reason:
        raise ValueError(f"The traces in {traces_dir} come from another target: {reason}. Rerun the collect stage.")


def save_draft(state: dict[str, torch.Tensor], draft: LlamaForCausalLM, target: Target, out_dir: Path,
               info: dict[str, Any], vocab: torch.Tensor | None = None) -> None:
    """Write a float32 Hugging Face folder with the target's tokenizer, the training record and the
    draft vocabulary, if any (a previous run's must not restrict this draft).

    The weights go through a fresh model so that nothing of the strategy's wrapping (ZeRO partitions,
    mixed-precision casts) reaches the file.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    config = copy.deepcopy(draft.config)
    config.dtype = torch.float32
    model = LlamaForCausalLM(config)
    model.load_state_dict({name: tensor.float() for name, tensor in state.items()})
    model.generation_config = draft.generation_config
    model.save_pretrained(out_dir)
    target.tokenizer.save_pretrained(out_dir)
    (out_dir / INFO_FILE).write_text(json.dumps(info, indent=2) + "\n")
    if vocab is not None:
        save_draft_vocab(out_dir, vocab)
    else:
        (out_dir / VOCAB_FILE).unlink(missing_ok=True)


def train_draft(cfg: TrainDraftConfig, target: Target, traces_dir: Path | str, logger: Logger | None = None) -> dict[str, Any]:
    """Distill a draft from traces_dir/{train,val}, save it to cfg.out_dir; returns the training report.

    `logger` is any Lightning logger, typically an MLFlowLogger on the pipeline's tracking URI.
    """
    traces_dir = Path(traces_dir)
    check_traces(traces_dir, target)
    pl.seed_everything(cfg.seed, workers=True, verbose=False)
    draft = build_draft_model(target.model, cfg)
    if not cfg.train_embeddings:
        draft.get_input_embeddings().weight.requires_grad_(False)
        draft.get_output_embeddings().weight.requires_grad_(False)
    parameters = sum(p.numel() for p in draft.parameters())  # before ZeRO-3 can partition them
    vocab, coverage = (None, 1.0) if cfg.draft_vocab_size is None else frequent_vocabulary(
        TraceShards(traces_dir / "train", fields=("input_ids", "loss_mask")), min(cfg.draft_vocab_size, target.vocab_size),
        target)
    module = DraftDistillation(draft, cfg.loss, cfg, vocab)
    data = TraceDataModule(traces_dir, DistillDataset, collate, cfg.batch_size, cfg.max_seq_len, cfg.seed)
    if logger is not None:
        logger.log_hyperparams({**asdict(cfg), "target": target.fingerprint.name})
    fitted = fit(cfg, "train_draft", module, data, logger)
    report = {
        **fitted.report, "loss": cfg.loss if vocab is None else "soft_cross_entropy (draft vocabulary)",
        "parameters": parameters, "draft_vocab_size": cfg.draft_vocab_size, "draft_vocab_coverage": round(coverage, 4),
    }
    state = fitted.weights(draft)  # the best validation's
    if fitted.trainer.is_global_zero:
        info = {"target": target.fingerprint.to_dict(), "config": asdict(cfg), "report": report}
        save_draft(state, draft, target, Path(cfg.out_dir), info, vocab)
    fitted.finish()
    log.info("train_draft: %s", report)
    return report
