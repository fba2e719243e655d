"""Scorers: bad generated code fails within its timeout (never hangs), good code passes; answers and
likelihoods are scored as documented."""

from __future__ import annotations

import time

import pytest
import torch

from specops.data.datasets import read_humaneval
from specops.train.scorers import (
    SCORERS,
    Response,
    ScorerError,
    ScoringContext,
    extract_code,
    mean_logprob,
)

SOLUTION = """def has_close_elements(numbers, threshold):
    for i, a in enumerate(numbers):
        for j, b in enumerate(numbers):
            if i != j and abs(a - b) < threshold:
                return True
    return False
"""
BAD_CODE = {
    "infinite loop": "def has_close_elements(numbers, threshold):\n    while True:\n        pass\n",
    "exception": "def has_close_elements(numbers, threshold):\n    raise RuntimeError('nope')\n",
    "syntax error": "def has_close_elements(numbers, threshold)\n    return True\n",
    "wrong answer": "def has_close_elements(numbers, threshold):\n    return False\n",
    "exit early": "import os\nos._exit(0)\n",
    "sys.exit early": "import sys\nsys.exit(0)\n",
    "equal to everything": "class Yes:\n    def __eq__(self, other):\n        return True\n"
                           "def has_close_elements(numbers, threshold):\n    return Yes()\n",
}


@pytest.fixture(scope="module")
def task() -> dict:
    return next(iter(read_humaneval()))  # HumanEval/0, has_close_elements


def humaneval(task: dict, text: str, timeout_s: float = 2.0) -> float:
    return SCORERS["humaneval"](Response(task, [1], [1], text), ScoringContext(timeout_s=timeout_s))


def test_humaneval_passes_a_fenced_solution_and_a_bare_body(task):
    assert humaneval(task, f"Here it is:\n```python\n{SOLUTION}```\nDone.") == 1.0
    body = SOLUTION.split("\n", 1)[1]  # the function body only, continuing the prompt as in the original benchmark
    assert humaneval(task, body) == 1.0


@pytest.mark.parametrize("case", list(BAD_CODE))
def test_humaneval_fails_bad_code_within_the_timeout(task, case):
    start = time.perf_counter()
    assert humaneval(task, f"```python\n{BAD_CODE[case]}```", timeout_s=1.5) == 0.0
    assert time.perf_counter() - start < 10  # bounded: the timeout plus interpreter start-up


def test_extract_code_takes_the_first_python_block():
    assert extract_code("a\n```bash\nls\n```\n```python\nx = 1\n```\n```python\ny = 2\n```") == "x = 1\n"
    assert extract_code("```\nz = 3\n```") == "z = 3\n"
    assert extract_code("```python\nunterminated = 1\n") == "unterminated = 1\n"  # cut off by the token budget
    assert extract_code("no fence at all") == "no fence at all"


def test_exact_match():
    def score(text: str, answer: str) -> float:
        return SCORERS["exact_match"](Response({"answer": answer}, [1], [1], text), ScoringContext())

    assert score("Adding them up.\nThe answer is 1,234.", "1234") == 1.0
    assert score("steps...\n#### 42", "42.0") == 1.0
    assert score("I think it is Paris.", "paris") == 0.0  # the last line is the answer: "i think it is paris"
    assert score("Answer: Paris.", "paris") == 1.0
    assert score("#### 41", "42") == 0.0
    with pytest.raises(ScorerError, match="answer"):
        SCORERS["exact_match"](Response({}, [1], [1], "x"), ScoringContext())


def test_target_likelihood_is_relative_to_the_greedy_reply(target):
    prompt = [5, 17, 33]
    greedy = target.model.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False)[0, 3:].tolist()
    other = [(t + 1) % target.vocab_size for t in greedy]
    ctx = ScoringContext(target=target)

    def score(reply: list[int]) -> float:
        return SCORERS["target_likelihood"](Response({}, prompt, reply, "", greedy), ctx)

    assert score(greedy) == 1.0
    expected = torch.tensor(mean_logprob(target, prompt, other) - mean_logprob(target, prompt, greedy)).exp()
    assert score(other) == pytest.approx(float(expected.clamp(max=1.0)), rel=1e-5)
    assert score(other) < 1.0
    with torch.inference_mode():  # mean_logprob against a direct computation
        logits = target.model(torch.tensor([prompt + other])).logits[0].log_softmax(-1)
    direct = sum(float(logits[len(prompt) - 1 + i, t]) for i, t in enumerate(other)) / len(other)
    assert mean_logprob(target, prompt, other) == pytest.approx(direct, abs=1e-5)


def test_an_unknown_sandbox_isolation_is_refused_before_any_scoring():
    from specops.train.scorers import ScoringContext

    with pytest.raises(ValueError, match="Unknown sandbox isolation 'bwrap'"):
        ScoringContext(isolation="bwrap")
