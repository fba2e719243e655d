"""A causal LM plus its KV cache for one sequence: prefill, chain or tree forward, rollback.

The cache always holds every committed token but the last; rollback crops or compacts it so the
prefix is never recomputed.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch
from transformers import DynamicCache, PreTrainedModel

from specops.core.llama import MATH_ROWS, ROPE_TYPES, Branches, Segment, rotate

if TYPE_CHECKING:  # batching imports the cost model, which imports this module
    from specops.core.batching import PassBatcher


def additive_mask(visible: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Boolean visibility [rows, keys] -> the additive 4D attention mask [1, 1, rows, keys] HF models take."""
    # masked_fill, not torch.where with a Python scalar: finfo(float64).min does not fit the float32 scalar.
    return torch.zeros(visible.shape, dtype=dtype).masked_fill(~visible, torch.finfo(dtype).min)[None, None]


def tree_attention_mask(parents: list[int], past: int, dtype: torch.dtype) -> torch.Tensor:
    """Additive 4D mask [1, 1, n+1, past+n+1] for the root (the last committed token) plus n tree nodes.

    Every row sees the whole cached prefix; node i sees the root, its ancestors and itself.
    """
    n = len(parents)
    visible = torch.zeros(n + 1, past + n + 1, dtype=torch.bool)
    visible[:, : past + 1] = True  # the cached prefix and the root
    for node, parent in enumerate(parents):
        row = node + 1
        if parent >= 0:
            visible[row] = visible[parent + 1]
        visible[row, past + row] = True
    return additive_mask(visible, dtype)


def tree_depths(parents: list[int]) -> list[int]:
    """Depth of each node; the root (last committed token) has depth 0, its children depth 1."""
    depths: list[int] = []
    for parent in parents:
        depths.append(1 if parent < 0 else depths[parent] + 1)
    return depths


def shift_positions(keys: torch.Tensor, shift: int, inv_freq: torch.Tensor) -> torch.Tensor:
    """Keys [..., T, D] rotated by rotary embeddings at positions p -> the same keys at positions p + shift.

    RoPE rotates each pair of dimensions by position x frequency, and rotations compose, so a cached key
    moves to another position without its token being run again (computed in float32, then cast back).
    """
    angle = shift * inv_freq.float()
    emb = torch.cat((angle, angle))
    return rotate(keys.float(), emb.cos(), emb.sin()).to(keys.dtype)


def rotary_frequencies(model: PreTrainedModel) -> torch.Tensor | None:
    """The rotary frequencies [D/2] a model's cached keys were rotated with; None for a model whose keys
    carry no positions (the tests' table LMs). Rope types whose rotation depends on the sequence length or
    rescales it (dynamic, yarn, longrope) are refused: their keys cannot be moved by a rotation alone."""
    rotary = getattr(model.base_model, "rotary_emb", None)
    if rotary is None:
        return None
    if rotary.rope_type not in ROPE_TYPES or float(rotary.attention_scaling) != 1.0:
        raise ValueError(f"Rope type '{rotary.rope_type}' cannot move cached keys to new positions; a draft "
                         f"window needs one of {', '.join(ROPE_TYPES)}.")
    return rotary.inv_freq.detach()


def storage_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of memory the tensors hold: their storages' (a cropped view still holds the whole)."""
    return sum(t.untyped_storage().nbytes() for t in tensors)


