"""The aligned-head drafter: drafts from the target's hidden states with an `AlignedHead`.

The loop gives it, through `observe_features`, the target's features at every committed token but
the last (the prefill, then each verified path), and it keeps the head's KV cache over exactly those
positions. `propose` first feeds the new positions (true features, and the committed token after
each), then drafts:
  * chain: k tokens, each step reading the previous step's feature output (EAGLE);
  * dynamic tree (EAGLE-2, specops.drafters.dynamic_tree): the head runs once per level on that
    level's best nodes, lossless at any temperature.
Drafted positions are removed from the head's cache afterwards; only verified positions stay.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import PreTrainedModel

from specops.core.drafter import EMPTY, Draft, DrafterBase, TokenStop, refuse_stop
from specops.core.sampling import Randomness, argmax, draw, logits_to_probs
from specops.core.types import SamplingParams
from specops.drafters.aligned_head.model import AlignedHead, HeadCache, load_head
from specops.drafters.dynamic_tree import Children, TreeNode, grow_tree, top_children

ALIGNED_KINDS = ("aligned_head", "aligned_head_tree")  # drafter kinds: chain, dynamic tree


class AlignedHeadDrafter(DrafterBase):
    def __init__(self, head: AlignedHead, target_model: PreTrainedModel, tree_nodes: int = 0,
                 tree_top_k: int = 4) -> None:
        """tree_nodes = 0 drafts chains; > 0 drafts a dynamic tree of at most that many nodes."""
        cfg = head.config
        tc = target_model.config
        embed = target_model.get_input_embeddings().weight
        if embed.shape != (cfg.target_vocab_size, cfg.hidden_size) or tc.num_hidden_layers != cfg.num_target_layers:
            raise ValueError(f"This aligned head was trained for a target with {cfg.num_target_layers} layers, "
                             f"vocabulary {cfg.target_vocab_size} and width {cfg.hidden_size}; this target has "
                             f"{tc.num_hidden_layers}, {embed.shape[0]} and {embed.shape[1]}.")
        if tree_nodes < 0 or tree_top_k < 1:
            raise ValueError(f"tree_nodes must be >= 0 and tree_top_k >= 1, got {tree_nodes}, {tree_top_k}.")
        self.head = head.eval()
        self.hidden_layers = list(cfg.hidden_layers)  # the loop captures these target layers for us
        self.embed = embed
        self.target_lm_head = None if head.lm_head is not None else target_model.get_output_embeddings().weight
        self.tree_nodes, self.tree_top_k = tree_nodes, tree_top_k
        self.name = "aligned_head_tree" if tree_nodes else "aligned_head"
        self.reset()

    def reset(self) -> None:
        self.cache = HeadCache()
        self.pending: list[torch.Tensor] = []  # target features [n, L, H] not yet fed to the head
        self.last: tuple[torch.Tensor, torch.Tensor] | None = None  # head outputs at the last verified position
        self.last_position = -1  # that position

    def observe_features(self, features: torch.Tensor) -> None:
        """Target features [n, L, H] of the next n committed positions, in order."""
        self.pending.append(features)

    def _embed(self, tokens: list[int]) -> torch.Tensor:
        return self.embed[torch.tensor(tokens)][None].to(self.head.fc.weight.dtype)  # [1, T, H]

    def _catch_up(self, context: list[int]) -> None:
        """Feed the pending true positions: position t reads f_t and the token x_{t+1}."""
        start = self.cache.length
        features = torch.cat(self.pending) if self.pending else None
        n = 0 if features is None else features.shape[0]
        if start + n != len(context) - 1:
            raise RuntimeError(f"The aligned head has features for {start + n} positions but the context has "
                               f"{len(context)} tokens: the loop must report the target's features of every "
                               "committed token but the last (observe_features).")
        self.pending = []
        if features is None:
            return
        positions = torch.arange(start, start + n)
        visible = torch.arange(start + n)[None, :] <= positions[:, None]  # causal over the cache
        token, feature = self.head.step(self.head.fuse(features)[None], self._embed(context[start + 1:]),
                                         positions, visible, self.cache)
        self.last = token[:, -1:], feature[:, -1:]

    def _run(self, inputs: torch.Tensor, tokens: list[int], depth: int, visible: torch.Tensor
             ) -> tuple[torch.Tensor, torch.Tensor]:
        """One head step for drafted tokens at drafting `depth`: inputs [1, n, H] are their parents'
        feature outputs, `visible` [n, S] their attention over the cache after appending."""
        positions = torch.full((len(tokens),), self.last_position + depth)  # every node of a depth shares it
        return self.head.step(inputs, self._embed(tokens), positions, visible, self.cache)

    def propose(self, context: list[int], k: int, sampling: SamplingParams,
                generator: Randomness, stop: TokenStop | None = None) -> Draft:
        refuse_stop(self, stop)
        self._catch_up(context)
        if k <= 0 or self.last is None:
            return EMPTY
        verified = self.cache.length
        self.last_position = verified - 1
        try:
            if self.tree_nodes:
                return self._tree(k)
            return self._chain(k, sampling, generator)
        finally:
            self.cache.crop(verified)  # drop drafted positions: only verified ones stay

    def _logits(self, token_branch: torch.Tensor) -> torch.Tensor:
        return self.head.logits(token_branch, self.target_lm_head)

    def _chain(self, k: int, sampling: SamplingParams, generator: Randomness) -> Draft:
        token_branch, feature = self.last
        tokens: list[int] = []
        rows: list[torch.Tensor] = []
        for depth in range(1, k + 1):
            logits = self._logits(token_branch[0, -1])  # [N]
            if sampling.greedy:
                token = int(self.head.to_target_ids(argmax(logits)))
            else:
                probs = logits_to_probs(self.head.to_target_logits(logits).float(), sampling)  # [V]
                rows.append(probs)
                token = draw(probs, generator, depth - 1)  # coupled: the noise of this drafted position
            tokens.append(token)
            if depth < k:
                visible = torch.ones(1, self.cache.length + 1, dtype=torch.bool)
                token_branch, feature = self._run(feature, [token], depth, visible)
        # At temperature 0 q is exactly the one-hot of each token, which the verifiers assume for q=None.
        return Draft(tokens=tokens, q=torch.stack(rows) if rows else None)

    def _children(self, token_branch: torch.Tensor) -> list[Children]:
        """Per position of token_branch [n, H]: its top-K next tokens (target ids) with their draft
        log-probabilities. One head matmul for all n positions of a tree level."""
        logprobs = self._logits(token_branch).float().log_softmax(-1)
        return top_children(logprobs, self.tree_top_k, self.head.to_target_ids)

    def _tree(self, max_depth: int) -> Draft:
        """EAGLE-2 dynamic tree (specops.drafters.dynamic_tree)."""
        token_branch, feature = self.last
        features = {-1: feature[0, -1]}  # node -> feature output (the parent input of its children)

        def expand(nodes: list[TreeNode], chosen: list[int], visible: torch.Tensor, depth: int) -> list[Children]:
            inputs = torch.stack([features[nodes[i].parent] for i in chosen])[None]  # [1, K, H]
            token_branch, feature = self._run(inputs, [nodes[i].token for i in chosen], depth, visible)
            features.update((i, feature[0, row]) for row, i in enumerate(chosen))
            return self._children(token_branch[0])

        return grow_tree(self._children(token_branch[0, -1:])[0], expand, max_depth, self.tree_top_k,
                         self.tree_nodes, self.cache.length)


def load_aligned_drafter(path: str | Path, target_model: PreTrainedModel, tree_nodes: int = 0,
                         tree_top_k: int = 4) -> AlignedHeadDrafter:
    """The head saved in `path`, run in the target's dtype (bf16 halves its cost too)."""
    return AlignedHeadDrafter(load_head(path).to(target_model.dtype), target_model, tree_nodes, tree_top_k)
