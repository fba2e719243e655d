"""Stage collect: the target regenerates the responses to the prompts and we record what it knew.

Self-distillation: a drafter is judged by how often the target accepts its tokens, so it should learn
the target's own outputs, not the human or GPT answers of a dataset. For each prompt the target
generates a response (greedy at temperature 0), and we keep, at every position of prompt + response,
the target's top-k next-token log-probabilities and the chosen hidden states. The format is described
in `specops.data.traces`.

Resumable: the prompts of a split are cut into fixed shards; each finished shard is renamed into
place and then recorded in the split's manifest, so a killed run loses at most the shard in progress
and a rerun skips every recorded shard whose checksum still matches. A run whose settings, target or
prompts differ from the manifest's, or whose manifest is unreadable, starts the split over. (Under
`dvc repro`, mark the traces output `persist: true`, or DVC deletes it before the stage runs.)

Backends are a plain dict. A backend turns prompts into `SequenceTrace`s and is free to batch them.
The transformers one regenerates in one of two ways:
- `generate_batch_size: 1` runs our speculative loop a sequence at a time, whose output is exactly the
  target's (greedy as `generate`, tests/core checks that; sampled with a per-prompt seed), then one
  forward pass over prompt + response scores it.
- `generate_batch_size: N > 1` runs HF `generate` greedily on N left-padded prompts at once and takes
  the scores from generate's own hidden states, with no second pass. At batch 1 a decoding step reads
  every weight for one token; at 32 it reads them once for 32 tokens: on this repo's 2-core CPU,
  SmolLM2-135M collects ~62 response tokens/s this way, while batch-1 greedy decoding alone runs at
  ~19 tokens/s before one at a time adds its scoring pass. Batched float
  arithmetic sums in another order, so a near-tie can flip a token: the responses are the target's
  greedy text up to such rare flips, which a training set tolerates and the evaluation never relies
  on (it decodes on its own, at batch 1).

`responses: dataset` is the cheaper alternative (EAGLE-1 and Medusa-1 trained this way): a prompt whose
source carries an answer (ShareGPT's first assistant turn, kept by prepare as `reply`) gets that answer
teacher-forced instead of regenerated, so one forward pass gives the target's distributions over it
(~110 response tokens/s here). The tokens are not the target's own, but the targets to learn (its
top-k next-token distributions) still are. Prompts without a reply are regenerated. On the same 338
quickstart prompts, a draft LM distilled from regenerated responses had its first draft token
accepted 32% of the time against 26% from teacher-forced ones (README).
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm
from transformers import PreTrainedModel

from specops.core.loop import SpeculativeGenerator
from specops.core.target import Target, encode_prompt
from specops.core.types import DEFAULT_DRAFT_TOKENS, SamplingParams
from specops.data.prompts import SPLITS, read_split
from specops.data.traces import (
    FORMAT,
    LOGPROB_DTYPES,
    VERSION,
    SequenceTrace,
    TraceError,
    check_shard,
    hf_hidden_index,
    read_manifest,
    resolve_layers,
    shard_name,
    write_manifest,
    write_shard,
)
from specops.drafters.recycling import RecyclingDrafter

log = logging.getLogger(__name__)

RESPONSES = ("regenerate", "dataset")


@dataclass(frozen=True)
class Prompt:
    id: str
    token_ids: list[int]
    reply_ids: list[int] | None = None
    """The source's own answer (ShareGPT), teacher-forced under `responses: dataset`; else None."""


