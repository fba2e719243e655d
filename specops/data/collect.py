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

Data-parallel: launched by torchrun (`torchrun --nproc-per-node 8 -m specops.cli stage collect`), or
called inside an initialised torch.distributed group (Lightning DDP), the processes share the work
of each split, each with its own replica of the target (transformers backend; with `device: cuda`
on its own GPU, cuda:LOCAL_RANK). Rank 0 alone resumes (checks and cleans the split), then the shards still to do are
dealt round-robin, so ranks get equal counts (+-1) whatever was resumed. Each rank writes its shards
under their global names, so the files are those of a one-process run, and records them in its own
manifest (`rank-R/manifest.json`; rank 0's is the split's), so no two ranks ever write one file. At
the end rank 0 merges the ranks' records into the split's manifest, in the one-process format, and
removes them; a killed run's records are merged when it resumes, with any number of processes.
Ranks coordinate over gloo (a few small objects per split), which needs no GPU mapping and works
beside an NCCL group; out_dir must be on a filesystem every rank shares. A rank that fails tells the
others where they next meet, and every rank raises there, the failed one's error naming it.

Backends are a plain dict. A backend turns prompts into `SequenceTrace`s and is free to batch them.
The vllm one runs vLLM's offline engine on GPU clusters (specops.data.vllm_backend, imported only then).
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
import os
import shutil
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
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
DEVICES = ("cpu", "cuda")
RANK_RECORD = "rank-{}"  # under a split's folder: the manifest of the shards rank R >= 1 wrote


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
    vllm_engine_args: dict[str, Any] = field(default_factory=dict)
    """backend vllm only: extra keyword arguments for vllm.LLM, e.g. {tensor_parallel_size: 8,
    gpu_memory_utilization: 0.9, max_model_len: 4096 (default: the target's context)}. The model, dtype,
    logprobs and hidden-state capture come from the target and the settings here (specops.data.vllm_backend)."""
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
    device: str = "cpu"
    """Where the transformers backend runs the target. cuda: each process on its own GPU, cuda:LOCAL_RANK
    (torchrun sets it), with generate_batch_size > 1 (batch 1 runs specops' own decoding loop, CPU-only)."""
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
    coordination_timeout_s: float = 24 * 3600.0
    """Distributed runs: how long a rank waits for the others where they meet (each split's start and end;
    at the end, for the slowest rank's last shards, minutes on a large target). A rank that fails tells the
    others there, so this only bounds the wait for one that dies or hangs without a launcher to stop the
    rest (inside a caller's group, as under Lightning)."""

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
        if self.device not in DEVICES:
            raise ValueError(f"collect.device must be one of {', '.join(DEVICES)}, got '{self.device}'.")
        if self.device == "cuda" and self.generate_batch_size == 1:
            raise ValueError("collect.device: cuda regenerates through HF generate: set collect.generate_batch_size > 1 "
                             "(batch 1 runs specops' own decoding loop, which is CPU-only).")
        if self.max_prompts_per_split is not None and self.max_prompts_per_split < 0:
            raise ValueError(f"collect.max_prompts_per_split must be >= 0 or null, got {self.max_prompts_per_split}")
        if self.coordination_timeout_s <= 0:
            raise ValueError(f"collect.coordination_timeout_s must be > 0, got {self.coordination_timeout_s}.")


@torch.inference_mode()
def score(model: PreTrainedModel, prompt_id: str, prompt_ids: list[int], response: list[int], k: int,
          layers: list[int]) -> SequenceTrace:
    """One forward pass over prompt + response: top-k next-token log-probs and hidden states at every position."""
    ids = torch.tensor(prompt_ids + response)  # [T]
    out = model(input_ids=ids[None].to(model.device), output_hidden_states=bool(layers))
    hidden = [out.hidden_states[hf_hidden_index(i)][0] for i in layers]  # L x [T, H]
    return make_trace(prompt_id, ids, len(prompt_ids), out.logits[0], hidden, k)


