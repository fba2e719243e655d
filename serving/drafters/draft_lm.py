"""An independent draft LM with its own KV cache, sharing the target's vocabulary.

With an acceptance head (SpecDec++, arXiv 2405.19715) it can end a draft early: `propose` then
scores each drafted token and asks a `stop` rule whether to go on.
"""

from __future__ import annotations

import torch
from transformers import PreTrainedModel

from serving.acceptance_head import AcceptanceHead
from serving.drafters.base import Draft, TokenStop
from serving.kv import CachedLM
from serving.sampling import logits_to_probs, sample
from serving.types import SamplingParams


class VocabularyMismatchError(ValueError):
    pass


class DraftLMDrafter:
    name = "draft-lm"

    def __init__(self, model: PreTrainedModel, target_vocab_size: int, head: AcceptanceHead | None = None) -> None:
        draft_vocab = model.get_output_embeddings().weight.shape[0]
        if draft_vocab != target_vocab_size:
            raise VocabularyMismatchError(
                f"The draft model's vocabulary has {draft_vocab} tokens but the target's has {target_vocab_size}: "
                "a draft LM must share the target's tokenizer.")
        if head is not None and head.config.hidden_size != model.config.hidden_size:
            raise ValueError(f"The acceptance head reads hidden states of size {head.config.hidden_size} but the "
                             f"draft model's are {model.config.hidden_size}: it was trained for another draft.")
        self.model = model.eval()
        self.head = head.eval() if head is not None else None
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

    def _forward_last(self, feed: list[int], with_hidden: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits [V] at the last fed token and, if asked (for the acceptance head), its hidden state [H]."""
        if not with_hidden:
            return self.lm.forward(feed)[-1], None
        logits, hidden = self.lm.forward_hidden(feed)
        return logits[-1], hidden[-1]

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
            logits, hidden = self._forward_last(feed, with_hidden=stop is not None)
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
        return Draft(tokens=tokens, q=torch.stack(rows) if rows else None)