@dataclass
class CollectConfig:
    """params.yaml section `collect`."""

    backend: str = "transformers"
    """Inference engine that regenerates and scores the responses; one of BACKENDS."""
    max_new_tokens: int = 256
    """Response length cap; generation also stops at the target's EOS and at its context length."""
    responses: str = "regenerate"
    """regenerate: the target writes every response (self-distillation). dataset: teacher-force the source's
    own answer where it has one (ShareGPT, HumanEval, user replies), ~2x cheaper on a CPU than batched
    regeneration, but not the target's own text; the others are regenerated."""
    temperature: float = 0.0
    """0 regenerates greedily; above 0 samples from softmax(logits / temperature), seeded per prompt."""
    generate_batch_size: int = 1
    """Prompts regenerated together. 1: our lossless loop, one prompt at a time (any temperature).
    N > 1: HF generate on N left-padded prompts at once, greedy only, several times the tokens/s on a CPU."""
    top_k_logits: int = 64
    """K: how many of the target's most likely next tokens (with log-probs) to keep per position."""
    logprobs_dtype: str = "float32"
    """Storage dtype of topk_logprobs: float32, or float16 to halve its size (~1e-3 relative error)."""
    hidden_layers: list[int] = field(default_factory=lambda: [-1])
    """Decoder layers whose outputs to store (fp16); -1 is the last. See specops.data.traces for the convention."""
    shard_size: int = 64
    """Sequences per shard: the most work a killed run can lose."""
    splits: list[str] = field(default_factory=lambda: ["train", "val"])
    """Which prompt splits to collect."""
    max_prompts_per_split: int | None = None
    """Use only the first N prompts of each split file (they are in hash order, a random sample); None = all."""
    seed: int = 0
    """Sampling seed when temperature > 0, mixed with each prompt's id so a resumed run samples the same."""
    out_dir: str = "data/traces"
    """Traces go to out_dir/{split}/."""

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"collect.backend '{self.backend}' is unknown. Available: {', '.join(BACKENDS)}.")
        if self.responses not in RESPONSES:
            raise ValueError(f"collect.responses must be one of {', '.join(RESPONSES)}, got '{self.responses}'.")
        if self.logprobs_dtype not in LOGPROB_DTYPES:
            raise ValueError(f"collect.logprobs_dtype must be one of {', '.join(LOGPROB_DTYPES)}, got '{self.logprobs_dtype}'.")
        unknown = sorted(set(self.splits) - set(SPLITS))
        if unknown:
            raise ValueError(f"collect.splits: unknown split(s) {', '.join(unknown)}; choose from {', '.join(SPLITS)}.")
        if self.temperature < 0 or min(self.max_new_tokens, self.top_k_logits, self.shard_size, self.generate_batch_size) < 1:
            raise ValueError("collect: temperature must be >= 0; max_new_tokens, top_k_logits, shard_size and "
                             "generate_batch_size >= 1.")
        if self.generate_batch_size > 1 and self.temperature > 0:
            raise ValueError(f"collect.generate_batch_size={self.generate_batch_size} regenerates greedily; with "
                             f"temperature {self.temperature} use generate_batch_size: 1 (per-prompt seeded sampling).")
        if self.max_prompts_per_split is not None and self.max_prompts_per_split < 0:
            raise ValueError(f"collect.max_prompts_per_split must be >= 0 or null, got {self.max_prompts_per_split}")


@torch.inference_mode()
def score(model: PreTrainedModel, prompt_id: str, prompt_ids: list[int], response: list[int], k: int,
          layers: list[int]) -> SequenceTrace:
    """One forward pass over prompt + response: top-k next-token log-probs and hidden states at every position."""
    ids = torch.tensor(prompt_ids + response)  # [T]
    out = model(input_ids=ids[None], output_hidden_states=bool(layers))
    hidden = [out.hidden_states[hf_hidden_index(i)][0] for i in layers]  # L x [T, H]
    return make_trace(prompt_id, ids, len(prompt_ids), out.logits[0], hidden, k)