def make_trace(prompt_id: str, ids: torch.Tensor, n_prompt: int, logits: torch.Tensor, hidden: list[torch.Tensor],
               k: int) -> SequenceTrace:
    """A trace, on the CPU, from one sequence's logits [T, V] and its chosen layers' hidden states (L x [T, H])."""
    logprobs = logits.float().log_softmax(-1)  # [T, V], normalized over the full vocabulary
    top = logprobs.topk(k, dim=-1)  # values and indices [T, K], best first
    stacked = None
    if hidden:
        stacked = torch.stack(hidden, dim=1).to(torch.float16)  # [T, L, H]
        if not torch.isfinite(stacked).all():
            raise OverflowError(f"Hidden states of prompt {prompt_id} overflow float16; choose other hidden_layers.")
        stacked = stacked.cpu()
    return SequenceTrace(prompt_id=prompt_id, input_ids=ids, n_prompt=n_prompt, topk_ids=top.indices.cpu(),
                         topk_logprobs=top.values.cpu(), hidden_states=stacked)


def prompt_seed(seed: int, prompt_id: str) -> int:
    """A sampling seed that depends only on the run seed and the prompt, not on run order or resumption."""
    return seed ^ int(prompt_id[:15], 16)


def transformers_backend(target: Target, prompts: Iterable[Prompt], cfg: CollectConfig) -> Iterator[SequenceTrace]:
    """Teacher-force the dataset's replies (under `responses: dataset`) and regenerate the rest, in prompt order."""
    layers = resolve_layers(cfg.hidden_layers, target.model.config.num_hidden_layers)
    if cfg.device == "cuda":
        target.model.to(local_gpu())
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


def local_gpu() -> torch.device:
    """This process's GPU: torchrun (and Lightning) number a node's processes by LOCAL_RANK, one GPU each."""
    if not torch.cuda.is_available():
        raise RuntimeError("collect.device is cuda, but torch finds no GPU here; set collect.device: cpu.")
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    torch.cuda.set_device(device)
    return device


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
        ids, mask = ids.to(target.model.device), mask.to(target.model.device)
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


def vllm_backend(target: Target, prompts: Iterable[Prompt], cfg: CollectConfig) -> Iterator[SequenceTrace]:
    """vLLM's offline engine, on GPUs: specops.data.vllm_backend, imported on use (it imports this module)."""
    from specops.data.vllm_backend import vllm_backend as engine_backend

    return engine_backend(target, prompts, cfg)


BACKENDS: dict[str, Backend] = {"transformers": transformers_backend, "vllm": vllm_backend}


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
        **backend_plan(cfg, target),
    }


def backend_plan(cfg: CollectConfig, target: Target) -> dict[str, Any]:
    """The backend's own settings that change the shards. None for the default run (transformers on the CPU),
    so that its plan, and every manifest made with it, stays what it was before they were added."""
    if cfg.backend == "vllm":
        from specops.data.vllm_backend import max_model_len  # on use, as the backend itself

        return {"max_model_len": max_model_len(target, cfg)}  # it caps the responses
    # Another device runs other kernels, whose rounding can flip a greedy near-tie.
    return {"device": cfg.device} if cfg.device != "cpu" else {}


def shard_metadata(plan: dict[str, Any]) -> dict[str, str]:
    """The safetensors header: a shard explains itself without its manifest."""
    return {key: json.dumps(value) if not isinstance(value, str) else value
            for key, value in plan.items() if key not in ("shard_size", "n_prompts", "prompts_sha256")}


@dataclass(frozen=True)
class RankFailure:
    """What a rank whose step raised sends the others instead of its value (Ranks.sharing_failure)."""

    rank: int
    error: str


