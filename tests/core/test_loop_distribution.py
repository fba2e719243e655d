"""Sampled speculative decoding follows the target's distribution end to end, through the real loop.

The pure rules are tested in test_verify_distribution.py. Here the whole `SpeculativeGenerator` runs:
its cache and rollback, every drafter kind (chain and tree, model-free and model-based, feature
readers) under the sampling verifiers whose output depends on the draft (rejection, block), the coupled
verifier (whose output is plain coupled sampling's, bitwise, for every drafter: tested below) through the
draft LM, and every draft-length policy, at temperature 1 and with top-k and top-p. Target and draft are
`TableLM`s, exact fp64 conditional tables over 3 tokens, so the exact distribution of any window of
generated tokens is known; chi-square tests compare it with N seeded generations of 8 tokens, on the
first three (the first step drafts K = 3 tokens, so block verification's interior h_i are exercised)
and on the last three (after several steps of cache rollback, drafter state and policy updates).

Must-fail controls, run with the same seeds and sample sizes as the correct ones, show the test has the
power to catch: the old goodput_head trim applied while sampling (it verifies a prefix chosen from each
token's own predicted acceptance), a tree walk that reads the root's row at every depth, and a chain
rule that resamples from p instead of the residual. Every test prints its p-value (`pytest -s`).
"""

from __future__ import annotations

import functools
from collections import Counter, defaultdict
from collections.abc import Callable
from typing import Protocol

import pytest
import torch
from scipy.stats import chisquare

from specops.core.cost_model import CostModel
from specops.core.drafter import Draft, Drafter, DrafterBase
from specops.core.kv import CachedLM
from specops.core.loop import SpeculativeGenerator
from specops.core.policies import (
    FixedPolicy,
    GoodputPolicy,
    HeadGoodputPolicy,
    HeuristicPolicy,
    SpecDecPPPolicy,
)
from specops.core.sampling import logits_to_probs, sample
from specops.core.target import Target, TargetFingerprint
from specops.core.types import SamplingParams
from specops.core.verify import VERIFIERS
from specops.drafters import del_exit
from specops.drafters.acceptance_head import AcceptanceHead, AcceptanceHeadConfig
from specops.drafters.aligned_head.drafter import AlignedHeadDrafter
from specops.drafters.aligned_head.model import AlignedHead, AlignedHeadConfig
from specops.drafters.cosine import CosineDrafter, CosineSettings
from specops.drafters.del_exit import DELDrafter, ExitHeads
from specops.drafters.draft_lm import DraftLMDrafter
from specops.drafters.prompt_lookup import PromptLookupDrafter
from specops.drafters.recycling import RecyclingDrafter
from specops.drafters.suffix import SuffixCache, SuffixDrafter
from specops.drafters.suffix_front import SuffixFrontDrafter
from tests.conftest import tiny_llama
from tests.core.table_lm import TableLM, table_target

V, K, N = 3, 3, 1200
PROMPT = [0, 1, 2, 0, 1]  # "0 1" repeats, so prompt lookup drafts from the first step on
MAX_NEW = 8
WINDOWS = ((0, 3), (5, 8))  # generated positions compared with the exact distribution
TARGET = TableLM(V, salt=0, sharpness=1.5)
DRAFT = TableLM(V, salt=1, sharpness=2.5)  # sharper and different: many rejections, large residuals
DRAFT_2 = TableLM(V, salt=2, sharpness=2.0)  # CoSine's second specialist
TEMPERATURE = SamplingParams(temperature=1.0)
ALPHA = 1e-3  # a correct combination must not be rejected at this level (seeds are fixed: no flakes)
MUTANT_ALPHA = 1e-6  # a mutant must be rejected at this level
# Step times for the goodput policies: verification grows with the tokens verified, so trimming
# and shorter drafts both pay for a weak draft.
COST = CostModel(draft_token_s=0.05, verify_s=((1, 1.0), (2, 1.6), (4, 2.0), (8, 3.0)))


class Table(Protocol):
    def log_probs(self, context: tuple[int, ...]) -> torch.Tensor: ...


def acceptance_head() -> AcceptanceHead:
    """A fixed logistic head on q(x) alone: P(accept) = sigmoid(6 q(x) - 3), ~0.2 to ~0.95 here. The
    prediction depends on the drafted token itself, which is what a trim must not act on."""
    head = AcceptanceHead(AcceptanceHeadConfig(hidden_size=V, hidden_units=0))  # float32, as it reads features
    with torch.no_grad():
        head.net.weight.zero_()
        head.net.weight[0, V] = 6.0  # the q(x) feature
        head.net.bias.fill_(-3.0)
    return head.eval()


