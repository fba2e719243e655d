"""Fit speculative serving into a memory budget (SpecMemo, arXiv 2506.01986): what to draft, how many at once.

The planner chooses, within the ceilings the operator configured,
  * the draft length: the static runtime's pass width W (drafts of W - 1 tokens), or the dynamic
    runtime's chain length k, or a tree drafter's node count;
  * the generations decoding at once (max_batch), when the runtime batches exactly (else 1);
  * the context (prompt + max_tokens) every slot holds,
so that the memory model's peak (specops.core.memory) stays within the budget.

Objective: the most predicted goodput, SmartSpec's (arXiv 2406.14066) under load as the start-up cost
model can state it: B generations each committing E[tokens | draft] per step, over one step's time
(their drafting spread over the cores, plus one batched target pass over B x rows rows). While serving,
the batcher sets each step's draft length from the passes it observes instead
(specops.core.policies.step_seconds); the plan only sizes the memory for the longest. Memory is a
constraint, not a term: among the plans that hold `min_context` tokens per slot, the one with the best
goodput wins (ties: less memory, then fewer slots and shorter drafts); its context is then grown to the
largest that still fits, up to `max_context`. Per-slot memory is linear in the slots and monotone in the
context, so the planner solves each for its limit instead of enumerating (tests compare it with a
brute-force enumeration).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Protocol

from specops.core.memory import DecodingShape, MemoryReport, ModelShape, memory_report
from specops.core.policies import expected_tokens


class StepCost(Protocol):
    """specops.core.cost_model.CostModel, structurally (it imports torch; this module does not)."""

    draft_token_s: float

    def verify_time(self, tokens: int) -> float: ...


class MemoryBudgetError(ValueError):
    """Not even one generation of the smallest allowed context fits the budget."""


@dataclass(frozen=True)
class PlanSpace:
    """What the planner may choose from: the configured values are ceilings."""

    max_width: int  # static runtime: the widest pass (drafts of width - 1); 0: the dynamic runtime
    max_draft_tokens: int  # dynamic runtime: the longest chain (a tree's depth); 0: no drafter
    max_tree_nodes: int = 0  # > 0: a tree drafter of at most this many nodes
    max_batch: int = 1  # generation slots at most
    batchable: bool = False  # whether several generations decode at once (else one at a time)
    min_context: int = 1024  # every slot must hold at least this many tokens, or the plan is refused
    max_context: int = 8192  # the target's context
    acceptance: float = 0.6  # per-token draft acceptance assumed (specops.core.types.PRIOR_ACCEPTANCE)
    cores: int = 2
    headroom: float = 0.0  # the fraction of the budget the plan leaves unused, for what the model misses

    def usable(self, budget: int) -> int:
        return int(budget * (1.0 - self.headroom))

    def __post_init__(self) -> None:
        if not 0.0 <= self.headroom < 1.0:
            raise ValueError(f"headroom must be in [0, 1), got {self.headroom}.")
        if self.max_batch < 1 or not 2 <= self.min_context <= self.max_context:
            raise ValueError(f"max_batch >= 1 and 2 <= min_context <= max_context are needed, got {self.max_batch}, "
                             f"{self.min_context}, {self.max_context}.")

    def drafts(self) -> list[tuple[int, int, int]]:
        """Candidate (static width, draft tokens, tree nodes)."""
        if self.max_width and self.max_tree_nodes:  # no draft, or trees as deep as the width allows
            depth = min(self.max_width - 1, self.max_draft_tokens)
            trees = [(self.max_width, depth, n) for n in range(1, self.max_tree_nodes + 1)] if depth else []
            return [(1, 0, 0), *trees]
        if self.max_width:
            return [(w, w - 1, 0) for w in range(1, min(self.max_width, self.max_draft_tokens + 1) + 1)]
        if self.max_tree_nodes:
            depth = max(self.max_draft_tokens, 1)
            return [(0, depth, n) for n in range(1, self.max_tree_nodes + 1)]
        return [(0, k, 0) for k in range(self.max_draft_tokens + 1)]

    def batches(self) -> range:
        return range(1, (self.max_batch if self.batchable else 1) + 1)


@dataclass(frozen=True)
class MemoryPlan:
    static_width: int
    draft_tokens: int
    tree_nodes: int
    max_batch: int
    max_context: int
    budget_bytes: int
    usable_bytes: int  # the budget less the headroom: what the predicted peak stays within
    goodput: float  # predicted tokens per second over all slots
    report: MemoryReport

    def to_dict(self) -> dict[str, Any]:
        return {"static_width": self.static_width, "draft_tokens": self.draft_tokens, "tree_nodes": self.tree_nodes,
                "max_batch": self.max_batch, "max_context": self.max_context, "budget_bytes": self.budget_bytes,
                "usable_bytes": self.usable_bytes,
                "predicted_peak_bytes": self.report.peak_bytes, "predicted_goodput_tok_s": round(self.goodput, 2)}


def expected_step_tokens(acceptance: float, draft_tokens: int, tree_nodes: int) -> float:
    """Tokens one step commits. A chain: sum_i a^i. A tree of n nodes over d levels: about n / d siblings
    per level, a level passing when one of them is right, 1 - (1 - a)^(n/d) (an approximation that
    treats siblings as independent)."""
    if not tree_nodes:
        return expected_tokens(acceptance, draft_tokens)
    depth = min(draft_tokens, tree_nodes)
    level = 1.0 - (1.0 - acceptance) ** (tree_nodes / depth)
    return expected_tokens(level, depth)


def goodput(cost: StepCost, space: PlanSpace, width: int, draft_tokens: int, tree_nodes: int, batch: int) -> float:
    """SmartSpec's goodput of `batch` generations: batch x E[tokens] / (drafting + one batched pass)."""
    rows = 1 + tree_nodes if tree_nodes else width or 1 + draft_tokens  # a static chain pays its full width
    drafting = draft_tokens * cost.draft_token_s * max(1.0, batch / space.cores)
    return batch * expected_step_tokens(space.acceptance, draft_tokens, tree_nodes) / (
        drafting + cost.verify_time(batch * rows))


