"""DEL (specops.drafters.del_exit): the target drafts with its first layers and an exit head, in its own
static cache; the output stays bitwise plain decoding's through the same runtime (fp32 and bf16,
greedy and coupled sampling), the adaptive choice matches a plain reference, and a must-fail mutant
(a drafter writing into the committed slots of the shared cache) breaks exactness."""

from __future__ import annotations

import itertools

import pytest
import torch

from specops.core.kv import StaticLM
from specops.core.loop import SpeculativeGenerator
from specops.core.target import target_from_model
from specops.core.types import SamplingParams
from specops.core.verify import VERIFIERS
from specops.drafters import del_exit
from specops.drafters.del_exit import (
    AcceptanceTracker,
    DELDrafter,
    EarlyCache,
    ExitCosts,
    ExitHeads,
    choose_exit,
)
from specops.drafters.factory import build_drafter
from specops.drafters.kinds import DecodingConfig, MethodSpec
from tests.conftest import tiny_llama, tiny_tokenizer

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
WIDTH = 4
EXITS = [1, 2, 3]
PROMPTS = [[5, 17, 33, 17, 33, 40], list(range(10, 40)), [7, 7, 7, 7]]


def make_target(dtype: torch.dtype = torch.float32):
    return target_from_model(tiny_llama(0, layers=4, dtype=dtype, hidden=64), tiny_tokenizer(), "t")


def make_heads(target, prior: float = 0.9) -> ExitHeads:
    """The target's own norm and head rows (every other token) at layers 1-3: an untrained early exit,
    which agrees with the tiny target often enough to accept some drafts and reject others."""
    heads = ExitHeads.from_target(target.model, EXITS, torch.arange(0, target.vocab_size, 2))
    heads.config.prior_acceptance = [prior] * len(EXITS)  # optimistic: every step drafts at first
    return heads


@pytest.fixture(scope="module", params=list(DTYPES))
def target(request):
    return make_target(DTYPES[request.param])


@pytest.mark.parametrize("exit_layer", [0, 1, 3])
def test_del_is_bitwise_plain_decoding_on_the_static_runtime(target, exit_layer):
    plain = SpeculativeGenerator(target, None, "greedy", 0, static_width=WIDTH)
    drafter = DELDrafter(target.model, make_heads(target), exit_layer)
    for verifier in VERIFIERS:
        generator = SpeculativeGenerator(target, drafter, verifier, WIDTH - 1, static_width=WIDTH)
        for prompt in PROMPTS:
            result = generator.generate(prompt, 24)
            assert result.token_ids == plain.generate(prompt, 24).token_ids, (exit_layer, verifier, prompt)
    assert drafter.choices, "DEL never drafted: the test would prove nothing"


def test_del_coupled_sampling_is_bitwise_plain_sampling(target):
    sampling = SamplingParams(temperature=0.8, top_p=0.95)
    plain = SpeculativeGenerator(target, None, "coupled", 0, static_width=WIDTH)
    drafter = DELDrafter(target.model, make_heads(target))
    generator = SpeculativeGenerator(target, drafter, "coupled", WIDTH - 1, static_width=WIDTH)
    accepted = 0
    for prompt, seed in itertools.product(PROMPTS, (1, 2)):
        result = generator.generate(prompt, 24, sampling, seed=seed)
        assert result.token_ids == plain.generate(prompt, 24, sampling, seed=seed).token_ids, (prompt, seed)
        accepted += result.stats.accepted
    assert accepted > 0


def test_del_shares_the_target_cache_and_leaves_committed_slots_alone():
    """On the static runtime DEL drafts in the target's own K/V: it writes only at and past the committed
    length, and writes there (no private cache)."""
    target = make_target()
    drafter = DELDrafter(target.model, make_heads(target), 3)
    lm = StaticLM(target.model, WIDTH, 128)
    context = PROMPTS[1]
    lm.prefill(context[:-1])
    drafter.reset()
    drafter.share_runtime(lm)
    before = [k.clone() for k in lm.keys]
    draft = drafter.propose(context, WIDTH - 1, SamplingParams(), None)
    committed = len(context) - 1
    assert len(draft.tokens) > 0 and drafter.cache.keys is lm.keys
    for layer, (old, new) in enumerate(zip(before, lm.keys, strict=True)):
        assert torch.equal(old[:, :committed], new[:, :committed]), layer
        wrote = not torch.equal(old[:, committed: committed + len(draft.tokens)],
                                new[:, committed: committed + len(draft.tokens)])
        assert wrote == (layer < 3), layer  # the first 3 layers only


