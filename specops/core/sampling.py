"""Turn logits into the distribution we sample from. Applied identically to target (p) and draft (q)."""

from __future__ import annotations

import torch

from specops.core.types import SamplingParams, TokenLogprob


def argmax(scores: torch.Tensor) -> torch.Tensor:
    """scores [..., V] -> the index of each row's first maximum [...], as `scores.argmax(-1)`. bf16 and fp16
    are upcast first: exact (every value converts to fp32 unchanged, so the same index wins), and on this
    CPU (quiet, 2 threads) a bf16 argmax over SmolLM2's 49k vocabulary took 485 us for a 5-row verification
    pass and 164 us for one row, against 104 and 33 us upcast (the greedy loop takes one per pass, drafters
    one per token)."""
    if scores.dtype in (torch.bfloat16, torch.float16):
        scores = scores.float()
    return scores.argmax(-1)


def logits_to_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """logits [..., V] -> probabilities [..., V] after temperature, top-k and top-p.

    Temperature 0 is the limit of the softmax: a one-hot at the argmax. Verification rules then
    reduce to greedy matching without a special case.
    """
    if params.greedy:
        return torch.zeros_like(logits).scatter_(-1, argmax(logits).unsqueeze(-1), 1.0)
    dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
    scores = logits.to(dtype) / params.temperature
    if params.top_k and params.top_k < scores.shape[-1]:
        kth = scores.topk(params.top_k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_scores, order = scores.sort(dim=-1, descending=True)
        sorted_probs = sorted_scores.softmax(-1)
        # Drop a token when the mass strictly before it already reaches top_p; the top token always stays, even
        # for a top_p that rounds to 0 in the scores' dtype (1e-300 in float32), which would drop every token.
        drop_sorted = (sorted_probs.cumsum(-1) - sorted_probs) >= params.top_p
        drop_sorted[..., 0] = False
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        scores = scores.masked_fill(drop, float("-inf"))
    return scores.softmax(-1)


def expand_draft_vocab(logits: torch.Tensor, draft_to_target: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Draft-vocabulary logits [..., N] (column i is target id draft_to_target[i]) -> [..., vocab_size], -inf
    elsewhere: a drafter over a reduced vocabulary gives the other tokens probability 0, so q stays a
    distribution over the target's vocabulary and every verifier stays lossless."""
    full = logits.new_full((*logits.shape[:-1], vocab_size), float("-inf"))
    return full.index_copy(-1, draft_to_target, logits)


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """One token id from a distribution [V]."""
    return int(torch.multinomial(probs, 1, generator=generator))


class PositionNoise:
    """The randomness of coupled sampling: Gumbel noise g_t [V] keyed by (seed, sequence position t).

    Coupled sampling draws the token at position t as argmax(log p_t + g_t), an exact draw from p_t
    (the Gumbel-max trick). Because g_t depends on nothing but the seed and t, plain decoding and every
    speculative run, whatever they drafted and however many steps they took, draw position t with the
    same noise: given bitwise-equal target logits (the static runtime), they emit bitwise the same
    tokens. A drafter that samples with the same noise proposes the target's own draw whenever its
    distribution is close, which is what makes coupled drafts accepted.

    `start` is the position of the first token this object is asked about (row 0 of `rows`).
    """

    def __init__(self, seed: int, vocab: int, start: int = 0, cache: dict[int, torch.Tensor] | None = None) -> None:
        self.seed, self.vocab, self.start = seed, vocab, start
        self._cache = cache if cache is not None else {}

    def at(self, position: int) -> torch.Tensor:
        """g_position [V], float64, from a generator seeded by (seed, position) alone."""
        if position not in self._cache:
            g = torch.Generator().manual_seed((self.seed * 1_000_003 + position) % (1 << 63))
            uniform = torch.rand(self.vocab, generator=g, dtype=torch.float64).clamp_min(1e-300)
            self._cache[position] = -torch.log(-torch.log(uniform))
        return self._cache[position]

    def shifted(self, start: int) -> PositionNoise:
        """The same noise, with row 0 at `start`, sharing the cache of drawn positions. Positions before
        `start` are committed and never asked for again, so they leave the cache: a long generation
        keeps a few [V] rows, not one per token."""
        for position in [p for p in self._cache if p < start]:
            del self._cache[position]
        return PositionNoise(self.seed, self.vocab, start, self._cache)

    def rows(self, n: int) -> torch.Tensor:
        """[n, V]: the noise of positions start .. start + n - 1."""
        return torch.stack([self.at(self.start + i) for i in range(n)])


def coupled_sample(probs: torch.Tensor, noise: torch.Tensor) -> int:
    """argmax(log p + g): a draw from probs [V] (zero-probability tokens have log p = -inf and never win)."""
    return int((probs.to(torch.float64).log() + noise).argmax())


Randomness = torch.Generator | PositionNoise | None  # a draw stream, or coupled sampling's position-keyed noise


def draw(probs: torch.Tensor, randomness: Randomness, offset: int = 0) -> int:
    """One token from probs [V]: coupled (the noise at start + offset) or from the generator's stream."""
    if isinstance(randomness, PositionNoise):
        return coupled_sample(probs, randomness.at(randomness.start + offset))
    return sample(probs, randomness)


def token_logprobs(logits: torch.Tensor, tokens: list[int], top: int = 0) -> list[TokenLogprob]:
    """Row i of `logits` [n, V] is the target's output at the position where tokens[i] was emitted: that
    token's log-probability under it, and the `top` most likely tokens (log_softmax in at least float32,
    so bf16 logits lose no more precision here)."""
    dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
    logp = torch.log_softmax(logits[: len(tokens)].to(dtype), dim=-1)
    chosen = logp[torch.arange(len(tokens)), torch.tensor(tokens, dtype=torch.long)].tolist()
    if top <= 0:
        return [TokenLogprob(token, value) for token, value in zip(tokens, chosen, strict=True)]
    values, ids = logp.topk(min(top, logp.shape[-1]), dim=-1)
    return [TokenLogprob(token, value, tuple(zip(row_ids, row_values, strict=True)))
            for token, value, row_ids, row_values in zip(tokens, chosen, ids.tolist(), values.tolist(), strict=True)]
