"""The vllm collect backend against a fake vLLM: the same names and fields as vLLM's offline API (LLM,
SamplingParams, TokensPrompt, RequestOutput, CompletionOutput, Logprob, the extract_hidden_states method's
connector files), backed by the tiny HF target, so its traces can be compared with the transformers
backend's. vLLM itself is not installed here (it needs CUDA); nothing in this file runs it."""

from __future__ import annotations

import fcntl
import sys
import threading
import time
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypedDict

import pytest
import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from specops.core.target import Target, encode_prompt, load_target
from specops.data import vllm_backend
from specops.data.collect import CollectConfig, collect, load_prompts, prompt_seed
from specops.data.prompts import read_split
from specops.data.traces import TraceShards
from tests.train.conftest import LAYERS, collect_config, tiny_llama, write_jsonl


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    kv_transfer_params: dict[str, Any] | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: list[dict[int, Logprob] | None] | None
    outputs: list[CompletionOutput]
    finished: bool

    @property
    def kv_transfer_params(self) -> dict[str, Any] | None:
        return self.outputs[0].kv_transfer_params


@dataclass
class SamplingParams:
    """vLLM's defaults (temperature 1.0, max_tokens 16), so that a setting the backend forgets shows."""

    temperature: float = 1.0
    seed: int | None = None
    max_tokens: int = 16
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    detokenize: bool = True


class TokensPrompt(TypedDict):
    prompt_token_ids: list[int]


def position_logprobs(logprobs: torch.Tensor, token: int, k: int) -> dict[int, Logprob]:
    """One position as vLLM reports it: the actual token with its rank, then the top k (ranks 1..k), which
    replace the actual token's entry when it is among them."""
    entries = {token: Logprob(float(logprobs[token]), int((logprobs > logprobs[token]).sum()) + 1)}
    top = logprobs.topk(k)
    entries.update({int(t): Logprob(float(v), rank) for rank, (v, t) in enumerate(zip(top.values, top.indices, strict=True), 1)})
    return entries


class FakeLLM:
    """vllm.LLM on the tiny HF model: it loads the weights from `model` itself, decodes without a cache, and
    writes hidden states as the extract_hidden_states method and ExampleHiddenStatesConnector do."""

    instances: list[FakeLLM] = []
    captures_last_layer = True
    """vLLM's forward (EagleModelMixin) records id N after the last layer; older forwards recorded each id
    only before its layer, so never N."""

    def __init__(self, model: str, tokenizer: str, dtype: str, max_model_len: int, seed: int,
                 max_logprobs: int = 20, logprobs_mode: str = "raw_logprobs", speculative_config: dict | None = None,
                 kv_transfer_config: dict | None = None, enable_chunked_prefill: bool = True, **engine: Any) -> None:
        assert logprobs_mode == "raw_logprobs"
        self.model = AutoModelForCausalLM.from_pretrained(model, dtype=getattr(torch, dtype)).eval()
        self.eos = {AutoTokenizer.from_pretrained(tokenizer).eos_token_id, self.model.generation_config.eos_token_id}
        self.max_model_len, self.max_logprobs, self.engine = max_model_len, max_logprobs, engine
        self.aux_ids, self.folder = None, None
        if speculative_config is not None:
            assert speculative_config["method"] == "extract_hidden_states" and not enable_chunked_prefill
            assert kv_transfer_config["kv_connector"] == "ExampleHiddenStatesConnector"
            self.aux_ids = speculative_config["draft_model_config"]["hf_config"]["eagle_aux_hidden_state_layer_ids"]
            self.folder = Path(kv_transfer_config["kv_connector_extra_config"]["shared_storage_path"])
        self.requests = 0
        FakeLLM.instances.append(self)

    def generate(self, prompts: list[TokensPrompt], sampling_params: SamplingParams | list[SamplingParams],
                 use_tqdm: bool = True) -> list[RequestOutput]:
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(prompts)
        return [self.request(prompt["prompt_token_ids"], p) for prompt, p in zip(prompts, params, strict=True)]

    @torch.no_grad()
    def request(self, ids: list[int], params: SamplingParams) -> RequestOutput:
        if max(params.logprobs or 0, params.prompt_logprobs or 0) > self.max_logprobs:
            raise ValueError(f"Requested logprobs greater than max allowed: {self.max_logprobs}")
        if len(ids) + params.max_tokens > self.max_model_len:
            raise ValueError(f"prompt ({len(ids)}) + max_tokens exceeds max_model_len {self.max_model_len}")
        self.requests += 1
        rid = str(self.requests)
        tokens, sampled = self.decode(list(ids), params)
        prompt_logprobs = None
        if params.prompt_logprobs is not None:
            logprobs = self.model(input_ids=torch.tensor([ids])).logits[0].float().log_softmax(-1)
            prompt_logprobs = [None] + [position_logprobs(logprobs[j - 1], ids[j], params.prompt_logprobs)
                                        for j in range(1, len(ids))]
        completion = CompletionOutput(0, "", tokens, None, sampled, kv_transfer_params=self.save_hidden(rid, ids))
        return RequestOutput(rid, None, list(ids), prompt_logprobs, [completion], True)

    def decode(self, ids: list[int], params: SamplingParams) -> tuple[list[int], list[dict[int, Logprob]] | None]:
        stops = set(params.stop_token_ids or []) | (set() if params.ignore_eos else self.eos)
        generator = torch.Generator().manual_seed(params.seed if params.seed is not None else 0)
        tokens: list[int] = []
        sampled: list[dict[int, Logprob]] | None = [] if params.logprobs is not None else None
        while len(tokens) < params.max_tokens and (not tokens or tokens[-1] not in stops):
            logits = self.model(input_ids=torch.tensor([ids + tokens])).logits[0, -1].float()
            if params.temperature < 1e-5:
                token = int(logits.argmax())
            else:
                token = int(torch.multinomial((logits / params.temperature).softmax(-1), 1, generator=generator))
            if sampled is not None:
                sampled.append(position_logprobs(logits.log_softmax(-1), token, params.logprobs))
            tokens.append(token)
        return tokens, sampled

    def save_hidden(self, rid: str, ids: list[int]) -> dict[str, str] | None:
        """The connector's file, for every prompt token: the residual stream at each aux layer id, as vLLM's
        forward records it, passing id 0 (entering layer 0), then id i + 1 (leaving layer i) up to id N (the
        last layer's output, before the final norm) and appending the state if the id is in the list. So the
        states come in ascending id order, whatever the list's order, and a repeated id comes once."""
        if self.aux_ids is None:
            return None
        captured = {}
        hook = self.model.model.layers[-1].register_forward_hook(lambda m, a, out: captured.update(pre_norm=out))
        out = self.model(input_ids=torch.tensor([ids]), output_hidden_states=True)
        hook.remove()
        last = self.model.config.num_hidden_layers
        stream = [*out.hidden_states[:last], captured["pre_norm"]]  # ids 0..N; HF's hidden_states[N] is after the norm
        states = [state[0] for i, state in enumerate(stream) if i in self.aux_ids and (i < last or self.captures_last_layer)]
        path = self.folder / f"{rid}.safetensors"
        save_file({"hidden_states": torch.stack(states, dim=1).contiguous(), "token_ids": torch.tensor(ids)}, str(path))
        Path(f"{path}.lock").touch()  # the connector's lock, released once written
        return {"hidden_states_path": str(path)}