def make_trace(prompt_id: str, ids: torch.Tensor, n_prompt: int, logits: torch.Tensor, hidden: list[torch.Tensor],
               k: int) -> SequenceTrace:
    """A trace from one sequence's logits [T, V] and its chosen layers' hidden states (L x [T, H])."""
    logprobs = logits.float().log_softmax(-1)  # [T, V], normalized over the full vocabulary
    top = logprobs.topk(k, dim=-1)  # values and indices [T, K], best first
    stacked = None
    if hidden:
        stacked = torch.stack(hidden, dim=1).to(torch.float16)  # [T, L, H]
        if not torch.isfinite(stacked).all():
            raise OverflowError(f"Hidden states of prompt {prompt_id} overflow float16; choose other hidden_layers.")
    return SequenceTrace(prompt_id=prompt_id, input_ids=ids, n_prompt=n_prompt, topk_ids=top.indices,
                         topk_logprobs=top.values, hidden_states=stacked)


def prompt_seed(seed: int, prompt_id: str) -> int:
    """A sampling seed that depends only on the run seed and the prompt, not on run order or resumption."""
    return seed ^ int(prompt_id[:15], 16)


def transformers_backend(target: Target, prompts: Iterable[Prompt], cfg: CollectConfig) -> Iterator[SequenceTrace]:
    """Teacher-force the dataset's replies (under `responses: dataset`) and regenerate the rest, in prompt order."""
    layers = resolve_layers(cfg.hidden_layers, target.model.config.num_hidden_layers)
    prompts = list(prompts)
    forced = {p.id for p in prompts if p.reply_ids is not None and cfg.responses == "dataset"}
    batched: dict[str, SequenceTrace] = {}
    if cfg.generate_batch_size > 1:
        batched = {trace.prompt_id: trace for trace in
                   generate_batched(target, [p for p in prompts if p.id not in forced], cfg, layers)}
    sampling = SamplingParams(temperature=cfg.temperature)
    # Our own lossless loop, one prompt at a time: Token Recycling drafts, the target verifies, so the
    # responses are exactly the target's (greedy, or sampled with a per-prompt seed) and faster.
    generator = SpeculativeGenerator(target, RecyclingDrafter(target.vocab_size),
                                     "greedy" if sampling.greedy else "rejection", draft_tokens=DEFAULT_DRAFT_TOKENS)
    for prompt in prompts:
        if prompt.id in batched:
            yield batched[prompt.id]
            continue
        response = prompt.reply_ids[:room(target, prompt, cfg)] if prompt.id in forced else generator.generate(
            prompt.token_ids, room(target, prompt, cfg), sampling, seed=prompt_seed(cfg.seed, prompt.id)).token_ids
        yield score(target.model, prompt.id, prompt.token_ids, response, cfg.top_k_logits, layers)


def room(target: Target, prompt: Prompt, cfg: CollectConfig) -> int:
    """How many response tokens fit: max_new_tokens, within the target's context."""
    return min(cfg.max_new_tokens, target.max_context - len(prompt.token_ids))


@torch.inference_mode()
def generate_batched(target: Target, prompts: list[Prompt], cfg: CollectConfig, layers: list[int]) -> Iterator[SequenceTrace]:
    """Greedy traces from HF generate, generate_batch_size left-padded prompts at a time.

    No second pass: the hidden states generate computes (prompt prefill, then one position per step)
    are the trace's, and the LM head over the final ones gives its log-probs. Prompts of similar length
    share a batch (less padding); a response ends at its first EOS, which it keeps."""
    pad = target.model.generation_config.pad_token_id
    pad = target.tokenizer.pad_token_id if pad is None else pad
    pad = next(iter(target.eos_token_ids), 0) if pad is None else pad
    final = target.model.config.num_hidden_layers  # hidden_states[final] is the normed output the LM head reads
    order = sorted(prompts, key=lambda prompt: len(prompt.token_ids))
    for start in range(0, len(order), cfg.generate_batch_size):
        batch = order[start:start + cfg.generate_batch_size]
        width = max(len(prompt.token_ids) for prompt in batch)
        ids = torch.full((len(batch), width), pad, dtype=torch.long)  # [B, W], left-padded
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for row, prompt in enumerate(batch):
            ids[row, width - len(prompt.token_ids):] = torch.tensor(prompt.token_ids)
            mask[row, width - len(prompt.token_ids):] = 1
        keep = min(room(target, prompt, cfg) for prompt in batch)
        # eos_token_id=None: all keep + 1 steps run even once every row has ended, so that each row's last
        # kept token (an EOS included) is fed back and has hidden states; until_eos cuts the rest.
        out = target.model.generate(input_ids=ids, attention_mask=mask, do_sample=False, pad_token_id=pad,
                                    max_new_tokens=keep + 1, eos_token_id=None, return_dict_in_generate=True,
                                    output_hidden_states=True)
        # out.hidden_states: per step, per layer (embeddings first) [B, W or 1, H]; joined: [B, W + steps - 1, H]
        joined = {i: torch.cat([step[i] for step in out.hidden_states], dim=1) for i in {final, *map(hf_hidden_index, layers)}}
        for row, prompt in enumerate(batch):
            response = until_eos(out.sequences[row, width:width + keep].tolist(), target.eos_token_ids)
            span = slice(width - len(prompt.token_ids), width + len(response))
            logits = target.model.get_output_embeddings()(joined[final][row, span])  # [T, V]
            hidden = [joined[hf_hidden_index(i)][row, span] for i in layers]
            yield make_trace(prompt.id, torch.tensor(prompt.token_ids + response), len(prompt.token_ids), logits, hidden,
                             cfg.top_k_logits)