def test_writing_into_committed_slots_breaks_exactness(monkeypatch):
    """Must-fail mutant: a drafter whose passes start one slot early overwrites the last committed token's
    early-layer keys in the shared cache; verification then reads them and the output changes."""
    target = make_target()
    plain = SpeculativeGenerator(target, None, "greedy", 0, static_width=WIDTH)
    ready = EarlyCache.ready
    monkeypatch.setattr(EarlyCache, "ready", lambda self, context, room: ready(self, context, room) - 1)
    generator = SpeculativeGenerator(target, DELDrafter(target.model, make_heads(target), 1), "greedy", WIDTH - 1,
                                     static_width=WIDTH)
    assert any(generator.generate(p, 24).token_ids != plain.generate(p, 24).token_ids for p in PROMPTS)


def test_del_matches_hf_greedy_on_the_dynamic_runtime_with_its_own_cache():
    target = make_target()
    drafter = DELDrafter(target.model, make_heads(target))
    generator = SpeculativeGenerator(target, drafter, "greedy", 3)
    for prompt in PROMPTS:
        expected = target.model.generate(torch.tensor([prompt]), max_new_tokens=20, do_sample=False)[0, len(prompt):]
        assert generator.generate(prompt, 20).token_ids == expected.tolist(), prompt
    assert drafter.cache.shared is None and drafter.choices


def reference_choice(alphas: list[float], token_costs: list[float], verify: float, max_k: int) -> tuple[int, int]:
    """Plain reference: expected tokens from the distribution of the accepted count n (P(n) = a^n (1 - a)
    for n < k, a^k for n = k), every (candidate, k) scored, the best by (rate, shorter, earlier)."""
    def rate(alpha: float, per_token: float, k: int) -> float:
        tokens = sum((n + 1) * alpha ** n * (1 - alpha) for n in range(k)) + (k + 1) * alpha ** k
        return tokens / (verify + k * per_token)
    options = [(1 / verify, 0, 0, 0)] + [(rate(a, c, k), -k, -i, i) for i, (a, c) in enumerate(zip(alphas, token_costs, strict=True))
                                         for k in range(1, max_k + 1)]
    best = max(options, key=lambda o: (round(o[0], 12), o[1], o[2]))
    return (best[3], -best[1]) if best[1] else (0, 0)


def test_choose_exit_matches_the_reference():
    rng = torch.Generator().manual_seed(0)
    layers = [4, 8, 12, 16]
    chose_some = set()
    for _ in range(300):
        alphas = torch.rand(4, generator=rng).tolist()
        head = float(torch.rand(1, generator=rng)) * 2
        token_costs = [layer + head for layer in layers]
        verify = 20 + 20 * float(torch.rand(1, generator=rng))
        got = choose_exit(alphas, token_costs, verify, 4)
        assert got == reference_choice(alphas, token_costs, verify, 4), (alphas, token_costs, verify)
        chose_some.add(got)
    assert len({c[0] for c in chose_some if c[1]}) > 1 and (0, 0) in chose_some  # several layers, and plain decoding


def test_adaptive_exit_follows_the_tracked_acceptance():
    target = make_target()
    drafter = DELDrafter(target.model, make_heads(target, prior=0.5), 0, ExitCosts(20.0, (1.5, 2.5, 3.5)))
    for _ in range(60):  # layer 2's head agrees with the target, layers 1 and 3's do not
        for slot, agree in ((0, False), (1, True), (2, False)):
            drafter.tracker.update(slot, torch.tensor([agree]))
    assert drafter.choose(3) == (1, 3)
    drafter.costs = ExitCosts(20.0, (1.5, 12.0, 3.5))  # the same rates, but layer 2's tokens measured slow
    assert drafter.choose(3) == (1, 1)  # still layer 2 (the others' drafts fail), one token at a time
    drafter.tracker.reset()
    drafter.costs = ExitCosts(6.0, (1.5, 2.5, 3.5))  # a cheap verification: drafting must earn more
    for _ in range(60):
        for slot in range(3):
            drafter.tracker.update(slot, torch.tensor([False]))
    assert drafter.choose(3) == (0, 0)  # nothing pays: plain decoding


