"""Plain data passed between the speculative loop, the CLI, the API and the feedback log."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

# The one default draft length: chain drafters draft this many tokens a step; tree drafters accept at most this depth.
DEFAULT_DRAFT_TOKENS = 6
# The one default prefill chunk: the prompt is prefilled this many tokens a pass, and a cancelled request
# stops between two passes, so an abandoned long prompt frees the worker within one chunk.
DEFAULT_PREFILL_CHUNK = 512


# Rows of every pass at least: with one row, bf16 F.linear takes another kernel for the 1536-wide down
# projection (measured on this CPU, torch 2.13: one row differs from the same row among 2 to 96, which all
# agree), so a lone token would round differently from the same token in a batch or a verification pass.
MIN_ROWS = 2

# torch's CPU matmuls run on oneDNN only above this many multiply-adds (batch x m x n x k; `checksize` in
# aten/src/ATen/native/mkldnn/Matmul.cpp); smaller ones take a kernel that sums in another order.
ONEDNN_MIN_WORK = 16**3

# Static cache lengths are rounded up to this. Attention reads every slot, stale or not, so a small step
# wastes less: a 250-token prompt and 128 new tokens take 384 slots, and compiled bf16 plain decoding
# 20.6 ms a token there, against 21.3 ms with 512 (2026-11-25).
STATIC_BUCKET = 64


# Slots kept past the last committed token for a last pass's padding rows: as many as any width up to this
# needs, so that the cache length does not depend on the width.
WIDTH_ROOM = 16


def static_cache_length(prompt_tokens: int, max_new_tokens: int, width: int) -> int:
    """The one cache length of a generation: every committed token plus a last pass's padding rows,
    rounded up. Plain and speculative decoding of the same request get the same length, so every
    pass attends over keys of the same shape; so do runtimes of any width up to WIDTH_ROOM, since the
    length over which attention sums changes a row's rounding: plain decoding at width 1 and at width 5
    answered 3 of 64 HumanEval requests differently on SmolLM2 in bf16 when the length followed the width,
    each time one whose two lengths fell in different 64-slot buckets (2026-11-27; a prompt's prefill then
    attended over the whole cache, masked, and since 2026-11-28 reads only the slots up to its last row)."""
    need = prompt_tokens + max_new_tokens + max(width, WIDTH_ROOM)
    return -(-need // STATIC_BUCKET) * STATIC_BUCKET


# Per-token draft acceptance assumed before any evidence, weighted as this many observed tokens (the goodput
# policy's prior, and a request's running estimate under batching).
PRIOR_ACCEPTANCE = 0.6
PRIOR_TOKENS = 4.0


def check_runtime(static_width: int, compiled: bool, prefill_chunk: int) -> None:
    """The target runtime's settings, checked where a config is built and where a generator is."""
    if static_width < 0:
        raise ValueError(f"static_width must be >= 0 (0: the dynamic runtime), got {static_width}.")
    if compiled and not static_width:
        raise ValueError("compiled runs the static runtime: set static_width > 0 too.")
    if prefill_chunk < 0:
        raise ValueError(f"prefill_chunk must be >= 0 (0: one pass), got {prefill_chunk}.")


def static_tree_refusal(compiled: bool, dtype: str | None = None) -> str | None:
    """Why tree drafts would not stay exact on the static runtime with these settings, else None: a tree row
    must round as the same token does alone, so each branch attends in its own cache in an eager pass on
    rows that do not depend on the pass's shape. For configs, before any model loads; once the target has
    loaded, specops.core.batching.batch_invariant also checks that its products are large enough."""
    if compiled:
        return "their passes run eager (each branch in its own cache), so compiled plain decoding would round differently"
    if dtype is not None and dtype != "bfloat16":
        return "the static runtime verifies them exactly in bfloat16 only (rows that do not depend on the batch)"
    return None


@dataclass(frozen=True)
class SamplingParams:
    """How tokens are chosen. temperature 0 means greedy; the same transform is applied to p and q."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0 disables top-k

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass
class GenerationStats:
    """Counters of one generate call. A step is one target forward pass after the prefill."""

    steps: int = 0
    drafted: int = 0
    accepted: int = 0
    bonus: int = 0  # steps where every drafted token was accepted and the target added one more
    accepted_per_position: list[int] = field(default_factory=list)  # [i]: steps whose draft token i was accepted
    drafted_per_position: list[int] = field(default_factory=list)  # [i]: steps that drafted a token at depth i
    per_step: list[tuple[int, int]] = field(default_factory=list)  # (drafted, accepted) per step, for the feedback log
    new_tokens: int = 0
    prefill_s: float = 0.0
    draft_s: float = 0.0
    verify_s: float = 0.0
    total_s: float = 0.0
    draft_kv_bytes: int = 0  # the most bytes the drafter's own KV cache held (Drafter.peak_kv_bytes)
    cached_prompt_tokens: int = 0  # prompt tokens whose keys and values came from a prefix cache, not a pass
    # Lossy modes (specops/lossy/autojudge.py, specops/lossy/arbitrage.py) mark their output so nobody mistakes it
    # for the target's own: lossy_accepted counts mismatching tokens the judge accepted (autojudge)
    # or draft steps kept without the target (arbitrage).
    lossy: bool = False
    lossy_mode: str | None = None
    lossy_threshold: float | None = None
    lossy_accepted: int = 0

    def record_step(self, drafted: int, accepted: int, depth: int) -> None:
        """`depth` is the deepest draft position offered (a tree's depth, a chain's length)."""
        self.steps += 1
        self.drafted += drafted
        self.accepted += accepted
        self.per_step.append((drafted, accepted))
        for counts, n in ((self.drafted_per_position, depth), (self.accepted_per_position, accepted)):
            counts.extend([0] * (n - len(counts)))
            for i in range(n):
                counts[i] += 1

    @property
    def mean_accepted_length(self) -> float:
        """Tokens committed per target forward pass (1.0 for plain autoregressive decoding)."""
        return self.new_tokens / self.steps if self.steps else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def running_acceptance(self) -> float:
        """Per-token acceptance so far, from the prior acceptance worth PRIOR_TOKENS tokens (what a step
        accepted, plus one rejection if it stopped early: the trials of a geometric run), for a draft length
        choice mid-request."""
        trials = PRIOR_TOKENS + self.accepted + sum(int(a < d) for d, a in self.per_step)
        return (PRIOR_ACCEPTANCE * PRIOR_TOKENS + self.accepted) / trials

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.total_s if self.total_s > 0 else 0.0

    def to_dict(self, per_step: bool = False) -> dict:
        data = asdict(self)
        if not per_step:
            data.pop("per_step")
        data.update(mean_accepted_length=self.mean_accepted_length, acceptance_rate=self.acceptance_rate,
                    tokens_per_s=self.tokens_per_s)
        return data


@dataclass(frozen=True)
class TokenLogprob:
    """The target's log-probability of a token at its position, and the `top` most likely tokens there
    (id, log-probability), most likely first. The distribution is the target's own (temperature 1, no
    top-k/top-p), as vLLM's default raw logprobs, so it does not depend on how the token was chosen."""

    token: int
    logprob: float | None  # None only for a prompt's first token, which has no context to be scored in
    top: tuple[tuple[int, float], ...] = ()


@dataclass
class Generation:
    token_ids: list[int]
    stats: GenerationStats
    finish_reason: str  # "stop" (an EOS token), "length", or "cancelled" (stopped during the prefill)
    logprobs: list[TokenLogprob] | None = None  # one per token of token_ids, when the caller asked for them
