"""An independent draft LM with its own KV cache, sharing the target's vocabulary.

With an acceptance head (SpecDec++, arXiv 2405.19715) it can end a draft early: `propose` then
scores each drafted token and asks a `stop` rule whether to go on.

With a draft vocabulary (FR-Spec, arXiv 2502.14856; train_draft.draft_vocab_size) the draft proposes
only the N most frequent tokens of its training data: its LM head runs on those N rows. On a CPU the
full 49k-row head of a SmolLM2-sized draft is most of a draft step. The other tokens get logit -inf, so
q is still a distribution over the target's vocabulary and every verifier stays lossless. The model
folder keeps the full head, so Hugging Face code (assisted generation) loads it unchanged.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, PreTrainedModel

from serving.acceptance_head import AcceptanceHead
from serving.drafters.base import Draft, TokenStop
from serving.kv import CachedLM
from serving.sampling import expand_draft_vocab, logits_to_probs, sample
from serving.types import SamplingParams

VOCAB_FILE = "draft_vocab.safetensors"


class VocabularyMismatchError(ValueError):
    pass


def save_draft_vocab(out_dir: Path, vocab: torch.Tensor) -> None:
    save_file({"draft_to_target": vocab.to(torch.int64).contiguous()}, str(out_dir / VOCAB_FILE))


def load_draft_vocab(model_dir: Path | str) -> torch.Tensor | None:
    """The target ids a draft may propose (ascending [N]), or None when it drafts over the whole vocabulary."""
    path = Path(model_dir) / VOCAB_FILE
    return load_file(str(path))["draft_to_target"] if path.is_file() else None


def load_draft_model(model_dir: Path | str, dtype: torch.dtype = torch.float32) -> PreTrainedModel:
    """A draft LM folder's model in eval mode (the full head kept, so Hugging Face code can use it)."""
    model_dir = Path(model_dir)
    if not (model_dir / "config.json").is_file():
        raise FileNotFoundError(f"Draft model folder {model_dir} has no config.json; pass a Hugging Face model folder.")
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()


def load_draft(model_dir: Path | str, dtype: torch.dtype = torch.float32) -> tuple[PreTrainedModel, torch.Tensor | None]:
    """A draft LM and its draft vocabulary; pass the target's dtype, since a bf16 target wants a bf16 draft."""
    return load_draft_model(model_dir, dtype), load_draft_vocab(model_dir)


def vocab_logits(hidden: torch.Tensor, head_rows: torch.Tensor, vocab: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """hidden [..., H], the LM head's rows for the draft vocabulary [N, H] -> logits [..., vocab_size],
    -inf outside the draft vocabulary."""
    return expand_draft_vocab(F.linear(hidden, head_rows), vocab, vocab_size)


def draft_head(model: PreTrainedModel, vocab: torch.Tensor | None) -> Callable[[torch.Tensor], torch.Tensor]:
    """The draft's LM head as drafting uses it: last hidden states [..., H] -> logits [..., V] over the
    target's vocabulary, -inf outside the draft vocabulary when it has one (whose rows alone were trained)."""
    head = model.get_output_embeddings()
    if vocab is None:
        return head
    rows = head.weight[vocab].detach()
    return lambda hidden: vocab_logits(hidden, rows, vocab, head.weight.shape[0])


class DraftLMDrafter:
    name = "draft-lm"

    def __init__(self, model: PreTrainedModel, target_vocab_size: int, head: AcceptanceHead | None = None,
                 vocab: torch.Tensor | None = None) -> None:
        draft_vocab = model.get_output_embeddings().weight.shape[0]
        if draft_vocab != target_vocab_size:
            raise VocabularyMismatchError(
                f"The draft model's vocabulary has {draft_vocab} tokens but the target's has {target_vocab_size}: "
                "a draft LM must share the target's tokenizer.")
        if head is not None and head.config.hidden_size != model.config.hidden_size:
            raise ValueError(f"The acceptance head reads hidden states of size {head.config.hidden_size} but the "
                             f"draft model's are {model.config.hidden_size}: it was trained for another draft.")
        if vocab is not None and (vocab.numel() == 0 or int(vocab.max()) >= target_vocab_size):
            raise VocabularyMismatchError(f"The draft vocabulary must be non-empty target ids below {target_vocab_size}.")
        self.model = model.eval()
        self.head = head.eval() if head is not None else None
        self.vocab = vocab
        self.lm_head = draft_head(model, vocab)
        self.lm = CachedLM(self.model)
        self.cached: list[int] = []  # tokens whose keys/values are in self.lm's cache

    @property
    def predicts_acceptance(self) -> bool:
        """Whether `propose` can take a per-token `stop` rule (it needs an acceptance head)."""
        return self.head is not None

    def reset(self) -> None:
        self.lm = CachedLM(self.model)
        self.cached = []

    def observe(self, tokens: list[int], logits: torch.Tensor) -> None:
        pass

    def _sync(self, context: list[int]) -> list[int]:
        """Roll the cache back to the longest prefix shared with `context`; return the tokens to feed."""
        common = 0
        limit = min(len(self.cached), len(context) - 1)  # always re-feed the last token to get logits
        while common < limit and self.cached[common] == context[common]:
            common += 1
        self.lm.crop(common)
        self.cached = context[:common]
        return context[common:]

    def _forward_last(self, feed: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Logits [V] at the last fed token and its hidden state [H] (the acceptance head reads it)."""
        hidden = self.lm.forward_final_hidden(feed)[-1]
        return self.lm_head(hidden), hidden

    def propose(self, context: list[int], k: int, sampling: SamplingParams,
                generator: torch.Generator | None, stop: TokenStop | None = None) -> Draft:
        """Up to k tokens; with `stop`, the draft also ends after the first token for which
        stop(acceptance probabilities so far) is True."""
        if stop is not None and self.head is None:
            raise ValueError("A per-token stop rule needs an acceptance head; load one into the draft-lm drafter.")
        feed = self._sync(context)
        tokens: list[int] = []
        rows: list[torch.Tensor] = []
        accept_probs: list[float] = []
        for _ in range(k):
            logits, hidden = self._forward_last(feed)
            self.cached += feed
            if sampling.greedy:
                token = int(logits.argmax())
            else:
                probs = logits_to_probs(logits, sampling)
                rows.append(probs)
                token = sample(probs, generator)
            tokens.append(token)
            if stop is not None:
                accept_probs.append(self.head.accept_prob(hidden, logits, token))
                if stop(accept_probs):
                    break
            feed = [token]
        # At temperature 0 q is exactly the one-hot of each token, which the verifiers assume for q=None.
        return Draft(tokens=tokens, q=torch.stack(rows) if rows else None, accept_probs=accept_probs if stop else None)
