"""Collect backend `vllm`: the target regenerates and scores on vLLM's offline engine, for GPU clusters.

Two passes per shard, as vllm-project/speculators builds its training data (its response_regeneration
script, then data_generation_offline):
1. Regenerate: `LLM.generate` on each prompt's token ids with `SamplingParams(temperature, seed = the
   prompt's seed, max_tokens, logprobs off)`; the response ends at the target's EOS, which it keeps.
2. Score: one prefill of prompt + response (`max_tokens=1`) with `prompt_logprobs=K` and `logprobs=K`.
   vLLM's `prompt_logprobs[j]` is the distribution that predicted token j (`[0]` is None: nothing predicts
   token 0) and the one sampled token's `logprobs[0]` is the distribution after the last token, so trace
   row t (which predicts token t + 1) is `prompt_logprobs[t + 1]`, and the last row is `logprobs[0]`.
   Each of those dicts holds the top K plus the position's actual or sampled token (K or K + 1 entries);
   the K best are kept. vLLM computes them from the raw logits (`logprobs_mode="raw_logprobs"`, its
   default, pinned here): the full-vocabulary log-softmax before temperature or penalties, as
   `specops.data.collect.make_trace` does.

Hidden states are captured the way speculators captures them since it dropped its own worker extension:
vLLM's `extract_hidden_states` speculative method caches the residual stream at each id of
`eagle_aux_hidden_state_layer_ids` (id 0 enters the first layer, id i + 1 leaves layer i), and its
`ExampleHiddenStatesConnector` writes every finished request's states ([T, n ids, H] with the token ids)
to a safetensors file whose path the output carries in `kv_transfer_params["hidden_states_path"]`. Our
layer i (its output) is vLLM's id i + 1, which is also its HF `hidden_states` index. vLLM's model forward
appends a state as it passes each id, so the file holds them in ascending id order, each once, whatever
the order of the list: the backend asks for its layers' ids sorted and unique, and puts them back in
collect.hidden_layers' order (repeats included); a file with another number of states is refused. The
last layer's output is id N (num_hidden_layers; speculators' --include-last-layer asks for it too), and
vLLM's docs say it is "not normalized using the output norm" (speculators applies the target's norm to it
before its LM head), while HF's, which specops stores, is after the norm (specops.data.traces): that slot
gets the target's own final norm here. The connector needs chunked prefill off. It also writes a file for
every regeneration request; those are deleted unread.

Settings: the engine gets the target's folder and dtype (target.source must be a Hugging Face folder;
set target.dtype: bfloat16 on GPUs), max_logprobs = top_k_logits, the run seed, and whatever
collect.vllm_engine_args adds (tensor_parallel_size, gpu_memory_utilization, max_model_len, ...); the
split's plan records max_model_len, which caps the responses. One engine serves every shard; collect.shard_size is its batch, so raise it on GPUs. generate_batch_size and
device are the transformers backend's and do nothing here. The stage still loads the target with
transformers on the CPU, for its fingerprint, tokenizer and final norm. It runs as one process: vLLM
spreads the target over the GPUs itself, so torchrun (collect's data parallelism) is refused.

vLLM is imported only when the backend runs, never by `import specops`; the CPU install lacks it.
Written against vLLM's documented offline API (its docs and source on main, late 2026). VLLM_VERSION is
the newest release that pins the torch specops pins (2.13.0; 0.33.0 needs 2.14.0); it needs transformers
< 5.20 where specops asks for >= 5.20, so the GPU environment installs specops with --no-deps (README).
Hidden-state extraction needs vLLM >= 0.22, as speculators requires. Never run in this repository, which
has no GPU: the tests drive it with a fake engine of the same interface (tests/train/test_vllm_backend.py).
"""

from __future__ import annotations

import fcntl
import os
import tempfile
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from specops.core.target import Target
from specops.data.collect import CollectConfig, Prompt, prompt_seed, room
from specops.data.traces import SequenceTrace, hf_hidden_index, resolve_layers

