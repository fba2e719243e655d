"""Continuous batching through a real server: concurrent requests decode together (their target passes
batched) and each one's output, text and logprobs, greedy and sampled, is bitwise what it is alone.
Every request leaves its feedback row. A model that cannot batch exactly serves one at a time."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch

from benchmarks.load_test import pass_seconds
from specops.core.target import target_from_model
from specops.drafters.draft_lm import DraftLMDrafter
from specops.drafters.kinds import DecodingConfig
from specops.drafters.prompt_lookup import PromptLookupDrafter
from specops.server.generator import TextGenerator
from specops.server.worker import ServedModel
from tests.conftest import tiny_llama, tiny_tokenizer
from tests.server.conftest import PROMPTS, metric, served
from tests.server.test_openai_api import client

WIDTH = 5


@pytest.fixture(scope="module")
def bf16_target():
    return target_from_model(tiny_llama(0, dtype=torch.bfloat16, hidden=96), tiny_tokenizer(), "tiny-bf16")


def bf16_model(target, drafter: str) -> ServedModel:
    config = DecodingConfig(drafter=drafter, static_width=WIDTH, draft_tokens=WIDTH - 1)
    made = (PromptLookupDrafter(3) if drafter == "prompt-lookup"
            else DraftLMDrafter(tiny_llama(1, layers=1, hidden=96, dtype=torch.bfloat16), target.vocab_size))
    return ServedModel(TextGenerator(target, made, config), drafter=drafter)


def ask(url: str, index: int) -> tuple[str, list[float]]:
    """Request `index`: greedy or sampled (its own seed), with logprobs."""
    reply = client(url).chat.completions.create(
        model="specops", messages=[{"role": "user", "content": PROMPTS[index % len(PROMPTS)]}], max_tokens=32,
        logprobs=True, **({"temperature": 0} if index % 2 == 0 else {"temperature": 0.9, "seed": index}))
    choice = reply.choices[0]
    return choice.message.content, [entry.logprob for entry in choice.logprobs.content]


@pytest.mark.parametrize("drafter", ["prompt-lookup", "draft-lm"])
def test_concurrent_requests_are_bitwise_what_they_are_alone(start_server, bf16_target, drafter):
    live = start_server(model=bf16_model(bf16_target, drafter), max_batch=4, batch_window_ms=20)
    assert live.state.worker.batched
    requests = list(range(8))
    alone = [ask(live.url, i) for i in requests]
    with ThreadPoolExecutor(len(requests)) as pool:
        together = list(pool.map(lambda i: ask(live.url, i), requests))
    assert together == alone
    text = httpx.get(live.url + "/metrics").text
    batches = metric(text, "specops_batch_size_count")
    single = metric(text, "specops_batch_size_bucket", 'le="1.0"')
    assert batches > single > 0  # some passes ran alone (the requests one by one), others packed
    assert metric(text, "specops_observed_step_costs", 'field="target_pass_s"') > 0  # learned from those passes
    # The pass thread's time by kind, as the load test reads it: the target's passes and prefills, timing
    # the target at start-up, and a draft LM's passes and prompts.
    busy = pass_seconds(text)
    assert busy["target"] > 0 and busy["target_alone"] > 0 and busy["other"] > 0
    # A draft LM's passes join the batches; a feed longer than a batched draft pass (a prompt the draft had not
    # seen) runs alone, which depends on when the policy first let a request draft, so only the first is sure.
    assert ("draft" in busy) == (drafter == "draft-lm")
    assert "draft_alone" not in busy or drafter == "draft-lm"
    assert live.state.feedback.count() == 2 * len(requests)


def test_a_model_that_cannot_batch_exactly_serves_one_at_a_time(start_server, target):
    """The fp32 tiny target on the dynamic runtime: one fork, so the slots take turns."""
    live = start_server(model=served(target), max_batch=4)
    assert not live.state.worker.batched
    with ThreadPoolExecutor(3) as pool:
        replies = list(pool.map(lambda i: ask(live.url, 2 * i), range(3)))
    # Greedy texts (the recycling drafter's trees change between requests, so fp32 logprobs round differently).
    assert [text for text, _ in replies] == [ask(live.url, 2 * i)[0] for i in range(3)]
    text = httpx.get(live.url + "/metrics").text
    assert metric(text, "specops_batch_size_count") == 0
    assert pass_seconds(text) == {}  # no pass thread


SYSTEM = " ".join(f"w{(7 * i) % 90 + 3}" for i in range(48))  # a system turn every request shares: 3 blocks


def ask_with_system(url: str, index: int) -> tuple[str, list[float], int]:
    """`ask` behind the shared system turn: text, logprobs and the prompt tokens the server reports cached."""
    reply = client(url).chat.completions.create(
        model="specops", messages=[{"role": "system", "content": SYSTEM},
                                   {"role": "user", "content": PROMPTS[index % len(PROMPTS)]}],
        max_tokens=24, logprobs=True, **({"temperature": 0} if index % 2 == 0 else {"temperature": 0.9, "seed": index}))
    choice = reply.choices[0]
    return (choice.message.content, [entry.logprob for entry in choice.logprobs.content],
            reply.usage.prompt_tokens_details.cached_tokens)


def off_by_one_slot(add):
    """The mutant: blocks stored one slot off (their keys rolled along the cache)."""
    def wrapped(cache, root, token_ids, lm):
        add(cache, root, token_ids, lm)
        for block in cache._blocks():
            if not getattr(block, "rolled", False):
                block.keys, block.rolled = [k.roll(1, 1) for k in block.keys], True
    return wrapped


@pytest.mark.parametrize("mutant", [False, True])
def test_concurrent_requests_reusing_a_shared_system_turn_are_bitwise_without_it(start_server, bf16_target,
                                                                                  mutant, monkeypatch):
    if mutant:
        from specops.core.prefix_cache import PrefixCache
        monkeypatch.setattr(PrefixCache, "_add", off_by_one_slot(PrefixCache._add))
    plain = start_server(model=bf16_model(bf16_target, "prompt-lookup"), max_batch=4, prefix_cache_mb=0)
    cached = start_server(model=bf16_model(bf16_target, "prompt-lookup"), max_batch=4, batch_window_ms=20)
    requests = list(range(6))
    without = [ask_with_system(plain.url, i) for i in requests]
    assert all(reused == 0 for *_, reused in without)
    ask_with_system(cached.url, 0)  # the system turn's blocks go into the cache
    with ThreadPoolExecutor(len(requests)) as pool:
        together = list(pool.map(lambda i: ask_with_system(cached.url, i), requests))
    assert all(reused >= 48 for *_, reused in together)
    text = httpx.get(cached.url + "/metrics").text
    assert metric(text, "specops_cached_prompt_tokens_total") == sum(reused for *_, reused in together)
    assert metric(text, "specops_prefix_cache_bytes") > 0
    same = [answer[:2] for answer in together] == [answer[:2] for answer in without]
    assert same != mutant
