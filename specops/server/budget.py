"""`specops serve --memory-budget`: plan the served model into a memory budget and hold it to the plan.

At start the planner (specops.core.planner) picks the draft length, the generation slots and the
context per slot from the memory model of what is served: the target's shapes, the draft LM's when
the drafter is one, the runtime's settings (the configured width, draft length, tree size and
--max-batch are ceilings it may lower). The server then runs that many slots (more requests queue,
then get 429) and answers 400 to a request whose prompt plus max_tokens exceeds the planned context.
"""

from __future__ import annotations

import copy
import logging
import os
from dataclasses import replace

from specops.core.cost_model import measure_cost_model
from specops.core.memory import DecodingShape, ModelShape
from specops.core.planner import MemoryBudgetError, MemoryPlan, PlanSpace, plan_memory, require_one_request
from specops.core.types import PRIOR_ACCEPTANCE
from specops.drafters.draft_lm import DraftLMDrafter
from specops.drafters.recycling import RecyclingDrafter
from specops.server.config import ServerConfig
from specops.server.generator import TextGenerator
from specops.server.worker import ServedModel

log = logging.getLogger(__name__)
PLANNED_VERIFY_SIZES = (1, 2, 4, 8, 16, 32, 64, 96)  # rows of one batched pass to time: up to 8 slots x width 9+


def plan_space(config: ServerConfig, generator: TextGenerator) -> PlanSpace:
    """The ceilings the operator configured: the runtime's width, draft length and tree, --max-batch."""
    decoding = generator.config
    tree = 0
    if generator.drafter is not None and getattr(generator.drafter, "tree_nodes", 0):
        tree = generator.drafter.tree_nodes
    return PlanSpace(max_width=decoding.static_width,
                     max_draft_tokens=decoding.draft_tokens if generator.drafter is not None else 0,
                     max_tree_nodes=tree, max_batch=config.max_batch, batchable=generator.batchable,
                     min_context=min(config.min_context, generator.target.max_context),
                     max_context=generator.target.max_context, acceptance=PRIOR_ACCEPTANCE,
                     cores=os.cpu_count() or 1, headroom=config.memory_headroom)


def decoding_shape(generator: TextGenerator) -> DecodingShape:
    target = generator.target
    return DecodingShape(dtype=str(target.model.dtype).removeprefix("torch."),
                         prefill_chunk=generator.config.prefill_chunk,
                         sampled=True,  # the server accepts sampled requests: their float32 buffers count
                         gguf=target.fingerprint.name.endswith(".gguf"), draft_window=generator.config.draft_window)


def prefix_cache_bytes(config: ServerConfig, generator: TextGenerator) -> int:
    """The prefix cache's budget (--prefix-cache-mb) for `generator`: none where its runtime could not use one
    (specops.core.prefix_cache.PrefixCache.exact: the eager static runtime in bf16, as batching needs)."""
    return config.prefix_cache_bytes if generator.batchable else 0


def memory_plan(config: ServerConfig, model: ServedModel, budget: int) -> MemoryPlan:
    """The plan for `model` within `budget` bytes, less the prefix cache's; MemoryBudgetError (a ValueError) when
    nothing fits."""
    cache = prefix_cache_bytes(config, model.generator)
    budget -= cache
    generator = model.generator
    drafter = generator.drafter
    draft, draft_vocab = None, 0
    if isinstance(drafter, DraftLMDrafter):
        draft = ModelShape.of(drafter.model.config)
        draft_vocab = int(drafter.vocab.numel()) if drafter.vocab is not None else 0
    elif drafter is not None:
        log.warning("The memory model counts draft LMs only; the %s drafter's own memory is not in the plan.",
                    drafter.name)
    if isinstance(drafter, RecyclingDrafter) and generator.config.static_width:
        # Token Recycling's template trees (no tree_nodes the planner could set): a target cache per leaf.
        log.warning("The %s drafter grows trees of a fixed template on the static runtime; the memory model does "
                    "not count its branch caches (one target KV cache per leaf).", drafter.name)
    space = plan_space(config, generator)
    target, base = ModelShape.of(generator.target.model.config), decoding_shape(generator)
    try:
        require_one_request(budget, target, base, space, draft, draft_vocab)  # before the cost model's seconds
    except MemoryBudgetError as error:
        if not cache:
            raise
        raise MemoryBudgetError(f"{error} (That budget is what is left after the prefix cache's "
                                f"{config.prefix_cache_mb:g} MiB: lower --prefix-cache-mb, or 0 for none.)") from error
    sizes = tuple(n for n in PLANNED_VERIFY_SIZES if n <= max(16, space.max_batch * max(space.max_width, 1)))
    cost = measure_cost_model(generator.target.model, generator.fork(None).drafter, sizes=sizes)
    return plan_memory(budget, target, base, space, cost, draft, draft_vocab)


def planned(model: ServedModel, plan: MemoryPlan) -> ServedModel:
    """`model` decoding as the plan says: its width, draft length and tree size."""
    generator = model.generator
    decoding = replace(generator.config, static_width=plan.static_width, draft_tokens=plan.draft_tokens)
    drafter = generator.drafter
    if plan.tree_nodes and drafter is not None and getattr(drafter, "tree_nodes", 0) != plan.tree_nodes:
        drafter = replace_tree(drafter, plan.tree_nodes)
    return replace(model, generator=TextGenerator(generator.target, drafter, decoding))


def replace_tree(drafter: object, nodes: int) -> object:
    """A shallow copy of a tree drafter with at most `nodes` nodes (the models are shared)."""
    twin = copy.copy(drafter)
    twin.tree_nodes = nodes  # type: ignore[attr-defined]
    return twin


def describe(plan: MemoryPlan) -> str:
    report = plan.report
    return (f"memory plan for {plan.budget_bytes / 2**20:.0f} MiB ({plan.usable_bytes / 2**20:.0f} usable): static_width {plan.static_width}, draft_tokens "
            f"{plan.draft_tokens}, tree_nodes {plan.tree_nodes}, max_batch {plan.max_batch}, context {plan.max_context}"
            f" tokens; predicted peak {report.peak_bytes / 2**20:.0f} MiB (process {report.overhead / 2**20:.0f}, "
            f"target {report.target.bytes / 2**20:.0f}, draft {(report.draft.bytes if report.draft else 0) / 2**20:.0f},"
            f" one request {report.request.bytes / 2**20:.1f} + {report.concurrency - 1} x "
            f"{report.request.held / 2**20:.1f}); goodput {plan.goodput:.1f} tok/s")
