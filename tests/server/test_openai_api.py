"""The OpenAI surface through a real uvicorn server: the official client, streaming, bad input, metrics."""

from __future__ import annotations

import json

import httpx
import pytest
from openai import OpenAI

from tests.server.conftest import PROMPTS, metric

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


def client(url: str, key: str = "unused") -> OpenAI:
    return OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=30)


def test_openai_client_chat_and_stream(shared_server):
    api = client(shared_server.url)
    messages = [{"role": "user", "content": PROMPTS[0]}]
    reply = api.chat.completions.create(model="specops", messages=messages, max_tokens=24, temperature=0)
    chunks = list(api.chat.completions.create(model="specops", messages=messages, max_tokens=24, temperature=0,
                                              stream=True, stream_options={"include_usage": True}))

    choice = reply.choices[0]
    assert choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason in ("stop", "length")
    usage = reply.usage
    assert usage.completion_tokens == 24 or choice.finish_reason == "stop"
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    extra = usage.model_extra
    assert extra["drafted"] >= extra["accepted"] >= 0 and extra["mean_accepted_length"] >= 1.0
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == choice.message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == choice.finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == usage.completion_tokens


def test_openai_client_legacy_completions_and_models(shared_server):
    api = client(shared_server.url)
    reply = api.completions.create(model="specops", prompt=PROMPTS[1], max_tokens=12, temperature=0)
    streamed = "".join(c.choices[0].text for c in api.completions.create(
        model="specops", prompt=PROMPTS[1], max_tokens=12, temperature=0, stream=True))

    assert reply.object == "text_completion" and reply.choices[0].text == streamed
    models = api.models.list().data
    assert [m.id for m in models] == ["specops"]
    assert models[0].model_extra["drafter"] == "recycling"
    assert api.models.retrieve("specops").id == "specops"


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
def test_streamed_text_equals_non_streamed_for_greedy(shared_server, path):
    for prompt in PROMPTS[:4]:
        body = ({"messages": [{"role": "user", "content": prompt}]} if path == CHAT else {"prompt": prompt})
        body.update(max_tokens=40, temperature=0)
        whole = httpx.post(shared_server.url + path, json=body, timeout=30).json()
        deltas = []
        with httpx.stream("POST", shared_server.url + path, json={**body, "stream": True}, timeout=30) as response:
            assert response.headers["content-type"].startswith("text/event-stream")
            lines = [line for line in response.iter_lines() if line]
        assert lines[-1] == "data: [DONE]"
        for line in lines[:-1]:
            choice = json.loads(line.removeprefix("data: "))["choices"][0]
            deltas.append(choice["delta"].get("content", "") if path == CHAT else choice["text"])
        text = whole["choices"][0]["message"]["content"] if path == CHAT else whole["choices"][0]["text"]
        assert "".join(deltas) == text


def test_stop_strings_cut_the_text_in_both_modes(shared_server):
    body = {"messages": [{"role": "user", "content": PROMPTS[0]}], "max_tokens": 30, "temperature": 0}
    full = httpx.post(shared_server.url + CHAT, json=body, timeout=30).json()["choices"][0]["message"]["content"]
    words = full.split()
    assert len(words) > 5, full
    stop = f" {words[3]} "  # spans several tokens; the spaces keep w8 from matching inside w88
    expected = full[:full.index(stop)]
    cut = httpx.post(shared_server.url + CHAT, json={**body, "stop": [stop, "never-seen"]}, timeout=30).json()
    streamed = list(client(shared_server.url).chat.completions.create(model="specops", stream=True, stop=stop, **body))

    assert cut["choices"][0]["message"]["content"] == expected
    assert cut["choices"][0]["finish_reason"] == "stop"
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == expected


def _error(response: httpx.Response) -> dict:
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    return error


