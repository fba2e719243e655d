"""The head's parallel training forward equals step-by-step drafting; masks, vocab maps and files."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from specops.drafters.aligned_head.model import (
    WEIGHTS_FILE,
    AlignedHeadConfig,
    HeadCache,
    load_head,
    save_head,
    unroll_attention_mask,
)
from tests.conftest import tiny_llama
from tests.drafters.aligned_head.conftest import make_head

T, STEPS = 8, 3


@pytest.fixture(scope="module")
def model():
    return tiny_llama(seed=0, vocab=64, layers=3, hidden=32)


def sequential(head, x0, e, start: int, steps: int) -> torch.Tensor:
    """Reference drafting: true features at 0..start, then `steps` steps on the head's own features
    (with the true next tokens). The token branch [1, H] of the last step."""
    cache = HeadCache()
    positions = torch.arange(start + 1)
    token, feature = head.step(x0[:, : start + 1], e[:, : start + 1], positions,
                               positions[None, :] <= positions[:, None], cache)
    token, feature = token[:, -1:], feature[:, -1:]
    for i in range(1, steps + 1):
        visible = torch.ones(1, cache.length + 1, dtype=torch.bool)
        token, feature = head.step(feature, e[:, start + i: start + i + 1], torch.tensor([start + i]), visible, cache)
    return token[:, -1]


@pytest.mark.parametrize(("tgf", "teh"), [(True, True), (False, False), (True, False)])
def test_unroll_equals_step_by_step_drafting(model, tgf, teh):
    head = make_head(model, [0, 2], draft_vocab=20, tgf=tgf, teh=teh)
    x0 = head.fuse(torch.randn(1, T, 2, 32))
    e = torch.randn(1, T, 32)
    with torch.no_grad():
        unrolled = head.unroll(x0, e, STEPS)
        for j in range(STEPS):
            for t in range(j, T):
                # fp32 sums in another order: ~1e-6 apart; a wrong mask or input shifts by O(1).
                torch.testing.assert_close(unrolled[j][0][:, t], sequential(head, x0, e, t - j, j), atol=1e-5, rtol=1e-5)


def test_unroll_attention_mask_matches_its_definition():
    for step in range(4):
        mask = unroll_attention_mask(5, step)
        assert mask.shape == (5, 5 * (step + 1))
        for t in range(5):
            expected = torch.zeros(step + 1, 5, dtype=torch.bool)
            expected[0, : max(t - step + 1, 0)] = True  # true prefix: positions <= t - step
            for i in range(1, step + 1):
                if t - step + i >= 0:
                    expected[i, t - step + i] = True
            assert torch.equal(mask[t], expected.flatten()), (step, t)


def test_draft_vocabulary_maps(model):
    head = make_head(model, [1], draft_vocab=4)
    head.set_draft_vocab(torch.tensor([3, 7, 8, 60]))
    assert head.d2t.tolist() == [3, 6, 6, 57] and head.t2d.nonzero().flatten().tolist() == [3, 7, 8, 60]
    assert head.to_target_ids(torch.tensor([0, 3])).tolist() == [3, 60]
    full = head.to_target_logits(torch.tensor([1.0, 2.0, 3.0, 4.0]))
    assert full.shape == (64,) and full[[3, 7, 8, 60]].tolist() == [1.0, 2.0, 3.0, 4.0]
    assert torch.isinf(full).sum() == 60
    with pytest.raises(ValueError, match="ascending"):
        head.set_draft_vocab(torch.tensor([7, 3, 8, 60]))
    with pytest.raises(ValueError, match="no draft vocabulary"):
        make_head(model, [1]).logits(torch.randn(32))


def test_config_rejects_bad_shapes():
    base = dict(hidden_size=32, target_vocab_size=64, num_target_layers=3, num_attention_heads=4,
                num_key_value_heads=2, head_dim=8, intermediate_size=64)
    with pytest.raises(ValueError, match="outside"):
        AlignedHeadConfig(hidden_layers=[3], **base)
    with pytest.raises(ValueError, match="at least one"):
        AlignedHeadConfig(hidden_layers=[], **base)
    with pytest.raises(ValueError, match="draft_vocab_size"):
        AlignedHeadConfig(hidden_layers=[0], draft_vocab_size=65, **base)


def test_save_load_roundtrip_and_refusals(model, tmp_path):
    head = make_head(model, [0, 1], draft_vocab=10)
    folder = save_head(head, tmp_path / "head")
    loaded = load_head(folder)
    x = torch.randn(1, 3, 2, 32)
    e = torch.randn(1, 3, 32)
    with torch.no_grad():
        expected = head.logits(head.unroll(head.fuse(x), e, 2)[1][0])
        assert torch.equal(loaded.logits(loaded.unroll(loaded.fuse(x), e, 2)[1][0]), expected)
    assert torch.equal(loaded.d2t, head.d2t)

    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "surprise": 1}))
    with pytest.raises(ValueError, match="surprise"):
        load_head(folder)
    (folder / "config.json").write_text(json.dumps({**config, "kind": "draft-lm"}))
    with pytest.raises(ValueError, match="not an aligned head"):
        load_head(folder)
    (folder / "config.json").write_text(json.dumps(config))
    state = load_file(str(folder / WEIGHTS_FILE))
    del state["fc.weight"]
    save_file(state, str(folder / WEIGHTS_FILE))
    with pytest.raises(ValueError, match="fc.weight"):
        load_head(folder)
