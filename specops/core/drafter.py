"""The one drafter interface the speculative loop talks to."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from specops.core.kv import CachedLM, StaticLM, tree_depths
from specops.core.sampling import Randomness
from specops.core.types import SamplingParams

# A per-token stop rule (SpecDec++): called after each drafted token with the acceptance head's
# P(accept) of every token drafted so far in this step; True ends the draft after that token.
TokenStop = Callable[[list[float]], bool]
# A trim rule (goodput_head): given the P(accept) of every drafted token, how many of them to verify.
TokenTrim = Callable[[list[float]], int]


@dataclass
class Draft:
    """Proposed tokens. A chain when `parents` is None, else a tree in topological order.

    q [k, V]: the distribution each chain token was drawn from (after the shared sampling transform);
    None means deterministic drafting (one-hot q). parents[i] = -1 marks a child of the last
    committed token.
    """

    tokens: list[int]
    q: torch.Tensor | None = None
    parents: list[int] | None = None
    accept_probs: list[float] | None = None  # the acceptance head's P(accept) per chain token, when it ran

    def prefix(self, n: int) -> Draft:
        """The chain's first n tokens."""
        if self.parents is not None:
            raise ValueError("Only a chain draft can be cut to a prefix.")
        return Draft(self.tokens[:n], None if self.q is None else self.q[:n], None,
                     None if self.accept_probs is None else self.accept_probs[:n])

    @property
    def is_tree(self) -> bool:
        return self.parents is not None

    @property
    def depth(self) -> int:
        if self.parents is None:
            return len(self.tokens)
        return max(tree_depths(self.parents), default=0)


EMPTY = Draft(tokens=[])


class Drafter(Protocol):
    """What the loop needs from a drafter. Capabilities are declared, not probed: `DrafterBase` gives the
    defaults (no acceptance head, no target features, nothing learned from verification)."""

    name: str
    # Whether `propose` can take a per-token `stop` rule: it scores each drafted token with an acceptance head.
    predicts_acceptance: bool
    # Target decoder layers whose outputs it reads (specops.data.traces convention: entry i is the
    # output of layer i), or None. The loop captures them and reports them through `observe_features`
    # for every committed token but the last: after the prefill, then the verified path of each step.
    hidden_layers: list[int] | None
    # How many past responses it learns from when serving starts (Suffix Decoding: the feedback log's
    # newest), given to `remember`; 0: none.
    remembers: int
    # The most bytes of keys and values its own KV cache held since `reset` (0: it keeps none), measured
    # from the tensors: a full draft LM's grows with the context, a windowed one's stops at the window.
    peak_kv_bytes: int

    def reset(self) -> None:
        """Forget per-sequence state before a new request (learned statistics may persist)."""

    def share_runtime(self, lm: CachedLM | StaticLM) -> None:
        """The target's runtime of this generation, after `reset` and the prompt's prefill. DEL drafts
        with the target's first layers and writes their keys and values into its static cache past the
        committed tokens, where verification overwrites them; a draft LM batches its passes on the static
        runtime's batcher when it has one; other drafters ignore it."""

    def propose(self, context: list[int], k: int, sampling: SamplingParams, generator: Randomness,
                stop: TokenStop | None = None) -> Draft:
        """Up to k tokens (or a tree of at most k nodes) continuing `context` (all committed tokens).
        With `stop` (only when predicts_acceptance), the draft also ends after the first token for which
        stop(acceptance probabilities so far) is True."""

    def free_draft(self, context: list[int], k: int) -> Draft | None:
        """The draft `propose` would make here if it costs no model pass (a suffix front's), else None; only
        drafters that draft both ways have one. Under load the batcher caps drafts that cost passes harder
        than free ones (specops.core.batching.PassBatcher.draft_caps), and the loop then takes this one."""

    def observe(self, tokens: list[int], logits: torch.Tensor) -> None:
        """See the target's logits [n, V] at the tokens [n] of a verify pass (Token Recycling learns here)."""

    def observe_features(self, features: torch.Tensor) -> None:
        """Target features [n, L, H] at the hidden_layers of the next n committed tokens, in order."""

    def finish(self, context: list[int]) -> None:
        """The generation ended with `context` (prompt and every committed token); learn from it (Suffix
        Decoding keeps past responses). Not called for a generation stopped early."""

    def remember(self, responses: list[list[int]]) -> None:
        """Past responses' token ids, oldest first: served before this process started."""


class DrafterBase:
    """Defaults for the Drafter protocol: no per-sequence state, nothing learned from verification, no
    acceptance head, no target features. Drafters override what they have."""

    predicts_acceptance = False
    hidden_layers: list[int] | None = None
    remembers = 0
    peak_kv_bytes = 0

    def reset(self) -> None:
        pass

    def share_runtime(self, lm: CachedLM | StaticLM) -> None:
        pass

    def free_draft(self, context: list[int], k: int) -> Draft | None:
        return None

    def observe(self, tokens: list[int], logits: torch.Tensor) -> None:
        pass

    def observe_features(self, features: torch.Tensor) -> None:
        pass

    def finish(self, context: list[int]) -> None:
        pass

    def remember(self, responses: list[list[int]]) -> None:
        pass


def refuse_stop(drafter: Drafter, stop: TokenStop | None) -> None:
    """A drafter without an acceptance head refuses a stop rule instead of ignoring it."""
    if stop is not None:
        raise ValueError(f"The {drafter.name} drafter has no acceptance head to take a per-token stop rule.")
