"""Draft length policies: how many tokens to draft each step.

A policy only changes how much is drafted, never what is accepted. That keeps it as lossless as
the verifier it runs with only while the decision to draft (and verify) token X_i depends on X_<i
alone: rejection sampling and block verification are exact for a draft length that is a stopping
time of the draft, not for one that looks at X_i before deciding whether X_i is verified. So:
  * `draft_length()` is fixed before the step drafts anything;
  * a `stop` rule (SpecDec++) is asked after each drafted token X_i whether to draft X_{i+1}; the
    token it stopped on is still verified, so the decision about X_i never depends on X_i;
  * a `trim` rule, which picks after the draft how many tokens to verify from each token's own
    predicted acceptance, would select X_i by its value. The loop applies it at temperature 0 and
    under coupled verification only, where the output is the target's own draw at every position
    whatever is verified; under rejection or block sampling, goodput_head runs as its stop rule alone (tests/core/test_loop_distribution.py shows the trim biases it).
The loop asks `draft_length()` before each step and reports `update(drafted, accepted)` after
verifying it; `reset()` starts a new request.

  fixed      k tokens every step.
  heuristic  Hugging Face's assisted-generation schedule: start at k, +2 after a step whose draft
             was accepted entirely, -1 otherwise, never below 1. Restarts at k on every request
             (HF's "heuristic_transient"), so a request's drafts do not depend on earlier ones.
  specdecpp  SpecDec++ (Huang et al., arXiv 2405.19715): draft up to k_max tokens and stop after
             the token at which the acceptance head's P(at least one rejection so far)
             = 1 - prod_i P(accept_i) exceeds a threshold; the paper shows such a threshold rule is
             the optimal stopping policy of its MDP.
  goodput    SmartSpec (Liu et al., arXiv 2406.14066): choose k maximizing goodput = expected tokens
             per step / predicted step time, from a running acceptance-rate estimate and a cost
             model measured at start-up (specops/core/cost_model.py).
  goodput_head
             SmartSpec's objective on SpecDec++'s per-token predictions: the acceptance head scores
             each drafted token, drafting goes on while one more token (assumed as likely to pass as
             the last) raises the step's expected goodput, and then only the prefix with the best
             goodput is verified, which may be none of it (a plain decoding step); that trim is
             greedy-only (see above). Unlike the two above, it can decline to speculate where the
             draft is unlikely to be right, which is where a weak draft loses time.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Protocol

from specops.core.types import PRIOR_ACCEPTANCE, PRIOR_TOKENS

# Annotations only: the CLI imports POLICIES to build its parser, which must stay free of torch.
if TYPE_CHECKING:
    from specops.core.cost_model import CostModel, StepCosts
    from specops.core.drafter import TokenStop, TokenTrim


class DraftLengthPolicy(Protocol):
    name: str
    stop: TokenStop | None  # a per-token stop rule for drafters with an acceptance head, or None
    trim: TokenTrim | None  # greedy and coupled only: how many drafted tokens to verify, from their P(accept); None verifies all

    def reset(self) -> None:
        """A new request starts."""

    def draft_length(self) -> int:
        """Tokens to draft this step (an upper bound when `stop` may end the draft earlier)."""

    def update(self, drafted: int, accepted: int) -> None:
        """The step drafted `drafted` tokens and the target accepted the first `accepted` of them."""


def _check_length(name: str, k: int) -> None:
    if k < 1:
        raise ValueError(f"The {name} policy needs a draft length >= 1, got {k}.")


class FixedPolicy:
    name = "fixed"
    stop = None
    trim = None

    def __init__(self, k: int) -> None:
        if k < 0:
            raise ValueError(f"draft_tokens must be >= 0, got {k}")
        self.k = k

    def reset(self) -> None:
        pass

    def draft_length(self) -> int:
        return self.k

    def update(self, drafted: int, accepted: int) -> None:
        pass


class HeuristicPolicy:
    name = "heuristic"
    stop = None
    trim = None

    def __init__(self, start: int) -> None:
        _check_length(self.name, start)
        self.start = start
        self.k = start

    def reset(self) -> None:
        self.k = self.start

    def draft_length(self) -> int:
        return self.k

    def update(self, drafted: int, accepted: int) -> None:
        if drafted == 0:  # the token budget left no room to draft: nothing was learned
            return
        self.k = self.k + 2 if accepted == drafted else max(1, self.k - 1)


def rejection_probability(accept_probs: list[float]) -> float:
    """P(at least one of these drafted tokens is rejected) = 1 - prod_i P(accept_i)."""
    return 1.0 - math.prod(accept_probs)


class _HeadPolicy:
    """A policy that decides inside each draft from the acceptance head: it drafts up to max_tokens and
    keeps no state between steps."""

    name: str

    def __init__(self, max_tokens: int) -> None:
        _check_length(self.name, max_tokens)
        self.max_tokens = max_tokens

    def reset(self) -> None:
        pass

    def draft_length(self) -> int:
        return self.max_tokens

    def update(self, drafted: int, accepted: int) -> None:
        pass


class SpecDecPPPolicy(_HeadPolicy):
    name = "specdecpp"
    trim = None

    def __init__(self, max_tokens: int, threshold: float) -> None:
        super().__init__(max_tokens)
        if not 0.0 <= threshold <= 1.0:
            raise ValueError(f"The specdecpp stop threshold must be in [0, 1], got {threshold}.")
        self.threshold = threshold
        self.stop: TokenStop | None = self.should_stop

    def should_stop(self, accept_probs: list[float]) -> bool:
        """End the draft once P(some drafted token is rejected) exceeds the threshold."""
        return rejection_probability(accept_probs) > self.threshold


def expected_tokens(acceptance: float, k: int) -> float:
    """Tokens one step commits with k drafted, each accepted with probability `acceptance` until the
    first rejection, plus the target's own token: sum_{i=0..k} a^i = (1 - a^(k+1)) / (1 - a)."""
    return float(k + 1) if acceptance >= 1.0 else (1.0 - acceptance ** (k + 1)) / (1.0 - acceptance)