LONG_PROMPT = " ".join(f"w{i % 80}" for i in range(300))  # the tiny target's context is 256 tokens
BAD_REQUESTS = [
    (COMPLETIONS, b'{"prompt": "w1",', 400, None),  # malformed JSON
    (COMPLETIONS, b"[1, 2]", 400, None),  # not an object
    (COMPLETIONS, {}, 400, "prompt"),  # missing prompt
    (COMPLETIONS, {"prompt": ""}, 400, "prompt"),
    (COMPLETIONS, {"prompt": "   "}, 400, "prompt"),
    (COMPLETIONS, {"prompt": []}, 400, "prompt"),
    (COMPLETIONS, {"prompt": [1, 500]}, 400, "prompt"),  # token id outside the vocabulary
    (COMPLETIONS, {"prompt": 5}, 400, "prompt"),  # wrong type
    (COMPLETIONS, {"prompt": "w1", "max_tokens": "10"}, 400, "max_tokens"),
    (COMPLETIONS, {"prompt": "w1", "max_tokens": True}, 400, "max_tokens"),
    (COMPLETIONS, {"prompt": "w1", "temperature": "hot"}, 400, "temperature"),
    (COMPLETIONS, {"prompt": "w1", "max_tokens": 0}, 400, "max_tokens"),
    (COMPLETIONS, {"prompt": "w1", "max_tokens": -3}, 400, "max_tokens"),
    (COMPLETIONS, {"prompt": "w1", "max_tokens": 1000}, 400, "max_tokens"),  # past the context
    (COMPLETIONS, {"prompt": "w1", "temperature": -0.5}, 400, "temperature"),
    (COMPLETIONS, {"prompt": "w1", "top_p": 0}, 400, "top_p"),
    (COMPLETIONS, {"prompt": "w1", "top_p": 1.5}, 400, "top_p"),
    (COMPLETIONS, {"prompt": "w1", "n": 0}, 400, "n"),
    (COMPLETIONS, {"prompt": "w1", "n": 17}, 400, "n"),  # over MAX_N
    (COMPLETIONS, {"prompt": "w1", "presence_penalty": 0.5}, 400, "presence_penalty"),
    (COMPLETIONS, {"prompt": "w1", "logit_bias": {"5": 10}}, 400, "logit_bias"),
    (COMPLETIONS, {"prompt": "w1", "seed": 2**70}, 400, "seed"),
    (COMPLETIONS, {"prompt": "w1", "stop": ["a", "b", "c", "d", "e"]}, 400, "stop"),
    (COMPLETIONS, {"prompt": "w1", "logprobs": 6}, 400, "logprobs"),  # over OpenAI's 5
    (COMPLETIONS, {"prompt": "w1", "echo": "yes"}, 400, "echo"),
    (CHAT, {"messages": [{"role": "user", "content": "w1"}], "top_logprobs": 2}, 400, "top_logprobs"),
    (CHAT, {"messages": [{"role": "user", "content": "w1"}], "logprobs": True, "top_logprobs": 21}, 400,
     "top_logprobs"),
    (COMPLETIONS, {"prompt": "w1", "suffix": "w2"}, 400, "suffix"),  # asked for, not implemented
    (CHAT, {"messages": [{"role": "user", "content": "w1"}], "response_format": {"type": "json_object"}}, 400,
     "response_format"),
    (CHAT, {"messages": [{"role": "user", "content": "w1"}], "tools": [{"type": "function"}]}, 400, "tools"),
    (COMPLETIONS, {"prompt": "w1", "model": "gpt-4o"}, 404, "model"),
    (COMPLETIONS, {"prompt": LONG_PROMPT}, 400, "prompt"),
    (CHAT, {"messages": []}, 400, "messages"),
    (CHAT, {}, 400, "messages"),
    (CHAT, {"messages": "w1"}, 400, "messages"),
    (CHAT, {"messages": [{"role": "user", "content": ""}]}, 400, "messages"),
    (CHAT, {"messages": [{"role": "wizard", "content": "w1"}]}, 400, "messages"),
    (CHAT, {"messages": [{"role": "user", "content": "w1", "mood": "x"}]}, 400, "messages"),
    (CHAT, {"messages": [{"role": "user", "content": "w1"}], "temperature": 3}, 400, "temperature"),
    (CHAT, {"messages": [{"role": "user", "content": LONG_PROMPT}]}, 400, "messages"),
    (CHAT, {"messages": [{"role": "user", "content": "w1"}], "max_tokens": 255}, 400, "max_tokens"),
]


@pytest.mark.parametrize(("path", "body", "status", "param"), BAD_REQUESTS,
                         ids=[f"{p.rsplit('/', 1)[-1]}-{i}" for i, (p, *_) in enumerate(BAD_REQUESTS)])