def aligned_drafter(tree_nodes: int = 0) -> AlignedHeadDrafter:
    torch.manual_seed(7)
    cfg = AlignedHeadConfig(hidden_size=V, target_vocab_size=V, hidden_layers=[0], num_target_layers=1,
                            num_attention_heads=1, num_key_value_heads=1, head_dim=4, intermediate_size=8)
    head = AlignedHead(cfg).double()
    with torch.no_grad():  # sharpen the random head so its drafts differ from uniform
        for p in head.parameters():
            p.mul_(3.0)
    return AlignedHeadDrafter(head, TARGET, tree_nodes=tree_nodes, tree_top_k=2)


class TrimWhileSampling(DrafterBase):
    """Must-fail control: the loop's old goodput_head behaviour at temperature > 0, verifying only the
    draft prefix that `trim` picks from the drafted tokens' own predicted acceptance."""

    name = "trim-while-sampling"
    predicts_acceptance = True

    def __init__(self, inner: DraftLMDrafter, trim: Callable[[list[float]], int]) -> None:
        self.inner, self.trim = inner, trim

    def reset(self) -> None:
        self.inner.reset()

    def propose(self, context, k, sampling, generator, stop=None) -> Draft:
        draft = self.inner.propose(context, k, sampling, generator, stop=stop)
        return draft.prefix(self.trim(draft.accept_probs)) if draft.accept_probs else draft


@functools.cache
def exact_windows(sampling: SamplingParams, lm: Table = TARGET) -> list[dict[tuple[int, ...], float]]:
    """The exact distribution of each window of the generated tokens: every 8-token continuation with
    its probability under the (transformed) target `lm`, summed into its windows."""
    out: list[dict[tuple[int, ...], float]] = [defaultdict(float) for _ in WINDOWS]

    def walk(prefix: tuple[int, ...], prob: float) -> None:
        if len(prefix) == MAX_NEW:
            for dist, (a, b) in zip(out, WINDOWS, strict=True):
                dist[prefix[a:b]] += prob
            return
        for token, p in enumerate(logits_to_probs(lm.log_probs(tuple(PROMPT) + prefix), sampling).tolist()):
            if p > 0:
                walk(prefix + (token,), prob * p)

    walk((), 1.0)
    return out


def chi_square(samples: list[tuple[int, ...]], exact: dict[tuple[int, ...], float]) -> float:
    """Chi-square p-value of samples against an exact distribution; cells expecting fewer than 5
    samples are pooled. A sample the target gives probability 0 (top-k, top-p) is an outright failure."""
    counts = Counter(samples)
    if any(exact.get(seq, 0.0) == 0 for seq in counts):
        return 0.0
    n = len(samples)
    big = [seq for seq in exact if exact[seq] * n >= 5]
    small = [seq for seq in exact if 0 < exact[seq] * n < 5]
    observed = [counts[seq] for seq in big] + ([sum(counts[seq] for seq in small)] if small else [])
    expected = [exact[seq] * n for seq in big] + ([sum(exact[seq] for seq in small) * n] if small else [])
    return float(chisquare(observed, expected).pvalue)


def sampled_p_value(generator: SpeculativeGenerator, sampling: SamplingParams = TEMPERATURE,
                    lm: Table = TARGET) -> float:
    """The smaller p-value of the two windows' tests over N seeded generations of the target `lm`."""
    runs = []
    for seed in range(N):
        out = generator.generate(PROMPT, MAX_NEW, sampling, seed=seed)
        assert len(out.token_ids) == MAX_NEW and not out.stats.lossy
        runs.append(tuple(out.token_ids))
    return min(chi_square([run[a:b] for run in runs], exact)
               for (a, b), exact in zip(WINDOWS, exact_windows(sampling, lm), strict=True))


def report(name: str, p: float) -> float:
    print(f"\n{name}: p = {p:.3g}")
    return p


def draft_lm(head: bool = False, tree_nodes: int = 0) -> DraftLMDrafter:
    return DraftLMDrafter(DRAFT, V, acceptance_head() if head else None, tree_nodes=tree_nodes, tree_top_k=2)


def windowed() -> DraftLMDrafter:
    """The draft LM with a window of 6 (1 sink): from the second step on it drafts from the context's first
    token and its last ones, a distribution of its own (the table LM reads every key it is shown)."""
    return DraftLMDrafter(DRAFT, V, window=6, sinks=1)


