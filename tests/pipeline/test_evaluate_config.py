"""The evaluate stage's serving runtime: refused before any model loads when it cannot run a method, and
the bundle's default is the fastest method that is lossless on that runtime."""

from __future__ import annotations

import pytest

from specops.eval.evaluate import EvaluateConfig, default_method


@pytest.mark.parametrize(("overrides", "message"), [
    ({"methods": ["draft-lm@3", "recycling@8"], "dtype": "float32"}, r"evaluate.methods: recycling@8 drafts trees"),
    ({"methods": ["recycling@8"], "compiled": True}, r"evaluate.methods: recycling@8: .*drop compiled"),
    ({"methods": ["draft-lm@5"], "static_width": 5}, r"draft-lm@5 drafts 5 tokens, but passes of static_width 5"),
    ({"methods": ["prompt-lookup"], "draft_tokens": 6, "static_width": 4}, r"prompt-lookup drafts 6 tokens"),
    ({"dtype": "float16"}, r"evaluate.dtype 'float16' is unknown"),
    ({"static_width": 0, "compiled": True}, r"compiled runs the static runtime"),
])
def test_a_runtime_that_cannot_run_a_method_is_refused(overrides, message):
    with pytest.raises(ValueError, match=message):
        EvaluateConfig(**overrides)


def test_trees_run_on_the_dynamic_runtime_and_the_bf16_static_one():
    assert EvaluateConfig(methods=["recycling@8", "draft-lm-tree@8"], static_width=0, dtype="float32").methods
    assert EvaluateConfig(methods=["recycling@8", "draft-lm-tree@8"], static_width=5, draft_tokens=4).methods


def _row(speedup: float, plain: bool, ar: bool) -> dict:
    return {"speedup_median": speedup, "identical_to_plain": plain, "identical_to_ar": ar}


def test_the_default_is_the_fastest_method_lossless_on_its_own_runtime():
    # bf16 on the static runtime: HF greedy rounds differently, so no method equals it; lossless means
    # bitwise our plain decoding. A mutant that judged by identical_to_ar picks aligned_head@4, and one
    # that ignored losslessness the lossy 2.5x.
    methods = {"draft-lm@4": _row(1.9, plain=True, ar=False), "draft-lm@6": _row(2.5, plain=False, ar=False),
               "aligned_head@4": _row(1.7, plain=True, ar=True), "prompt-lookup@4": _row(3.0, plain=True, ar=False)}
    assert default_method(methods, ["draft-lm", "aligned_head"]) == "draft-lm@4"
    with pytest.raises(ValueError, match="no method of"):
        default_method(methods, ["hybrid"])
