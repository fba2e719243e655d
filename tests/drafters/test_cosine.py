"""CoSine: the router's pure rules against plain references, the tree fusion against a brute-force
reference, and the drafter's routing on tiny models (exactness: the shared suites in tests/core)."""

from __future__ import annotations

import copy
import json
import random

import pytest
import torch

from specops.core.loop import SpeculativeGenerator
from specops.core.types import SamplingParams
from specops.drafters.cosine import (
    SPECIALISTS_FILE,
    CosineDrafter,
    CosineSettings,
    decayed_hits,
    fuse_trees,
    fusion_log_weights,
    route,
    score,
)
from specops.drafters.draft_lm import DraftLMDrafter
from specops.drafters.dynamic_tree import TreeNode
from specops.drafters.factory import build_drafter
from specops.drafters.kinds import DecodingConfig
from specops.drafters.suffix_front import SuffixFrontDrafter
from tests.conftest import tiny_llama

PROMPT = list(range(10, 40))
GREEDY = SamplingParams()


def test_decayed_hits_is_the_weighted_mean_of_hits():
    rng = random.Random(0)
    hits = [rng.random() < 0.6 for _ in range(40)]
    decay = 0.9
    weights = [decay ** (len(hits) - 1 - j) for j in range(len(hits))]  # the newest weighs 1
    expected = sum(w * h for w, h in zip(weights, hits, strict=True)) / sum(weights)
    state = decayed_hits((0.0, 0.0), hits[:17], decay)
    state = decayed_hits(state, hits[17:], decay)  # scoring in pieces is scoring at once
    assert score(state) == pytest.approx(expected, rel=1e-12)
    assert score((0.0, 0.0)) == 0.0
    assert score(decayed_hits((0.0, 0.0), [True, False, True], 1.0)) == pytest.approx(2 / 3)


def test_route_takes_the_best_score_and_the_first_on_ties():
    assert route([0.2, 0.7, 0.5]) == 1
    assert route([0.5, 0.5]) == 0
    assert route([0.1, 0.9, 0.9]) == 1


def test_fusion_weights_are_a_tempered_softmax():
    weights = torch.tensor(fusion_log_weights([0.6, 0.5], 0.1)).exp()
    assert weights.sum().item() == pytest.approx(1.0)
    assert (weights[0] / weights[1]).item() == pytest.approx(torch.e)  # better by the temperature: e times
    assert fusion_log_weights([0.3, 0.3], 0.1)[0] == pytest.approx(fusion_log_weights([0.3, 0.3], 0.1)[1])


def random_pool(rng: random.Random, vocab: int, size: int) -> list[TreeNode]:
    """A candidate pool as grow_nodes leaves it: parents first, scores falling along every path."""
    nodes: list[TreeNode] = []
    for _ in range(size):
        parent = rng.randrange(-1, len(nodes))
        base = nodes[parent].score if parent >= 0 else 0.0
        depth = nodes[parent].depth + 1 if parent >= 0 else 1
        nodes.append(TreeNode(rng.randrange(vocab), parent, depth, base - rng.random()))
    return nodes


def paths(tokens: list[int], parents: list[int]) -> list[tuple[int, ...]]:
    out: list[tuple[int, ...]] = []
    for token, parent in zip(tokens, parents, strict=True):
        out.append((out[parent] if parent >= 0 else ()) + (token,))
    return out


def reference_fusion(pools: list[list[TreeNode]], log_weights: list[float], tree_nodes: int) -> set[tuple[int, ...]]:
    """The plain rule: every token path's best confidence over the pools, then the most confident paths
    whose prefix is already taken, best first."""
    best: dict[tuple[int, ...], float] = {}
    for pool, log_weight in zip(pools, log_weights, strict=True):
        for node, path in zip(pool, paths([n.token for n in pool], [n.parent for n in pool]), strict=True):
            best[path] = max(best.get(path, -float("inf")), node.score + log_weight)
    chosen: set[tuple[int, ...]] = set()
    for path in sorted(best, key=lambda p: (-best[p], len(p))):
        if len(chosen) < tree_nodes and (len(path) == 1 or path[:-1] in chosen):
            chosen.add(path)
    return chosen


@pytest.mark.parametrize("seed", range(20))
def test_fuse_trees_keeps_the_most_confident_paths(seed):
    rng = random.Random(seed)
    pools = [random_pool(rng, 4, rng.randrange(1, 14)) for _ in range(rng.randrange(2, 4))]
    log_weights = [-rng.random() for _ in pools]
    tree_nodes = rng.randrange(1, 12)
    draft = fuse_trees(pools, log_weights, tree_nodes)
    got = paths(draft.tokens, draft.parents)
    assert len(got) == len(set(got)) <= tree_nodes  # a shared path is one node
    assert all(parent < i for i, parent in enumerate(draft.parents))  # topological
    assert set(got) == reference_fusion(pools, log_weights, tree_nodes)


def two_specialists(target, draft_model, tree_nodes: int = 0) -> CosineDrafter:
    """A weak specialist (a random draft) and a perfect one (the target drafting for itself)."""
    specialists = [DraftLMDrafter(draft_model, target.vocab_size), DraftLMDrafter(target.model, target.vocab_size)]
    return CosineDrafter(specialists, ["weak", "self"], CosineSettings(0.9, 0.1, tree_nodes))