def suffix_front(head: bool = False) -> SuffixFrontDrafter:
    """The draft LM behind a suffix front that takes over once the samples so far repeat."""
    return SuffixFrontDrafter(SuffixDrafter(SuffixCache(8, 64), 0, 1.0, 0.1), draft_lm(head=head), min_score=1.0)


def cosine(tree_nodes: int = 0, cls: type[CosineDrafter] = CosineDrafter) -> CosineDrafter:
    """Two specialists; a short decay so the route changes within a generation."""
    specialists = [DraftLMDrafter(DRAFT, V, tree_top_k=2), DraftLMDrafter(DRAFT_2, V, tree_top_k=2)]
    return cls(specialists, ["a", "b"], CosineSettings(0.5, 0.1, tree_nodes))


CHAIN_DRAFTERS: dict[str, Callable[[], Drafter]] = {
    "prompt-lookup": lambda: PromptLookupDrafter(max_ngram=2),
    "draft-lm": draft_lm,
    "aligned_head": aligned_drafter,
    "suffix": lambda: SuffixDrafter(SuffixCache(8, 64), 0, 1.0, 0.1),  # drafts from earlier samples: its cache outlives a generation
    "draft-lm-suffix": suffix_front,
    "cosine": cosine,
    "cosine-suffix": lambda: SuffixFrontDrafter(SuffixDrafter(SuffixCache(8, 64), 0, 1.0, 0.1), cosine(), 1.0),


    "draft-lm-window": windowed,
}
TREE_DRAFTERS: dict[str, Callable[[], Drafter]] = {
    "recycling": lambda: RecyclingDrafter(V, num_nodes=6, top_k=3),
    "hybrid": lambda: RecyclingDrafter(V, num_nodes=4, top_k=3, lookup=PromptLookupDrafter(max_ngram=2)),
    "draft-lm-tree": lambda: draft_lm(tree_nodes=5),
    "aligned_head_tree": lambda: aligned_drafter(tree_nodes=5),
    "suffix-tree": lambda: SuffixDrafter(SuffixCache(8, 64), 5, 1.0, 0.1),
    "cosine-tree": lambda: cosine(tree_nodes=5),
}
POLICIES = {
    "fixed": lambda: FixedPolicy(K),
    "heuristic": lambda: HeuristicPolicy(K),
    "goodput": lambda: GoodputPolicy(K, COST),
    "specdecpp": lambda: SpecDecPPPolicy(K, threshold=0.5),
    "goodput_head": lambda: HeadGoodputPolicy(K, COST),
}
HEAD_POLICIES = ("specdecpp", "goodput_head")
SAMPLING_VERIFIERS = [v for v in VERIFIERS if v != "greedy"]
# Which drafters each policy sets the length of (as specops.drafters.factory allows), and the fixed policy for all.
# cosine-suffix composes two drafters checked under every verifier (cosine, draft-lm-suffix): rejection, whose
# output depends on the drafts' q, checks the composition. Under coupled verification every drafter's output is
# plain coupled sampling's, bitwise (test_coupled_runs_draw_what_plain_coupled_sampling_draws below), so the
# distribution is checked there through the draft LM alone, under every policy.
CHAIN_CASES = [(d, v, p) for d in CHAIN_DRAFTERS for v in SAMPLING_VERIFIERS for p in POLICIES
               if (p == "fixed" or (d == "draft-lm" and p != "fixed") or (d == "prompt-lookup" and p in ("heuristic", "goodput"))
                   or (d == "draft-lm-suffix" and p == "specdecpp")) and (d != "cosine-suffix" or v == "rejection")
               and (v != "coupled" or d == "draft-lm")]


def test_every_policy_is_covered():
    from specops.core.policies import POLICIES as ALL

    assert set(POLICIES) == set(ALL)
    assert {p for _, _, p in CHAIN_CASES} == set(ALL)


@pytest.mark.slow
@pytest.mark.parametrize(("drafter", "verifier", "policy"), CHAIN_CASES, ids=["-".join(c) for c in CHAIN_CASES])
def test_chain_drafters_sample_the_target_distribution(drafter, verifier, policy):
    head = suffix_front(head=True) if drafter == "draft-lm-suffix" else draft_lm(head=True)
    built = head if policy in HEAD_POLICIES else CHAIN_DRAFTERS[drafter]()
    generator = SpeculativeGenerator(table_target(TARGET), built, verifier, K, policy=POLICIES[policy]())
    assert report(f"{drafter} {verifier} {policy}", sampled_p_value(generator)) > ALPHA


