"""The promotion gate refuses a lossy default beyond max_quality_drop; serving marks lossy output as lossy
and keeps lossless the default."""

from __future__ import annotations

import pytest

from specops.core.target import target_from_model
from specops.drafters.draft_lm import DraftLMDrafter
from specops.drafters.kinds import DecodingConfig
from specops.eval.gate import GateConfig, decide
from specops.lossy.modes import LossyModels
from specops.lossy.router import RouterLoadError
from specops.server.generator import TextGenerator
from tests.conftest import tiny_llama

POINT = {"threshold": 0.5, "speedup_vs_ar": 1.6, "speedup_vs_lossless": 1.2, "quality": 0.78, "quality_drop": 0.05,
         "scorer": "humaneval", "identical_to_ar": False, "identical_to_plain": False, "mean_accepted_length": 3.1, "lossy_accepted": 40}


def test_gate_refuses_a_lossy_default_that_loses_too_much_quality():
    from specops.eval.lossy_eval import gate_snapshot

    report = {"autojudge": [POINT, {**POINT, "threshold": 0.1, "quality_drop": 0.004}]}
    lenient = GateConfig(require_lossless=False, max_quality_drop=0.01)
    refused = decide(gate_snapshot(report, "autojudge", 0.5), None, lenient)
    assert not refused.passed and "quality_drop 0.0500 > max_quality_drop 0.0100" in refused.reason
    assert decide(gate_snapshot(report, "autojudge", 0.1), None, lenient).passed
    strict = decide(gate_snapshot(report, "autojudge", 0.1), None, GateConfig())  # the default gate: lossless only
    assert not strict.passed and "not lossless" in strict.reason
    with pytest.raises(KeyError, match="no autojudge point"):
        gate_snapshot(report, "autojudge", 0.3)


def make_text_generator(target, draft_model, router_dir, **overrides) -> TextGenerator:
    config = DecodingConfig(drafter="draft-lm", draft_tokens=3, router_dir=str(router_dir) if router_dir else None,
                            **overrides)
    return TextGenerator(target, DraftLMDrafter(draft_model, target.vocab_size), config)


def test_lossless_stays_the_default(target, draft_model, router_dir):
    reply = make_text_generator(target, draft_model, router_dir).generate_text("w20 w21", max_new_tokens=12)
    assert reply["stats"]["lossy"] is False and reply["stats"]["lossy_mode"] is None


def test_lossy_is_opt_in_per_request_and_says_so(target, draft_model, router_dir):
    text_generator = make_text_generator(target, draft_model, router_dir)
    lossless = text_generator.generate_text("w20 w21", max_new_tokens=12)
    for mode in ("autojudge", "arbitrage"):
        reply = text_generator.generate_text("w20 w21", max_new_tokens=12, lossy_mode=mode, lossy_threshold=0.0)
        assert reply["stats"]["lossy"] is True and reply["stats"]["lossy_mode"] == mode
        assert reply["stats"]["lossy_threshold"] == 0.0
        assert reply["token_ids"] == lossless["token_ids"]  # threshold 0 is lossless
        trained = text_generator.generate_text("w20 w21", max_new_tokens=12, lossy_mode=mode)
        assert trained["stats"]["lossy_threshold"] == 0.5  # the router's trained default


def test_serving_yaml_lossy_default_applies_to_greedy_requests_only(target, draft_model, router_dir):
    text_generator = make_text_generator(target, draft_model, router_dir, lossy_mode="arbitrage", lossy_threshold=0.9)
    assert text_generator.generate_text("w20", max_new_tokens=8)["stats"]["lossy_mode"] == "arbitrage"
    sampled = text_generator.generate_text("w20", max_new_tokens=8, temperature=0.8, seed=1)
    assert sampled["stats"]["lossy"] is False  # served losslessly, and says so
    off = text_generator.generate_text("w20", max_new_tokens=8, lossy_mode="off")
    assert off["stats"]["lossy"] is False


def test_lossy_config_errors_are_clear(target, draft_model, router_dir, tokenizer):
    with pytest.raises(ValueError, match="Unknown lossy_mode"):
        make_text_generator(target, draft_model, router_dir, lossy_mode="fast")
    with pytest.raises(ValueError, match="router_dir"):
        make_text_generator(target, draft_model, None, lossy_mode="autojudge")
    with pytest.raises(ValueError, match=">= 0"):
        make_text_generator(target, draft_model, router_dir).generate_text("w20", lossy_mode="autojudge",
                                                                            lossy_threshold=-0.1)
    other = target_from_model(tiny_llama(seed=7), tokenizer, name="other-target")
    with pytest.raises(RouterLoadError, match="another target"):
        LossyModels(other, draft_model, router_dir).generator("autojudge", 0.5)