@dataclass(frozen=True)
class Ranks:
    """The processes collecting together and this one's rank among them; one process alone is rank 0 of 1."""

    rank: int = 0
    world: int = 1
    group: dist.ProcessGroup | None = None
    """The gloo group they coordinate over; None: the default group (or none, alone)."""

    def all_gather(self, value: Any) -> list[Any]:
        """Every rank's value, in rank order; no rank returns before every rank has called it. If another
        rank sent a RankFailure, this one raises an error naming it instead."""
        if self.world == 1:
            return [value]
        values: list[Any] = [None] * self.world
        dist.all_gather_object(values, value, group=self.group)
        failed = [v for v in values if isinstance(v, RankFailure)]
        if failed and not isinstance(value, RankFailure):
            raise RuntimeError(f"collect: rank {failed[0].rank} failed ({failed[0].error}), so rank {self.rank} stops "
                               "too; a rerun resumes every shard any rank recorded.")
        return values

    @contextmanager
    def sharing_failure(self) -> Iterator[None]:
        """Run one rank's part of a step whose end is an all_gather. If it raises, the failure takes the
        place of its value in that all_gather, so every other rank raises there too (naming this one)
        instead of waiting for it until coordination_timeout_s; then this rank raises its own error."""
        try:
            yield
        except Exception as error:
            reason = f"{type(error).__name__}: {error}" if str(error) else type(error).__name__
            self.all_gather(RankFailure(self.rank, reason))
            raise


def process_rank() -> int:
    """This process's rank: in an initialised torch.distributed group (ours or a caller's), its rank there;
    else torchrun's RANK (after our group is gone); else 0, alone. Ranks are numbered by it, and the caller
    asks it which process writes the reports."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", "0"))


def is_rank_zero() -> bool:
    """Whether this process writes a run's reports: the only process, or rank 0 of the collecting ones."""
    return process_rank() == 0


@contextmanager
def process_group(timeout: timedelta) -> Iterator[Ranks]:
    """The processes of an initialised torch.distributed group (a caller's, Lightning's), or of a torchrun
    launch (WORLD_SIZE > 1 in the environment), else this process alone.

    Ranks coordinate over gloo: in a gloo group of their own beside a caller's group (NCCL's collectives
    need each rank's GPU mapped, and ours move only a few small objects), or in the default group when
    it is ours to start, from torchrun's RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT."""
    ours = not (dist.is_available() and dist.is_initialized())
    if ours and int(os.environ.get("WORLD_SIZE", "1")) == 1:
        yield Ranks()
        return
    if ours:
        dist.init_process_group("gloo", timeout=timeout)
    group = None if ours else dist.new_group(backend="gloo", timeout=timeout)
    try:
        yield Ranks(process_rank(), dist.get_world_size(), group)
    finally:
        dist.destroy_process_group(group)  # None: the default group, which we started


def check_same_plan(plans: list[dict[str, Any]], split: str) -> None:
    """Ranks can share a split's shards only if each would make them alike: same settings, prompts and target."""
    for rank, plan in enumerate(plans):
        differ = sorted(key for key in plans[0].keys() | plan.keys() if plan.get(key) != plans[0].get(key))
        if differ:
            raise ValueError(f"collect {split}: rank {rank} differs from rank 0 in {', '.join(differ)}; every rank "
                             "must run with the same params, prompts and target.")


