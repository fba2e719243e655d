"""The static runtime is batch-invariant: a token's logits are bitwise the same whether it is decoded
alone (plain decoding) or verified among drafts, in fp32 and bf16, so speculative output is bitwise
plain decoding's through the same runtime, eager and compiled. Mutants that must fail: rows that see
stale slots past their position, a pass width that follows the token count, compiled and eager passes
mixed, and the dynamic cache (fp32)."""

from __future__ import annotations

import pytest
import torch

from specops.core.kv import CachedLM, StaticLM
from specops.core.llama import LlamaForward, UnsupportedModelError, _AttentionPlan, llama_forward
from specops.core.loop import SpeculativeGenerator, prefill
from specops.core.target import target_from_model
from specops.core.types import SamplingParams, static_cache_length
from specops.core.verify import VERIFIERS, verify_greedy
from specops.drafters.aligned_head.drafter import AlignedHeadDrafter
from specops.drafters.aligned_head.model import AlignedHead, AlignedHeadConfig
from specops.drafters.cosine import CosineDrafter, CosineSettings
from specops.drafters.del_exit import DELDrafter, ExitHeads
from specops.drafters.draft_lm import DraftLMDrafter
from specops.drafters.prompt_lookup import PromptLookupDrafter
from specops.drafters.recycling import RecyclingDrafter
from specops.drafters.suffix import SuffixCache, SuffixDrafter
from specops.drafters.suffix_front import SuffixFrontDrafter
from tests.conftest import tiny_llama, tiny_tokenizer

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
PROMPT, TOKENS, CHUNKS = list(range(10, 50)), list(range(60, 71)), [4, 3, 1, 4]
WIDTH = 4


def rows_equal(make, prompt=PROMPT, tokens=TOKENS, chunks=CHUNKS) -> list[bool]:
    """For each token: are its logits fed one at a time (plain decoding) bitwise those fed in chunks
    (verification passes of several rows)?"""
    plain = make()
    plain.prefill(prompt[:-1])
    one = [plain.forward([t])[0] for t in [prompt[-1], *tokens]]
    verify = make()
    verify.prefill(prompt[:-1])
    seq, many, i = [prompt[-1], *tokens], [], 0
    for size in chunks:
        many += list(verify.forward(seq[i:i + size]))
        i += size
    return [torch.equal(a, b) for a, b in zip(one, many, strict=True)]


@pytest.fixture(scope="module", params=list(DTYPES))
def model(request):
    return tiny_llama(0, dtype=DTYPES[request.param], hidden=64)


def test_static_rows_are_bitwise_plain_decoding(model):
    assert all(rows_equal(lambda: StaticLM(model, WIDTH, 256)))


def test_a_rejection_rewinds_the_cache():
    """After a crop (a rejected draft), the next pass overwrites the stale slots before anyone sees them."""
    model = tiny_llama(0, hidden=64)
    plain = StaticLM(model, WIDTH, 256)
    plain.prefill(PROMPT[:-1])
    expected = [plain.forward([t])[0] for t in [PROMPT[-1], 60, 61]]
    spec = StaticLM(model, WIDTH, 256)
    spec.prefill(PROMPT[:-1])
    spec.forward([PROMPT[-1], 90, 91, 92])  # three drafts, all rejected
    spec.crop(len(PROMPT))
    got = [*spec.forward([60]), *spec.forward([61])]
    assert torch.equal(expected[1], got[0]) and torch.equal(expected[2], got[1])



def test_rows_that_see_stale_slots_differ(monkeypatch):
    """The causal visibility is what hides padding rows and rejected drafts: without it rows differ."""
    monkeypatch.setattr(LlamaForward, "visible_ends", lambda self, pos, length: torch.full_like(pos, length))
    assert not all(rows_equal(lambda: StaticLM(tiny_llama(0, hidden=64), WIDTH, 256)))


def test_the_lean_forward_is_transformers_llama():
    """Eager, op for op the HF forward: the same logits and the same layer outputs (features)."""
    model = tiny_llama(0, hidden=64, layers=3)
    ids = list(range(10, 50))
    with torch.inference_mode():
        ref = model(torch.tensor([ids]), output_hidden_states=True)
        lm = StaticLM(model, WIDTH, 256, hidden_layers=[0, 1])
        lm.prefill(ids[:-4])
        logits = lm.forward(ids[-4:])
    assert torch.allclose(logits, ref.logits[0, -4:], atol=1e-5)
    assert torch.allclose(lm.features, torch.stack([ref.hidden_states[1][0, -4:], ref.hidden_states[2][0, -4:]], 1),
                          atol=1e-5)


