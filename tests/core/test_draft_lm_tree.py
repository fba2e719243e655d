"""The draft LM's dynamic tree: built through its KV cache under tree masks, it must equal the tree a
plain reference builds by running the draft from scratch on every path, and leave the cache as it was."""

from __future__ import annotations

import heapq

import pytest
import torch

from specops.core.loop import SpeculativeGenerator
from specops.core.types import SamplingParams
from specops.drafters.draft_lm import DraftLMDrafter

GREEDY = SamplingParams(temperature=0.0)


def reference_tree(model, context: list[int], depth: int, top_k: int, nodes: int,
                   vocab: torch.Tensor | None = None) -> tuple[list[int], list[int]]:
    """EAGLE-2's tree from full forward passes: no cache, no masks, one path at a time; a draft
    vocabulary leaves the other tokens at logit -inf."""
    def children(path: list[int]) -> list[tuple[int, float]]:
        with torch.no_grad():
            logits = model(torch.tensor([context + path])).logits[0, -1].float()
        if vocab is not None:
            outside = torch.ones_like(logits, dtype=torch.bool)
            outside[vocab] = False
            logits = logits.masked_fill(outside, float("-inf"))
        logprobs = logits.log_softmax(-1)
        top = logprobs.topk(top_k)
        return list(zip(top.indices.tolist(), top.values.tolist(), strict=True))

    tree = [(t, -1, 1, s) for t, s in children([])]  # (token, parent, depth, score)

    def path(i: int) -> list[int]:
        return ([] if tree[i][1] < 0 else path(tree[i][1])) + [tree[i][0]]

    for d in range(1, depth):
        level = [i for i, node in enumerate(tree) if node[2] == d]
        for i in heapq.nlargest(top_k, level, key=lambda i: tree[i][3]):
            tree.extend((t, i, d + 1, tree[i][3] + s) for t, s in children(path(i)))
    order = sorted(range(len(tree)), key=lambda i: (-tree[i][3], tree[i][2], i))
    chosen: set[int] = set()
    for i in order:
        if len(chosen) < nodes and (tree[i][1] < 0 or tree[i][1] in chosen):
            chosen.add(i)
    kept = sorted(chosen, key=lambda i: (tree[i][2], i))
    index = {node: position for position, node in enumerate(kept)}
    return [tree[i][0] for i in kept], [index[tree[i][1]] if tree[i][1] >= 0 else -1 for i in kept]


@pytest.mark.parametrize("draft_vocab", [None, 40], ids=["full-head", "draft-vocab"])
@pytest.mark.parametrize(("depth", "top_k", "nodes"), [(1, 3, 3), (3, 2, 5), (4, 3, 10)])
def test_the_tree_equals_a_plain_reference_and_the_cache_keeps_only_the_context(target, draft_model, depth, top_k,
                                                                                  nodes, draft_vocab):
    vocab = None if draft_vocab is None else torch.arange(3, 3 + 2 * draft_vocab, 2)  # every other id
    drafter = DraftLMDrafter(draft_model, target.vocab_size, vocab=vocab, tree_nodes=nodes, tree_top_k=top_k)
    context = [5, 17, 33, 17, 33, 40]
    for step in range(3):  # later steps reuse the cache the earlier ones left
        draft = drafter.propose(context, depth, GREEDY, None)
        tokens, parents = reference_tree(draft_model, context, depth, top_k, nodes, vocab)
        assert (draft.tokens, draft.parents) == (tokens, parents), step
        assert draft.depth <= depth and len(draft.tokens) == min(nodes, len(draft.tokens))
        assert drafter.lm.length == len(context) and drafter.cached == context
        context = context + [tokens[0], 9 + step]  # as if the first draft token and a correction were committed


def test_a_tree_of_the_targets_own_tokens_is_accepted_to_full_depth(target):
    """The target drafting for itself, with room for every candidate (2 + 4 + 4 nodes): its greedy path
    is in the tree, so every step accepts the whole depth and the output is still the target's."""
    drafter = DraftLMDrafter(target.model, target.vocab_size, tree_nodes=10, tree_top_k=2)
    result = SpeculativeGenerator(target, drafter, draft_tokens=3).generate(list(range(10, 40)), 24)
    expected = target.model.generate(torch.tensor([list(range(10, 40))]), max_new_tokens=24, do_sample=False)
    assert result.token_ids == expected[0, 30:].tolist()
    assert result.finish_reason == "length"  # no EOS in 24 tokens: every step had the full depth to accept
    assert result.stats.mean_accepted_length == pytest.approx(4.0, abs=0.5)


def test_tree_settings_are_checked(target, draft_model):
    from specops.drafters.acceptance_head import AcceptanceHead, AcceptanceHeadConfig

    with pytest.raises(ValueError, match="tree_nodes"):
        DraftLMDrafter(draft_model, target.vocab_size, tree_nodes=-1)
    head = AcceptanceHead(AcceptanceHeadConfig(hidden_size=draft_model.config.hidden_size))
    with pytest.raises(ValueError, match="without one"):
        DraftLMDrafter(draft_model, target.vocab_size, head=head, tree_nodes=4)


def test_a_masked_tree_level_computes_what_each_path_alone_computes(draft_model):
    """Siblings side by side in the cache, then a grandchild: each node's hidden state equals the plain
    forward pass over context + its own path."""
    from specops.core.kv import CachedLM

    context = [5, 17, 33, 17, 33, 40]
    lm = CachedLM(draft_model)
    lm.prefill(context)
    n = len(context)

    def alone(path: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return draft_model.base_model(torch.tensor([context + path])).last_hidden_state[0, -1]

    siblings = torch.ones(2, n + 2, dtype=torch.bool)
    siblings[0, n + 1] = siblings[1, n] = False  # each sees the context and itself
    with torch.no_grad():
        level = lm.forward_final_hidden([7, 11], n, siblings)
        grandchild = torch.ones(1, n + 3, dtype=torch.bool)
        grandchild[0, n] = False  # under the second sibling only
        deeper = lm.forward_final_hidden([13], n + 1, grandchild)
    torch.testing.assert_close(level[0], alone([7]), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(level[1], alone([11]), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(deeper[0], alone([11, 13]), atol=1e-5, rtol=1e-5)