def test_forks_track_their_own_requests():
    """A server slot's fork (copy.copy) tracks its own request: another fork's observations and reset do
    not move its rates, so a rejection-sampled request's draft lengths do not depend on what else runs."""
    import copy

    target = make_target()
    drafter = DELDrafter(target.model, make_heads(target, prior=0.5), 0)
    one, other = copy.copy(drafter), copy.copy(drafter)
    for _ in range(30):
        one.tracker.update(1, torch.tensor([True]))
    before = one.tracker.rates()
    other.tracker.update(1, torch.tensor([False, False]))
    other.reset()
    assert one.tracker.rates() == before != drafter.tracker.rates()
    assert one.cache is not other.cache and one.choices is not other.choices


def test_exit_costs_are_measured_on_both_runtimes(target):
    """The factory measures the costs on this machine (no wall-clock bound asserted: only their shape)."""
    drafter = DELDrafter(target.model, make_heads(target), 0)
    assert drafter.costs == ExitCosts.nominal(EXITS)
    costs = del_exit.measure_exit_costs(drafter, target.model, WIDTH, repeats=2)
    assert len(costs.token) == len(EXITS) and costs.verify > 0 and all(t > 0 for t in costs.token)
    assert del_exit.measure_exit_costs(drafter, target.model, 0, repeats=1).verify > 0  # the dynamic runtime


def test_tracker_forgets_and_keeps_its_prior():
    tracker = AcceptanceTracker([0.5], weight=10.0, decay=0.9)
    assert tracker.rates() == [0.5]
    for _ in range(100):
        tracker.update(0, torch.tensor([True, True]))
    assert tracker.rates()[0] > 0.6  # ~19 observations at 1 against 10 at the prior
    for _ in range(100):
        tracker.update(0, torch.tensor([False]))
    assert tracker.rates()[0] < 0.4


def test_heads_round_trip_and_the_factory(tmp_path, target):
    heads = make_heads(target)
    heads.save(tmp_path)
    loaded = ExitHeads.load(tmp_path)
    x = torch.randn(3, 64)
    assert torch.equal(loaded(x, 1), heads.float()(x, 1))
    assert loaded.config == heads.config
    config = MethodSpec.parse("del@2").decoding(DecodingConfig(drafter="del", static_width=WIDTH))
    built = build_drafter("del", target, config, tmp_path)
    assert isinstance(built, del_exit.DELDrafter) and built.candidates == [1] and built.hidden_layers == [1]
    assert built.costs != ExitCosts.nominal(EXITS) and built.costs.verify < 1.0  # measured here, in seconds
    with pytest.raises(ValueError, match="No exit head after layer 5"):
        build_drafter("del", target, MethodSpec.parse("del@5").decoding(), tmp_path)
    with pytest.raises(ValueError, match="exit heads folder"):
        build_drafter("del", target, MethodSpec.parse("del").decoding(), None)


def test_a_del_bundle_serves_bitwise_plain_decoding(tmp_path):
    """The evaluate stage may choose del as the bundle's drafter: its exit heads travel as the bundle's
    drafter folder, and the served generator is DEL on the static runtime, bitwise plain decoding."""
    from specops.server.bundle import write_bundle
    from specops.server.generator import generator_from_bundle

    target = make_target(torch.bfloat16)
    make_heads(target).save(tmp_path / "heads")
    bundle = write_bundle(tmp_path / "bundle", drafter_dir=tmp_path / "heads", drafter_kind="del",
                          serving={"verifier": "greedy", "draft_tokens": WIDTH - 1, "static_width": WIDTH},
                          target_source="in-memory", target_dtype="bfloat16", fingerprint=target.fingerprint, metrics={})
    served = generator_from_bundle(bundle, target=target)
    assert isinstance(served.drafter, DELDrafter)
    plain = SpeculativeGenerator(target, None, "greedy", 0, static_width=WIDTH)
    generator = served.generator(SamplingParams())
    for prompt in PROMPTS:
        assert generator.generate(prompt, 24).token_ids == plain.generate(prompt, 24).token_ids, prompt
    assert served.drafter.choices, "DEL never drafted: the test would prove nothing"