@pytest.fixture
def fake_vllm(monkeypatch: pytest.MonkeyPatch) -> type[FakeLLM]:
    """sys.modules['vllm'] (and vllm.inputs) replaced by the fake, with no engine left from another test."""
    module, inputs = types.ModuleType("vllm"), types.ModuleType("vllm.inputs")
    module.LLM, module.SamplingParams, inputs.TokensPrompt = FakeLLM, SamplingParams, TokensPrompt
    monkeypatch.setitem(sys.modules, "vllm", module)
    monkeypatch.setitem(sys.modules, "vllm.inputs", inputs)
    monkeypatch.setattr(vllm_backend, "_engine", None)
    monkeypatch.setattr(FakeLLM, "instances", [])
    return FakeLLM


@pytest.fixture(scope="module")
def folder_target(tmp_path_factory: pytest.TempPathFactory, chat_tokenizer, prompts_dir) -> Target:
    """The tiny target saved as a HF folder (vLLM loads weights from a path). Its EOS (generation_config) is a
    token about half its greedy replies contain, so that some replies end at it, at different steps, and
    others run to the cap. The tokenizer's own eos_token, <|im_end|>, which vLLM also stops at unless told
    not to, is made to appear in replies: its lm_head row is a common token's, scaled up to win over it.
    small_batch_linear is off: both backends run the same kernels, so their greedy tokens agree."""
    model = tiny_llama(len(chat_tokenizer), chat_tokenizer.eos_token_id)
    prompts = [encode_prompt(chat_tokenizer, row["messages"]) for row in read_split(prompts_dir / "train.jsonl")]

    def halfway_token(exclude: int) -> int:
        """A token that about half the greedy replies contain."""
        replies = [model.generate(torch.tensor([p]), max_new_tokens=16, do_sample=False, eos_token_id=None)[0, len(p):]
                   for p in prompts]
        counts = {int(t): sum(t in reply for reply in replies) for reply in replies for t in reply if t != exclude}
        return min(counts, key=lambda token: abs(counts[token] - len(replies) / 2))

    with torch.no_grad():
        model.lm_head.weight[chat_tokenizer.eos_token_id] = 1.2 * model.lm_head.weight[halfway_token(-1)]
    model.generation_config.eos_token_id = halfway_token(chat_tokenizer.eos_token_id)
    folder = tmp_path_factory.mktemp("tiny-target")
    model.save_pretrained(folder)
    chat_tokenizer.save_pretrained(folder)
    return load_target(str(folder), "float32", small_batch_linear=False)


