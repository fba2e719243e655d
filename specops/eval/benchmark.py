"""Side-by-side benchmark: HF generate baselines and our drafters, same prompts, same process.

Methods run interleaved prompt by prompt, so a change in machine load hits all of them alike and
the speed ratios stay meaningful. The order rotates by one method per prompt, so no method always runs
in the same place (after the same neighbour, first or last). (Prompted by two quiet evaluate runs where
the champion, run last, was 8% faster than the same method and weights run mid-list; rotated, a third
run still had it 3% faster and a fourth equal, so position was not the whole cause.) Each method gets
one untimed warm-up generation first.

Two speedups per method: `speedup_vs_ar`, total tokens over total time against the baseline's, and
`speedup_median`, the median over prompts of each prompt's own ratio. A burst of load from another job
that slows a few prompts' runs weighs in the first by those runs' seconds (one slowed baseline run can
move it by several x); the second moves only if it hits half the prompts, so the promotion gate
compares that one.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from importlib import metadata
from typing import Any

import torch
from tqdm import tqdm

from specops.core.loop import PrefillCache, SpeculativeGenerator
from specops.core.policies import HEAD_POLICIES
from specops.core.target import Target, encode_prompt
from specops.core.types import DEFAULT_PREFILL_CHUNK, GenerationStats
from specops.drafters.factory import build_drafter, build_policy
from specops.drafters.kinds import DEFAULT_DRAFT_TOKENS, DecodingConfig, MethodSpec

# A method maps prompt ids to (new token ids, our loop's stats or None for HF generate).
Method = Callable[[list[int]], tuple[list[int], GenerationStats | None]]
BASELINE = "hf_ar"
PLAIN = "plain"  # our plain decoding through the same runtime: the reference every method must equal bitwise


@dataclass
class BenchConfig:
    dataset: str = "humaneval"  # humaneval | sharegpt | path to a JSONL file of {"prompt"} or {"messages"} rows
    n: int = 20  # number of prompts
    max_new_tokens: int = 128
    max_prompt_tokens: int = 1024  # longer prompts are skipped (ShareGPT has some very long ones)
    # Our methods: a drafter kind, optionally "+policy" (a draft length policy of specops/core/policies.py, for
    # chain drafters) and "@size" (Token Recycling tree nodes, or chain draft tokens: the policy's k or bound);
    # several sizes or policies of one kind make a sweep in the same run.
    # Our plain decoding (the `plain` method) always runs, so "none" here would only run it twice.
    drafters: list[str] = field(default_factory=lambda: ["prompt-lookup", "recycling"])
    draft_tokens: int = DEFAULT_DRAFT_TOKENS  # chain draft length when a method gives no @size; the depth limit of tree methods
    draft_model: str | None = None  # HF folder of a draft LM: needed by draft-lm
    aligned_head: str | None = None  # aligned head folder (models/aligned_head): needed by aligned_head[_tree]
    exit_heads: str | None = None  # exit heads folder (models/exit_heads): needed by del (del@L fixes exit layer L)
    specialists: str | None = None  # CoSine's specialists folder (models/specialists): needed by cosine[-tree]
    acceptance_head: str | None = None  # folder of an acceptance head for the draft LM: needed by +specdecpp and +goodput_head
    stop_threshold: float | None = None  # +specdecpp's stop threshold; None keeps DecodingConfig's
    hf_assisted: bool = True  # with a draft model, also run HF assisted generation with it
    static_width: int = 0  # our methods on the static runtime with passes this wide (DecodingConfig.static_width)
    compiled: bool = False  # the static runtime's passes through torch.compile (DecodingConfig.compiled)
    prefill_chunk: int = DEFAULT_PREFILL_CHUNK  # prompt tokens per prefill pass (DecodingConfig.prefill_chunk)
    hf_prompt_lookup_tokens: int = 10  # HF's documented default for prompt_lookup_num_tokens; 0 skips that baseline
    hf_greedy: bool = True  # False skips HF greedy (long prompts: its prefill alone takes minutes); then no speedup_vs_ar
    # Our generators reuse the prompt's prefill, computed by the first of them to run on it (the order
    # rotates), so a long prompt is prefilled once, not once per method (specops.core.loop.PrefillCache;
    # static runtime only). Only that one's wall time includes a prefill: compare methods by
    # decode_tokens_per_s (end-to-end speedups are then left out, except HF greedy's own).
    share_prefill: bool = False
    # The untimed warm-up generation's prompt: the first prompt's first N tokens; 0: all of it but its first
    # token, so a compiled runtime meets the timed prompts' cache length before the timing (not in the
    # first method's first prompt), and a shared prefill is not the timed prompt's.
    warmup_tokens: int = 32


def _hf_method(target: Target, max_new_tokens: int, **kwargs: Any) -> Method:
    def run(ids: list[int]) -> tuple[list[int], GenerationStats | None]:
        inputs = torch.tensor([ids])
        out = target.model.generate(inputs, attention_mask=torch.ones_like(inputs), max_new_tokens=max_new_tokens,
                                    do_sample=False, **kwargs)
        return out[0, len(ids):].tolist(), None
    return run


def _our_method(generator: SpeculativeGenerator, max_new_tokens: int) -> Method:
    def run(ids: list[int]) -> tuple[list[int], GenerationStats | None]:
        result = generator.generate(ids, max_new_tokens)
        return result.token_ids, result.stats
    run.generator = generator  # type: ignore[attr-defined]  # for variants of the same method (benchmarks/packed_linear.py)
    return run


def build_methods(target: Target, cfg: BenchConfig,
                  extra: dict[str, SpeculativeGenerator] | None = None) -> dict[str, Method]:
    """HF baselines, then our methods; `extra` adds ready-made generators (e.g. the current champion)."""
    from specops.drafters.draft_lm import load_draft_model

    m = cfg.max_new_tokens
    shared = PrefillCache() if cfg.share_prefill else None
    methods: dict[str, Method] = {BASELINE: _hf_method(target, m)} if cfg.hf_greedy else {}
    methods[PLAIN] = _our_method(SpeculativeGenerator(target, None, "greedy", 0, static_width=cfg.static_width,
                                                      compiled=cfg.compiled, prefill_chunk=cfg.prefill_chunk,
                                                      prefill_cache=shared), m)
    if cfg.hf_prompt_lookup_tokens:
        methods["hf_prompt_lookup"] = _hf_method(target, m, prompt_lookup_num_tokens=cfg.hf_prompt_lookup_tokens)
    if cfg.draft_model and cfg.hf_assisted:
        methods["hf_assisted"] = _hf_method(target, m, assistant_model=load_draft_model(cfg.draft_model, target.model.dtype))
    for spec in cfg.drafters:
        method = MethodSpec.parse(spec)
        # replace() re-checks the config: trees are refused on the static runtime here, before any model loads.
        config = method.decoding(DecodingConfig(drafter="none", verifier="greedy", draft_tokens=cfg.draft_tokens,
                                                static_width=cfg.static_width, compiled=cfg.compiled,
                                                prefill_chunk=cfg.prefill_chunk))
        if cfg.stop_threshold is not None:
            config.stop_threshold = cfg.stop_threshold
        head = cfg.acceptance_head if config.policy in HEAD_POLICIES else None
        weights = method.drafter.weights_from(cfg.draft_model, cfg.aligned_head, cfg.exit_heads, cfg.specialists)
        drafter = build_drafter(method.kind, target, config, weights, head)
        policy = build_policy(config, target, drafter)
        generator = SpeculativeGenerator(target, drafter, "greedy", config.draft_tokens, policy, config.static_width,
                                         config.compiled, config.prefill_chunk, prefill_cache=shared)
        methods[spec] = _our_method(generator, m)
    for name, generator in (extra or {}).items():
        methods[name] = _our_method(generator, m)
    return methods


def environment() -> dict[str, Any]:
    versions = {}
    for package in ("torch", "transformers", "specops"):
        try:
            versions[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            versions[package] = None
    return {"platform": platform.platform(), "processor": platform.processor(), "cpu_count": os.cpu_count(),
            "torch_threads": torch.get_num_threads(), "python": platform.python_version(), "versions": versions}


def merge_stats(into: GenerationStats, stats: GenerationStats) -> None:
    """Add one generation's counters to a running total (per-position lists padded as needed)."""
    for name in ("steps", "drafted", "accepted", "bonus", "new_tokens", "prefill_s", "draft_s", "verify_s", "total_s"):
        setattr(into, name, getattr(into, name) + getattr(stats, name))
    for attr in ("accepted_per_position", "drafted_per_position"):
        total, extra = getattr(into, attr), getattr(stats, attr)
        total.extend([0] * (len(extra) - len(total)))
        for i, count in enumerate(extra):
            total[i] += count


