"""The side-by-side benchmark on a tiny target: every method lossless, ratios against the HF baseline."""

from __future__ import annotations

from specops.eval.benchmark import BASELINE, BenchConfig, run_benchmark

PROMPTS = [[{"role": "user", "content": "w1 w2 w3 w1 w2 w3"}], [{"role": "user", "content": "w9 w8 w7"}]]


def test_benchmark_reports_every_method(target):
    cfg = BenchConfig(n=2, max_new_tokens=16, drafters=["none", "prompt-lookup", "recycling@4", "recycling@8"])
    report = run_benchmark(target, PROMPTS, cfg)
    methods = report["methods"]
    assert set(methods) == {BASELINE, "hf_prompt_lookup", "none", "prompt-lookup", "recycling@4", "recycling@8"}
    assert methods[BASELINE]["speedup_vs_ar"] == 1.0
    for name, row in methods.items():
        assert row["identical_to_ar"], name
        assert row["tokens_per_s"] > 0
    assert methods["none"]["mean_accepted_length"] == 1.0  # plain decoding: one token per target pass
    assert methods["none"]["acceptance_rate"] == 0.0
    assert report["prompts"] == 2 and len(report["per_prompt"]) == 2