VLLM_VERSION = "0.32.0"  # the release to install (see the module docstring)
# Engine settings this backend derives from the target and the collect settings; vllm_engine_args may not set them.
DERIVED_ARGS = ("model", "tokenizer", "dtype", "max_logprobs", "logprobs_mode", "seed", "speculative_config",
                "kv_transfer_config", "enable_chunked_prefill")
# How long the hidden-state file of a finished request may take to appear (see wait_written); vLLM's
# connector creates its lock before the output names it, so a wait this long means it writes nothing.
WRITE_DEADLINE_S = 60.0


def import_vllm() -> tuple[Any, Any, Any]:
    """vLLM's LLM, SamplingParams and TokensPrompt, or an error that says how to install it."""
    try:
        from vllm import LLM, SamplingParams
        from vllm.inputs import TokensPrompt
    except ImportError as error:
        raise ImportError(f"collect.backend 'vllm' needs vLLM, on a CUDA machine, in an environment of its own: "
                          f"pip install 'vllm=={VLLM_VERSION}', then pip install --no-deps -e . (it brings its own CUDA "
                          f"torch and transformers; see specops.data.vllm_backend). Import failed: {error}") from error
    return LLM, SamplingParams, TokensPrompt


def vllm_layer_ids(layers: list[int]) -> list[int]:
    """vLLM's eagle_aux_hidden_state_layer_ids for our layers: each once, in the ascending order in which
    vLLM's forward collects them."""
    return sorted({hf_hidden_index(layer) for layer in layers})


@dataclass
class HiddenStateFiles:
    """speculators' capture: vLLM's extract_hidden_states method plus its ExampleHiddenStatesConnector."""

    layer_ids: list[int]  # vLLM's eagle_aux_hidden_state_layer_ids: vllm_layer_ids(layers)
    folder: Path  # where the connector writes one file per request

    def engine_args(self) -> dict[str, Any]:
        return {
            "speculative_config": {"method": "extract_hidden_states", "num_speculative_tokens": 1,
                                   "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": self.layer_ids}}},
            "kv_transfer_config": {"kv_connector": "ExampleHiddenStatesConnector", "kv_role": "kv_producer",
                                   # its default, pinned: wait_written relies on the lock
                                   "kv_connector_extra_config": {"shared_storage_path": str(self.folder),
                                                                 "use_synchronization_lock": True}},
            "enable_chunked_prefill": False,  # the connector reads each request's whole prefill at once
        }

    def take(self, output: Any, token_ids: list[int], layers: list[int]) -> torch.Tensor:
        """The states [T, L, H] of one scoring request, one slot per entry of `layers` (collect.hidden_layers,
        resolved, in its order), checked against the request's tokens and ids; the file is removed."""
        path = self._path(output)
        wait_written(path)
        data = load_file(path)
        remove(path)
        if data["token_ids"].tolist() != token_ids:
            raise RuntimeError(f"{path} holds the hidden states of other tokens than the request's.")
        states = data["hidden_states"]  # [T, n ids, H], ascending ids
        if states.shape[:2] != (len(token_ids), len(self.layer_ids)):
            raise RuntimeError(f"vLLM wrote hidden states of shape {tuple(states.shape)} to {path}, not {len(self.layer_ids)} "
                               f"per token for layer ids {self.layer_ids} (collect.hidden_layers, resolved: {layers}): "
                               f"this vLLM does not capture them all; choose other collect.hidden_layers.")
        slot = {layer_id: i for i, layer_id in enumerate(self.layer_ids)}
        return states[:, [slot[hf_hidden_index(layer)] for layer in layers]]  # [T, L, H]

    def discard(self, output: Any) -> None:
        """Remove the file a regeneration request left, once it is fully written."""
        path = self._path(output)
        wait_written(path)
        remove(path)

    @staticmethod
    def _path(output: Any) -> Path:
        params = output.kv_transfer_params
        if not isinstance(params, dict) or "hidden_states_path" not in params:
            raise RuntimeError(f"vLLM returned no hidden_states_path for request {output.request_id}: the engine is not "
                               f"extracting hidden states (needs vLLM >= 0.22 with ExampleHiddenStatesConnector).")
        return Path(params["hidden_states_path"])