LONG = [10 + i % 80 for i in range(200)]  # a prompt whose passes are longer than MATH_ROWS: SDPA's flash kernel


def long_prefill_matches_transformers(chunk: int, native: bool = False) -> bool:
    """A 196-token prompt prefilled in one pass or in chunks of `chunk`, then 4 tokens: transformers' logits and
    layer outputs, up to rounding? In the Python loop (`native` False) the one pass runs SDPA's causal kernel and
    of the chunks the second SDPA with a mask over the slots up to its last row, the third the math path; the
    native decoder's kernel takes every row."""
    model = tiny_llama(0, hidden=64, layers=3, max_positions=512)
    llama_forward(model)[0].use_native = native
    with torch.inference_mode():
        ref = model(torch.tensor([LONG]), output_hidden_states=True)
        lm = StaticLM(model, WIDTH, 320, hidden_layers=[0, 1])
        prefill(lm, LONG[:-4], chunk)
        features = lm.features
        logits = lm.forward(LONG[-4:])
    expected = torch.stack([ref.hidden_states[1][0, :-4], ref.hidden_states[2][0, :-4]], 1)
    return torch.allclose(logits, ref.logits[0, -4:], atol=1e-5) and torch.allclose(features, expected, atol=1e-5)


@pytest.mark.parametrize("native", [False, True])
@pytest.mark.parametrize("chunk", [0, 80])
def test_a_long_prefill_is_transformers_llama(chunk, native):
    assert long_prefill_matches_transformers(chunk, native)


@pytest.mark.parametrize("mutant", ["no mask", "causal from the first key"])
def test_a_long_prefill_that_sees_too_much_differs(monkeypatch, mutant):
    """Mutants of the Python loop's flash segments' visibility: no mask at all (every row sees every slot up to the last
    row), and SDPA's causal kernel for a chunk that does not start at slot 0 (its rows would see only the
    first slots, aligned to the top left)."""
    def flash(self, segment):
        pos = segment.pos
        end = int(pos[-1]) + 1
        return end, torch.ones(len(pos), end, dtype=torch.bool) if mutant == "no mask" else None

    monkeypatch.setattr(_AttentionPlan, "_flash", flash)
    assert not long_prefill_matches_transformers(80)


def test_weights_changed_in_place_are_picked_up():
    model = tiny_llama(0, hidden=64)
    before = llama_forward(model)[0]
    assert llama_forward(model)[0] is before  # built once per model
    with torch.no_grad():
        model.model.layers[0].mlp.down_proj.weight.mul_(2)
    assert llama_forward(model)[0] is not before


