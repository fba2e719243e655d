"""The speculative decoding loop, batch 1: draft, verify in one target pass, commit, roll back the cache."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Protocol

import torch

from specops.core.drafter import EMPTY, Draft, Drafter
from specops.core.kv import CachedLM, StaticLM
from specops.core.policies import DraftLengthPolicy, FixedPolicy
from specops.core.sampling import PositionNoise, logits_to_probs, token_logprobs
from specops.core.target import Target
from specops.core.types import (
    DEFAULT_DRAFT_TOKENS,
    DEFAULT_PREFILL_CHUNK,
    Generation,
    GenerationStats,
    SamplingParams,
    TokenLogprob,
    check_runtime,
    static_cache_length,
)
from specops.core.verify import VERIFIERS, verify_tree

if TYPE_CHECKING:  # batching imports the cost model, which imports this module
    from specops.core.batching import PassBatcher

GREEDY = SamplingParams()
Cancelled = Callable[[], bool]  # polled between prefill chunks: True once nobody awaits the result


def prefill(lm: CachedLM | StaticLM, token_ids: list[int], chunk: int, cancelled: Cancelled | None = None) -> bool:
    """Feed the prompt in passes of at most `chunk` tokens (0: one pass); False when `cancelled` stopped it.

    A prompt no longer than the chunk is one pass, as HF's generate prefills it. A longer one is
    numerically a different computation (the chunks' products and attention reduce over other shapes),
    so its logits may round differently from a one-pass prefill's, except on the native decoder in bf16,
    where a prompt's rows do not depend on the pass (specops.core.prefix_cache); plain and speculative
    decoding share this function, so they still share the same prefill bit for bit. Chunks write cache slots in order,
    so the cache ends as a one-pass prefill leaves it (the static cache needs no more room).
    """
    size = chunk if chunk > 0 else max(len(token_ids), 1)
    features: list[torch.Tensor] = []
    for begin in range(0, len(token_ids), size):
        if cancelled is not None and cancelled():
            return False
        lm.prefill(token_ids[begin: begin + size])
        if lm.features is not None:
            features.append(lm.features)
    if features:  # feature-reading drafters observe the whole prompt, as after one pass
        lm.features = torch.cat(features)
    return True


class PromptFill(Protocol):
    """What a generator prefills its prompts through instead of `prefill`: the same result, some of it reused."""

    def prefill(self, lm: StaticLM, token_ids: list[int], chunk: int, cancelled: Cancelled | None = None) -> bool: ...


class PrefillCache:
    """The static runtime's cache after the last prompt's prefill, for the next generation of the same
    prompt: a benchmark runs every method on a prompt in turn, and a 7k-token prompt's prefill costs far
    more than its decoding on a CPU. Restoring is bitwise the prefill itself: the prefill's passes depend
    only on the model, the prompt, the chunk size and the cache length, which the key holds."""

    def __init__(self) -> None:
        self.key: tuple | None = None
        self.state: tuple | None = None

    def prefill(self, lm: StaticLM, token_ids: list[int], chunk: int, cancelled: Cancelled | None = None) -> bool:
        """`prefill`, or the stored result of the same one."""
        key = (lm.eager, lm.max_length, chunk, tuple(token_ids))  # the module itself: an id could be reused
        if key == self.key:
            lm.restore(self.state)
            lm.reused = len(token_ids)
            return True
        if not prefill(lm, token_ids, chunk, cancelled):
            return False
        self.key, self.state = key, lm.snapshot()
        return True


PROMPT_LOGPROBS_ROWS = 256  # LM-head rows at a time when scoring a prompt: [rows, V] logits, not [prompt, V]


def prompt_logprobs(target: Target, prompt_ids: list[int], top: int = 0) -> list[TokenLogprob]:
    """The target's log-probability of each prompt token after the tokens before it (the first token has
    no context, so entries start at the second), with the `top` most likely tokens at each position."""
    with torch.inference_mode():
        hidden = target.model.model(torch.tensor([prompt_ids])).last_hidden_state[0, :-1]  # [T - 1, H]
        entries: list[TokenLogprob] = []
        for begin in range(0, hidden.shape[0], PROMPT_LOGPROBS_ROWS):
            logits = target.model.lm_head(hidden[begin: begin + PROMPT_LOGPROBS_ROWS])
            entries += token_logprobs(logits, prompt_ids[begin + 1: begin + 1 + PROMPT_LOGPROBS_ROWS], top)
    return entries


class GenerationRequestError(ValueError):
    """The request cannot be served as asked (empty prompt, too long, bad budget)."""


class GenerationStream:
    """Iterate to receive newly committed tokens step by step; `.generation` fills in as it goes."""

    def __init__(self, steps: Iterator[list[int]], generation: Generation) -> None:
        self._steps = steps
        self.generation = generation

    def __iter__(self) -> Iterator[list[int]]:
        return self._steps

    def close(self) -> None:
        """Stop early (a client went away); the cache is released with the iterator."""
        self._steps.close()  # type: ignore[attr-defined]


class SpeculativeGenerator:
    def __init__(self, target: Target, drafter: Drafter | None = None, verifier: str = "greedy",
                 draft_tokens: int = DEFAULT_DRAFT_TOKENS, policy: DraftLengthPolicy | None = None,
                 static_width: int = 0, compiled: bool = False, prefill_chunk: int = DEFAULT_PREFILL_CHUNK,
                 batcher: PassBatcher | None = None, prefill_cache: PromptFill | None = None) -> None:
        """`policy` decides the draft length of each step (specops/core/policies.py); without one, every
        step drafts `draft_tokens`.

        `static_width` > 0 runs the target on the static runtime (specops.core.kv.StaticLM): every pass
        after the prefill is that many rows wide (batched: its real rows only, on kernels whose rows do not
        depend on the pass's shape), so each row's logits are bitwise those of plain
        decoding through the same runtime, in bf16 as in fp32. Drafts are then at most static_width - 1
        tokens deep (trees in bf16 only: StaticLM.forward_tree). 0 keeps the dynamic cache (exact in fp32
        only up to kernel rounding).
        `compiled` runs the static runtime's passes through torch.compile (specops.core.llama).
        `prefill_chunk` bounds the tokens of one prefill pass (0: the whole prompt in one), see `prefill`.
        `batcher` runs the static runtime's passes batched with other generations' (specops.core.batching).
        `prefill_cache` (static runtime only) prefills prompts reusing what other generations computed: the last
        prompt's whole prefill (PrefillCache), or prompts' first blocks (specops.core.prefix_cache.PrefixCache)."""
        if verifier not in VERIFIERS:
            raise ValueError(f"Unknown verifier '{verifier}'. Choose one of: {', '.join(VERIFIERS)}.")
        if draft_tokens < 0:
            raise ValueError(f"draft_tokens must be >= 0, got {draft_tokens}")
        check_runtime(static_width, compiled, prefill_chunk)
        policy = policy if policy is not None else FixedPolicy(draft_tokens)
        if policy.stop is not None and (drafter is None or not drafter.predicts_acceptance):
            raise ValueError(f"The '{policy.name}' policy stops drafts on an acceptance head's predictions: it needs "
                             "the draft-lm drafter with an acceptance head.")
        self.target = target
        self.drafter = drafter
        self.verifier = verifier
        self.draft_tokens = draft_tokens
        self.policy = policy
        self.eos = target.eos_token_ids
        self.static_width = static_width
        self.compiled = compiled
        self.prefill_chunk = prefill_chunk
        if batcher is not None and not static_width:
            raise ValueError("Batched passes run on the static runtime: set static_width > 0.")
        self.batcher = batcher
        if prefill_cache is not None and not static_width:
            raise ValueError("A prefill cache keeps the static runtime's cache: set static_width > 0.")
        self.prefill_cache = prefill_cache

    def check_request(self, prompt_ids: list[int], max_new_tokens: int) -> None:
        if not prompt_ids:
            raise GenerationRequestError("The prompt is empty.")
        if max_new_tokens < 1:
            raise GenerationRequestError(f"max_new_tokens must be >= 1, got {max_new_tokens}.")
        limit = self.target.max_context
        if len(prompt_ids) + max_new_tokens > limit:
            raise GenerationRequestError(
                f"The prompt has {len(prompt_ids)} tokens; with max_new_tokens={max_new_tokens} it exceeds the "
                f"target's context of {limit} tokens.")

    def generate(self, prompt_ids: list[int], max_new_tokens: int, sampling: SamplingParams = GREEDY,
                 seed: int | None = None, cancelled: Cancelled | None = None,
                 logprobs: int | None = None) -> Generation:
        stream = self.stream(prompt_ids, max_new_tokens, sampling, seed, cancelled, logprobs)
        for _ in stream:
            pass
        return stream.generation

    def stream(self, prompt_ids: list[int], max_new_tokens: int, sampling: SamplingParams = GREEDY,
               seed: int | None = None, cancelled: Cancelled | None = None,
               logprobs: int | None = None) -> GenerationStream:
        """`cancelled` is polled between prefill chunks; once it is true the stream ends with no tokens and
        finish_reason "cancelled" (between decode steps, the caller stops iterating instead).
        `logprobs` not None fills `generation.logprobs` with the target's log-probability of every emitted
        token and its `logprobs` most likely alternatives, read off the verification pass's own rows (so
        speculative and plain decoding report the same numbers through the same runtime)."""
        self.check_request(prompt_ids, max_new_tokens)
        if self.verifier == "greedy" and not sampling.greedy:
            raise GenerationRequestError("The greedy verifier needs temperature 0; use 'rejection' or 'block' to sample.")
        if logprobs is not None and logprobs < 0:
            raise GenerationRequestError(f"logprobs must be >= 0, got {logprobs}.")
        generation = Generation(token_ids=[], stats=GenerationStats(), finish_reason="length",
                                logprobs=[] if logprobs is not None else None)
        generator: torch.Generator | PositionNoise = torch.Generator().manual_seed(seed if seed is not None else 0)
        if self.verifier == "coupled":  # every position drawn with noise keyed by (seed, position)
            generator = PositionNoise(seed if seed is not None else 0, self.target.vocab_size)
        steps = self._steps(list(prompt_ids), max_new_tokens, sampling, generator, generation, cancelled,
                            logprobs or 0)
        return GenerationStream(steps, generation)

    def _steps(self, context: list[int], max_new_tokens: int, sampling: SamplingParams,
               generator: torch.Generator | PositionNoise, out: Generation,
               cancelled: Cancelled | None, top_logprobs: int = 0) -> Iterator[list[int]]:
        stats = out.stats
        start = time.perf_counter()
        coupled = isinstance(generator, PositionNoise)
        with torch.inference_mode():
            lm = self._target_lm(len(context), max_new_tokens)
            fill = prefill if self.prefill_cache is None else self.prefill_cache.prefill
            if not fill(lm, context[:-1], self.prefill_chunk, cancelled):  # type: ignore[arg-type]
                out.finish_reason = "cancelled"
                return
            if self.prefill_cache is not None:  # the static runtime's (checked in __init__)
                stats.cached_prompt_tokens = lm.reused  # type: ignore[union-attr]
            if self.drafter is not None:
                self.drafter.reset()
                self.drafter.share_runtime(lm)
                if lm.features is not None:
                    self.drafter.observe_features(lm.features)
            self.policy.reset()
            stats.prefill_s = time.perf_counter() - start
            # Registered while decoding: the batcher then waits for this sequence's passes too.
            with self.batcher.sequence() if self.batcher is not None else contextlib.nullcontext():
                while stats.new_tokens < max_new_tokens:
                    k = min(self.policy.draft_length(), max_new_tokens - stats.new_tokens - 1)
                    if self.static_width:
                        k = min(k, self.static_width - 1)  # a pass verifies at most width - 1 drafts
                    free_k = k
                    if self.batcher is not None and (sampling.greedy or coupled):
                        # Under load drafts shrink as the batch grows, those that cost draft passes first. Greedy
                        # and coupled output is the target's own draw whatever the draft; a rejection-sampled one
                        # depends on the draft, so its length must not depend on what else is running (the
                        # request would not be reproducible).
                        head_stops = self.policy.stop is not None  # a head's rule ends the draft: alone, uncapped
                        paid, free = self.batcher.draft_caps(stats.running_acceptance, k, stopped=head_stops)
                        k, free_k = min(k, paid), min(k, free)
                    tick = time.perf_counter()
                    if isinstance(generator, PositionNoise):
                        generator = generator.shifted(len(context))  # row 0: the next position to fill
                    draft = self._propose(context, k, free_k, sampling, generator)
                    if self.policy.trim is not None and draft.accept_probs and (sampling.greedy or coupled):
                        # Greedy and coupled only: a trim looks at each token's predicted acceptance, which
                        # depends on the token itself, so under rejection or block sampling it would choose
                        # which X_i get verified from X_i's value and bias the output (specops/core/policies.py).
                        # Greedy and coupled output is the target's own draw at every position whatever is
                        # verified, so there it only saves time.
                        draft = draft.prefix(self.policy.trim(draft.accept_probs))
                    tock = time.perf_counter()
                    accepted, next_token, rows = self._verify(lm, context[-1], draft, sampling, generator)
                    stats.draft_s += tock - tick
                    stats.verify_s += time.perf_counter() - tock
                    stats.record_step(len(draft.tokens), len(accepted), draft.depth)
                    if self.drafter is not None:
                        stats.draft_kv_bytes = self.drafter.peak_kv_bytes
                    self.policy.update(len(draft.tokens), len(accepted))
                    stats.bonus += int(len(accepted) == len(draft.tokens) > 0 and not draft.is_tree)
                    new, stopped = self._commit(accepted + [next_token], context, out, start)
                    if out.logprobs is not None:
                        out.logprobs.extend(token_logprobs(rows, new, top_logprobs))
                    yield new
                    if stopped:
                        break
                if self.drafter is not None:
                    self.drafter.finish(context)

    def _target_lm(self, prompt_tokens: int, max_new_tokens: int) -> CachedLM | StaticLM:
        """The target's runtime for one generation: the static cache sized for it, or the dynamic one."""
        # Feature-reading drafters (aligned heads) name the target layers to capture; others add no cost.
        hidden_layers = self.drafter.hidden_layers if self.drafter is not None else None
        if self.static_width:
            length = static_cache_length(prompt_tokens, max_new_tokens, self.static_width)
            return StaticLM(self.target.model, self.static_width, length, hidden_layers, self.compiled, self.batcher)
        return CachedLM(self.target.model, hidden_layers)

    def _commit(self, new: list[int], context: list[int], out: Generation, start: float) -> tuple[list[int], bool]:
        """Append one step's tokens, cut after the first EOS, to the sequence; True when generation ends."""
        stop = next((i for i, t in enumerate(new) if t in self.eos), None)
        if stop is not None:
            new = new[: stop + 1]
            out.finish_reason = "stop"
        context.extend(new)
        out.token_ids.extend(new)
        out.stats.new_tokens += len(new)
        out.stats.total_s = time.perf_counter() - start
        return new, stop is not None

    def _propose(self, context: list[int], k: int, free_k: int, sampling: SamplingParams,
                 generator: torch.Generator | PositionNoise) -> Draft:
        """A draft of up to k tokens, or of up to free_k (> k under load) if it costs no model pass."""
        if self.drafter is None:
            return EMPTY
        if free_k > k:
            draft = self.drafter.free_draft(context, free_k)
            if draft is not None:
                return draft
        if k <= 0:
            return EMPTY
        # Only drafters with an acceptance head take a stop rule (checked in __init__).
        return self.drafter.propose(context, k, sampling, generator, stop=self.policy.stop)

    def _verify(self, lm: CachedLM | StaticLM, last: int, draft: Draft, sampling: SamplingParams,
                generator: torch.Generator | PositionNoise) -> tuple[list[int], int, torch.Tensor]:
        """One target pass over [last] + draft; returns the accepted draft tokens, the next token, and the
        pass's logits rows [n + 1, V] at which those n + 1 tokens were emitted.

        Leaves the cache holding everything up to and including the accepted tokens.
        """
        past = lm.length
        if draft.is_tree:
            logits = lm.forward_tree(last, draft.tokens, draft.parents)  # [n+1, V]
            p = logits if sampling.greedy else logits_to_probs(logits, sampling)
            path, next_token = verify_tree(torch.tensor(draft.tokens), draft.parents, p, sampling.greedy, generator)
            kept = [0] + [node + 1 for node in path]  # rows of the root and the accepted path
            lm.keep(past, kept)
            accepted = [draft.tokens[node] for node in path]
            seen, rows = [last] + draft.tokens, logits[kept]
        else:
            seen = [last] + draft.tokens
            logits = lm.forward(seen)  # [k+1, V]
            # Greedy needs only the argmax, so it skips the softmax over the whole vocabulary. At
            # temperature 0 the other rules get one-hot p and reduce to greedy through their own code.
            p = logits if self.verifier == "greedy" else logits_to_probs(logits, sampling)
            n, next_token = VERIFIERS[self.verifier](torch.tensor(draft.tokens, dtype=torch.long), draft.q, p, generator)
            lm.crop(past + 1 + n)
            accepted = draft.tokens[:n]
            kept, rows = list(range(n + 1)), logits[: n + 1]  # a view: no copy when nobody asks for logprobs
        if self.drafter is not None:
            self.drafter.observe(seen, logits)
            if lm.features is not None:  # the target's features at the tokens now committed
                self.drafter.observe_features(lm.features[kept])
        return accepted, next_token, rows
