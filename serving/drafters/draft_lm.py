"""An independent draft LM with its own KV cache, sharing the target's vocabulary."""

from __future__ import annotations

import torch
from transformers import PreTrainedModel

from serving.drafters.base import Draft
from serving.kv import CachedLM
from serving.sampling import logits_to_probs, sample
from serving.types import SamplingParams


class VocabularyMismatchError(ValueError):
    pass


class DraftLMDrafter:
    name = "draft-lm"

    def __init__(self, model: PreTrainedModel, target_vocab_size: int) -> None:
        draft_vocab = model.get_output_embeddings().weight.shape[0]
        if draft_vocab != target_vocab_size:
            raise VocabularyMismatchError(
                f"The draft model's vocabulary has {draft_vocab} tokens but the target's has {target_vocab_size}: "
                "a draft LM must share the target's tokenizer.")
        self.model = model.eval()
        self.lm = CachedLM(self.model)
        self.cached: list[int] = []  # tokens whose keys/values are in self.lm's cache

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

    def propose(self, context: list[int], k: int, sampling: SamplingParams,
                generator: torch.Generator | None) -> Draft:
        feed = self._sync(context)
        tokens: list[int] = []
        rows: list[torch.Tensor] = []
        for _ in range(k):
            logits = self.lm.forward(feed)[-1]
            self.cached += feed
            if sampling.greedy:
                token = int(logits.argmax())
            else:
                probs = logits_to_probs(logits, sampling)
                rows.append(probs)
                token = sample(probs, generator)
            tokens.append(token)
            feed = [token]
        # At temperature 0 q is exactly the one-hot of each token, which the verifiers assume for q=None.
        return Draft(tokens=tokens, q=torch.stack(rows) if rows else None)
