"""OpenAI's two logprobs shapes (chat's `content` list, completions' parallel lists) from the loop's
TokenLogprob entries, with each token's text and bytes as the tokenizer spells it."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from transformers import PreTrainedTokenizerBase
from transformers.convert_slow_tokenizer import bytes_to_unicode

from specops.core.types import TokenLogprob


class TokenText:
    """A token's text and UTF-8 bytes. A byte-level BPE token can be part of a character: its bytes are
    then exact and its text has U+FFFD where the partial character is, as in OpenAI's responses."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self._tokenizer = tokenizer
        self._bytes_of = {char: byte for byte, char in bytes_to_unicode().items()} if _byte_level(tokenizer) else None
        self._cache: dict[int, tuple[str, list[int]]] = {}

    def __call__(self, token: int) -> tuple[str, list[int]]:
        if token not in self._cache:
            piece = self._tokenizer.convert_ids_to_tokens(token)
            if self._bytes_of is not None and isinstance(piece, str) and all(c in self._bytes_of for c in piece):
                raw = bytes(self._bytes_of[c] for c in piece)
            else:
                raw = self._tokenizer.decode([token]).encode("utf-8")
            self._cache[token] = (raw.decode("utf-8", errors="replace"), list(raw))
        return self._cache[token]


def _byte_level(tokenizer: PreTrainedTokenizerBase) -> bool:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return False
    decoder = json.loads(backend.to_str()).get("decoder") or {}
    return decoder.get("type") == "ByteLevel"


def chat_logprobs(entries: Sequence[TokenLogprob], text_of: TokenText) -> dict[str, Any]:
    """Chat's shape: {"content": [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}]}."""
    def item(token: int, logprob: float | None) -> dict[str, Any]:
        text, raw = text_of(token)
        return {"token": text, "logprob": logprob, "bytes": raw}

    return {"content": [{**item(e.token, e.logprob), "top_logprobs": [item(t, lp) for t, lp in e.top]}
                        for e in entries], "refusal": None}


def completion_logprobs(entries: Sequence[TokenLogprob], text_of: TokenText, offset: int = 0) -> dict[str, Any]:
    """The completions shape: parallel lists of token texts, their logprobs, {text: logprob} of the most likely
    tokens, and each token's character offset in the choice's text (`offset`: where these entries start)."""
    tokens, offsets = [], []
    for entry in entries:
        text = text_of(entry.token)[0]
        tokens.append(text)
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [{text_of(t)[0]: lp for t, lp in e.top} if e.logprob is not None else None
                             for e in entries],
            "text_offset": offsets}
