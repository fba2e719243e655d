"""Prometheus metrics of one server. Each app owns its registry, so many apps can live in one process."""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

from specops.core.types import GenerationStats

# Seconds; a request on a 2-core CPU spans ~50 ms (a few tokens) to minutes (long outputs in a queue).
LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160)
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
ITL_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56)
BATCH_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)
RATE_BUCKETS = (1, 2, 5, 10, 20, 30, 40, 60, 80, 120, 160)  # tokens/s of one request
DRAFT_BUCKETS = (0, 1, 2, 3, 4, 5, 6, 8, 10, 12, 16)
CONTENT_TYPE = CONTENT_TYPE_LATEST


def resident_bytes() -> float:
    """This process's resident memory from /proc (0 where there is none)."""
    try:
        with open("/proc/self/status") as handle:
            line = next(line for line in handle if line.startswith("VmRSS:"))
    except (OSError, StopIteration):
        return 0.0
    return float(line.split()[1]) * 1024


class ServerMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("specops_requests", "Completion requests by HTTP status (499: the client went "
                                "away before the response ended).", ["status"], registry=r)
        self.prompt_tokens = Counter("specops_prompt_tokens", "Prompt tokens of finished requests.", registry=r)
        self.cached_prompt_tokens = Counter("specops_cached_prompt_tokens", "Prompt tokens of finished requests "
                                            "whose keys and values the prefix cache held (not computed).", registry=r)
        self.prefix_cache_bytes = Gauge("specops_prefix_cache_bytes", "Bytes the prefix cache holds "
                                        "(--prefix-cache-mb).", registry=r)
        self.generated_tokens = Counter("specops_generated_tokens", "Tokens generated for finished requests.",
                                        registry=r)
        self.target_steps = Counter("specops_target_steps", "Target forward passes after the prefill.", registry=r)
        self.drafted_tokens = Counter("specops_drafted_tokens", "Draft tokens offered to the verifier.", registry=r)
        self.accepted_tokens = Counter("specops_accepted_tokens", "Draft tokens the verifier accepted.", registry=r)
        self.drafted_per_position = Counter("specops_drafted_per_position", "Steps that drafted a token at this "
                                            "depth (0 = first draft token).", ["position"], registry=r)
        self.accepted_per_position = Counter("specops_accepted_per_position", "Steps whose draft token at this "
                                             "depth was accepted.", ["position"], registry=r)
        self.latency = Histogram("specops_request_latency_seconds", "Arrival to last byte of successful "
                                 "completion requests.", buckets=LATENCY_BUCKETS, registry=r)
        self.ttft = Histogram("specops_time_to_first_token_seconds", "Arrival to the first generated token, "
                              "queue wait included.", buckets=TTFT_BUCKETS, registry=r)
        self.queue_depth = Gauge("specops_queue_depth", "Requests waiting for a generation slot.", registry=r)
        self.queue_depth_seen = Histogram("specops_queue_depth_observed", "Requests waiting, as each request "
                                          "arrived.", buckets=BATCH_BUCKETS, registry=r)
        self.active = Gauge("specops_active_generations", "Generations decoding now.", registry=r)
        self.batch_size = Histogram("specops_batch_size", "Sequences in each batched target pass.",
                                    buckets=BATCH_BUCKETS, registry=r)
        self.pass_seconds = Counter("specops_pass_seconds", "Seconds the batcher's pass thread spent running "
                                    "passes, by kind: target and draft (batched passes of the target and of a draft "
                                    "LM), target_alone and draft_alone (run alone: prompt prefills, a draft LM's "
                                    "catch-ups), other (work run alone at start-up: timing the target). Against wall "
                                    "time, what is left is the pass thread waiting for the sequences' own work.",
                                    ["kind"], registry=r)
        self.inter_token = Histogram("specops_inter_token_latency_seconds", "Time between a request's successive "
                                     "steps, over the tokens each step emitted.", buckets=ITL_BUCKETS, registry=r)
        self.request_rate = Histogram("specops_request_tokens_per_second", "Generated tokens per second of each "
                                      "finished request, from its first token.", buckets=RATE_BUCKETS, registry=r)
        self.draft_length = Histogram("specops_draft_length", "Tokens drafted per step, as the draft length "
                                      "policy chose them.", buckets=DRAFT_BUCKETS, registry=r)
        self.step_costs = Gauge("specops_observed_step_costs", "What the batched passes took lately, as the draft "
                                "length policy weighs it under load (NaN until observed): target_pass_s, "
                                "target_sequence_s and target_row_s (a target pass's fixed seconds, seconds per "
                                "sequence and per drafted row), draft_pass_s and draft_row_s (a draft model's pass "
                                "seconds and seconds per row), draft_passes_per_token, gap_sequence_s, "
                                "gap_draft_s and gap_row_s (the wait between batches per sequence after its target "
                                "pass and after a draft pass, and per row it verified).", ["field"], registry=r)
        self.bundle_info = Gauge("specops_bundle_info", "The model being served (value 1); version is the bundle "
                                 "hash, model_version the registry version.", ["version", "model_version", "drafter"],
                                 registry=r)
        self.reloads = Counter("specops_reloads", "Hot reload attempts by result (ok, refused).", ["result"],
                               registry=r)
        self.feedback_rows = Counter("specops_feedback_rows", "Rows committed to the feedback log.", registry=r)
        self.feedback_dropped = Counter("specops_feedback_dropped_rows", "Oldest feedback rows dropped by the "
                                        "retention cap.", registry=r)
        self.feedback_errors = Counter("specops_feedback_errors", "Feedback rows that could not be written.",
                                       registry=r)

    def set_plan(self, plan: dict[str, float]) -> None:
        """A --memory-budget's plan, one gauge per field (specops/server/budget.py)."""
        self.memory_plan = Gauge("specops_memory_plan", "The memory plan: budget_bytes, predicted_peak_bytes, "
                                 "max_batch, max_context, static_width, draft_tokens, tree_nodes.", ["field"],
                                 registry=self.registry)
        for name, value in plan.items():
            self.memory_plan.labels(field=name).set(value)
        self.resident = Gauge("specops_resident_memory_bytes", "The server process's resident memory (VmRSS).",
                              registry=self.registry)
        self.resident.set_function(resident_bytes)

    def observe_pass(self, kind: str, sequences: int, seconds: float) -> None:
        """One pass of the serving batcher (specops.core.batching.PassBatcher's on_pass)."""
        if kind == "target":
            self.batch_size.observe(sequences)
        self.pass_seconds.labels(kind=kind).inc(seconds)

    def watch_step_costs(self, observed: Callable[[], dict[str, float]]) -> None:
        """Read the serving batcher's observed costs (specops.core.batching.PassBatcher.observed) at each scrape."""
        for name in observed():
            self.step_costs.labels(field=name).set_function(lambda name=name: observed()[name])

    def watch_prefix_cache(self, held: Callable[[], int]) -> None:
        self.prefix_cache_bytes.set_function(held)

    def watch_queue(self, depth: Callable[[], int]) -> None:
        self.queue_depth.set_function(depth)

    def observe_generation(self, prompt_tokens: int, stats: GenerationStats) -> None:
        self.prompt_tokens.inc(prompt_tokens)
        self.cached_prompt_tokens.inc(stats.cached_prompt_tokens)
        for drafted, _ in stats.per_step:
            self.draft_length.observe(drafted)
        self.generated_tokens.inc(stats.new_tokens)
        self.target_steps.inc(stats.steps)
        self.drafted_tokens.inc(stats.drafted)
        self.accepted_tokens.inc(stats.accepted)
        for counter, counts in ((self.drafted_per_position, stats.drafted_per_position),
                                (self.accepted_per_position, stats.accepted_per_position)):
            for position, count in enumerate(counts):
                if count:
                    counter.labels(position=str(position)).inc(count)

    def set_serving(self, version: str | None, model_version: str | None, drafter: str) -> None:
        self.bundle_info.clear()  # exactly one series: the model serving right now
        self.bundle_info.labels(version=version or "none", model_version=model_version or "none",
                                drafter=drafter).set(1)

    def render(self) -> bytes:
        return generate_latest(self.registry)
