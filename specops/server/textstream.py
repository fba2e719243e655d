"""Token ids in, text deltas out, with OpenAI stop strings.

Streaming and non-streaming responses both concatenate these deltas, so the two give the same text
by construction.
"""

from __future__ import annotations

from collections.abc import Sequence

from transformers import PreTrainedTokenizerBase

REPLACEMENT = "\ufffd"  # what a byte-level BPE decodes a partial UTF-8 character to


class TextStream:
    """Incremental detokenizer. A delta never contains text that may still change: a trailing
    partial character, or a tail that could be the start of a stop string. The first stop string
    found ends the text before it (the stop string itself is not returned, as in OpenAI's API)."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, stop: Sequence[str] = ()) -> None:
        self._tokenizer = tokenizer
        self._stop = [s for s in stop if s]
        self._ids: list[int] = []
        self._sent = 0  # characters of the decoded text already returned
        self.stopped = False
        self.stop_tokens: int | None = None  # once stopped: how many tokens it took to complete the stop string

    def push(self, ids: Sequence[int]) -> str:
        """Add newly committed tokens; return the text that is now final."""
        if self.stopped:
            return ""
        before = len(self._ids)
        self._ids.extend(ids)
        text = self._decode()
        hits = [i for i in (text.find(s) for s in self._stop) if i >= 0]
        if hits:
            self.stopped = True
            # The stop string was not in the text before these tokens: one of them completed it.
            self.stop_tokens = next((m for m in range(before + 1, len(self._ids) + 1) if self._has_stop(m)),
                                    len(self._ids))
            return self._advance(text, min(hits))
        safe = len(text.rstrip(REPLACEMENT))
        return self._advance(text, safe - self._stop_prefix(text[:safe]))

    def finish(self) -> str:
        """The held-back rest once generation has ended."""
        if self.stopped:
            return ""
        text = self._decode()
        return self._advance(text, len(text))

    def _has_stop(self, tokens: int) -> bool:
        text = self._tokenizer.decode(self._ids[:tokens], skip_special_tokens=True)
        return any(s in text for s in self._stop)

    def _decode(self) -> str:
        # Decoding the whole output each step keeps merges across token boundaries right; outputs are
        # at most a few thousand tokens, so this costs far less than a target forward pass.
        return self._tokenizer.decode(self._ids, skip_special_tokens=True)

    def _stop_prefix(self, text: str) -> int:
        """Length of the longest tail of `text` that is a proper prefix of a stop string."""
        return max((k for s in self._stop for k in range(min(len(s) - 1, len(text)), 0, -1)
                    if text.endswith(s[:k])), default=0)

    def _advance(self, text: str, end: int) -> str:
        delta = text[self._sent:end] if end > self._sent else ""
        self._sent = max(self._sent, end)
        return delta
