"""Tree drafts on the static runtime (StaticLM.forward_tree): each root-to-leaf branch in a cache of its
own, so a tree row reduces over its ancestors in the slots plain decoding puts them, and its logits are
bitwise plain decoding's. Every tree drafter then emits plain decoding's tokens, greedy and sampled with
the same seed (the tree walk draws once per emitted token, as plain sampling does), alone and batched
with other generations. Mutants that must fail: rows attending in the first branch's cache, a commit that
leaves the root out of branches the tree did not use, branch caches not brought up to tokens committed by
chain passes."""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from specops.core import kv
from specops.core.batching import PassBatcher
from specops.core.kv import StaticLM
from specops.core.llama import Branches, LlamaForward
from specops.core.loop import SpeculativeGenerator
from specops.core.memory import DecodingShape, ModelShape, memory_report
from specops.core.target import target_from_model
from specops.core.types import SamplingParams, static_tree_refusal
from specops.core.verify import VERIFIERS
from specops.drafters.draft_lm import DraftLMDrafter
from specops.drafters.factory import build_drafter
from specops.drafters.kinds import DecodingConfig
from specops.drafters.prompt_lookup import PromptLookupDrafter
from specops.drafters.recycling import RecyclingDrafter
from specops.drafters.suffix import SuffixCache, SuffixDrafter
from tests.conftest import VOCAB, tiny_llama, tiny_tokenizer
from tests.core.test_static_runtime import aligned

HIDDEN = 96  # wide enough for every product to run on oneDNN (specops.core.batching.batch_invariant)
WIDTH = 4
PROMPTS = [[5, 17, 33, 17, 33, 40], list(range(10, 40)), [7, 7, 7, 7]]
SAMPLED = SamplingParams(temperature=0.9)


@pytest.fixture(scope="module")
def target():
    return target_from_model(tiny_llama(0, dtype=torch.bfloat16, hidden=HIDDEN), tiny_tokenizer(), "t")


def tree_drafters(target) -> dict:
    draft = tiny_llama(1, layers=1, hidden=32, dtype=torch.bfloat16)
    return {"recycling": RecyclingDrafter(target.vocab_size, num_nodes=8),
            "hybrid": RecyclingDrafter(target.vocab_size, num_nodes=6, lookup=PromptLookupDrafter(3)),
            "suffix-tree": SuffixDrafter(SuffixCache(8, 64), 6, 1.0, 0.1),
            "draft-lm-tree": DraftLMDrafter(draft, target.vocab_size, tree_nodes=8, tree_top_k=3),
            "self-draft-tree": DraftLMDrafter(target.model, target.vocab_size, tree_nodes=8, tree_top_k=3),
            "aligned_head_tree": aligned(target.model, tree_nodes=6)}  # reads the tree rows' features


def mismatches(target, drafters: dict, verifiers=VERIFIERS, tokens: int = 32) -> list:
    """(drafter, verifier, prompt, sampled) of every generation that differs from plain decoding's."""
    wrong = []
    for verifier in verifiers:
        plain = SpeculativeGenerator(target, None, verifier, 0, static_width=WIDTH)
        for name, drafter in drafters.items():
            spec = SpeculativeGenerator(target, drafter, verifier, WIDTH - 1, static_width=WIDTH)
            for prompt in PROMPTS:
                for sampling in [SamplingParams()] + ([SAMPLED] if verifier != "greedy" else []):
                    if spec.generate(prompt, tokens, sampling, seed=7).token_ids != \
                            plain.generate(prompt, tokens, sampling, seed=7).token_ids:
                        wrong.append((name, verifier, prompt[:3], sampling.temperature))
    return wrong


def test_tree_rows_are_bitwise_plain_decoding_rows(target):
    """Random trees after random prompts: every row's logits are those of its path fed one token at a time."""
    rng = random.Random(0)
    with torch.inference_mode():
        for _ in range(12):
            prompt = [rng.randrange(3, VOCAB) for _ in range(rng.randrange(5, 60))]
            n = rng.randrange(1, 10)
            parents = [-1] + [rng.randrange(-1, i) for i in range(1, n)]
            tokens = [rng.randrange(3, VOCAB) for _ in range(n)]
            tree = StaticLM(target.model, WIDTH, 128)
            tree.prefill(prompt[:-1])
            logits = tree.forward_tree(prompt[-1], tokens, parents)
            for row in range(n + 1):
                path, node = [], row
                while node:
                    path.insert(0, tokens[node - 1])
                    node = parents[node - 1] + 1
                plain = StaticLM(target.model, WIDTH, 128)
                plain.prefill(prompt[:-1])
                last = [plain.forward([t])[0] for t in [prompt[-1], *path]][-1]
                assert torch.equal(last, logits[row])


