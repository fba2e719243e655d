"""Prompt prefixes shared across requests, prefilled once: the keys and values of their blocks kept and copied
into the next prompt that starts the same way (vLLM's automatic prefix caching, SGLang's RadixAttention).

A served model's prompts share their start: the chat template's system turn, an instruction, a few-shot block.
Recomputing it is most of what a short prompt's prefill costs on a CPU, and a prefill runs alone on the pass
thread (specops.core.batching), so every other sequence waits for it too.

Exactness: a copied prefix and a computed one must be the same bits, and so must what comes after. That holds
where a prompt token's keys and values depend only on the tokens up to it, not on how the prompt was cut into
passes: on the native decoder in bf16 (`exact`), whose products compute each row alone (batch-invariant:
specops.core.batching) and whose attention computes each row from its query and the slots it sees alone, a
prompt's rows too (native_attention.cpp). A prompt prefilled in any chunks, or from another prompt's first
blocks and then its own rest, leaves the cache and the features bitwise as one pass over it does
(tests/core/test_prefix_cache.py). Elsewhere (fp32, where MKL's sums change with the row count; the Python loop,
whose prompts attend through SDPA's flash kernel; compiled passes) the cache steps aside and the prompt is
prefilled as `specops.core.loop.prefill` does.

Layout: blocks of `block` tokens in a trie, one node per block under the blocks before it, so a prompt reuses its
longest run of whole cached blocks from its start; the tokens after it are prefilled, and its new whole blocks
join the trie. Blocks hold copies (a sequence's cache is overwritten by its next passes), and are never written
after, so a copy into a sequence's cache runs outside the lock. Past the byte budget the least recently used
blocks with no children go first.
"""

from __future__ import annotations

import itertools
import threading
from dataclasses import dataclass, field

import torch

from specops.core.kv import StaticLM
from specops.core.loop import Cancelled, prefill

DEFAULT_BLOCK = 16  # tokens per cached block: the longest shared run reused is a multiple of it


@dataclass(eq=False)
class _Block:
    keys: list[torch.Tensor]  # per layer [kv_heads, block, D]
    values: list[torch.Tensor]
    features: torch.Tensor | None  # [block, hidden layers, H], for feature-reading drafters
    parent: _Block | None
    tokens: tuple[int, ...]
    used: int  # the tick of its last use, for eviction
    children: dict[tuple[int, ...], _Block] = field(default_factory=dict)

    @property
    def bytes(self) -> int:
        tensors = [*self.keys, *self.values, *([] if self.features is None else [self.features])]
        return sum(t.numel() * t.element_size() for t in tensors)


class PrefixCache:
    """Whole blocks of prompts' keys and values, shared by every generation of a served model (thread-safe)."""

    def __init__(self, budget_bytes: int, block: int = DEFAULT_BLOCK) -> None:
        if budget_bytes <= 0 or block <= 0:
            raise ValueError(f"A prefix cache needs a positive budget and block, got {budget_bytes} bytes, "
                             f"{block} tokens.")
        self.budget_bytes = budget_bytes
        self.block = block
        self.bytes = 0
        self._roots: dict[tuple[object, tuple[int, ...]], dict[tuple[int, ...], _Block]] = {}
        self._lock = threading.Lock()
        self._tick = itertools.count()

    @staticmethod
    def exact(lm: StaticLM) -> bool:
        """Whether `lm`'s prefill leaves the same bits however the prompt is cut (see the module docstring):
        eager and batch-invariant (StaticLM.trees), on the native decoder, from an empty cache."""
        return lm.trees and lm.length == 0 and lm.eager._native() is not None

    def prefill(self, lm: StaticLM, token_ids: list[int], chunk: int, cancelled: Cancelled | None = None) -> bool:
        """`specops.core.loop.prefill`, reusing the longest cached run of `token_ids`' first blocks; False when
        `cancelled` stopped it. `lm.reused` tells how many prompt tokens were copied."""
        if not self.exact(lm):
            return prefill(lm, token_ids, chunk, cancelled)
        root = (lm.eager, tuple(lm.hidden_layers or ()))  # the model's own forward: an id could be reused
        with self._lock:
            run = self._longest(root, token_ids)
        cached = len(run) * self.block
        if run:
            lm.restore(([torch.cat([b.keys[i] for b in run], 1) for i in range(len(run[0].keys))],
                        [torch.cat([b.values[i] for b in run], 1) for i in range(len(run[0].values))],
                        None if run[0].features is None else torch.cat([b.features for b in run])))
        cached_features = lm.features
        if not prefill(lm, token_ids[cached:], chunk, cancelled):
            return False
        if cached_features is not None and cached < len(token_ids):  # the rest's features follow the run's
            lm.features = torch.cat([cached_features, lm.features])
        lm.reused = cached
        with self._lock:
            self._add(root, token_ids, lm)
        return True

    def _longest(self, root: tuple[object, tuple[int, ...]], token_ids: list[int]) -> list[_Block]:
        """The cached blocks of token_ids' longest run of whole blocks from its start (holding the lock)."""
        run: list[_Block] = []
        children = self._roots.get(root, {})
        tick = next(self._tick)
        for begin in range(0, len(token_ids) - self.block + 1, self.block):
            found = children.get(tuple(token_ids[begin: begin + self.block]))
            if found is None:
                break
            found.used = tick
            run.append(found)
            children = found.children
        return run

    def _add(self, root: tuple[object, tuple[int, ...]], token_ids: list[int], lm: StaticLM) -> None:
        """token_ids' whole blocks into the trie, from `lm`'s cache where the trie lacks them; then evict down to
        the budget (holding the lock). The trie is walked again from its root: the blocks this prompt reused may
        have been evicted while it prefilled, and a block at a place in the trie is the same bits whoever made it."""
        children, parent = self._roots.setdefault(root, {}), None
        tick = next(self._tick)
        for begin in range(0, len(token_ids) - self.block + 1, self.block):
            end = begin + self.block
            tokens = tuple(token_ids[begin: end])
            found = children.get(tokens)
            if found is None:
                found = _Block([k[:, begin: end].clone() for k in lm.keys], [v[:, begin: end].clone() for v in lm.values],
                               None if lm.features is None else lm.features[begin: end].clone(), parent, tokens, tick)
                children[tokens] = found
                self.bytes += found.bytes
            found.used = tick
            parent, children = found, found.children
        self._evict()

    def _evict(self) -> None:
        """Drop least recently used childless blocks until the cache fits its budget (holding the lock)."""
        while self.bytes > self.budget_bytes:
            leaves = [b for b in self._blocks() if not b.children]
            if not leaves:
                return
            oldest = min(leaves, key=lambda b: b.used)
            siblings = oldest.parent.children if oldest.parent is not None else next(
                c for c in self._roots.values() if c.get(oldest.tokens) is oldest)
            del siblings[oldest.tokens]
            self.bytes -= oldest.bytes

    def _blocks(self) -> list[_Block]:
        out, stack = [], [b for children in self._roots.values() for b in children.values()]
        while stack:
            b = stack.pop()
            out.append(b)
            stack.extend(b.children.values())
        return out