def lock_file(path: Path) -> Path:
    return path.with_name(path.name + ".lock")


def wait_written(path: Path, deadline_s: float = WRITE_DEADLINE_S) -> None:
    """Block until the connector has written `path`.

    It writes in a thread, holding an exclusive lock on path.lock until done; a shared lock waits for it, as
    vLLM's own load_hidden_states does. vLLM's worker creates the lock before the output names the path, but
    the connector falls back to creating it in the writer thread, and then neither file need exist yet when
    generate() returns: poll for the lock, and once it is ours, for the file (while we hold it no write is
    under way, so a file that is there is whole)."""
    give_up = time.monotonic() + deadline_s
    while True:
        if lock_file(path).exists():
            with open(lock_file(path)) as handle:
                fcntl.flock(handle, fcntl.LOCK_SH)
                if path.exists():
                    return
        if time.monotonic() > give_up:
            raise TimeoutError(f"vLLM named {path} for a request's hidden states, but it was not written within "
                               f"{deadline_s:.0f} s: is ExampleHiddenStatesConnector saving to {path.parent}?")
        time.sleep(0.01)


def remove(path: Path) -> None:
    path.unlink(missing_ok=True)
    lock_file(path).unlink(missing_ok=True)


@dataclass
class Engine:
    llm: Any
    sampling_params: Any  # vllm.SamplingParams
    tokens_prompt: Any  # vllm.inputs.TokensPrompt
    context: int  # max_model_len: prompt + response + the scoring request's one token fit in it
    capture: HiddenStateFiles | None
    folder: tempfile.TemporaryDirectory | None  # the connector's files; removed with the engine


_engine: tuple[str, Engine] | None = None  # one engine per process: it holds the GPUs; shards reuse it


def engine_args(target: Target, cfg: CollectConfig) -> dict[str, Any]:
    """Keyword arguments for vllm.LLM, without the hidden-state capture."""
    clash = sorted(set(cfg.vllm_engine_args) & set(DERIVED_ARGS))
    if clash:
        raise ValueError(f"collect.vllm_engine_args may not set {', '.join(clash)}: the vllm backend derives them from "
                         f"the target and the other collect settings.")
    return {"model": model_folder(target), "tokenizer": model_folder(target),
            "dtype": str(target.model.dtype).removeprefix("torch."),  # losslessness is defined within the target's dtype
            "max_logprobs": cfg.top_k_logits, "logprobs_mode": "raw_logprobs", "seed": cfg.seed,
            **cfg.vllm_engine_args, "max_model_len": max_model_len(target, cfg)}


def max_model_len(target: Target, cfg: CollectConfig) -> int:
    """The engine's context: collect.vllm_engine_args' max_model_len, else the target's. It caps the responses,
    so the split's plan records it."""
    return int(cfg.vllm_engine_args.get("max_model_len", target.max_context))


def model_folder(target: Target) -> str:
    """The Hugging Face folder the target was loaded from: vLLM loads the same weights itself."""
    folder = target.model.name_or_path
    if not folder or not Path(folder, "config.json").is_file() or target.fingerprint.name.endswith(".gguf"):
        raise ValueError(f"collect.backend 'vllm' needs target.source to be a Hugging Face model folder with "
                         f"config.json; target '{target.fingerprint.name}' was loaded from '{folder}'.")
    return folder