def both_backends(tmp_path: Path, target: Target, prompts_dir: Path, **settings: Any) -> tuple[TraceShards, TraceShards]:
    """The train split's traces from the transformers backend and from the vllm one, checked to be the same."""
    for backend in ("transformers", "vllm"):
        collect(collect_config(tmp_path / backend, backend=backend, splits=["train"], **settings), target, prompts_dir)
    a, b = TraceShards(tmp_path / "transformers" / "train"), TraceShards(tmp_path / "vllm" / "train")
    assert len(a) == len(b) > 1
    for i in range(len(a)):
        for name in ("input_ids", "loss_mask", "topk_ids"):
            assert torch.equal(a[i][name], b[i][name]), (i, name)
        torch.testing.assert_close(b[i]["topk_logprobs"], a[i]["topk_logprobs"], rtol=0, atol=1e-5)  # same fp32 pass
        torch.testing.assert_close(b[i]["hidden_states"], a[i]["hidden_states"], rtol=1e-3, atol=1e-3)  # fp16 storage
    return a, b


def test_vllm_traces_match_the_transformers_backend(tmp_path, prompts_dir, folder_target, fake_vllm):
    """Same tokens, the same top-k at every position (row t predicts token t + 1) and the same hidden states,
    the last layer's included (vLLM's is before the final norm, specops' after it), in hidden_layers' order
    with its repeat, though vLLM returns each id once, in ascending order."""
    _, traces = both_backends(tmp_path, folder_target, prompts_dir, max_new_tokens=16, hidden_layers=[-1, 0, -1])
    (engine,) = fake_vllm.instances
    assert engine.aux_ids == [1, LAYERS]  # sorted, each once
    ended = sum(int(traces[i]["input_ids"][-1]) in folder_target.eos_token_ids for i in range(len(traces)))
    assert 0 < ended < len(traces)  # some replies stopped at the EOS (and kept it), others at max_new_tokens
    assert not list(Path(engine.folder).iterdir())  # every connector file was read or discarded


def test_a_vllm_that_misses_a_layer_is_refused_naming_hidden_layers(tmp_path, prompts_dir, folder_target, fake_vllm,
                                                                     monkeypatch):
    monkeypatch.setattr(FakeLLM, "captures_last_layer", False)
    with pytest.raises(RuntimeError, match=r"not 2 per token for layer ids \[1, 2\] \(collect.hidden_layers, resolved"):
        collect(collect_config(tmp_path, backend="vllm", splits=["train"]), folder_target, prompts_dir)


def test_wait_written_waits_for_a_file_the_connector_writes_after_generate_returns(tmp_path):
    """The connector's fallback: its writer thread creates the lock, holds it exclusively while it writes, then
    lets go; neither file is there when the output names the path."""
    path = tmp_path / "1.safetensors"
    lock = Path(f"{path}.lock")

    def write() -> None:
        time.sleep(0.05)
        with open(lock, "w") as handle:
            fcntl.flock(handle, fcntl.LOCK_EX)
            save_file({"hidden_states": torch.ones(3, 1, 4), "token_ids": torch.tensor([5, 6, 7])}, str(path))

    writer = threading.Thread(target=write)
    writer.start()
    files = vllm_backend.HiddenStateFiles([1], tmp_path)
    output = types.SimpleNamespace(request_id="1", kv_transfer_params={"hidden_states_path": str(path)})
    states = files.take(output, [5, 6, 7], [0, 0])
    writer.join()
    assert torch.equal(states, torch.ones(3, 2, 4)) and not path.exists() and not lock.exists()
    with pytest.raises(TimeoutError, match="not written within 0 s: is ExampleHiddenStatesConnector saving to"):
        vllm_backend.wait_written(tmp_path / "never.safetensors", deadline_s=0.05)


def test_dataset_replies_are_scored_without_regenerating_them(tmp_path, folder_target, fake_vllm):
    rows = [{"messages": [{"role": "user", "content": "say hi"}], "reply": "hello there, friend"},
            {"messages": [{"role": "user", "content": "no answer"}]}]
    prompts = tmp_path / "prompts"
    prompts.mkdir()
    write_jsonl(prompts / "train.jsonl", [{"id": f"{i:064x}", **row} for i, row in enumerate(rows, 1)])
    both_backends(tmp_path, folder_target, prompts, responses="dataset", max_new_tokens=8)
    assert fake_vllm.instances[0].requests == 3  # one regeneration (the prompt without a reply), two scorings