def until_eos(tokens: list[int], eos: set[int]) -> list[int]:
    """The tokens up to and including the first EOS (a row of a batch generates on past its EOS)."""
    end = next((i for i, token in enumerate(tokens) if token in eos), None)
    return tokens if end is None else tokens[:end + 1]


Backend = Callable[[Target, Iterable[Prompt], CollectConfig], Iterator[SequenceTrace]]
BACKENDS: dict[str, Backend] = {"transformers": transformers_backend}


def reply_ids(target: Target, reply: str | None) -> list[int] | None:
    """A dataset answer as the assistant turn the chat template would close: its tokens, then the end-of-turn token."""
    if reply is None:
        return None
    end = target.tokenizer.eos_token_id
    return target.tokenizer(reply, add_special_tokens=False).input_ids + ([end] if end is not None else [])


def load_prompts(path: Path, target: Target, limit: int | None) -> tuple[list[Prompt], int]:
    """Token ids of a split's prompts (the first `limit`), and how many were dropped for leaving no room to generate."""
    prompts: list[Prompt] = []
    too_long = 0
    for row in read_split(path)[:limit]:
        ids = encode_prompt(target.tokenizer, row["messages"])
        if len(ids) < target.max_context:
            prompts.append(Prompt(row["id"], ids, reply_ids(target, row.get("reply"))))
        else:
            too_long += 1
    return prompts, too_long


def make_plan(cfg: CollectConfig, target: Target, prompts: list[Prompt]) -> dict[str, Any]:
    """Everything that decides the shards' contents; a manifest with another plan cannot be resumed."""
    ids = "".join(prompt.id for prompt in prompts)
    return {
        "format": FORMAT, "version": VERSION, "backend": cfg.backend, "responses": cfg.responses,
        "max_new_tokens": cfg.max_new_tokens,
        "generate_batch_size": cfg.generate_batch_size,
        "temperature": cfg.temperature, "seed": cfg.seed, "top_k": cfg.top_k_logits, "logprobs_dtype": cfg.logprobs_dtype,
        "hidden_layers": resolve_layers(cfg.hidden_layers, target.model.config.num_hidden_layers),
        "shard_size": cfg.shard_size, "n_prompts": len(prompts),
        "prompts_sha256": hashlib.sha256(ids.encode()).hexdigest(), "target": target.fingerprint.to_dict(),
    }


def shard_metadata(plan: dict[str, Any]) -> dict[str, str]:
    """The safetensors header: a shard explains itself without its manifest."""
    return {key: json.dumps(value) if not isinstance(value, str) else value
            for key, value in plan.items() if key not in ("shard_size", "n_prompts", "prompts_sha256")}