def get_engine(target: Target, cfg: CollectConfig, layers: list[int]) -> Engine:
    """The process's engine for these settings, started on first use (minutes on a large model)."""
    global _engine
    args = engine_args(target, cfg)
    key = repr((sorted(args.items()), vllm_layer_ids(layers)))
    if _engine is None or _engine[0] != key:
        _engine = None  # drop the old engine first: two would not fit on the GPUs
        llm_class, sampling_params, tokens_prompt = import_vllm()
        folder = tempfile.TemporaryDirectory(prefix="specops-hidden-") if layers else None
        capture = HiddenStateFiles(vllm_layer_ids(layers), Path(folder.name)) if folder else None
        llm = llm_class(**args, **(capture.engine_args() if capture else {}))
        _engine = key, Engine(llm, sampling_params, tokens_prompt, args["max_model_len"], capture, folder)
    return _engine[1]


def vllm_backend(target: Target, prompts: Iterable[Prompt], cfg: CollectConfig) -> Iterator[SequenceTrace]:
    """Traces of a shard's prompts, in order: one regeneration batch, then one scoring batch."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise ValueError("collect.backend 'vllm' runs as one process, which spreads the target over the GPUs itself "
                         "(collect.vllm_engine_args: {tensor_parallel_size: N}); launch it without torchrun.")
    layers = resolve_layers(cfg.hidden_layers, target.model.config.num_hidden_layers)
    prompts = list(prompts)
    engine = get_engine(target, cfg, layers)
    responses = regenerate(engine, target, prompts, cfg)
    yield from score(engine, target, prompts, responses, cfg.top_k_logits, layers)


def response_limits(engine: Engine, target: Target, prompts: list[Prompt], cfg: CollectConfig) -> dict[str, int]:
    """How many response tokens each prompt may get.

    The scoring request adds a token after the response, and vLLM refuses prompt + max_tokens beyond
    max_model_len: at the context's edge, one response token fewer than the transformers backend."""
    limit = {p.id: min(room(target, p, cfg), engine.context - 1 - len(p.token_ids)) for p in prompts}
    too_long = [p.id for p in prompts if limit[p.id] < 0]
    if too_long:
        raise ValueError(f"{len(too_long)} prompt(s) (the first {too_long[0]}) do not fit in max_model_len="
                         f"{engine.context} with a token to score after them: raise collect.vllm_engine_args."
                         f"max_model_len (at most the target's {target.max_context}) or lower prepare.max_prompt_tokens.")
    return limit


def regenerate(engine: Engine, target: Target, prompts: list[Prompt], cfg: CollectConfig) -> dict[str, list[int]]:
    """Each prompt's response: its dataset reply under `responses: dataset`, else the target's own."""
    limit = response_limits(engine, target, prompts, cfg)
    responses = {p.id: p.reply_ids[:limit[p.id]] for p in prompts if cfg.responses == "dataset" and p.reply_ids is not None}
    todo = [p for p in prompts if p.id not in responses and limit[p.id] > 0]
    # ignore_eos + stop_token_ids: stop at exactly the target's EOS set, as the transformers backend does
    # (vLLM would otherwise also stop at the tokenizer's EOS); the stop token stays in the response.
    params = [engine.sampling_params(temperature=cfg.temperature, seed=prompt_seed(cfg.seed, p.id), max_tokens=limit[p.id],
                                     ignore_eos=True, stop_token_ids=sorted(target.eos_token_ids), detokenize=False)
              for p in todo]
    outputs = run(engine, [p.token_ids for p in todo], params)
    for prompt, output in zip(todo, outputs, strict=True):
        if engine.capture:
            engine.capture.discard(output)
        responses[prompt.id] = list(output.outputs[0].token_ids)
    return {p.id: responses.get(p.id, []) for p in prompts}