def test_sequences_starting_together_share_one_forward(monkeypatch):
    """Threads asking for a model's forward at once (a batched server's sequences starting together) get the
    same one: a batcher tells the target's passes from a draft's by their forward, and refused a draft whose
    forward another thread had just replaced (seen as a thread error in test_batching). A slow build widens
    the race; without the lock in llama_forward each thread builds its own."""
    import threading
    import time

    built = LlamaForward.__init__

    def slow(self, *args, **kwargs):
        built(self, *args, **kwargs)
        time.sleep(0.05)

    monkeypatch.setattr(LlamaForward, "__init__", slow)
    model, start, got = tiny_llama(0, hidden=64), threading.Barrier(4), []

    def ask() -> None:
        start.wait()
        got.append(llama_forward(model)[0])

    threads = [threading.Thread(target=ask) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(got) == 4 and all(forward is got[0] for forward in got)


def test_other_architectures_are_refused_with_a_reason():
    model = tiny_llama(0)
    model.config.mlp_bias = True
    with pytest.raises(UnsupportedModelError, match="static_width 0"):
        StaticLM(model, WIDTH, 256)


def test_a_width_that_follows_the_tokens_differs_in_fp32(monkeypatch):
    """The shape must not change with the number of drafts: one row vs four rows round differently."""
    original = StaticLM._segment
    monkeypatch.setattr(StaticLM, "_segment", lambda self, ids, rows: original(self, ids, len(ids)))
    assert not all(rows_equal(lambda: StaticLM(tiny_llama(0, hidden=64), WIDTH, 256)))


def test_the_dynamic_cache_differs_in_fp32():
    """Why the static runtime exists: a dynamic 4-row pass does not reproduce 1-row passes."""
    assert not all(rows_equal(lambda: CachedLM(tiny_llama(0, hidden=64))))


@pytest.fixture(scope="module")
def compiled_model():
    """One tiny bf16 model, compiled once (about 10 s) for the tests below."""
    return tiny_llama(4, dtype=torch.bfloat16, hidden=64)


def test_compiled_rows_are_bitwise_plain_decoding(compiled_model):
    assert all(rows_equal(lambda: StaticLM(compiled_model, WIDTH, 256, compiled=True)))
    # A second cache length reuses the compiled graph and stays exact.
    assert all(rows_equal(lambda: StaticLM(compiled_model, WIDTH, 512, compiled=True)))


def test_compiled_and_eager_passes_mixed_differ(compiled_model):
    """The must-fail control: compiled kernels round differently from eager ones, so a runtime that mixed
    them between plain decoding and verification would not be exact."""
    made = iter([True, False])
    assert not all(rows_equal(lambda: StaticLM(compiled_model, WIDTH, 256, compiled=next(made))))


def test_compiled_speculation_is_bitwise_plain_decoding(compiled_model):
    target = target_from_model(compiled_model, tiny_tokenizer(), "t")
    draft = tiny_llama(1, layers=1, hidden=32, dtype=torch.bfloat16)
    plain = SpeculativeGenerator(target, None, "greedy", 0, static_width=WIDTH, compiled=True)
    sampling = SamplingParams(temperature=0.9)
    for drafter in (PromptLookupDrafter(3), DraftLMDrafter(draft, target.vocab_size)):
        for prompt in ([5, 17, 33, 17, 33, 40], list(range(10, 40))):
            spec = SpeculativeGenerator(target, drafter, "greedy", 3, static_width=WIDTH, compiled=True)
            assert spec.generate(prompt, 24).token_ids == plain.generate(prompt, 24).token_ids
            coupled = SpeculativeGenerator(target, drafter, "coupled", 3, static_width=WIDTH, compiled=True)
            alone = SpeculativeGenerator(target, None, "coupled", 0, static_width=WIDTH, compiled=True)
            assert (coupled.generate(prompt, 24, sampling, seed=3).token_ids
                    == alone.generate(prompt, 24, sampling, seed=3).token_ids)


def test_compiled_needs_the_static_runtime(target):
    with pytest.raises(ValueError, match="static_width > 0"):
        SpeculativeGenerator(target, None, compiled=True)


def aligned(target_model, tree_nodes: int = 0) -> AlignedHeadDrafter:
    torch.manual_seed(3)
    cfg = target_model.config
    head = AlignedHead(AlignedHeadConfig(hidden_size=cfg.hidden_size, target_vocab_size=cfg.vocab_size,
                                         hidden_layers=[0, 1], num_target_layers=cfg.num_hidden_layers,
                                         num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                                         intermediate_size=64)).to(target_model.dtype)
    return AlignedHeadDrafter(head, target_model, tree_nodes=tree_nodes, tree_top_k=2)


def del_drafter(target_model) -> DELDrafter:
    """DEL after the first of the 2 layers, an untrained exit (the target's own norm and head rows), drafting
    every step (prior acceptance 1)."""
    heads = ExitHeads.from_target(target_model, [1], torch.arange(target_model.config.vocab_size))
    heads.config.prior_acceptance = [1.0]
    return DELDrafter(target_model, heads)


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_every_chain_drafter_is_bitwise_plain_decoding(dtype):
    target = target_from_model(tiny_llama(0, dtype=DTYPES[dtype], hidden=64), tiny_tokenizer(), "t")
    draft = tiny_llama(1, layers=1, hidden=32, dtype=DTYPES[dtype])
    plain = SpeculativeGenerator(target, None, "greedy", WIDTH - 1, static_width=WIDTH)
    drafters = {"prompt-lookup": PromptLookupDrafter(3), "draft-lm": DraftLMDrafter(draft, target.vocab_size),
                "self-draft": DraftLMDrafter(target.model, target.vocab_size), "aligned_head": aligned(target.model),
                # evicts within these prompts plus 24 tokens (a window of 10 holds 2 sinks and 8 recent tokens)
                "draft-lm-window": DraftLMDrafter(draft, target.vocab_size, window=10, sinks=2),
                "suffix": SuffixDrafter(SuffixCache(8, 64), 0, 1.0, 0.1),
                "draft-lm-suffix": SuffixFrontDrafter(SuffixDrafter(SuffixCache(8, 64), 0, 1.0, 0.1),
                                                      DraftLMDrafter(draft, target.vocab_size), 1.0),
                "del": del_drafter(target.model),  # drafts in the target's own cache, past the committed slots
                "cosine": CosineDrafter([DraftLMDrafter(draft, target.vocab_size),
                                         DraftLMDrafter(target.model, target.vocab_size)], ["weak", "self"],
                                        CosineSettings(0.9, 0.1, 0))}
    prompts = [[5, 17, 33, 17, 33, 40], list(range(10, 40)), [7, 7, 7, 7]]
    for name, drafter in drafters.items():
        for verifier in VERIFIERS:
            generator = SpeculativeGenerator(target, drafter, verifier, 6, static_width=WIDTH)
            for prompt in prompts:
                result = generator.generate(prompt, 24)
                assert result.token_ids == plain.generate(prompt, 24).token_ids, (name, verifier, prompt)
                assert max(len(row) for row in [result.stats.drafted_per_position]) <= WIDTH - 1


def test_cache_length_is_shared_by_plain_and_speculative_runs():
    assert static_cache_length(100, 128, 4) == static_cache_length(100, 128, 4) == 256  # 244, rounded up to 64s
    assert static_cache_length(200, 128, 4) == 384
    with pytest.raises(ValueError, match="1 to 4 tokens"):
        StaticLM(tiny_llama(0), 4, 256).forward([1, 2, 3, 4, 5])


def test_cache_length_does_not_follow_the_width():
    """Servers of one target at different widths (drafting off at width 1, a bundle at 5) must answer alike:
    the length attention sums over changes a row's rounding, so it must not change with the width."""
    assert all(len({static_cache_length(prompt, 64, width) for width in range(1, 17)}) == 1 for prompt in range(1, 300))


def one_past_the_mismatch(draft, q, p, generator=None):
    """The must-fail mutant of the greedy rule: a rejected draft token is kept (and the target's token after it)."""
    n, token = verify_greedy(draft, q, p, generator)
    return (n + 1, int(p[n + 1].argmax())) if n < len(draft) else (n, token)


@pytest.mark.slow
def test_smollm2_bf16_prompt_lookup_is_bitwise_plain_decoding_on_the_static_runtime():
    """The real target in bf16, a HumanEval prompt, 48 tokens: on the static runtime prompt lookup and Token
    Recycling's trees emit exactly plain decoding's tokens. Must-fail control: a greedy rule that keeps one draft
    token past the first mismatch. (The control used to be the dynamic cache, whose multi-row passes rounded
    otherwise and drifted on the EPYC these tests were written on, measured 2026-11-25; on this repo's Xeon its
    stock kernels did not, for this prompt.)"""
    from specops.core.target import encode_prompt, load_target
    from specops.data.datasets import bench_prompts

    target = load_target("smollm2", "bfloat16")
    ids = encode_prompt(target.tokenizer, bench_prompts("humaneval", 1)[0])

    def tokens(drafter, width: int) -> list[int]:
        return SpeculativeGenerator(target, drafter, "greedy", 3, static_width=width).generate(ids, 48).token_ids

    plain = tokens(None, WIDTH)
    assert tokens(PromptLookupDrafter(3), WIDTH) == plain
    assert tokens(RecyclingDrafter(target.vocab_size, num_nodes=6), WIDTH) == plain  # a tree a step
    with pytest.MonkeyPatch.context() as patch:
        patch.setitem(VERIFIERS, "greedy", one_past_the_mismatch)
        assert tokens(PromptLookupDrafter(3), WIDTH) != plain
    sampling = SamplingParams(temperature=0.8, top_p=0.95)  # coupled sampling: the same draws, bitwise
    spec = SpeculativeGenerator(target, PromptLookupDrafter(3), "coupled", 3, static_width=WIDTH)
    coupled = SpeculativeGenerator(target, None, "coupled", 3, static_width=WIDTH)
    assert spec.generate(ids, 48, sampling, seed=7).token_ids == coupled.generate(ids, 48, sampling, seed=7).token_ids


def test_the_cli_refuses_compile_without_a_static_width():
    from specops.cli import UserError, build_parser, cmd_bench

    args = build_parser().parse_args(["bench", "--compile"])
    with pytest.raises(UserError, match="--static-width"):
        cmd_bench(args)
    assert build_parser().parse_args(["generate", "--prompt", "x", "--compile", "--static-width", "4"]).compile