def test_one_engine_with_the_targets_settings_serves_every_shard(tmp_path, prompts_dir, folder_target, fake_vllm):
    cfg = collect_config(tmp_path, backend="vllm", splits=["train"], vllm_engine_args={"tensor_parallel_size": 1})
    collect(cfg, folder_target, prompts_dir)
    (engine,) = fake_vllm.instances  # shards of 3 prompts, one engine
    assert engine.max_model_len == folder_target.max_context and engine.max_logprobs == cfg.top_k_logits
    assert engine.model.dtype == torch.float32 and engine.engine == {"tensor_parallel_size": 1}
    assert engine.aux_ids == [1, LAYERS]  # layer i's output enters layer i + 1: vLLM's id i + 1


def test_a_changed_max_model_len_restarts_the_split(tmp_path, prompts_dir, folder_target, fake_vllm):
    """The engine's context caps the responses, so shards made under another one are not resumed."""
    def run(**engine_args: Any) -> dict[str, Any]:
        cfg = collect_config(tmp_path, backend="vllm", splits=["train"], hidden_layers=[], vllm_engine_args=engine_args)
        return collect(cfg, folder_target, prompts_dir)["train"]

    first = run()
    assert run()["shards_resumed"] == first["shards"]
    assert run(max_model_len=folder_target.max_context - 1)["shards_resumed"] == 0


def test_a_lower_max_model_len_caps_the_responses(tmp_path, prompts_dir, folder_target, fake_vllm):
    """vLLM refuses a prompt + max_tokens beyond max_model_len (the fake too): the scoring request's token fits."""
    prompts, _ = load_prompts(prompts_dir / "train.jsonl", folder_target, None)
    context = max(len(prompt.token_ids) for prompt in prompts) + 3
    cfg = collect_config(tmp_path, backend="vllm", splits=["train"], vllm_engine_args={"max_model_len": context})
    collect(cfg, folder_target, prompts_dir)
    traces = TraceShards(tmp_path / "train")
    assert max(len(traces[i]["input_ids"]) for i in range(len(traces))) == context - 1  # the cap, exactly
    with pytest.raises(ValueError, match="do not fit in max_model_len"):
        collect(collect_config(tmp_path / "short", backend="vllm", splits=["train"],
                               vllm_engine_args={"max_model_len": context - 3}), folder_target, prompts_dir)


def test_sampled_regeneration_passes_each_prompts_seed(tmp_path, prompts_dir, folder_target, fake_vllm, monkeypatch):
    """Sampling is vLLM's, seeded per prompt as the transformers backend seeds it, so a resumed run samples the same."""
    regenerations: dict[tuple[int, ...], SamplingParams] = {}
    request = FakeLLM.request

    def recording(self: FakeLLM, ids: list[int], params: SamplingParams) -> RequestOutput:
        if params.prompt_logprobs is None:
            regenerations[tuple(ids)] = params
        return request(self, ids, params)

    monkeypatch.setattr(FakeLLM, "request", recording)
    cfg = collect_config(tmp_path, backend="vllm", splits=["train"], temperature=0.8, hidden_layers=[])
    collect(cfg, folder_target, prompts_dir)
    prompts, _ = load_prompts(prompts_dir / "train.jsonl", folder_target, None)
    assert {ids: (p.temperature, p.seed) for ids, p in regenerations.items()} == {
        tuple(prompt.token_ids): (0.8, prompt_seed(cfg.seed, prompt.id)) for prompt in prompts}


def test_best_keeps_the_k_most_likely_of_k_plus_one_entries():
    entries = {7: Logprob(-5.0, 9), 3: Logprob(-0.5, 1), 4: Logprob(-1.0, 2), 1: Logprob(-2.0, 3)}
    assert vllm_backend.best(entries, 3) == [(3, -0.5), (4, -1.0), (1, -2.0)]
    with pytest.raises(RuntimeError, match="fewer than collect.top_k_logits=5"):
        vllm_backend.best(entries, 5)


def test_clear_errors_for_a_missing_vllm_and_bad_settings(tiny_target, folder_target, monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)  # what `import vllm` meets where it is not installed
    with pytest.raises(ImportError, match=f"pip install 'vllm=={vllm_backend.VLLM_VERSION}'"):
        vllm_backend.import_vllm()
    with pytest.raises(ValueError, match="may not set dtype"):
        vllm_backend.engine_args(folder_target, CollectConfig(backend="vllm", vllm_engine_args={"dtype": "float16"}))
    with pytest.raises(ValueError, match="needs target.source to be a Hugging Face model folder"):
        vllm_backend.engine_args(tiny_target, CollectConfig(backend="vllm"))
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match="without torchrun"):
        next(vllm_backend.vllm_backend(folder_target, [], CollectConfig(backend="vllm")))
