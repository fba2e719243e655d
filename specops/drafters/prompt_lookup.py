"""Prompt lookup decoding: copy what followed the latest earlier occurrence of the context's tail."""

from __future__ import annotations

import torch

from specops.core.drafter import EMPTY, Draft, DrafterBase, TokenStop, refuse_stop
from specops.core.sampling import Randomness
from specops.core.types import SamplingParams


class PromptLookupDrafter(DrafterBase):
    name = "prompt-lookup"

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram

    def propose(self, context: list[int], k: int, sampling: SamplingParams,
                generator: Randomness, stop: TokenStop | None = None) -> Draft:
        refuse_stop(self, stop)
        ids = torch.tensor(context)
        length = ids.shape[0]
        for n in range(min(self.max_ngram, length - 1), self.min_ngram - 1, -1):
            # windows [length-n+1, n]; drop the last window, which is the tail itself.
            windows = ids.unfold(0, n, 1)[:-1]
            hits = torch.nonzero((windows == ids[-n:]).all(1)).flatten()
            if hits.numel():
                # The latest occurrence is the most relevant; HF takes the first one.
                start = int(hits[-1]) + n
                return Draft(tokens=context[start:start + k])
        return EMPTY
