"""logprobs, n > 1, echo, /tokenize, /detokenize, /version and the model card, through the official
`openai` client against a real server (a tree drafter on the tiny target), streaming and not."""

from __future__ import annotations

from collections import defaultdict
from importlib.metadata import version

import httpx
import pytest
from tokenizers import ByteLevelBPETokenizer
from transformers import PreTrainedTokenizerFast

from specops.core.loop import SpeculativeGenerator, prompt_logprobs
from specops.core.types import SamplingParams
from specops.server.logprobs import TokenText
from tests.server.conftest import PROMPTS
from tests.server.test_openai_api import client


def tokenize(url: str, **body) -> list[int]:
    response = httpx.post(f"{url}/tokenize", json=body, timeout=30)
    assert response.status_code == 200, response.text
    return response.json()["tokens"]


def test_chat_logprobs_are_the_targets_streamed_or_not(shared_server, target):
    api = client(shared_server.url)
    messages = [{"role": "user", "content": PROMPTS[2]}]
    ask = {"model": "specops", "messages": messages, "max_tokens": 16, "temperature": 0, "logprobs": True,
           "top_logprobs": 3}
    reply = api.chat.completions.create(**ask)
    chunks = list(api.chat.completions.create(**ask, stream=True))

    content = reply.choices[0].logprobs.content
    plain = SpeculativeGenerator(target).generate(tokenize(shared_server.url, messages=messages), 16, logprobs=3)
    assert plain.logprobs is not None
    assert len(content) == reply.usage.completion_tokens == len(plain.logprobs)
    for got, want in zip(content, plain.logprobs, strict=True):
        assert got.token == target.tokenizer.decode([want.token])
        assert got.bytes == list(got.token.encode())
        assert got.logprob == pytest.approx(want.logprob, abs=1e-4)
        assert [t.token for t in got.top_logprobs] == [target.tokenizer.decode([t]) for t, _ in want.top]
        assert got.top_logprobs[0].token == got.token  # greedy: the emitted token is the most likely one
    streamed = [entry for c in chunks if c.choices and c.choices[0].logprobs for entry in c.choices[0].logprobs.content]
    # The recycling drafter's trees change between requests, and so the shapes of the fp32 dynamic runtime's
    # passes: equal tokens, logprobs equal up to rounding (bitwise only on the static runtime: tests/core).
    assert [e.token for e in streamed] == [e.token for e in content]
    assert [e.logprob for e in streamed] == pytest.approx([e.logprob for e in content], abs=1e-4)


def test_no_logprobs_unless_asked(shared_server):
    reply = client(shared_server.url).chat.completions.create(
        model="specops", messages=[{"role": "user", "content": PROMPTS[0]}], max_tokens=4, temperature=0)
    assert reply.choices[0].logprobs is None


def test_completions_echo_with_prompt_logprobs(shared_server, target):
    api = client(shared_server.url)
    prompt = PROMPTS[3] + " " + PROMPTS[4]
    ids = tokenize(shared_server.url, prompt=prompt)
    reply = api.completions.create(model="specops", prompt=prompt, max_tokens=8, temperature=0, echo=True, logprobs=2)
    plain = api.completions.create(model="specops", prompt=prompt, max_tokens=8, temperature=0)

    choice = reply.choices[0]
    assert choice.text == prompt + plain.choices[0].text
    scored = choice.logprobs
    assert len(scored.tokens) == len(ids) + reply.usage.completion_tokens
    assert scored.token_logprobs[0] is None and scored.top_logprobs[0] is None  # the first token has no context
    expected = [e.logprob for e in prompt_logprobs(target, ids)]
    assert scored.token_logprobs[1: len(ids)] == pytest.approx(expected, abs=1e-4)
    assert all(len(top) <= 2 for top in scored.top_logprobs[1:])
    assert scored.text_offset == sorted(scored.text_offset) and scored.text_offset[0] == 0
    streamed = "".join(c.choices[0].text for c in api.completions.create(
        model="specops", prompt=prompt, max_tokens=8, temperature=0, echo=True, stream=True))
    assert streamed == choice.text


def test_logprobs_stop_at_the_stop_string(shared_server):
    api = client(shared_server.url)
    full = api.completions.create(model="specops", prompt=PROMPTS[0], max_tokens=12, temperature=0, logprobs=0)
    words = full.choices[0].text.split()
    stop = words[4]
    cut = api.completions.create(model="specops", prompt=PROMPTS[0], max_tokens=12, temperature=0, logprobs=0,
                                 stop=[stop])
    assert cut.choices[0].finish_reason == "stop"
    assert stop not in cut.choices[0].text
    tokens = cut.choices[0].logprobs.tokens
    assert tokens == full.choices[0].logprobs.tokens[: len(tokens)] and tokens[-1].strip() == stop