def test_every_tree_drafter_is_bitwise_plain_decoding(target, monkeypatch):
    kept_from = []  # the branch each commit came from
    original = StaticLM.keep

    def spy(self, start, offsets):
        kept_from.append(self._tree[offsets[-1]])
        original(self, start, offsets)

    monkeypatch.setattr(StaticLM, "keep", spy)
    assert mismatches(target, tree_drafters(target)) == []
    assert max(kept_from) > 0  # paths were accepted from caches other than the main one


def final_tree_rows_are_plain(model, steps: list[tuple], tokens: list[int], parents: list[int]) -> tuple[bool, int]:
    """After a history of tree steps ("tree", root, tokens, parents, kept rows) and chain passes ("chain",
    tokens), a last tree rooted at 53: are all its rows' logits those of plain decoding over the same
    committed tokens? And how many caches does the pool hold?"""
    prompt = list(range(10, 30))
    lm = StaticLM(model, WIDTH, 128)
    lm.prefill(prompt[:-1])
    fed = []  # every token committed to the cache after the prompt's prefill, in order
    with torch.inference_mode():
        for step in steps:
            if step[0] == "tree":
                _, root, nodes, tree, kept = step
                start = lm.length
                lm.forward_tree(root, nodes, tree)
                lm.keep(start, kept)
                fed += [root] + [nodes[row - 1] for row in kept[1:]]
            else:
                lm.forward(step[1])
                fed += step[1]
        logits = lm.forward_tree(53, tokens, parents)
        plain = StaticLM(model, WIDTH, 128)
        plain.prefill(prompt[:-1])
        for token in fed:
            plain.forward([token])
        base, equal = plain.length, []
        for row in range(len(tokens) + 1):
            path, node = [], row
            while node:
                path.insert(0, tokens[node - 1])
                node = parents[node - 1] + 1
            plain.crop(base)
            equal.append(torch.equal([plain.forward([t])[0] for t in [53, *path]][-1], logits[row]))
    return all(equal), lm._pool[0][0].shape[0]


# Three leaves committing from the last branch, a chain pass, a one-leaf tree (the other branches unused),
# then three leaves again: every way a branch cache can fall behind the main one, without reallocating.
HISTORY = [("tree", 29, [41, 42, 43], [-1, -1, -1], [0, 3]), ("chain", [50, 51]), ("tree", 52, [44], [-1], [0, 1])]
LAST = ([45, 46, 47, 48], [-1, 0, -1, -1])


def rows_after_history(model) -> bool:
    return final_tree_rows_are_plain(model, HISTORY, *LAST)[0]


def test_rows_after_every_kind_of_commit_are_plain_decoding_rows(target):
    assert rows_after_history(target.model)


def test_the_branch_caches_grow_with_the_widest_tree_and_keep_what_they_hold(target):
    """Two leaves committing from the second branch and a chain pass, then five leaves: the pool is
    reallocated holding the committed tokens, one cache per leaf (the memory model's count), no more."""
    steps = [("tree", 29, [41, 42], [-1, -1], [0, 2]), ("chain", [50])]
    equal, caches = final_tree_rows_are_plain(target.model, steps, [45, 46, 47, 48, 49, 40], [-1, -1, -1, -1, -1, 0])
    assert equal and caches == 5


def first_branch_only(owner, write_branch, write_row):
    return Branches(torch.zeros_like(owner), write_branch, write_row)


def keep_without_the_root(self, start, offsets):
    end = start + len(offsets)
    source = self._tree[offsets[-1]]
    for pooled in (*self._pool[0], *self._pool[1]):
        pooled[:, :, start + 1: end] = pooled[source, :, start + 1: end].clone()
    self.length = self._synced = end
    self._tree = None


def no_sync(self, branches):
    if self._pool is not None:
        self._synced = max(self._synced, self.length)
    return original_branch_caches(self, branches)


original_branch_caches = StaticLM._branch_caches