def resume_state(split_dir: Path, plan: dict[str, Any]) -> dict[str, Any]:
    """The manifest to continue from: the old one when its plan matches, else a fresh one (old shards removed)."""
    try:
        manifest = read_manifest(split_dir)
    except TraceError as error:  # without a manifest no shard can be checked, so none can be kept
        log.warning("collect: %s Starting %s over.", error, split_dir)
        manifest = None
    if manifest is not None and manifest["plan"] != plan:
        log.warning("collect: %s was made with other settings, target or prompts; starting it over.", split_dir)
        manifest = None
    if manifest is None:
        for stale in split_dir.glob("shard-*.safetensors*"):
            stale.unlink()
        n_shards = -(-plan["n_prompts"] // plan["shard_size"])
        manifest = {"plan": plan, "n_shards": n_shards, "shards": [], "complete": False}
    return manifest


def finished_shards(split_dir: Path, manifest: dict[str, Any]) -> set[int]:
    """Indices of recorded shards whose file is still there, unchanged."""
    intact = [entry for entry in manifest["shards"] if check_shard(split_dir / entry["file"], entry) is None]
    manifest["shards"] = intact
    return {entry["index"] for entry in intact}


def collect_split(cfg: CollectConfig, target: Target, prompts_file: Path, split_dir: Path) -> dict[str, Any]:
    prompts, too_long = load_prompts(prompts_file, target, cfg.max_prompts_per_split)
    split_dir.mkdir(parents=True, exist_ok=True)
    plan = make_plan(cfg, target, prompts)
    manifest = resume_state(split_dir, plan)
    done = finished_shards(split_dir, manifest)
    metadata = shard_metadata(plan)
    resumed = sum(len(prompts[i * cfg.shard_size:(i + 1) * cfg.shard_size]) for i in done)
    generated, start = 0, time.perf_counter()
    bar = tqdm(total=len(prompts), initial=resumed, unit="seq", desc=f"collect {split_dir.name}", dynamic_ncols=True)
    for index in range(manifest["n_shards"]):
        if index in done:
            continue
        traces = []
        for trace in BACKENDS[cfg.backend](target, prompts[index * cfg.shard_size:(index + 1) * cfg.shard_size], cfg):
            traces.append(trace)
            generated += len(trace.input_ids) - trace.n_prompt
            bar.update(1)
            bar.set_postfix(tok_s=f"{generated / (time.perf_counter() - start):.1f}")
        entry = write_shard(split_dir / shard_name(index), traces, metadata, cfg.logprobs_dtype)
        manifest["shards"] = sorted([*manifest["shards"], {"index": index, **entry}], key=lambda e: e["index"])
        write_manifest(split_dir, manifest)
    bar.close()
    manifest["complete"] = True
    write_manifest(split_dir, manifest)
    seconds = time.perf_counter() - start
    return {
        "sequences": sum(e["sequences"] for e in manifest["shards"]),
        "tokens": sum(e["tokens"] for e in manifest["shards"]),
        "response_tokens": sum(e["response_tokens"] for e in manifest["shards"]),
        "prompts_too_long": too_long, "shards": manifest["n_shards"], "shards_resumed": len(done),
        "seconds": round(seconds, 3), "generated_tokens_per_s": round(generated / seconds, 2) if seconds > 0 else 0.0,
    }


def collect(cfg: CollectConfig, target: Target, prompts_dir: Path | str) -> dict[str, dict[str, Any]]:
    """Collect every configured split from prompts_dir/{split}.jsonl into cfg.out_dir/{split}/; returns per-split counts."""
    if cfg.top_k_logits > target.vocab_size:
        raise ValueError(f"collect.top_k_logits={cfg.top_k_logits} exceeds the target's vocabulary ({target.vocab_size}).")
    report = {split: collect_split(cfg, target, Path(prompts_dir) / f"{split}.jsonl", Path(cfg.out_dir) / split)
              for split in cfg.splits}
    log.info("collect: %s", report)
    return report