def best_draft_length(acceptance: float, cost: CostModel, max_tokens: int) -> int:
    """The k in 1..max_tokens maximizing expected tokens / step time (the smallest k on ties).

    k = 0 is left out on purpose: a step without a draft observes no acceptance, so the estimate
    could never recover once it chose to stop drafting.
    """
    return max(range(1, max_tokens + 1), key=lambda k: (expected_tokens(acceptance, k) / cost.step_time(k), -k))


def step_seconds(costs: StepCosts, batch: int, k: int, cores: int) -> float:
    """Seconds of one step of `batch` sequences each drafting k tokens. The batcher runs one pass of every
    sequence at a time, whichever model's (a round), so a step takes 1 + d * k rounds, d the batched draft
    passes per drafted token (1 for a draft LM, 0 for drafts on the generation threads, which take
    `thread_token_s` a token, `cores` threads at a time). Between rounds it waits for the sequences' own
    work, one sequence at a time under the GIL: a step's waits are each sequence's after its target pass
    (`gap_s` for the batch, and `gap_row_s` per row it verifies) and after each draft pass (`draft_gap_s`).

    The sequences' rounds are out of phase (each ends its draft where its stop rule says), so a round runs
    the target's pass when any sequence verifies in it, P = 1 - (1 - 1 / rounds) ** batch, and the draft's
    when any drafts, P = 1 - (1 / rounds) ** batch, each paying its pass's fixed seconds; a step's rows
    (each sequence once in a target pass with k drafted rows, and d * k draft rows) spread over its rounds.
    So once several sequences run, a drafted token that costs a draft pass costs nearly a whole target
    pass's fixed part; at one sequence the rounds cannot clash and only the draft pass is paid."""
    rounds = 1.0 + costs.draft_passes * k
    verifying, drafting = 1.0 - (1.0 - 1.0 / rounds) ** batch, 1.0 - (1.0 / rounds) ** batch
    rows_s = batch * (costs.sequence_s + k * costs.target[1] + costs.draft_passes * k * costs.draft[1])
    threads_s = k * costs.thread_token_s * max(1.0, batch / cores)
    waits_s = costs.gap_s + batch * k * (costs.gap_row_s + costs.draft_passes * costs.draft_gap_s)
    return rounds * (verifying * costs.target[0] + drafting * costs.draft[0]) + rows_s + threads_s + waits_s