def test_the_router_sends_steps_to_the_specialist_the_target_agrees_with(target, draft_model):
    drafter = two_specialists(target, draft_model)
    result = SpeculativeGenerator(target, drafter, draft_tokens=4).generate(PROMPT, 40)
    weak, perfect = drafter.scores()
    assert perfect > 0.95 and weak < 0.5  # the prompt (not the target's own text) has decayed away
    assert drafter.routed[1] >= drafter.routed[0] and sum(drafter.routed) == result.stats.steps
    alone = SpeculativeGenerator(target, DraftLMDrafter(draft_model, target.vocab_size), draft_tokens=4)
    assert result.stats.accepted > alone.generate(PROMPT, 40).stats.accepted
    # Its draft memory is both specialists' caches (the weak one read every token too, though it drafted less).
    peaks = [s.peak_kv_bytes for s in drafter.specialists]
    assert min(peaks) > 0 and result.stats.draft_kv_bytes == sum(peaks) >= sum(s.lm.kv_bytes() for s in drafter.specialists)


def test_the_fused_tree_holds_both_specialists_and_fits_its_size(target, draft_model):
    drafter = two_specialists(target, draft_model, tree_nodes=6)
    context = PROMPT + [3]
    draft = drafter.propose(context, 3, GREEDY, torch.Generator())
    assert draft.is_tree and 0 < len(draft.tokens) <= 6
    target_chain = DraftLMDrafter(target.model, target.vocab_size).propose(context, 3, GREEDY, torch.Generator())
    assert tuple(target_chain.tokens[:1]) in paths(draft.tokens, draft.parents)  # the perfect one's first guess


def test_catching_up_scores_every_committed_token_once(target, draft_model):
    drafter = two_specialists(target, draft_model)
    drafter.reset()
    drafter.propose(PROMPT, 3, GREEDY, torch.Generator())
    first = [state[1] for state in drafter.hits]
    assert first == [pytest.approx(sum(0.9 ** j for j in range(len(PROMPT) - 1)))] * 2  # the prompt's tokens but the first
    drafter.propose(PROMPT + [5, 6, 7], 3, GREEDY, torch.Generator())
    assert drafter.seen == len(PROMPT) + 3
    assert drafter.hits[0][1] == pytest.approx(first[0] * 0.9 ** 3 + 1 + 0.9 + 0.81)


def test_forks_keep_their_own_state(target, draft_model):
    drafter = two_specialists(target, draft_model)
    drafter.propose(PROMPT, 3, GREEDY, torch.Generator())
    twin = copy.copy(drafter)
    assert twin.seen == 0 and drafter.seen == len(PROMPT)
    assert all(a is not b for a, b in zip(twin.specialists, drafter.specialists, strict=True))
    assert all(a.model is b.model for a, b in zip(twin.specialists, drafter.specialists, strict=True))


def test_settings_and_specialists_are_checked(target, draft_model):
    one = [DraftLMDrafter(draft_model, target.vocab_size)]
    with pytest.raises(ValueError, match="at least two"):
        CosineDrafter(one, ["a"], CosineSettings(0.9, 0.1, 0))
    with pytest.raises(ValueError, match="decay"):
        CosineSettings(1.5, 0.1, 0)
    tree = [DraftLMDrafter(draft_model, target.vocab_size, tree_nodes=4)] * 2
    with pytest.raises(ValueError, match="chain draft LMs"):
        CosineDrafter(tree, ["a", "b"], CosineSettings(0.9, 0.1, 0))


def write_specialists(root, target, names=("code", "chat")):
    for seed, name in enumerate(names, 1):
        tiny_llama(seed, layers=1, hidden=32, vocab=target.vocab_size).save_pretrained(root / name)
    (root / SPECIALISTS_FILE).write_text(json.dumps({"specialists": list(names)}))
    return root


@pytest.mark.parametrize("kind", ["cosine", "cosine-tree", "cosine-suffix"])
def test_the_factory_builds_it_from_a_specialists_folder(target, tmp_path, kind):
    folder = write_specialists(tmp_path, target)
    config = DecodingConfig(drafter=kind, cosine_decay=0.95, cosine_temperature=0.2, tree_nodes=5,
                            suffix_front_min_score=1.5)
    drafter = build_drafter(kind, target, config, folder)
    assert drafter.name == kind
    if kind == "cosine-suffix":  # the routed specialists behind a suffix front, chains only
        assert isinstance(drafter, SuffixFrontDrafter) and drafter.min_score == 1.5 and not drafter.front.tree_nodes
        drafter = drafter.back
    assert isinstance(drafter, CosineDrafter) and drafter.names == ["code", "chat"]
    assert drafter.settings == CosineSettings(0.95, 0.2, 5 if kind == "cosine-tree" else 0)
    with pytest.raises(ValueError, match="specialists folder"):
        build_drafter(kind, target, config, None)
    with pytest.raises(FileNotFoundError, match=SPECIALISTS_FILE):
        build_drafter(kind, target, config, tmp_path / "code")


def test_a_bundle_carries_the_specialists_and_serves_them(target, tmp_path):
    """CoSine's drafter/ is a specialists folder: a config.json naming them and one draft LM folder each."""
    from specops.server.bundle import load_bundle, write_bundle
    from specops.server.generator import generator_from_bundle

    folder = write_specialists(tmp_path / "specialists", target)
    root = write_bundle(tmp_path / "bundle", drafter_dir=folder, drafter_kind="cosine",
                        serving={"verifier": "greedy", "draft_tokens": 3}, target_source="tiny", target_dtype="float32",
                        fingerprint=target.fingerprint, metrics={}, git_sha="0" * 40)
    bundle = load_bundle(root, expected_fingerprint=target.fingerprint)
    assert {"drafter/config.json", "drafter/code/model.safetensors", "drafter/chat/config.json"} <= set(
        bundle.manifest["files"])
    generator = generator_from_bundle(bundle, target)
    assert isinstance(generator.drafter, CosineDrafter) and generator.drafter.names == ["code", "chat"]
    plain = SpeculativeGenerator(target, None).generate(PROMPT, 10).token_ids
    assert generator.generator(GREEDY).generate(PROMPT, 10).token_ids == plain