def resume_state(split_dir: Path, plan: dict[str, Any]) -> dict[str, Any]:
    """The manifest to continue from: the old one when its plan matches, with the shards its ranks recorded
    (a distributed run stopped before merging them); else a fresh one (old shards removed)."""
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
            stale.unlink()  # the ranks' records of another plan are ignored here and removed by start_split
        n_shards = -(-plan["n_prompts"] // plan["shard_size"])
        manifest = {"plan": plan, "n_shards": n_shards, "shards": [], "complete": False}
    else:
        manifest["shards"] += rank_shards(split_dir, plan)
    return manifest


def rank_dir(split_dir: Path, rank: int) -> Path:
    """Where rank `rank` keeps its manifest: the split's own for rank 0, a folder of its own for the others."""
    return split_dir if rank == 0 else split_dir / RANK_RECORD.format(rank)


def rank_shards(split_dir: Path, plan: dict[str, Any]) -> list[dict[str, Any]]:
    """The shards that ranks >= 1 recorded in their own manifests under this plan."""
    entries = []
    for folder in sorted(split_dir.glob(RANK_RECORD.format("*"))):
        try:
            record = read_manifest(folder)
        except TraceError as error:  # its shards cannot be trusted, so they are collected again
            log.warning("collect: %s Its shards will be collected again.", error)
            continue
        if record is not None and record["plan"] == plan:
            entries += record["shards"]
    return entries


def remove_rank_records(split_dir: Path) -> None:
    """Remove the manifests of ranks >= 1 (their shards stay, under their global names)."""
    for folder in split_dir.glob(RANK_RECORD.format("*")):
        shutil.rmtree(folder)


def finished_shards(split_dir: Path, manifest: dict[str, Any]) -> set[int]:
    """Indices of recorded shards whose file is still there, unchanged; one entry is kept per shard."""
    intact: dict[int, dict[str, Any]] = {}
    for entry in manifest["shards"]:
        if entry["index"] not in intact and check_shard(split_dir / entry["file"], entry) is None:
            intact[entry["index"]] = entry
    manifest["shards"] = sorted(intact.values(), key=lambda entry: entry["index"])
    return set(intact)


def start_split(split_dir: Path, plan: dict[str, Any]) -> dict[str, Any]:
    """Rank 0's resumption: the manifest to continue from, written with its intact shards (the ranks' records
    folded in, then removed) before any rank writes a shard."""
    split_dir.mkdir(parents=True, exist_ok=True)
    manifest = resume_state(split_dir, plan)
    finished_shards(split_dir, manifest)
    manifest["complete"] = False  # until the shards missing now are there
    write_manifest(split_dir, manifest)
    remove_rank_records(split_dir)  # after the write: a kill in between leaves records, folded in again next time
    return manifest


def shard_prompts(prompts: list[Prompt], index: int, size: int) -> list[Prompt]:
    """The prompts of shard `index`: the split's prompts in order, `size` to a shard."""
    return prompts[index * size:(index + 1) * size]


def collect_shards(cfg: CollectConfig, target: Target, prompts: list[Prompt], split_dir: Path, todo: list[int],
                   record: dict[str, Any], rank: int) -> tuple[int, float]:
    """Collect shards `todo`, recording each in this rank's manifest once it is on disk.
    Returns the response tokens generated and the seconds it took."""
    folder = rank_dir(split_dir, rank)
    folder.mkdir(exist_ok=True)
    metadata = shard_metadata(record["plan"])
    generated, start = 0, time.perf_counter()
    total = sum(len(shard_prompts(prompts, index, cfg.shard_size)) for index in todo)
    bar = tqdm(total=total, unit="seq", desc=f"collect {split_dir.name}", dynamic_ncols=True, disable=rank != 0)
    for index in todo:
        traces = []
        for trace in BACKENDS[cfg.backend](target, shard_prompts(prompts, index, cfg.shard_size), cfg):
            traces.append(trace)
            generated += len(trace.input_ids) - trace.n_prompt
            bar.update(1)
            bar.set_postfix(tok_s=f"{generated / (time.perf_counter() - start):.1f}")
        entry = write_shard(split_dir / shard_name(index), traces, metadata, cfg.logprobs_dtype)
        record["shards"] = sorted([*record["shards"], {"index": index, **entry}], key=lambda e: e["index"])
        write_manifest(folder, record)
    bar.close()
    return generated, time.perf_counter() - start


def merge_ranks(split_dir: Path, manifest: dict[str, Any]) -> None:
    """Rank 0, once every rank is done: the ranks' records join the split's manifest, which is then complete."""
    manifest["shards"] = sorted([*manifest["shards"], *rank_shards(split_dir, manifest["plan"])], key=lambda e: e["index"])
    present = {entry["index"] for entry in manifest["shards"] if (split_dir / entry["file"]).is_file()}
    missing = sorted(set(range(manifest["n_shards"])) - present)
    if missing:
        raise RuntimeError(f"collect: {len(missing)} shard(s) of {split_dir} (the first {shard_name(missing[0])}) were "
                           "collected by other ranks but rank 0 cannot see them: collect.out_dir must be on a "
                           "filesystem every rank shares.")
    manifest["complete"] = True
    write_manifest(split_dir, manifest)
    remove_rank_records(split_dir)


def collect_split(cfg: CollectConfig, target: Target, prompts_file: Path, split_dir: Path,
                  ranks: Ranks = Ranks()) -> dict[str, Any]:
    """Collect one split with every rank; returns its counts (on every rank). Each step ends in an all_gather,
    where a rank that failed in it makes every rank raise (Ranks.sharing_failure)."""
    with ranks.sharing_failure():
        prompts, too_long = load_prompts(prompts_file, target, cfg.max_prompts_per_split)
        plan = make_plan(cfg, target, prompts)
    check_same_plan(ranks.all_gather(plan), split_dir.name)
    with ranks.sharing_failure():
        manifest = start_split(split_dir, plan) if ranks.rank == 0 else None
    manifest = ranks.all_gather(manifest)[0]
    done = {entry["index"] for entry in manifest["shards"]}
    # What is left is dealt round-robin, so ranks get equal counts (+-1) whatever was resumed.
    todo = [index for index in range(manifest["n_shards"]) if index not in done][ranks.rank::ranks.world]
    log.info("collect %s: rank %d of %d collects %d of %d shards (%d resumed)", split_dir.name, ranks.rank, ranks.world,
             len(todo), manifest["n_shards"], len(done))
    record = manifest if ranks.rank == 0 else {**manifest, "shards": []}
    with ranks.sharing_failure():
        timing = collect_shards(cfg, target, prompts, split_dir, todo, record, ranks.rank)
    timings = ranks.all_gather(timing)
    report = None
    with ranks.sharing_failure():
        if ranks.rank == 0:
            merge_ranks(split_dir, manifest)
            generated, seconds = sum(tokens for tokens, _ in timings), max(seconds for _, seconds in timings)
            report = split_report(manifest, too_long, len(done), ranks.world, generated, seconds)
    return ranks.all_gather(report)[0]


def split_report(manifest: dict[str, Any], too_long: int, resumed: int, world: int, generated: int,
                 seconds: float) -> dict[str, Any]:
    """The split's counts; tokens/s over all ranks, for the time the slowest one collected."""
    shards = manifest["shards"]
    return {
        "sequences": sum(e["sequences"] for e in shards), "tokens": sum(e["tokens"] for e in shards),
        "response_tokens": sum(e["response_tokens"] for e in shards),
        "prompts_too_long": too_long, "shards": manifest["n_shards"], "shards_resumed": resumed, "ranks": world,
        "seconds": round(seconds, 3), "generated_tokens_per_s": round(generated / seconds, 2) if seconds > 0 else 0.0,
    }


def collect(cfg: CollectConfig, target: Target, prompts_dir: Path | str) -> dict[str, dict[str, Any]]:
    """Collect every configured split from prompts_dir/{split}.jsonl into cfg.out_dir/{split}/, with every process
    of a torchrun launch or distributed group (see the module's docstring); returns per-split counts, on every rank."""
    if cfg.top_k_logits > target.vocab_size:
        raise ValueError(f"collect.top_k_logits={cfg.top_k_logits} exceeds the target's vocabulary ({target.vocab_size}).")
    with process_group(timedelta(seconds=cfg.coordination_timeout_s)) as ranks:
        report = {split: collect_split(cfg, target, Path(prompts_dir) / f"{split}.jsonl", Path(cfg.out_dir) / split, ranks)
                  for split in cfg.splits}
    if ranks.rank == 0:
        log.info("collect: %s", report)
    return report