class CachedLM:
    """Runs `model` on one growing sequence with a DynamicCache.

    With `hidden_layers` (decoder layer indices, specops.data.traces convention: entry i is the output of
    layer i, HF `hidden_states[i + 1]`), every prefill and forward also leaves `features` [n, L, H],
    those layers at the tokens just fed, for drafters that read the target's features (aligned heads).
    Without it nothing extra is computed.
    """

    def __init__(self, model: PreTrainedModel, hidden_layers: list[int] | None = None) -> None:
        self.model = model
        self.cache = DynamicCache(config=model.config)
        self.hidden_layers = hidden_layers
        self.features: torch.Tensor | None = None

    def _run(self, ids: torch.Tensor, **kwargs) -> torch.Tensor:
        """One model call appending `ids` [1, n] to the cache; its logits, and `features` when asked."""
        wanted = self.hidden_layers is not None
        out = self.model(ids, past_key_values=self.cache, use_cache=True, output_hidden_states=wanted, **kwargs)
        if wanted:
            self.features = torch.stack([out.hidden_states[i + 1][0] for i in self.hidden_layers], dim=1)
        return out.logits

    @property
    def length(self) -> int:
        return self.cache.get_seq_length()

    def prefill(self, token_ids: list[int]) -> None:
        """Append tokens whose logits are not needed (logits_to_keep=1 skips the LM head over the prompt)."""
        if token_ids:
            self._run(torch.tensor([token_ids]), logits_to_keep=1)

    def forward(self, token_ids: list[int]) -> torch.Tensor:
        """Append a chain of tokens; logits [n, V] for each of them."""
        return self._run(torch.tensor([token_ids]))[0]

    def forward_hidden(self, token_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Like `forward`, plus the last layer's hidden states [n, H] (after the final norm: the LM head's input)."""
        out = self.model(torch.tensor([token_ids]), past_key_values=self.cache, use_cache=True, output_hidden_states=True)
        return out.logits[0], out.hidden_states[-1][0]

    def forward_final_hidden(self, token_ids: list[int], position: int | None = None,
                             visible: torch.Tensor | None = None) -> torch.Tensor:
        """Append tokens through the decoder alone: the final norm's output [n, H], no LM head (the caller
        applies its own, e.g. a draft's reduced-vocabulary rows).

        By default the tokens continue the cached sequence causally. A drafter growing a tree passes its
        level's nodes instead: all at `position`, each attending to its row of `visible` [n, cache
        length after appending].
        """
        kwargs = {}
        if visible is not None:
            kwargs["attention_mask"] = additive_mask(visible, self.model.dtype)
            kwargs["position_ids"] = torch.full((1, len(token_ids)), position)
        out = self.model.base_model(torch.tensor([token_ids]), past_key_values=self.cache, use_cache=True, **kwargs)
        return out.last_hidden_state[0]

    def forward_tree(self, root: int, tokens: list[int], parents: list[int]) -> torch.Tensor:
        """Append the root plus tree nodes in one pass; logits [n+1, V] (row 0: root)."""
        past = self.length
        positions = torch.tensor([[past] + [past + d for d in tree_depths(parents)]])
        mask = tree_attention_mask(parents, past, self.model.dtype)
        return self._run(torch.tensor([[root] + tokens]), attention_mask=mask, position_ids=positions)[0]

    def crop(self, length: int) -> None:
        """Keep the first `length` cached tokens (transformers 5 crops by a negative count)."""
        surplus = self.length - length
        if surplus > 0:
            self.cache.crop(-surplus)

    def evict(self, start: int, count: int, inv_freq: torch.Tensor | None) -> None:
        """Drop the `count` entries after the first `start` and move the later ones `count` positions
        earlier (keys re-rotated with `inv_freq`; None: keys without positions), so the cache's slots stay
        its positions 0..length-1 and the next token fed takes position `length` (a draft window,
        specops.drafters.draft_lm)."""
        for layer in self.cache.layers:
            later = layer.keys[:, :, start + count:]
            if inv_freq is not None:
                later = shift_positions(later, -count, inv_freq)
            layer.keys = torch.cat([layer.keys[:, :, :start], later], dim=2)
            layer.values = torch.cat([layer.values[:, :, :start], layer.values[:, :, start + count:]], dim=2)

    def kv_bytes(self) -> int:
        """Bytes of memory its keys and values hold."""
        return storage_bytes(t for layer in self.cache.layers if layer.is_initialized for t in (layer.keys, layer.values))

    def keep(self, start: int, offsets: list[int]) -> None:
        """Keep cache entries start+offsets (ascending) and drop the rest after `start`.

        Used after tree verification: the accepted path is scattered among the tree's nodes.
        """
        if offsets == list(range(len(offsets))):
            self.crop(start + len(offsets))
            return
        index = torch.tensor(offsets) + start
        for layer in self.cache.layers:
            layer.keys = torch.cat([layer.keys[:, :, :start], layer.keys[:, :, index]], dim=2)
            layer.values = torch.cat([layer.values[:, :, :start], layer.values[:, :, index]], dim=2)


class StaticLM:
    """The target on a static KV cache, every pass after the prefill exactly `width` rows wide (batched
    with other sequences', only its real rows: see `forward`).

    Batch invariance (docs/architecture.md): a row's logits must not depend on how many other rows
    share its pass or where it sits in it, or speculative output would round differently from plain
    decoding (bf16 above all). Kernels are invariant when the shapes are held fixed, so every pass alone
    has `width` rows (real tokens first, padding after) over a key axis of `max_length` slots: plain
    decoding is one real row, verifying k drafts k + 1 rows, and token t always sits at cache slot t,
    seen by rows at positions >= t. Each pass writes from its first position on, so keys of rejected
    drafts and padding rows are overwritten before any row can see them.

    The passes run specops.core.llama's lean forward; `compiled` runs the fixed-width passes through
    torch.compile (the prompt's prefill, of its own length, stays eager: plain and speculative decoding
    share it).

    Trees (`forward_tree`) need a target whose rows do not depend on the pass's shape at all
    (specops.core.batching.batch_invariant) and eager passes: a tree row must see its ancestors in the slots
    a chain would put them, so each branch gets a cache of its own (llama.Branches), and a tree pass is
    another shape than plain decoding's. The branch caches are allocated at the first tree, one per
    leaf of the widest tree so far, and brought up to the committed tokens before each tree pass.
    """

    def __init__(self, model: PreTrainedModel, width: int, max_length: int,
                 hidden_layers: list[int] | None = None, compiled: bool = False,
                 batcher: PassBatcher | None = None, head: bool = True) -> None:
        """`batcher` runs the passes batched with other sequences' (specops.core.batching).
        Without `head`, `forward` returns the final hidden states instead of logits (a draft LM with a
        reduced vocabulary applies its own head rows)."""
        from specops.core.llama import llama_forward

        if width < 1:
            raise ValueError(f"The static runtime needs a pass width >= 1, got {width}.")
        self.width = width
        self.max_length = max_length
        self.eager, self.step = llama_forward(model, compiled)
        self.hidden_layers = hidden_layers
        self.keys, self.values = self.eager.new_cache(max_length)
        self.tables = self.eager.tables(max_length)
        if compiled:  # one compiled graph serves every cache length: a new length must not recompile
            for t in (*self.keys, *self.values):
                torch._dynamo.maybe_mark_dynamic(t, 1)
            for t in self.tables:
                torch._dynamo.maybe_mark_dynamic(t, 0)
        if batcher is not None:
            if compiled:
                raise ValueError("A batcher runs eager passes; compiled passes run alone.")
            # The target's passes, or a draft LM's batched beside them (its own forward, checked there).
            if (batcher.forward if head else batcher.forward_of(model)) is not self.eager:
                raise ValueError("A batcher runs the eager passes of its own target's forward, or a draft's.")
        self.batcher = batcher
        self.head = head
        self.features: torch.Tensor | None = None
        self.length = 0  # committed tokens in the cache; slots past it are stale
        self.reused = 0  # of the prompt's tokens, those copied from a cache rather than computed (PrefixCache)
        from specops.core.batching import batch_invariant  # batching imports this module

        self.trees = not compiled and batch_invariant(model)  # whether forward_tree is exact here
        self._pool: tuple[list[torch.Tensor], list[torch.Tensor]] | None = None  # [branches, kv, length, D] per layer
        self._synced = 0  # slots every branch cache holds as the main one (self.keys: branch 0's)
        self._tree: list[int] | None = None  # the last tree pass's owner branch per row, until `keep`

    def _segment(self, token_ids: list[int], rows: int) -> Segment:
        """`token_ids` at slots length.. (padded to `rows` rows), for one pass."""
        start = self.length
        if start + rows > self.max_length:
            raise ValueError(f"The static cache holds {self.max_length} tokens; a pass at {start} of {rows} "
                             "rows does not fit (size it with specops.core.types.static_cache_length).")
        return Segment(torch.tensor(token_ids + [0] * (rows - len(token_ids))), torch.arange(start, start + rows),
                       self.keys, self.values, *self.tables)

    def _advance(self, token_ids: list[int], layers: torch.Tensor) -> None:
        """The pass over `token_ids` is done: they are committed, and their features kept when asked for."""
        self._keep_features(layers)
        self.length += len(token_ids)

    def _keep_features(self, layers: torch.Tensor) -> None:
        self.features = None if self.hidden_layers is None else layers[:, self.hidden_layers]

    def _eager_pass(self, segment: Segment) -> tuple[torch.Tensor, torch.Tensor]:
        """One eager pass: batched with other sequences' when there is a batcher, else alone."""
        if self.batcher is not None:
            return self.batcher.run(segment, self.eager, self.head)
        return self.eager.forward_many([segment], self.head)[0]

    def prefill(self, token_ids: list[int]) -> torch.Tensor | None:
        """The prompt in one pass of its own length, without the LM head (its logits are not needed): plain
        and speculative decoding share it exactly. Batched, it runs alone on the batcher's pass thread.
        Every layer's output [n, L, H] (None for no tokens)."""
        if not token_ids:
            return None
        segment = self._segment(token_ids, len(token_ids))

        def run() -> torch.Tensor:
            return self.eager.prefill(*segment.args())

        layers = run() if self.batcher is None else self.batcher.call(run, self.eager)
        self._advance(token_ids, layers)
        return layers

    def forward(self, token_ids: list[int]) -> torch.Tensor:
        """Append up to `width` tokens; logits [n, V] for each of them (without `head`: the final hidden states
        [n, H]). Alone, the pass is `width` rows wide (real tokens first); batched, the sequence brings only
        its n real rows (EMS-SD's packing), since batched passes are exact only where a row does not depend
        on the pass's shape at all (specops.core.batching), so its own row count does not matter either."""
        if not 0 < len(token_ids) <= self.width:
            raise ValueError(f"A static pass takes 1 to {self.width} tokens, got {len(token_ids)}.")
        if self.batcher is None and self.head:
            out, layers = self.step(*self._segment(token_ids, self.width).args())
        else:
            rows = self.width if self.batcher is None else len(token_ids)  # batched: its real rows only
            out, layers = self._eager_pass(self._segment(token_ids, rows))
        n = len(token_ids)
        self._advance(token_ids, layers[:n])
        return out[:n]

    def forward_tree(self, root: int, tokens: list[int], parents: list[int]) -> torch.Tensor:
        """The root (the last committed token) and a tree's nodes in one pass, each branch in its own cache
        (llama.Branches); logits [n+1, V] (row 0: root), bitwise those plain decoding gives each token once
        its ancestors are committed. `keep` then commits a path."""
        if not self.trees:
            raise ValueError("Tree drafts on the static runtime need eager passes on a target whose rows do not "
                             "depend on the pass's shape (bf16, see specops.core.batching.batch_invariant); use a "
                             "chain drafter, or the dynamic runtime (static_width 0).")
        depths = tree_depths(parents)
        if len(tokens) + 1 > MATH_ROWS:  # checked here, not in the pass: a batched pass would fail every sequence
            raise ValueError(f"A tree pass takes at most {MATH_ROWS} rows; this tree has {len(tokens)} nodes.")
        start = self.length
        if start + max(depths, default=0) + 1 > self.max_length:
            raise ValueError(f"The static cache holds {self.max_length} tokens; a tree at {start} does not fit.")
        rows = [0] + [p + 1 for p in parents]  # each row's parent row; the root's is itself
        leaves = sorted(set(range(len(rows))) - set(rows[1:]))
        owner, write_branch, write_row = [-1] * len(rows), [], []
        for branch, leaf in enumerate(leaves):
            path, row = [leaf], leaf
            while row:
                row = rows[row]
                path.append(row)
            for row in path:
                write_branch.append(branch)
                write_row.append(row)
                if owner[row] < 0:
                    owner[row] = branch
        keys, values = self._branch_caches(len(leaves))
        branches = Branches(torch.tensor(owner), torch.tensor(write_branch), torch.tensor(write_row))
        segment = Segment(torch.tensor([root] + tokens), start + torch.tensor([0] + depths), keys, values,
                          *self.tables, branches)
        out, layers = self._eager_pass(segment)
        self._keep_features(layers)
        self._tree = owner
        return out

    def _branch_caches(self, branches: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """At least `branches` caches holding the committed tokens; the main cache is the first. Exactly as
        many as the widest tree so far has leaves (the memory model counts no more than one per node)."""
        if self._pool is None or self._pool[0][0].shape[0] < branches:
            shape = (branches, *self.keys[0].shape)
            self._pool = ([torch.zeros(shape, dtype=k.dtype) for k in self.keys],
                          [torch.zeros(shape, dtype=v.dtype) for v in self.values])
            for pooled, main in zip((*self._pool[0], *self._pool[1]), (*self.keys, *self.values), strict=True):
                pooled[0] = main
            self.keys, self.values = [k[0] for k in self._pool[0]], [v[0] for v in self._pool[1]]
            self._synced = 0
        if self._synced < self.length:  # tokens committed by chain passes, into the main cache only
            for pooled in (*self._pool[0], *self._pool[1]):
                pooled[1:, :, self._synced: self.length] = pooled[:1, :, self._synced: self.length]
            self._synced = self.length
        return self._pool

    def crop(self, length: int) -> None:
        self.length = min(self.length, length)
        self._synced = min(self._synced, self.length)
        self._tree = None

    def snapshot(self) -> tuple[list[torch.Tensor], list[torch.Tensor], torch.Tensor | None]:
        """Copies of the committed slots' keys and values (and the features of the last pass)."""
        return ([k[:, : self.length].clone() for k in self.keys], [v[:, : self.length].clone() for v in self.values],
                self.features)

    def restore(self, state: tuple[list[torch.Tensor], list[torch.Tensor], torch.Tensor | None]) -> None:
        """Write a snapshot back into this (fresh) cache: the same slots, the same bits. Also a prompt's first
        tokens from another prompt's (specops.core.prefix_cache): their keys and values [kv_heads, n, D] per layer
        and their features."""
        keys, values, self.features = state
        for cache, saved in zip((*self.keys, *self.values), (*keys, *values), strict=True):
            cache[:, : saved.shape[1]] = saved
        self.length = keys[0].shape[1]
        self._synced = 0  # the branch caches, if any, hold none of it

    def keep(self, start: int, offsets: list[int]) -> None:
        """Commit rows `offsets` (the root and a path, ascending) of the last tree pass at `start`: the branch
        that holds the path has them at their slots; every other cache gets a copy (the root's too: caches of
        branches the tree did not use have not seen it)."""
        if self._tree is None or self._pool is None or start != self.length or offsets[:1] != [0]:
            raise ValueError("keep commits a path of the last tree pass, from its root.")
        end = start + len(offsets)
        source = self._tree[offsets[-1]]  # the branch the deepest kept row attended in holds its whole path
        for pooled in (*self._pool[0], *self._pool[1]):
            pooled[:, :, start: end] = pooled[source, :, start: end].clone()
        self.length = self._synced = end
        self._tree = None