def batch_draft_length(acceptance: float, costs: StepCosts, batch: int, max_tokens: int, cores: int) -> int:
    """SmartSpec under load (arXiv 2406.14066): the draft length k in 0..max_tokens maximizing the batch's
    goodput, batch * E[tokens | k] / `step_seconds` (the smallest k on ties). While a step's passes cost
    little more for more rows and drafts a long draft pays; once rows or rounds cost, k shrinks, down to 0
    (no drafting)."""
    def goodput(k: int) -> float:
        return batch * expected_tokens(acceptance, k) / step_seconds(costs, batch, k, cores)

    return max(range(max_tokens + 1), key=lambda k: (goodput(k), -k))


class GoodputPolicy:
    name = "goodput"
    stop = None
    trim = None

    def __init__(self, max_tokens: int, cost: CostModel, prior_acceptance: float = PRIOR_ACCEPTANCE,
                 prior_tokens: float = PRIOR_TOKENS, decay: float = 0.95) -> None:
        """`prior_acceptance` is assumed before any step, with the weight of `prior_tokens` observed
        tokens; each step's evidence decays by `decay`, so the estimate follows roughly the last
        1 / (1 - decay) steps. The estimate persists across requests: it describes the drafter and
        target pair, not one request."""
        _check_length(self.name, max_tokens)
        if not 0.0 <= prior_acceptance <= 1.0 or prior_tokens <= 0 or not 0.0 < decay <= 1.0:
            raise ValueError("goodput needs prior_acceptance in [0, 1], prior_tokens > 0 and decay in (0, 1].")
        self.max_tokens = max_tokens
        self.cost = cost
        self.decay = decay
        # Decayed counts of accepted tokens and of Bernoulli trials: each step accepts `accepted` tokens
        # and, if it stopped early, adds one rejection. Tokens after a rejection were never tried.
        self.accepted = prior_acceptance * prior_tokens
        self.trials = prior_tokens

    @property
    def acceptance(self) -> float:
        return self.accepted / self.trials

    def reset(self) -> None:
        pass

    def draft_length(self) -> int:
        return best_draft_length(self.acceptance, self.cost, self.max_tokens)

    def update(self, drafted: int, accepted: int) -> None:
        if drafted == 0:
            return
        self.accepted = self.decay * self.accepted + accepted
        self.trials = self.decay * self.trials + accepted + int(accepted < drafted)


def prefix_goodput(accept_probs: list[float], cost: CostModel, drafted: int) -> list[float]:
    """Expected goodput of verifying the first j drafted tokens, for j = 0..len(accept_probs).

    Token i is committed when it and every token before it pass: probability prod_{l<=i} p_l, so j
    verified tokens commit 1 + sum_{i<=j} prod_{l<=i} p_l tokens in expectation (the 1 is the target's
    own token). The step took `drafted` draft forwards, whatever is verified, plus a target pass over
    j + 1 tokens.
    """
    goodputs, expected, passing = [], 1.0, 1.0
    for j in range(len(accept_probs) + 1):
        if j:
            passing *= accept_probs[j - 1]
            expected += passing
        goodputs.append(expected / (drafted * cost.draft_token_s + cost.verify_time(j + 1)))
    return goodputs


class HeadGoodputPolicy(_HeadPolicy):
    name = "goodput_head"

    def __init__(self, max_tokens: int, cost: CostModel) -> None:
        super().__init__(max_tokens)
        self.cost = cost
        self.stop: TokenStop | None = self.should_stop
        self.trim: TokenTrim | None = self.best_prefix

    def should_stop(self, accept_probs: list[float]) -> bool:
        """Stop unless one more token, passing as likely as the last one, would raise the best goodput."""
        now = max(prefix_goodput(accept_probs, self.cost, len(accept_probs)))
        longer = accept_probs + [accept_probs[-1]]
        return max(prefix_goodput(longer, self.cost, len(longer))) <= now

    def best_prefix(self, accept_probs: list[float]) -> int:
        """How many of the drafted tokens to verify: the prefix of best expected goodput (the shortest on ties)."""
        goodputs = prefix_goodput(accept_probs, self.cost, len(accept_probs))
        return goodputs.index(max(goodputs))


POLICIES = {"fixed": FixedPolicy, "heuristic": HeuristicPolicy, "specdecpp": SpecDecPPPolicy, "goodput": GoodputPolicy,
            "goodput_head": HeadGoodputPolicy}
# Policies reading the draft LM's acceptance head.
HEAD_POLICIES = tuple(name for name, policy in POLICIES.items() if issubclass(policy, _HeadPolicy))