@pytest.mark.parametrize(("attribute", "mutant"), [
    ("Branches", first_branch_only),  # rows attend in the first branch's cache
    ("keep", keep_without_the_root),  # a commit leaves the root out of branches the tree did not use
    ("_branch_caches", no_sync),  # tokens committed by chain passes never reach the other branches
])
def test_mutants_of_the_branch_layout_are_caught(target, monkeypatch, attribute, mutant):
    if attribute == "Branches":
        monkeypatch.setattr(kv, "Branches", mutant)
    else:
        monkeypatch.setattr(StaticLM, attribute, mutant)
    assert not rows_after_history(target.model)


def test_batched_tree_and_chain_generations_emit_what_they_emit_alone(target, monkeypatch):
    batcher = PassBatcher(target.model, window_s=0.05)
    mixed = []
    original = LlamaForward.forward_many

    def spy(self, segments, head=True):
        trees = sum(s.branches is not None for s in segments)
        mixed.append(trees and len(segments) > trees)  # a tree beside another sequence's rows
        return original(self, segments, head)

    monkeypatch.setattr(LlamaForward, "forward_many", spy)
    jobs = [(kind, verifier, sampling, prompt, seed) for kind in ("recycling", "suffix-tree", "prompt-lookup")
            for verifier, sampling in (("greedy", SamplingParams()), ("rejection", SAMPLED), ("coupled", SAMPLED))
            for seed, prompt in enumerate(PROMPTS)]

    def run(job, batcher: PassBatcher | None):
        kind, verifier, sampling, prompt, seed = job
        drafter = {"recycling": lambda: RecyclingDrafter(target.vocab_size, num_nodes=8),
                   "suffix-tree": lambda: SuffixDrafter(SuffixCache(8, 64), 6, 1.0, 0.1),
                   "prompt-lookup": lambda: PromptLookupDrafter(3)}[kind]()
        generator = SpeculativeGenerator(target, drafter, verifier, WIDTH - 1, static_width=WIDTH, batcher=batcher)
        result = generator.generate(prompt, 24, sampling, seed=seed, logprobs=2)
        return result.token_ids, result.logprobs

    alone = [run(job, None) for job in jobs]
    with ThreadPoolExecutor(len(jobs)) as pool:  # every generation on a thread of its own, as in the server
        together = list(pool.map(lambda job: run(job, batcher), jobs))
    assert any(mixed)
    assert together == alone


def test_a_tree_too_large_for_one_pass_fails_alone_before_its_pass(target):
    """Refused in its own sequence: inside a batched pass the error would reach every sequence in it."""
    lm = StaticLM(target.model, WIDTH, 128)
    lm.prefill(list(range(10, 20)))
    with pytest.raises(ValueError, match="at most 64 rows; this tree has 64 nodes"):
        lm.forward_tree(5, [6] * 64, [-1] * 64)
    assert lm._pool is None


def test_trees_are_refused_where_they_would_not_be_exact(tokenizer):
    fp32 = target_from_model(tiny_llama(0, hidden=HIDDEN), tokenizer, "t")
    generator = SpeculativeGenerator(fp32, RecyclingDrafter(fp32.vocab_size, num_nodes=6), static_width=WIDTH)
    with pytest.raises(ValueError, match="Tree drafts on the static runtime need"):
        generator.generate(list(range(10, 30)), 8)
    with pytest.raises(ValueError, match="batch-invariant"):
        build_drafter("recycling", fp32, DecodingConfig(drafter="recycling", static_width=WIDTH))
    with pytest.raises(ValueError, match="drop compiled"):
        DecodingConfig(drafter="draft-lm-tree", static_width=WIDTH, compiled=True)
    # The config-time reasons, before any model loads (DecodingConfig, EvaluateConfig).
    assert static_tree_refusal(False) is None and static_tree_refusal(False, "bfloat16") is None
    assert "eager" in static_tree_refusal(True, "bfloat16") and "bfloat16 only" in static_tree_refusal(False, "float32")


def test_the_memory_model_counts_a_cache_per_branch():
    shape = ModelShape(layers=2, hidden=64, intermediate=128, heads=4, kv_heads=2, head_dim=16, vocab=1000, tied=True)
    chain = memory_report(shape, DecodingShape(static_width=5, draft_tokens=4, context=256))
    tree = memory_report(shape, DecodingShape(static_width=5, draft_tokens=4, tree_nodes=8, context=256))
    assert tree.request.target_kv == 8 * chain.request.target_kv