@pytest.mark.slow
def test_tree_walk_samples_the_target_distribution():
    """Trees are verified by the tree walk whatever chain verifier is named."""
    generator = SpeculativeGenerator(table_target(TARGET), TREE_DRAFTERS["draft-lm-tree"](), "rejection", K)
    assert report("draft-lm-tree tree walk", sampled_p_value(generator)) > ALPHA


@pytest.mark.parametrize("drafter", list(TREE_DRAFTERS))
def test_tree_drafters_draw_what_plain_sampling_draws(drafter):
    """The tree walk draws y ~ p once per emitted token, as plain sampling does, and descends where y
    was drafted: with the same seed every tree drafter emits exactly plain sampling's tokens."""
    tree = SpeculativeGenerator(table_target(TARGET), TREE_DRAFTERS[drafter](), "rejection", K)
    assert accepted_while_matching_plain(tree) > 0  # the trees did shorten decoding: the walk descended into them


def accepted_while_matching_plain(spec: SpeculativeGenerator, seeds: int = 150) -> int:
    """Assert that `spec` emits plain decoding's tokens (same verifier, no drafter) for every seed; return
    how many drafted tokens it accepted on the way."""
    plain = SpeculativeGenerator(table_target(TARGET), None, spec.verifier, K)
    accepted = 0
    for seed in range(seeds):
        out = spec.generate(PROMPT, MAX_NEW, TEMPERATURE, seed=seed)
        assert out.token_ids == plain.generate(PROMPT, MAX_NEW, TEMPERATURE, seed=seed).token_ids, seed
        accepted += out.stats.accepted
    return accepted


TRUNCATIONS = {"top_k=2": SamplingParams(temperature=1.0, top_k=2), "top_p=0.8": SamplingParams(temperature=1.5, top_p=0.8)}


@pytest.mark.slow
@pytest.mark.parametrize("verifier", SAMPLING_VERIFIERS + ["tree"])
@pytest.mark.parametrize("truncation", list(TRUNCATIONS))
def test_truncated_sampling_keeps_the_target_distribution(verifier, truncation):
    """top-k and top-p cut tokens from p and q alike: drafted tokens the target gives 0 (p(x) = 0) and
    target tokens the draft cannot propose (q(x) = 0) both occur here."""
    drafter = draft_lm(tree_nodes=5) if verifier == "tree" else draft_lm()
    generator = SpeculativeGenerator(table_target(TARGET), drafter, "rejection" if verifier == "tree" else verifier, K)
    sampling = TRUNCATIONS[truncation]
    assert report(f"draft-lm {verifier} {truncation}", sampled_p_value(generator, sampling)) > ALPHA


@pytest.mark.slow
@pytest.mark.parametrize("verifier", ["rejection", "block"])
def test_trimming_while_sampling_is_caught(verifier):
    """The bug this file was written for: goodput_head's trim applied at temperature > 0."""
    policy = HeadGoodputPolicy(K, COST)
    drafter = TrimWhileSampling(draft_lm(head=True), policy.best_prefix)
    generator = SpeculativeGenerator(table_target(TARGET), drafter, verifier, K, policy=policy)  # type: ignore[arg-type]
    assert report(f"mutant: goodput_head trim while sampling, {verifier}", sampled_p_value(generator)) < MUTANT_ALPHA


class FrontChosenAfterDrawing(SuffixFrontDrafter):
    """Mutant: the draft LM draws first, and its draft is swapped for the suffix front's when the token it
    drew was unlikely under its own q: which draft is verified then depends on the drawn value."""

    def propose(self, context, k, sampling, generator, stop=None):
        drawn = self.back.propose(context, k, sampling, generator, stop)
        front, _ = self.front.scored(context, k)
        if front.tokens and drawn.q is not None and drawn.q[0, drawn.tokens[0]] < 0.5:
            return front
        return drawn


@pytest.mark.slow
def test_choosing_the_front_after_drawing_is_caught():
    """draft-lm-suffix decides from the context alone; deciding from the draw must fail the same test."""
    drafter = FrontChosenAfterDrawing(SuffixDrafter(SuffixCache(8, 64), 0, 1.0, 0.1), draft_lm(), min_score=1.0)
    generator = SpeculativeGenerator(table_target(TARGET), drafter, "rejection", K)
    assert report("mutant: front chosen after drawing", sampled_p_value(generator)) < MUTANT_ALPHA