def score(engine: Engine, target: Target, prompts: list[Prompt], responses: dict[str, list[int]], k: int,
          layers: list[int]) -> Iterator[SequenceTrace]:
    """One prefill per prompt + response: top-k next-token log-probs and hidden states at every position."""
    params = engine.sampling_params(temperature=0.0, max_tokens=1, logprobs=k, prompt_logprobs=k, detokenize=False)
    sequences = [p.token_ids + responses[p.id] for p in prompts]
    for prompt, ids, output in zip(prompts, sequences, run(engine, sequences, params), strict=True):
        topk_ids, topk_logprobs = topk_rows(output, k)
        hidden = None
        if engine.capture:
            hidden = fp16_states(prompt.id, last_layer_normed(target, engine.capture.take(output, ids, layers), layers))
        yield SequenceTrace(prompt_id=prompt.id, input_ids=torch.tensor(ids), n_prompt=len(prompt.token_ids),
                            topk_ids=topk_ids, topk_logprobs=topk_logprobs, hidden_states=hidden)


def run(engine: Engine, sequences: list[list[int]], params: Any) -> list[Any]:
    """LLM.generate on token ids; vLLM answers in input order, which the prompt ids confirm."""
    if not sequences:
        return []
    outputs = engine.llm.generate([engine.tokens_prompt(prompt_token_ids=ids) for ids in sequences], params, use_tqdm=False)
    if [list(output.prompt_token_ids) for output in outputs] != sequences:
        raise RuntimeError("vLLM returned its outputs in another order or with other prompt tokens than requested.")
    return outputs


def topk_rows(output: Any, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k ids [T, K] and log-probs [T, K], best first; row t predicts token t + 1 (see the module docstring)."""
    if output.prompt_logprobs is None or not output.outputs[0].logprobs:
        raise RuntimeError(f"vLLM returned no logprobs for request {output.request_id}.")
    rows = [best(entries, k) for entries in [*output.prompt_logprobs[1:], output.outputs[0].logprobs[0]]]
    ids = torch.tensor([[token for token, _ in row] for row in rows], dtype=torch.long)
    logprobs = torch.tensor([[value for _, value in row] for row in rows], dtype=torch.float32)
    return ids, logprobs


def best(entries: dict[int, Any] | None, k: int) -> list[tuple[int, float]]:
    """The k most likely of one position's {token id: Logprob}, which may add the actual token as entry k + 1."""
    if entries is None or len(entries) < k:
        raise RuntimeError(f"vLLM returned {0 if entries is None else len(entries)} logprobs for a position, "
                           f"fewer than collect.top_k_logits={k}.")
    ranked = sorted(entries.items(), key=lambda item: (-item[1].logprob, item[1].rank or 0))
    return [(int(token), float(entry.logprob)) for token, entry in ranked[:k]]


def last_layer_normed(target: Target, states: torch.Tensor, layers: list[int]) -> torch.Tensor:
    """vLLM's states [T, L, H] with the last decoder layer's slot passed through the final norm, as HF returns it."""
    last = target.model.config.num_hidden_layers - 1
    slots = [slot for slot, layer in enumerate(layers) if layer == last]
    if not slots:
        return states
    norm = getattr(target.model.base_model, "norm", None)
    if not isinstance(norm, torch.nn.Module):
        raise ValueError(f"collect.hidden_layers asks for the last layer, which specops stores after the final norm, "
                         f"but {type(target.model.base_model).__name__} has no `norm` module to apply.")
    states = states.clone()
    with torch.inference_mode():
        for slot in slots:
            states[:, slot] = norm(states[:, slot].to(target.model.dtype)).to(states.dtype)
    return states


def fp16_states(prompt_id: str, states: torch.Tensor) -> torch.Tensor:
    """The trace's fp16 hidden states [T, L, H], refused when they overflow (as make_trace does)."""
    stored = states.to(torch.float16)
    if not torch.isfinite(stored).all():
        raise OverflowError(f"Hidden states of prompt {prompt_id} overflow float16; choose other hidden_layers.")
    return stored
