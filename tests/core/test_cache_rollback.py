"""After a rejection the cropped or compacted cache must give the logits of a fresh forward pass."""

from __future__ import annotations

import torch

from specops.core.kv import CachedLM


def fresh_last_logits(model, tokens: list[int]) -> torch.Tensor:
    return model(torch.tensor([tokens])).logits[0, -1]


def test_crop_after_rejection_matches_fresh_forward(target):
    model = target.model
    prefix, drafted = [4, 8, 15, 16], [23, 42, 7]
    with torch.inference_mode():
        lm = CachedLM(model)
        lm.prefill(prefix[:-1])
        lm.forward([prefix[-1]] + drafted)
        lm.crop(len(prefix) + 1)  # one draft token accepted, the rest rolled back
        got = lm.forward([11])[-1]
        torch.testing.assert_close(got, fresh_last_logits(model, prefix + drafted[:1] + [11]), atol=1e-5, rtol=1e-5)


def test_tree_pass_and_keep_match_fresh_forward(target):
    model = target.model
    prefix = [4, 8, 15, 16]
    tokens, parents = [30, 31, 32, 33], [-1, -1, 0, 1]  # two branches: 30->32 and 31->33
    with torch.inference_mode():
        lm = CachedLM(model)
        lm.prefill(prefix[:-1])
        past = lm.length
        logits = lm.forward_tree(prefix[-1], tokens, parents)
        # Each node's logits equal a plain causal forward over its own branch.
        torch.testing.assert_close(logits[4], fresh_last_logits(model, prefix + [31, 33]), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(logits[3], fresh_last_logits(model, prefix + [30, 32]), atol=1e-5, rtol=1e-5)
        lm.keep(past, [0, 2, 4])  # accept the second branch: nodes 1 and 3
        got = lm.forward([5])[-1]
        torch.testing.assert_close(got, fresh_last_logits(model, prefix + [31, 33, 5]), atol=1e-5, rtol=1e-5)