class LlamaTable:
    """A tiny 4-layer Llama over the same 3 tokens, in fp64, as a target for DEL (which drafts with the
    target's own first layers, so a table cannot stand in): log p(. | context) from a full forward, for
    the exact distribution the generations are tested against."""

    def __init__(self) -> None:
        self.model = tiny_llama(3, vocab=V, layers=4, hidden=32, dtype=torch.float64)
        with torch.no_grad():  # conftest sharpens the head 8x for greedy tests: back to ~2x, so samples spread
            self.model.lm_head.weight.mul_(0.25)
        self.model.generation_config.eos_token_id = None  # never stops: every run has MAX_NEW tokens
        self._table: dict[tuple[int, ...], torch.Tensor] = {}

    def log_probs(self, context: tuple[int, ...]) -> torch.Tensor:
        if context not in self._table:
            with torch.no_grad():
                logits = self.model(torch.tensor([context])).logits[0, -1]
            self._table[context] = logits.log_softmax(-1)
        return self._table[context]

    def target(self) -> Target:
        return Target(model=self.model, tokenizer=None, fingerprint=TargetFingerprint("llama-3", "-", "-"))  # type: ignore[arg-type]

    def del_drafter(self) -> DELDrafter:
        """Exit heads at layers 1 and 2 made of the target's own norm and head (untrained: they disagree
        with the full model often), adaptive over both."""
        heads = ExitHeads.from_target(self.model, [1, 2], torch.arange(V))
        heads.config.prior_acceptance = [0.9, 0.9]  # optimistic: it drafts from the first step on
        return DELDrafter(self.model, heads)


LLAMA = LlamaTable()


@pytest.mark.slow
def test_del_samples_the_target_distribution():
    """Under rejection, whose output depends on DEL's q (block's rule is checked with every chain drafter above;
    coupled DEL is bitwise plain coupled sampling, tests/drafters/test_del_exit.py)."""
    drafter = LLAMA.del_drafter()
    generator = SpeculativeGenerator(LLAMA.target(), drafter, "rejection", K)
    assert report("del rejection", sampled_p_value(generator, lm=LLAMA)) > ALPHA
    assert drafter.choices, "DEL never drafted: the test would prove nothing"


@pytest.mark.slow
def test_del_drawing_from_another_distribution_than_its_q_is_caught(monkeypatch):
    """Mutant: DEL draws its tokens from a sharpened distribution but reports the unsharpened q, as a
    drafter would that drew at one exit layer and reported another's probabilities."""
    draw = del_exit.draw
    monkeypatch.setattr(del_exit, "draw", lambda probs, generator, j: draw((probs ** 3) / (probs ** 3).sum(), generator, j))
    generator = SpeculativeGenerator(LLAMA.target(), LLAMA.del_drafter(), "rejection", K)
    assert report("mutant: del draws from other than q", sampled_p_value(generator, lm=LLAMA)) < MUTANT_ALPHA


class RouterPeeksAtTarget(CosineDrafter):
    """Mutant: every specialist draws its chain and the router keeps the one whose first token the target
    likes best: which draft is verified then depends on the drawn tokens and on the target's p."""

    def propose(self, context, k, sampling, generator, stop=None):
        self._catch_up(context)
        drafts = [specialist.propose(context, k, sampling, generator) for specialist in self.specialists]
        p = TARGET.log_probs(tuple(context))
        return max(drafts, key=lambda draft: float(p[draft.tokens[0]]))


@pytest.mark.slow
def test_a_router_that_peeks_at_the_target_is_caught():
    """cosine routes from the committed context alone; routing on the target's next token must fail the same test."""
    generator = SpeculativeGenerator(table_target(TARGET), cosine(cls=RouterPeeksAtTarget), "rejection", K)
    assert report("mutant: router peeks at the target", sampled_p_value(generator)) < MUTANT_ALPHA


class WindowQFromTheWholeContext(DraftLMDrafter):
    """Mutant: draws each token from the window's distribution but reports q from the whole context's, as a
    window that kept a second, full cache for its q rows would."""

    def propose(self, context, k, sampling, generator, stop=None):
        draft = super().propose(context, k, sampling, generator, stop)
        full = CachedLM(self.model)
        full.prefill(context[:-1])
        logits = self.lm_head(full.forward_final_hidden([context[-1], *draft.tokens[:-1]]))
        return Draft(draft.tokens, logits_to_probs(logits, sampling))