def test_bad_input_is_an_openai_4xx(shared_server, path, body, status, param):
    kwargs = {"content": body, "headers": {"content-type": "application/json"}} if isinstance(body, bytes) else \
        {"json": body}
    response = httpx.post(shared_server.url + path, timeout=30, **kwargs)
    assert response.status_code == status, response.text
    assert _error(response)["param"] == param


def test_oversized_body_is_413_with_or_without_content_length(shared_server):
    limit = shared_server.config.max_body_bytes
    body = json.dumps({"prompt": "w1 " * (limit // 3 + 10)}).encode()
    declared = httpx.post(shared_server.url + COMPLETIONS, content=body, headers={"content-type": "application/json"})

    def chunks():
        for start in range(0, len(body), 65536):
            yield body[start:start + 65536]

    chunked = httpx.post(shared_server.url + COMPLETIONS, content=chunks(), headers={"content-type": "application/json"})
    assert declared.status_code == chunked.status_code == 413
    assert _error(declared)["code"] == _error(chunked)["code"] == "body_too_large"


def test_unknown_routes_and_methods_use_the_error_shape(shared_server):
    assert httpx.get(shared_server.url + "/v1/nothing").status_code == 404
    assert _error(httpx.get(shared_server.url + "/v1/nothing"))["type"] == "not_found_error"
    assert _error(httpx.get(shared_server.url + COMPLETIONS))["message"]  # 405
    assert httpx.get(shared_server.url + "/v1/models/gpt-4o").status_code == 404


def test_bad_input_never_counts_as_a_server_error(shared_server):
    before = metric(httpx.get(shared_server.url + "/metrics").text, "specops_requests_total", 'status="400"')
    bodies = [body for _path, body, status, _param in BAD_REQUESTS if status == 400 and isinstance(body, dict)]
    for body in bodies:
        httpx.post(shared_server.url + COMPLETIONS, json=body, timeout=30)
    metrics = httpx.get(shared_server.url + "/metrics").text
    assert metric(metrics, "specops_requests_total", 'status="400"') == before + len(bodies)
    assert metric(metrics, "specops_requests_total", 'status="500"') == 0


def test_health_ready_and_metrics(shared_server):
    httpx.post(shared_server.url + CHAT, json={"messages": [{"role": "user", "content": PROMPTS[2]}],
                                               "max_tokens": 16, "temperature": 0}, timeout=30)
    assert httpx.get(shared_server.url + "/health").json() == {"status": "ok"}
    assert httpx.get(shared_server.url + "/ready").json()["status"] == "ready"
    text = httpx.get(shared_server.url + "/metrics").text
    assert metric(text, "specops_requests_total", 'status="200"') >= 1
    assert metric(text, "specops_generated_tokens_total") >= 16
    assert metric(text, "specops_drafted_tokens_total") >= metric(text, "specops_accepted_tokens_total") > 0
    assert metric(text, "specops_accepted_per_position_total", 'position="0"') > 0
    assert metric(text, "specops_request_latency_seconds_count") >= 1
    assert metric(text, "specops_time_to_first_token_seconds_count") >= 1
    assert "specops_queue_depth 0.0" in text
    assert metric(text, "specops_bundle_info", 'drafter="recycling",model_version="none",version="none"') == 1


def test_unknown_fields_are_ignored_and_logged_once(shared_server, caplog):
    """Agent frameworks send fields of their own: accepted (as vLLM does), each named once in the log; the
    official client's extra_body reaches the server the same way."""
    body = {"messages": [{"role": "user", "content": "w1 w2"}], "max_tokens": 2, "temperature": 0,
            "specops_test_tag": "x", "logprobs": False, "tools": []}
    with caplog.at_level("WARNING", logger="specops.server.protocol"):
        for _ in range(2):
            response = httpx.post(shared_server.url + CHAT, json=body, timeout=30)
            assert response.status_code == 200, response.text
        reply = client(shared_server.url).chat.completions.create(
            model="specops", messages=[{"role": "user", "content": "w1 w2"}], max_tokens=2, temperature=0,
            extra_body={"specops_test_tag": "x"})
    assert reply.choices[0].message.content == response.json()["choices"][0]["message"]["content"]
    assert sum("specops_test_tag" in record.getMessage() for record in caplog.records) == 1
