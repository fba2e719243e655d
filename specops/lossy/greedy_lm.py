"""Greedy continuation of any context with one reusable KV cache, plus the hidden states behind each token.

The lossy modes need the draft's last-layer hidden states (their routers read them), and the router
miners continue many contexts that share long prefixes (what-if rollouts). Both jump between
contexts: the cache is rolled back to the longest prefix shared with the new context, so a shared
prefix is never recomputed.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

from specops.core.kv import CachedLM
from specops.drafters.draft_lm import draft_head


@dataclass
class GreedyRun:
    """Tokens chosen greedily, with, for each, the state that chose it."""

    tokens: list[int]
    hidden: torch.Tensor  # [n, H] last-layer hidden state (after the final norm: the LM head's input)
    logprobs: torch.Tensor  # [n] log-probability of each chosen token (its softmax maximum)


class GreedyLM:
    """A causal LM decoding greedily from whatever context it is given (batch 1)."""

    def __init__(self, model: PreTrainedModel, vocab: torch.Tensor | None = None) -> None:
        """`vocab`: a draft LM's draft vocabulary (specops.drafters.draft_lm), which it then decodes over."""
        self.model = model.eval()
        self.head = draft_head(model, vocab)
        self.reset()

    def reset(self) -> None:
        self.lm = CachedLM(self.model)
        self.cached: list[int] = []  # tokens whose keys/values are in self.lm's cache

    def _sync(self, context: list[int]) -> list[int]:
        """Roll the cache back to the longest prefix shared with `context`; return the tokens to feed."""
        common = 0
        limit = min(len(self.cached), len(context) - 1)  # always re-feed the last token to get its logits
        while common < limit and self.cached[common] == context[common]:
            common += 1
        self.lm.crop(common)
        self.cached = context[:common]
        return context[common:]

    def _feed(self, feed: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Logits [V] and hidden state [H] at the last of the fed tokens."""
        hidden = self.lm.forward_final_hidden(feed)[-1]
        self.cached += feed
        return self.head(hidden), hidden

    @torch.inference_mode()
    def greedy(self, context: list[int], max_tokens: int, stop: Collection[int] = ()) -> GreedyRun:
        """Up to max_tokens greedy tokens after `context` (non-empty); ends after the first token in `stop`."""
        if not context:
            raise ValueError("GreedyLM.greedy needs a non-empty context.")
        feed = self._sync(context)
        tokens: list[int] = []
        hidden: list[torch.Tensor] = []
        logprobs: list[torch.Tensor] = []
        while len(tokens) < max_tokens:
            logits, state = self._feed(feed)
            log_p = logits.float().log_softmax(-1)
            token = int(log_p.argmax())
            tokens.append(token)
            hidden.append(state)
            logprobs.append(log_p[token])
            if token in stop:
                break
            feed = [token]
        width = self.model.config.hidden_size
        return GreedyRun(tokens, torch.stack(hidden) if hidden else torch.zeros(0, width),
                         torch.stack(logprobs) if logprobs else torch.zeros(0))

    @torch.inference_mode()
    def hidden_after(self, context: list[int]) -> torch.Tensor:
        """The last-layer hidden state [H] at the last token of `context` (it has seen that token)."""
        return self._feed(self._sync(context))[1]

