"""The memory model against what the runtime really allocates, and the planner against brute force.

The model's byte counts are checked against real tensors of tiny random models (the static cache a
generation allocates, the lean forward's fused copies, a draft's dynamic cache), its shape arithmetic
against Hugging Face's parameter count (SmolLM2's shape on the meta device, so nothing is allocated),
and the planner's choice against an enumeration of every plan on a small grid.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

from specops.core.cost_model import CostModel
from specops.core.kv import StaticLM
from specops.core.llama import llama_forward
from specops.core.memory import (
    DecodingShape,
    ModelShape,
    memory_report,
    parse_bytes,
)
from specops.core.planner import MemoryBudgetError, PlanSpace, goodput, plan_memory
from specops.core.types import static_cache_length
from tests.conftest import tiny_llama

SMOLLM2 = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                      num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
                      tie_word_embeddings=True)


def nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def test_parse_bytes_reads_units_and_refuses_nonsense():
    assert parse_bytes("1.5GiB") == 3 * 2**29
    assert parse_bytes("800MiB") == 800 * 2**20
    assert parse_bytes("2GB") == 2 * 10**9
    assert parse_bytes("4096") == 4096
    assert parse_bytes(" 64 kib ") == 64 * 1024
    for bad in ("", "GiB", "1.5 GiBs", "-1GiB", "one GiB"):
        with pytest.raises(ValueError, match="Cannot read"):
            parse_bytes(bad)


@pytest.mark.parametrize("tied", [True, False])
def test_parameter_count_matches_hugging_face(tied):
    config = LlamaConfig(**{**SMOLLM2.to_dict(), "tie_word_embeddings": tied})
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    # parameters() yields a tied tensor once, as memory holds it once.
    assert ModelShape.of(config).params == sum(p.numel() for p in model.parameters())
    if tied:
        assert ModelShape.of(config).params == 134_515_008  # SmolLM2-135M, as load_target reports it
    linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    assert ModelShape.of(config).linear_params == linear


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_static_runtime_bytes_are_what_it_allocates(dtype):
    model = tiny_llama(0, dtype=dtype)
    shape = ModelShape.of(model.config)
    name = str(dtype).removeprefix("torch.")
    prompt, new, width = 40, 30, 5
    report = memory_report(shape, DecodingShape(dtype=name, static_width=width, draft_tokens=width - 1,
                                                context=prompt + new, gguf=False))
    lm = StaticLM(model, width, static_cache_length(prompt, new, width))
    assert report.request.target_kv == nbytes(lm.keys + lm.values)
    assert report.request.rotary == nbytes(lm.tables)
    forward = llama_forward(model)[0]
    fused = nbytes([*forward.qkv, *forward.gate_up])  # the lean forward's copies; the rest is shared
    assert report.target.lean_copy * report.target.dtype_bytes == fused
    with torch.inference_mode():  # the head is packed at its first use
        forward.forward(torch.tensor([3, 4]), torch.tensor([0, 1]), *forward.new_cache(64), *forward.tables(64))
    packed = [t for t in (*forward.packed.qkv, *forward.packed.o, *forward.packed.gate_up, *forward.packed.down,
                          forward.packed_head) if t is not None]
    assert (dtype == torch.bfloat16) == bool(packed)
    assert report.target.packed * report.target.dtype_bytes == nbytes(packed)
    assert report.target.params * report.target.dtype_bytes == nbytes(model.parameters())


def test_draft_kv_is_a_dynamic_cache_of_the_context():
    draft = tiny_llama(1, layers=1, hidden=32)
    tokens = 50
    cache = DynamicCache(config=draft.config)
    with torch.inference_mode():
        draft(torch.arange(3, 3 + tokens)[None], past_key_values=cache, use_cache=True)
    held = nbytes([t for layer in cache.layers for t in (layer.keys, layer.values)])
    assert ModelShape.of(draft.config).kv_bytes(tokens, 4) == held


def test_a_draft_window_caps_the_draft_kv_at_what_the_windowed_drafter_holds():
    from specops.core.loop import SpeculativeGenerator
    from specops.core.target import target_from_model
    from specops.drafters.draft_lm import DraftLMDrafter
    from tests.conftest import tiny_tokenizer

    draft, window = tiny_llama(1, layers=1, hidden=32), 24
    target = target_from_model(tiny_llama(0), tiny_tokenizer(), "t")
    drafter = DraftLMDrafter(draft, target.vocab_size, window=window, sinks=4)
    held = SpeculativeGenerator(target, drafter, draft_tokens=4).generate([(7 * i) % 90 + 5 for i in range(120)], 16).stats.draft_kv_bytes
    shape = ModelShape.of(SMOLLM2)
    modelled = [memory_report(shape, DecodingShape(dtype="float32", context=c, draft_window=window), ModelShape.of(draft.config))
                for c in (64, 1000)]
    assert held <= modelled[0].request.draft_kv == modelled[1].request.draft_kv == ModelShape.of(draft.config).kv_bytes(window, 4)


def test_report_adds_up_and_grows_with_what_it_should():
    shape = ModelShape.of(SMOLLM2)
    base = DecodingShape(dtype="bfloat16", static_width=5, draft_tokens=4, context=2048)
    one = memory_report(shape, base)
    four = memory_report(shape, DecodingShape(**{**base.__dict__, "concurrency": 4}))
    # Concurrent requests prefill one at a time: one at its peak, the others decoding.
    assert four.serving_peak_bytes - one.serving_peak_bytes == 3 * one.request.held < 3 * one.request.bytes
    longer = memory_report(shape, DecodingShape(**{**base.__dict__, "context": 4096}))
    assert longer.request.target_kv > one.request.target_kv
    fp32 = memory_report(shape, DecodingShape(**{**base.__dict__, "dtype": "float32"}))
    assert one.target.packed == shape.linear_params  # SmolLM2's products are all packed in bf16, none in fp32
    assert fp32.target.bytes == 2 * (one.target.bytes - one.target.packed * one.target.dtype_bytes)
    draft = ModelShape.of(LlamaConfig(**{**SMOLLM2.to_dict(), "num_hidden_layers": 2}))
    with_draft = memory_report(shape, base, draft, draft_vocab=8192)
    assert with_draft.draft is not None and with_draft.draft.vocab_rows == 8192 * 576
    # bf16: the vocabulary rows packed too, and the static chain draft's decoder products.
    assert with_draft.draft.packed == 8192 * 576 + draft.packed_decoder_params > 8192 * 576
    # A draft LM on its own dynamic cache (here a tree's) prefills on every generation's thread at once.
    tree = DecodingShape(**{**base.__dict__, "tree_nodes": 8})
    tree_one, tree_four = (memory_report(shape, DecodingShape(**{**tree.__dict__, "concurrency": c}), draft, 8192)
                           for c in (1, 4))
    assert tree_four.serving_peak_bytes - tree_one.serving_peak_bytes == 3 * tree_one.request.bytes
    assert with_draft.serving_peak_bytes > one.serving_peak_bytes
    # SmolLM2's static KV in bf16 at 2048 + 5 -> 2112 slots: 30 x 2 x 3 x 2112 x 64 x 2 bytes.
    assert one.request.target_kv == 30 * 2 * 3 * 2112 * 64 * 2


# The planner, against every plan of a small grid.
COST = CostModel(draft_token_s=0.004, verify_s=((1, 0.020), (2, 0.021), (4, 0.022), (8, 0.026), (16, 0.035),
                                                  (32, 0.060), (64, 0.110)))
TINY = ModelShape(layers=4, hidden=64, intermediate=128, heads=4, kv_heads=2, head_dim=16, vocab=512, tied=True,
                  max_context=1024)
DRAFT = ModelShape(layers=1, hidden=64, intermediate=128, heads=4, kv_heads=2, head_dim=16, vocab=512, tied=True,
                   max_context=1024)


def brute_force(budget: int, base: DecodingShape, space: PlanSpace, draft: ModelShape | None):
    """Every (draft, slots) at min_context, then every context on a fine grid for the winner."""
    def report(width, k, nodes, batch, context):
        shape = DecodingShape(**{**base.__dict__, "static_width": width, "draft_tokens": k, "tree_nodes": nodes,
                                 "concurrency": batch, "context": context})
        return memory_report(TINY, shape, draft)

    candidates = []
    for (width, k, nodes), batch in itertools.product(space.drafts(), space.batches()):
        peak = report(width, k, nodes, batch, space.min_context).peak_bytes
        if peak <= budget:
            candidates.append(((goodput(COST, space, width, k, nodes, batch), -peak, -batch, -k), (width, k, nodes, batch)))
    if not candidates:
        return None
    width, k, nodes, batch = max(candidates)[1]
    context = max(c for c in range(space.min_context, space.max_context + 1)
                  if report(width, k, nodes, batch, c).peak_bytes <= budget)
    return width, k, nodes, batch, context


SPACES = [PlanSpace(max_width=6, max_draft_tokens=5, max_batch=8, batchable=True, min_context=64, max_context=1024),
          PlanSpace(max_width=0, max_draft_tokens=6, max_batch=8, batchable=False, min_context=64, max_context=1024),
          PlanSpace(max_width=0, max_draft_tokens=4, max_tree_nodes=10, min_context=64, max_context=1024),
          PlanSpace(max_width=1, max_draft_tokens=0, max_batch=4, batchable=True, min_context=128, max_context=1024),
          PlanSpace(max_width=5, max_draft_tokens=4, max_tree_nodes=6, max_batch=4, batchable=True, min_context=64,
                    max_context=1024)]


@pytest.mark.parametrize("space", SPACES, ids=["static", "dynamic", "tree", "plain", "static-tree"])
@pytest.mark.parametrize("draft", [None, DRAFT], ids=["no-draft", "draft"])
def test_planner_matches_brute_force(space, draft):
    base = DecodingShape(dtype="bfloat16", sampled=True, gguf=False)
    floor = memory_report(TINY, DecodingShape(**{**base.__dict__, "context": space.min_context}), draft).peak_bytes
    # From "fits one small plan" to "everything fits": budgets where each constraint binds somewhere.
    for extra in (0, 20_000, 60_000, 150_000, 400_000, 2_000_000, 20_000_000):
        budget = floor + extra
        expected = brute_force(budget, base, space, draft)
        if expected is None:
            with pytest.raises(MemoryBudgetError):
                plan_memory(budget, TINY, base, space, COST, draft)
            continue
        plan = plan_memory(budget, TINY, base, space, COST, draft)
        assert (plan.static_width, plan.draft_tokens, plan.tree_nodes, plan.max_batch, plan.max_context) == expected
        assert plan.report.peak_bytes <= budget


def test_configured_values_are_ceilings():
    static = PlanSpace(max_width=9, max_draft_tokens=3, max_batch=4, batchable=True)
    assert [(w, k) for w, k, _ in static.drafts()] == [(1, 0), (2, 1), (3, 2), (4, 3)]
    assert [w for w, _, _ in PlanSpace(max_width=5, max_draft_tokens=0).drafts()] == [1]  # no drafter
    # static trees: no draft, or trees as deep as the width allows of up to the configured nodes
    assert PlanSpace(max_width=5, max_draft_tokens=9, max_tree_nodes=3).drafts() == [(1, 0, 0), (5, 4, 1), (5, 4, 2),
                                                                                   (5, 4, 3)]
    assert list(static.batches()) == [1, 2, 3, 4]
    assert list(PlanSpace(max_width=5, max_draft_tokens=4, max_batch=8, batchable=False).batches()) == [1]


def test_headroom_leaves_that_share_of_the_budget_unplanned():
    base = DecodingShape(dtype="bfloat16", sampled=True, gguf=True)
    space = PlanSpace(max_width=5, max_draft_tokens=4, max_batch=8, batchable=True, min_context=1024, max_context=8192)
    budget = parse_bytes("1.5GiB")
    full = plan_memory(budget, ModelShape.of(SMOLLM2), base, space, COST)
    spared = plan_memory(budget, ModelShape.of(SMOLLM2), base, PlanSpace(**{**space.__dict__, "headroom": 0.1}), COST)
    assert full.report.peak_bytes > 0.9 * budget >= spared.report.peak_bytes
    assert spared.usable_bytes == int(0.9 * budget) and spared.budget_bytes == budget
    assert (spared.max_batch, spared.max_context) < (full.max_batch, full.max_context)


def test_planner_refuses_a_budget_below_one_request_and_says_why():
    base = DecodingShape(dtype="bfloat16", gguf=True)
    space = PlanSpace(max_width=5, max_draft_tokens=4, max_batch=8, batchable=True, min_context=1024, max_context=8192)
    with pytest.raises(MemoryBudgetError, match="cannot hold even one generation of 1024 tokens"):
        plan_memory(parse_bytes("900MiB"), ModelShape.of(SMOLLM2), base, space, COST)
    plan = plan_memory(parse_bytes("1.5GiB"), ModelShape.of(SMOLLM2), base, space, COST)
    assert 1 <= plan.max_batch <= 8 and plan.max_context >= 1024 and plan.report.peak_bytes <= parse_bytes("1.5GiB")
