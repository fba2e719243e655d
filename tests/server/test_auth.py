"""Bearer-token auth: every endpoint but /health needs the key when one is configured."""

from __future__ import annotations

import httpx
import openai
import pytest

from specops.server.config import ServerConfig
from tests.server.conftest import served
from tests.server.test_openai_api import client

KEY = "s3cret-key"
PROTECTED = [("GET", "/v1/models"), ("GET", "/ready"), ("GET", "/metrics"),
             ("POST", "/v1/completions"), ("POST", "/v1/chat/completions")]
BODIES = {"/v1/completions": {"prompt": "w1 w2", "max_tokens": 4},
          "/v1/chat/completions": {"messages": [{"role": "user", "content": "w1"}], "max_tokens": 4}}


def test_api_key_comes_from_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("SPECOPS_API_KEY", KEY)
    assert ServerConfig().api_key == KEY
    monkeypatch.delenv("SPECOPS_API_KEY")
    assert ServerConfig().api_key is None


def test_every_endpoint_but_health_needs_the_key(start_server, target):
    live = start_server(model=served(target), api_key=KEY, auth={"Authorization": f"Bearer {KEY}"})
    for method, path in PROTECTED:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
            response = httpx.request(method, live.url + path, headers=headers, json=BODIES.get(path))
            assert response.status_code == 401, (path, headers)
            assert response.json()["error"]["code"] == "invalid_api_key"
        ok = httpx.request(method, live.url + path, headers={"Authorization": f"Bearer {KEY}"}, json=BODIES.get(path),
                           timeout=30)
        assert ok.status_code == 200, (path, ok.text)
    assert httpx.get(live.url + "/health").status_code == 200
    # With a key the Host header is not checked: the key keeps a rebinding page out, whatever name it uses.
    assert httpx.get(live.url + "/v1/models", headers={"Authorization": f"Bearer {KEY}", "Host": "api.example"},
                     ).status_code == 200

    assert client(live.url, KEY).completions.create(model="specops", prompt="w1", max_tokens=3).choices[0].text
    with pytest.raises(openai.AuthenticationError):
        client(live.url, "wrong").models.list()