@pytest.mark.parametrize("stream", [False, True])
def test_n_choices_are_the_single_requests_with_seeds_counted_up(shared_server, stream):
    api = client(shared_server.url)
    ask = {"model": "specops", "prompt": PROMPTS[5], "max_tokens": 10, "temperature": 1.0, "top_p": 0.9}
    singles = [api.completions.create(**ask, seed=40 + i).choices[0].text for i in range(3)]
    if stream:
        texts: dict[int, str] = defaultdict(str)
        for chunk in api.completions.create(**ask, seed=40, n=3, stream=True):
            for choice in chunk.choices:
                texts[choice.index] += choice.text
        assert [texts[i] for i in range(3)] == singles
    else:
        reply = api.completions.create(**ask, seed=40, n=3)
        assert [c.index for c in reply.choices] == [0, 1, 2]
        assert [c.text for c in reply.choices] == singles
        assert len(set(singles)) > 1  # independent samples, not one sample three times
        assert reply.usage.completion_tokens == sum(
            api.completions.create(**ask, seed=40 + i).usage.completion_tokens for i in range(3))


def test_n_chat_choices_each_announce_their_role(shared_server):
    chunks = list(client(shared_server.url).chat.completions.create(
        model="specops", messages=[{"role": "user", "content": PROMPTS[1]}], max_tokens=4, temperature=0.7, seed=3,
        n=2, stream=True))
    roles = [c.choices[0].index for c in chunks if c.choices and c.choices[0].delta.role == "assistant"]
    finished = [c.choices[0].index for c in chunks if c.choices and c.choices[0].finish_reason]
    assert sorted(roles) == sorted(finished) == [0, 1]


def test_tokenize_detokenize_version_and_model_card(shared_server, target):
    url = shared_server.url
    ids = tokenize(url, prompt=PROMPTS[2])
    assert ids == target.tokenizer(PROMPTS[2], add_special_tokens=False)["input_ids"]
    response = httpx.post(f"{url}/tokenize", json={"prompt": PROMPTS[2]}, timeout=30).json()
    assert response["count"] == len(ids) and response["max_model_len"] == target.max_context
    chat_ids = tokenize(url, messages=[{"role": "user", "content": PROMPTS[2]}])
    assert len(chat_ids) > len(ids)  # the chat template's tokens around the message
    assert httpx.post(f"{url}/detokenize", json={"tokens": ids}, timeout=30).json() == {"prompt": PROMPTS[2]}
    assert httpx.post(f"{url}/detokenize", json={"tokens": [10**6]}, timeout=30).status_code == 400
    assert httpx.post(f"{url}/tokenize", json={"prompt": "w1", "messages": [{"role": "user", "content": "w1"}]},
                      timeout=30).status_code == 400
    assert httpx.get(f"{url}/version", timeout=30).json() == {"version": version("specops")}
    card = client(url).models.retrieve("specops").model_extra
    assert card["root"] == target.fingerprint.name and card["parent"] is None
    assert card["max_model_len"] == target.max_context


def test_sampled_logprobs_follow_the_emitted_tokens(shared_server, target):
    """Sampled tokens need not be the most likely, but each one's logprob is the target's for it."""
    messages = [{"role": "user", "content": PROMPTS[6]}]
    reply = client(shared_server.url).chat.completions.create(
        model="specops", messages=messages, max_tokens=10, temperature=1.0, seed=9, logprobs=True, top_logprobs=1)
    ids = tokenize(shared_server.url, messages=messages)
    out = SpeculativeGenerator(target, verifier="rejection").generate(ids, 10, SamplingParams(1.0), seed=9,
                                                                       logprobs=0)
    assert out.logprobs is not None
    content = reply.choices[0].logprobs.content
    assert [e.token for e in content] == [target.tokenizer.decode([e.token]) for e in out.logprobs]
    assert [e.logprob for e in content] == pytest.approx([e.logprob for e in out.logprobs], abs=1e-4)


def test_byte_level_tokens_give_their_exact_bytes():
    """A token holding part of a character: its bytes are the character's, its text has U+FFFD; decoding
    it alone (the fallback for other tokenizers) would give U+FFFD's bytes instead."""
    text = "héllo 日本 wörld"
    trainer = ByteLevelBPETokenizer()
    trainer.train_from_iterator([text], vocab_size=257, min_frequency=1, show_progress=False)  # no merges
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=trainer._tokenizer)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    pieces = [TokenText(tokenizer)(token) for token in ids]
    assert b"".join(bytes(raw) for _, raw in pieces) == text.encode()
    assert any(piece == "\ufffd" for piece, _ in pieces)  # some token is part of a character