@pytest.mark.slow
def test_window_q_from_the_whole_context_is_caught():
    """draft-lm-window's q is the window's own distribution; q from the whole context must fail the same test."""
    generator = SpeculativeGenerator(table_target(TARGET), WindowQFromTheWholeContext(DRAFT, V, window=6, sinks=1),
                                     "rejection", K)
    assert report("mutant: window q from the whole context", sampled_p_value(generator)) < MUTANT_ALPHA


@pytest.mark.slow
def test_wrong_tree_walk_is_caught(monkeypatch):
    """A tree walk that draws every level from the root's distribution must fail the same test."""
    import specops.core.loop as loop
    from specops.core.verify import verify_tree

    def root_row_walk(tokens, parents, p, greedy, generator=None):
        return verify_tree(tokens, parents, p[:1].expand(p.shape[0], -1), greedy, generator)

    monkeypatch.setattr(loop, "verify_tree", root_row_walk)
    generator = SpeculativeGenerator(table_target(TARGET), draft_lm(tree_nodes=5), "rejection", K)
    assert report("mutant: tree walk on the root's row", sampled_p_value(generator)) < MUTANT_ALPHA


@pytest.mark.slow
def test_wrong_chain_rule_is_caught(monkeypatch):
    """Resampling from p after a rejection (forgetting the residual) must fail the same test."""
    from specops.core.verify import _draft_probs

    def resample_from_p(draft, q, p, generator=None):
        q_dense = _draft_probs(draft, q, p)
        for i in range(draft.shape[0]):
            if torch.rand(1, generator=generator, dtype=p.dtype) >= p[i, draft[i]] / q_dense[i, draft[i]]:
                return i, sample(p[i], generator)
        return draft.shape[0], sample(p[-1], generator)

    monkeypatch.setitem(VERIFIERS, "rejection", resample_from_p)
    generator = SpeculativeGenerator(table_target(TARGET), draft_lm(), "rejection", K)
    assert report("mutant: resample from p, draft-lm", sampled_p_value(generator)) < MUTANT_ALPHA


def test_trim_still_applies_at_temperature_zero():
    """goodput_head keeps its trim where it is exact: greedy verification of the same drafter."""
    policy = HeadGoodputPolicy(K, COST)
    generator = SpeculativeGenerator(table_target(TARGET), draft_lm(head=True), "greedy", K, policy=policy)
    trimmed = generator.generate(PROMPT, 12)
    plain = SpeculativeGenerator(table_target(TARGET), None, "greedy", K).generate(PROMPT, 12)
    assert trimmed.token_ids == plain.token_ids
    steps, drafted = trimmed.stats.steps, trimmed.stats.drafted
    assert drafted < steps * K  # some drafts were cut (the head's predictions are low for weak tokens)


COUPLED_DRAFTERS = {**CHAIN_DRAFTERS, **TREE_DRAFTERS, "draft-lm+goodput_head": lambda: draft_lm(head=True)}


@pytest.mark.parametrize("drafter", list(COUPLED_DRAFTERS))
def test_coupled_runs_draw_what_plain_coupled_sampling_draws(drafter):
    """Coupled verification: every position is the target's own draw with the noise keyed by (seed,
    position), so with the same seed every drafter, chain or tree, emits exactly plain decoding's tokens
    (goodput_head's trim included, which is exact here)."""
    policy = HeadGoodputPolicy(K, COST) if drafter.endswith("goodput_head") else None
    spec = SpeculativeGenerator(table_target(TARGET), COUPLED_DRAFTERS[drafter](), "coupled", K, policy=policy)
    assert accepted_while_matching_plain(spec) > 0


def test_coupled_noise_at_the_wrong_position_is_caught(monkeypatch):
    """A coupled rule that reads the noise one position late must break the equality above."""
    plain = SpeculativeGenerator(table_target(TARGET), None, "coupled", K)
    expected = [plain.generate(PROMPT, MAX_NEW, TEMPERATURE, seed=seed).token_ids for seed in range(40)]
    real = VERIFIERS["coupled"]
    monkeypatch.setitem(VERIFIERS, "coupled", lambda d, q, p, g: real(d, q, p, g.shifted(g.start + 1)))
    spec = SpeculativeGenerator(table_target(TARGET), draft_lm(), "coupled", K)
    got = [spec.generate(PROMPT, MAX_NEW, TEMPERATURE, seed=seed).token_ids for seed in range(40)]
    assert sum(a != b for a, b in zip(got, expected, strict=True)) > 0