def acceptance_per_position(stats: GenerationStats) -> list[float]:
    """[i]: of the steps that drafted a token at depth i+1, the fraction that accepted one there."""
    accepted = stats.accepted_per_position + [0] * (len(stats.drafted_per_position) - len(stats.accepted_per_position))
    return [round(a / d, 4) for a, d in zip(accepted, stats.drafted_per_position, strict=True)]


def run_benchmark(target: Target, prompts: list[list[dict[str, str]]], cfg: BenchConfig,
                  extra: dict[str, SpeculativeGenerator] | None = None, compare: Target | None = None) -> dict[str, Any]:
    return run_benchmark_ids(target, [encode_prompt(target.tokenizer, p) for p in prompts], cfg, extra, compare)


def memory_bandwidth_gb_s(megabytes: int = 256, repeats: int = 5) -> float:
    """One thread reading `megabytes` of float32 (numpy sum), best of `repeats`: the bound a one-token
    pass cannot beat, since it must stream every weight once."""
    import numpy as np

    data = np.ones(megabytes * (1 << 20) // 4, dtype=np.float32)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        data.sum()
        best = min(best, time.perf_counter() - start)
    return data.nbytes / best / 1e9


def physical_bound(target: Target) -> dict[str, float]:
    """The fastest possible plain decoding: the target's weight bytes over the measured memory bandwidth."""
    weight_bytes = sum(p.numel() * p.element_size() for p in target.model.parameters())
    bandwidth = memory_bandwidth_gb_s()
    return {"weight_bytes": weight_bytes, "bandwidth_gb_s": round(bandwidth, 2),
            "bound_tokens_per_s": round(bandwidth * 1e9 / weight_bytes, 2)}


def run_benchmark_ids(target: Target, prompts: list[list[int]], cfg: BenchConfig,
                      extra: dict[str, SpeculativeGenerator] | None = None,
                      compare: Target | None = None) -> dict[str, Any]:
    """run_benchmark on prompts that are token ids already (e.g. served requests from the feedback log).

    With `compare` (the same target in another dtype), HF greedy and our plain decoding also run on it,
    interleaved with the rest, as `hf_ar[DTYPE]` and `plain[DTYPE]`; speedups are always against HF
    greedy in the method's own dtype, and exactness against our plain decoding in it."""
    encoded = [ids for ids in prompts if len(ids) <= cfg.max_prompt_tokens]
    if not encoded:
        raise ValueError(f"Every prompt is longer than max_prompt_tokens={cfg.max_prompt_tokens}.")
    methods = build_methods(target, cfg, extra)
    suffix = {name: "" for name in methods}  # names the baseline and plain decoding each method is judged by
    if compare is not None:
        tag = f"[{str(compare.model.dtype).removeprefix('torch.')}]"
        plain_cfg = replace(cfg, drafters=[], hf_prompt_lookup_tokens=0, hf_assisted=False)
        for name, run in build_methods(compare, plain_cfg).items():
            methods[name + tag] = run
            suffix[name + tag] = tag
    with torch.inference_mode():
        for run in methods.values():
            run(encoded[0][:cfg.warmup_tokens] if cfg.warmup_tokens else encoded[0][1:] or encoded[0])  # allocator, kernels, imports
    totals = {name: {"tokens": 0, "seconds": 0.0, "identical": 0, "identical_plain": 0} for name in methods}
    merged: dict[str, GenerationStats] = {name: GenerationStats() for name in methods}
    per_prompt: list[dict[str, Any]] = []
    names = list(methods)
    for index, ids in enumerate(tqdm(encoded, desc="bench prompts", unit="prompt")):
        outputs: dict[str, list[int]] = {}
        order = rotated(names, index)
        row: dict[str, Any] = {"prompt_tokens": len(ids), "order": order}
        for name in order:  # interleaved: every method on this prompt before the next one
            run = methods[name]
            start = time.perf_counter()
            with torch.inference_mode():
                tokens, stats = run(ids)
            seconds = time.perf_counter() - start
            outputs[name] = tokens
            total = totals[name]
            total["tokens"] += len(tokens)
            total["seconds"] += seconds
            if stats is not None:
                merge_stats(merged[name], stats)
            row[name] = {"tokens": len(tokens), "seconds": round(seconds, 4)}
            if stats is not None:  # per request: how a drafter that learns from traffic improves over a stream
                row[name].update(steps=stats.steps, accepted=stats.accepted, prefill_s=round(stats.prefill_s, 4),
                                 draft_kv_bytes=stats.draft_kv_bytes)
        for name, tokens in outputs.items():
            reference = outputs.get(BASELINE + suffix[name])
            same_ar, same_plain = tokens == reference, tokens == outputs[PLAIN + suffix[name]]
            totals[name]["identical"] += int(same_ar)
            totals[name]["identical_plain"] += int(same_plain)
            row[name].update(identical=same_ar, identical_to_plain=same_plain)
        per_prompt.append(row)
    results = {}
    for name, total in totals.items():
        tps = total["tokens"] / total["seconds"]
        base = totals.get(BASELINE + suffix[name])
        stats = merged[name]
        # Without a shared prefill every method's wall time includes its own; with one, only the first's on
        # each prompt, which rotates, so no end-to-end ratio but HF greedy's (its own prefill) is fair.
        walled = base is not None and (not cfg.share_prefill or name == BASELINE + suffix[name])
        results[name] = {
            "tokens_per_s": round(tps, 3),
            # HF greedy in the same dtype, end to end (prefill included)
            "speedup_vs_ar": round(tps / (base["tokens"] / base["seconds"]), 4) if walled else None,
            "speedup_median": round(median_speedup(per_prompt, name, BASELINE + suffix[name]), 4) if walled else None,
            # decoding alone (after the target's prefill, which `prefill_s` is): None for HF generate
            "decode_tokens_per_s": round(total["tokens"] / (total["seconds"] - stats.prefill_s), 3) if stats.steps else None,
            "prefill_s": round(stats.prefill_s, 3) if stats.steps else None,
            "mean_accepted_length": round(stats.mean_accepted_length, 4) if stats.steps else None,
            "acceptance_rate": round(stats.acceptance_rate, 4) if stats.steps else None,
            "acceptance_per_position": acceptance_per_position(stats),
            "draft_s": round(stats.draft_s, 3), "verify_s": round(stats.verify_s, 3),
            "identical_to_ar": total["identical"] == len(encoded) if base is not None else None,  # HF greedy's, same dtype
            "identical_to_plain": total["identical_plain"] == len(encoded),  # our plain decoding, same runtime
            "identical_prompts": total["identical"],
            "new_tokens": total["tokens"],
            "seconds": round(total["seconds"], 3),
        }
    for name, row in results.items():  # decoding against our plain decoding through the same runtime, same dtype
        plain = results[PLAIN + suffix[name]]["decode_tokens_per_s"]
        row["decode_speedup_vs_plain"] = round(row["decode_tokens_per_s"] / plain, 4) \
            if row["decode_tokens_per_s"] and plain else None
    return {"methods": results, "prompts": len(encoded), "config": asdict(cfg), "target": target.fingerprint.to_dict(),
            "dtype": str(target.model.dtype).removeprefix("torch."), "bound": physical_bound(target),
            "environment": environment(), "per_prompt": per_prompt,
            "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}


def rotated(names: list[str], by: int) -> list[str]:
    """`names` rotated left by `by` places: prompt i's run order."""
    shift = by % len(names)
    return names[shift:] + names[:shift]


def median_speedup(per_prompt: list[dict[str, Any]], name: str, base: str) -> float:
    """The median over prompts of method `name`'s tokens/s on that prompt over method `base`'s."""
    def rate(run: dict[str, Any]) -> float:
        return run["tokens"] / run["seconds"]

    return statistics.median(rate(row[name]) / rate(row[base]) for row in per_prompt)


def write_report(report: dict[str, Any], path: str) -> None:
    with open(path, "w") as handle:
        json.dump(report, handle, indent=2)