def _report(target: ModelShape, base: DecodingShape, draft: ModelShape | None, draft_vocab: int, width: int,
            draft_tokens: int, tree_nodes: int, batch: int, context: int) -> MemoryReport:
    shape = replace(base, static_width=width, draft_tokens=draft_tokens, tree_nodes=tree_nodes,
                    concurrency=batch, context=context)
    return memory_report(target, shape, draft, draft_vocab)


def _largest_context(fits: Any, low: int, high: int) -> int:
    """The largest context in [low, high] for which fits(context) holds, given fits(low) (monotone)."""
    while low < high:
        middle = (low + high + 1) // 2
        low, high = (middle, high) if fits(middle) else (low, middle - 1)
    return low


def require_one_request(budget: int, target: ModelShape, base: DecodingShape, space: PlanSpace,
                        draft: ModelShape | None = None, draft_vocab: int = 0) -> None:
    """Raise MemoryBudgetError, saying what takes the memory, when no draft length fits one generation of
    min_context tokens (cheap: call it before measuring a cost model)."""
    smallest = min((_report(target, base, draft, draft_vocab, width, k, nodes, 1, space.min_context)
                    for width, k, nodes in space.drafts()), key=lambda report: report.peak_bytes)
    if smallest.peak_bytes <= space.usable(budget):
        return
    mib = 2**20
    hint = ", or serve in bfloat16" if base.dtype == "float32" else ""
    raise MemoryBudgetError(
        f"A memory budget of {budget / mib:.0f} MiB ({space.usable(budget) / mib:.0f} usable after a headroom of "
        f"{space.headroom:.0%}) cannot hold even one generation of {space.min_context} tokens: "
        f"the smallest plan needs {smallest.peak_bytes / mib:.0f} MiB (process {smallest.overhead / mib:.0f} + "
        f"{smallest.residue / mib:.0f}, target weights {smallest.target.bytes / mib:.0f}, draft "
        f"{(smallest.draft.bytes if smallest.draft else 0) / mib:.0f}, one request {smallest.request.bytes / mib:.0f}; "
        f"loading peaks at {smallest.load_peak_bytes / mib:.0f}). Raise the budget, lower min_context or the "
        f"prefill chunk{hint}.")


def plan_memory(budget: int, target: ModelShape, base: DecodingShape, space: PlanSpace, cost: StepCost,
                draft: ModelShape | None = None, draft_vocab: int = 0) -> MemoryPlan:
    """The plan of best goodput within `budget` bytes less the space's headroom; MemoryBudgetError when no plan
    holds one generation."""
    require_one_request(budget, target, base, space, draft, draft_vocab)
    usable = space.usable(budget)
    best: tuple[tuple[float, int, int, int], MemoryPlan] | None = None
    for width, k, nodes in space.drafts():
        one = _report(target, base, draft, draft_vocab, width, k, nodes, 1, space.min_context)
        if one.peak_bytes > usable:
            continue
        # Serving memory is fixed + slots x per-slot: solve for the most slots.
        fixed = one.serving_peak_bytes - one.request.held
        most = min(max(space.batches()), (usable - fixed) // one.request.held)
        for batch in range(1, most + 1):
            value = goodput(cost, space, width, k, nodes, batch)
            report = _report(target, base, draft, draft_vocab, width, k, nodes, batch, space.min_context)
            key = (value, -report.peak_bytes, -batch, -k)
            if best is None or key > best[0]:
                best = (key, MemoryPlan(width, k, nodes, batch, space.min_context, budget, usable, value, report))
    assert best is not None  # require_one_request found a draft length that fits one generation
    plan = best[1]

    def fits(context: int) -> bool:
        return _report(target, base, draft, draft_vocab, plan.static_width, plan.draft_tokens, plan.tree_nodes,
                       plan.max_batch, context).peak_bytes <= usable

    context = _largest_context(fits, space.min_context, space.max_context)
    report = _report(target, base, draft, draft_vocab, plan.static_width, plan.draft_tokens, plan.tree_nodes,
                     plan.max_batch, context)
    return replace(plan, max_context=context, report=report)

