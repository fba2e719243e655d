"""The aligned-head drafter in the speculative loop: the features it is fed, greedy equality with the
target (chain and dynamic tree), sampling, and bundles."""

from __future__ import annotations

import pytest
import torch

from specops.core.kv import CachedLM
from specops.core.loop import SpeculativeGenerator
from specops.core.types import SamplingParams
from specops.data.collect import score
from specops.drafters.aligned_head.drafter import AlignedHeadDrafter
from specops.drafters.factory import build_drafter
from specops.drafters.kinds import DecodingConfig
from specops.server.bundle import write_bundle
from specops.server.generator import generator_from_bundle
from tests.drafters.aligned_head.conftest import make_head

PROMPTS = [[5, 17, 33, 17, 33, 40], [7], list(range(10, 40))]


def reference(model, prompt: list[int], n: int) -> list[int]:
    out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, attention_mask=None)
    return out[0, len(prompt):].tolist()


def test_loop_captures_the_layers_collect_stores(target):
    """Serving and training must read the same hidden states: CachedLM's features equal the traces'."""
    ids = PROMPTS[0] + [3, 9]
    lm = CachedLM(target.model, hidden_layers=[1, 0])
    lm.prefill(ids[:4])
    prefill_features = lm.features
    lm.forward(ids[4:])
    stored = score(target.model, "0" * 16, ids[:3], ids[3:], k=4, layers=[1, 0]).hidden_states  # [T, 2, H] fp16
    torch.testing.assert_close(torch.cat([prefill_features, lm.features]).half(), stored, atol=2e-3, rtol=2e-3)
    out = target.model(torch.tensor([ids]), output_hidden_states=True)
    torch.testing.assert_close(lm.features[:, 0], out.hidden_states[2][0, 4:], atol=1e-5, rtol=1e-5)  # layer 1's output
    assert CachedLM(target.model).features is None


@pytest.mark.parametrize(("tree_nodes", "draft_vocab"), [(0, 40), (0, None), (10, 40), (10, None)],
                         ids=["chain", "chain-target-head", "tree", "tree-target-head"])
def test_greedy_is_identical_to_the_target(target, tree_nodes, draft_vocab):
    head = make_head(target.model, [0, 1], draft_vocab=draft_vocab)
    generator = SpeculativeGenerator(target, AlignedHeadDrafter(head, target.model, tree_nodes, tree_top_k=3),
                                     "greedy", draft_tokens=4)
    for prompt in PROMPTS:
        for n in (1, 7, 40):
            assert generator.generate(prompt, n).token_ids == reference(target.model, prompt, n), (prompt, n)


def test_a_tree_holding_every_token_is_accepted_at_every_step(target):
    """With all V tokens as depth-1 candidates the target's token is always in the tree: this checks
    the tree path, the cache compaction and the features fed back after each step."""
    head = make_head(target.model, [1], draft_vocab=None)
    drafter = AlignedHeadDrafter(head, target.model, tree_nodes=target.vocab_size, tree_top_k=target.vocab_size)
    result = SpeculativeGenerator(target, drafter, "greedy", draft_tokens=1).generate(PROMPTS[2], 30)
    assert result.token_ids == reference(target.model, PROMPTS[2], 30)
    drafting_steps = sum(1 for drafted, _ in result.stats.per_step if drafted)
    assert result.stats.accepted == drafting_steps > 0


def test_sampled_chain_drafts_carry_their_distributions(target):
    head = make_head(target.model, [0, 1], draft_vocab=40)
    drafter = AlignedHeadDrafter(head, target.model)
    lm = CachedLM(target.model, hidden_layers=drafter.hidden_layers)
    context = PROMPTS[0]
    lm.prefill(context[:-1])
    drafter.observe_features(lm.features)
    draft = drafter.propose(context, 3, SamplingParams(temperature=0.9, top_p=0.95), torch.Generator().manual_seed(0))
    assert len(draft.tokens) == 3 and draft.q.shape == (3, target.vocab_size)
    torch.testing.assert_close(draft.q.sum(-1), torch.ones(3))
    assert not draft.q[:, ~head.t2d].any()  # nothing outside the draft vocabulary
    assert all(draft.q[i, token] > 0 for i, token in enumerate(draft.tokens))
    with pytest.raises(RuntimeError, match="observe_features"):
        drafter.propose(context + [5], 3, SamplingParams(), None)  # the loop skipped a verify pass


@pytest.mark.parametrize("kind", ["aligned_head", "aligned_head_tree"])
def test_sampling_runs_and_stops(target, kind):
    head = make_head(target.model, [0, 1], draft_vocab=40)
    nodes = 8 if kind == "aligned_head_tree" else 0
    generator = SpeculativeGenerator(target, AlignedHeadDrafter(head, target.model, nodes), "rejection", draft_tokens=3)
    first = generator.generate(PROMPTS[0], 25, SamplingParams(temperature=0.8), seed=3)
    again = generator.generate(PROMPTS[0], 25, SamplingParams(temperature=0.8), seed=3)
    assert first.token_ids == again.token_ids and 0 < len(first.token_ids) <= 25
    assert first.stats.drafted > 0


def test_trained_head_serves_from_a_bundle(trained, chat_target, tmp_path):
    cfg, _ = trained
    bundle = write_bundle(tmp_path / "bundle", drafter_dir=cfg.out_dir, drafter_kind="aligned_head_tree",
                          serving={"draft_tokens": 3, "tree_nodes": 6}, target_source="in-memory",
                          target_dtype="float32", fingerprint=chat_target.fingerprint, metrics={})
    text = generator_from_bundle(bundle, chat_target)
    assert text.drafter.tree_nodes == 6 and text.drafter.hidden_layers == [0, 1]
    prompt = chat_target.tokenizer("question 3: what is 3 + 9?")["input_ids"]
    result = text.generator(SamplingParams()).generate(prompt, 20)
    assert result.token_ids == reference(chat_target.model, prompt, 20)[: len(result.token_ids)]
    with pytest.raises(ValueError, match="aligned head folder"):
        build_drafter("aligned_head", chat_target, DecodingConfig(drafter="aligned_head"))
