"""The incremental detokenizer: deltas concatenate to the final text, stop strings cut it exactly."""

from __future__ import annotations

import pytest

from specops.server.textstream import TextStream


class CharTokenizer:
    """Token i decodes to chr(i); 0xFFFD stands for half of a two-token character completed by 1."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        text = "".join(chr(i) for i in ids)
        return text.replace("\ufffd\x01", "é")


def run(stop: list[str], text: str) -> tuple[list[str], TextStream]:
    stream = TextStream(CharTokenizer(), stop)  # type: ignore[arg-type]
    deltas = [stream.push([ord(c)]) for c in text]
    return deltas + [stream.finish()], stream


@pytest.mark.parametrize(("stop", "text", "expected"), [
    ([], "hello world", "hello world"),
    (["wor"], "hello world", "hello "),
    (["xyz", "lo w"], "hello world", "hel"),
    (["ll", "he"], "hello", ""),  # the earliest match wins
    (["wox"], "hello world", "hello world"),  # a held-back prefix that never completes is released
])
def test_deltas_concatenate_to_the_text_before_the_first_stop(stop, text, expected):
    deltas, stream = run(stop, text)
    assert "".join(deltas) == expected
    assert stream.stopped == (expected != text)


def test_a_possible_stop_prefix_is_held_back_until_it_is_decided():
    deltas, _ = run(["wor"], "hello wox")
    assert deltas[6:9] == ["", "", "wox"]  # "w" and "wo" could start "wor": released once "x" decides


def test_a_partial_character_is_never_emitted():
    stream = TextStream(CharTokenizer())  # type: ignore[arg-type]
    assert stream.push([ord("a"), 0xFFFD]) == "a"
    assert stream.push([1]) == "é"
    assert stream.finish() == ""
