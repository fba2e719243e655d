"""Export to vLLM (speculators layout) and SGLang: config schema, weight names, the layer convention,
and an independent re-implementation of vLLM's EAGLE-3 forward that must reproduce our logits.

`pip install speculators` would replace torch 2.13 (it pulls torch 2.14 with CUDA wheels), so the
config is checked against the schema documented by its pydantic classes (speculators
models/eagle3/config.py, config.py, proposals/greedy.py), mirrored in `check_speculators_schema`.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors.torch import load_file
from transformers import LlamaConfig

from specops.cli import build_parser, main
from specops.core.kv import CachedLM
from specops.core.target import target_from_model
from specops.drafters.aligned_head.export import (
    EXPORT_FORMATS,
    ExportError,
    eagle3_default_layers,
    export_head,
    vllm_layer_ids,
)
from specops.server.bundle import write_bundle
from tests.conftest import tiny_llama, tiny_tokenizer
from tests.drafters.aligned_head.conftest import make_head

LAYERS = 8
EXPECTED_WEIGHTS = {
    "fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d", "midlayer.input_layernorm.weight",
    "midlayer.hidden_norm.weight", "midlayer.post_attention_layernorm.weight", "midlayer.self_attn.q_proj.weight",
    "midlayer.self_attn.k_proj.weight", "midlayer.self_attn.v_proj.weight", "midlayer.self_attn.o_proj.weight",
    "midlayer.mlp.gate_proj.weight", "midlayer.mlp.up_proj.weight", "midlayer.mlp.down_proj.weight",
}
VERIFIER = {"name_or_path": "org/tiny-verifier", "architectures": ["LlamaForCausalLM"]}


@pytest.fixture(scope="module")
def model():
    return tiny_llama(seed=5, vocab=96, layers=LAYERS, hidden=32)


@pytest.fixture(scope="module")
def eagle3_head(model):
    return make_head(model, eagle3_default_layers(LAYERS), draft_vocab=30, tgf=False, teh=False)


def test_layer_convention_matches_eagle3_capture(model):
    """EAGLE-3 taps the inputs of layers 2, L//2, L-3: our outputs of layers 1, L//2-1, L-4."""
    assert eagle3_default_layers(30) == [1, 14, 26] and vllm_layer_ids([1, 14, 26]) == [2, 15, 27]  # SmolLM2
    for num_layers in (8, 24, 32):
        assert vllm_layer_ids(eagle3_default_layers(num_layers)) == [2, num_layers // 2, num_layers - 3]
    ids = [4, 8, 15, 16, 23]
    lm = CachedLM(model, hidden_layers=eagle3_default_layers(LAYERS))
    lm.forward(ids)
    out = model(torch.tensor([ids]), output_hidden_states=True)  # hidden_states[i] is the input of layer i
    for column, layer in enumerate([2, LAYERS // 2, LAYERS - 3]):
        torch.testing.assert_close(lm.features[:, column], out.hidden_states[layer][0])


def check_speculators_schema(config: dict) -> None:
    """The fields and constraints of speculators' Eagle3SpeculatorConfig / SpeculatorsConfig /
    VerifierConfig / GreedyTokenProposalConfig, plus what vLLM's SpeculatorsConfig reads."""
    assert config["speculators_model_type"] == "eagle3"
    assert isinstance(config["architectures"], list) and all(isinstance(a, str) for a in config["architectures"])
    layer = LlamaConfig(**config["transformer_layer_config"])  # the validator builds exactly this
    assert layer.num_hidden_layers == 1 and isinstance(config["draft_vocab_size"], int)
    assert 0 < config["draft_vocab_size"] <= layer.vocab_size
    assert isinstance(config["norm_before_residual"], bool) and isinstance(config["embed_requires_grad"], bool)
    assert config["target_hidden_size"] is None or isinstance(config["target_hidden_size"], int)
    ids = config["eagle_aux_hidden_state_layer_ids"]
    assert ids is None or (isinstance(ids, list) and all(isinstance(i, int) for i in ids))
    spec = config["speculators_config"]
    assert isinstance(spec["algorithm"], str) and spec["proposal_methods"]
    for method in spec["proposal_methods"]:
        assert method["proposal_type"] == "greedy"  # the registered type we write
        assert method["speculative_tokens"] >= 1 and method["verifier_accept_k"] >= 1
        assert method["accept_tolerance"] >= 0.0
    assert spec["default_proposal_method"] in {m["proposal_type"] for m in spec["proposal_methods"]}
    verifier = spec["verifier"]
    assert set(verifier) == {"name_or_path", "architectures"} and isinstance(verifier["architectures"], list)
    assert isinstance(verifier["name_or_path"], str)


def test_vllm_speculators_export_follows_the_schema(eagle3_head, tmp_path):
    out = export_head(eagle3_head, tmp_path / "vllm", "vllm-speculators", VERIFIER, speculative_tokens=4)
    config = json.loads((out / "config.json").read_text())
    check_speculators_schema(config)
    assert config["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5] and config["draft_vocab_size"] == 30
    assert config["norm_before_residual"] is False  # vLLM would assume True without it
    assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 4
    weights = load_file(str(out / "model.safetensors"))
    assert set(weights) == EXPECTED_WEIGHTS
    assert weights["fc.weight"].shape == (32, 3 * 32) and weights["midlayer.self_attn.q_proj.weight"].shape[1] == 64
    assert weights["d2t"].dtype == torch.int64 and weights["t2d"].dtype == torch.bool
    assert (torch.arange(30) + weights["d2t"]).tolist() == list(range(0, 60, 2)) and int(weights["t2d"].sum()) == 30
    with pytest.raises(ExportError, match="not empty"):
        export_head(eagle3_head, out, "vllm-speculators", VERIFIER, speculative_tokens=4)


def vllm_eagle3_logits(folder, aux: torch.Tensor, embeds: torch.Tensor) -> torch.Tensor:
    """vLLM's llama_eagle3 forward (first draft step, causal over T positions), written from its source
    against the exported files only: aux [T, 3H] captured states, embeds [T, H] -> logits [T, V]."""
    w = load_file(str(folder / "model.safetensors"))
    cfg = json.loads((folder / "config.json").read_text())
    layer = cfg["transformer_layer_config"]
    eps, heads, kv_heads, hd = layer["rms_norm_eps"], layer["num_attention_heads"], layer["num_key_value_heads"], layer["head_dim"]

    def rms(x, weight):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight

    T = aux.shape[0]
    hidden = aux @ w["fc.weight"].T
    residual = hidden  # norm_before_residual = False
    x = torch.cat([rms(embeds, w["midlayer.input_layernorm.weight"]), rms(hidden, w["midlayer.hidden_norm.weight"])], -1)
    q = (x @ w["midlayer.self_attn.q_proj.weight"].T).view(T, heads, hd)
    k = (x @ w["midlayer.self_attn.k_proj.weight"].T).view(T, kv_heads, hd)
    v = (x @ w["midlayer.self_attn.v_proj.weight"].T).view(T, kv_heads, hd)
    inv = 1.0 / layer["rope_theta"] ** (torch.arange(0, hd, 2).float() / hd)
    angle = torch.arange(T).float()[:, None] * inv[None]
    cos, sin = torch.cat([angle, angle], -1).cos()[:, None], torch.cat([angle, angle], -1).sin()[:, None]

    def rope(t):
        return t * cos + torch.cat([-t[..., hd // 2:], t[..., : hd // 2]], -1) * sin

    q, k = rope(q), rope(k)
    k, v = k.repeat_interleave(heads // kv_heads, 1), v.repeat_interleave(heads // kv_heads, 1)
    scores = torch.einsum("thd,shd->hts", q, k) / math.sqrt(hd)
    scores = scores.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    attn = torch.einsum("hts,shd->thd", scores.softmax(-1), v).reshape(T, heads * hd)
    residual = attn @ w["midlayer.self_attn.o_proj.weight"].T + residual
    m = rms(residual, w["midlayer.post_attention_layernorm.weight"])
    mlp = (torch.nn.functional.silu(m @ w["midlayer.mlp.gate_proj.weight"].T) * (m @ w["midlayer.mlp.up_proj.weight"].T))
    prenorm = mlp @ w["midlayer.mlp.down_proj.weight"].T + residual
    draft = rms(prenorm, w["norm.weight"]) @ w["lm_head.weight"].T
    full = torch.full((T, layer["vocab_size"]), float("-inf"))
    full[:, torch.arange(cfg["draft_vocab_size"]) + w["d2t"]] = draft  # vLLM's compute_logits
    return full


def test_vllm_forward_on_the_export_reproduces_our_logits(model, eagle3_head, tmp_path):
    out = export_head(eagle3_head, tmp_path / "vllm", "vllm-speculators", VERIFIER, speculative_tokens=3)
    ids = [4, 8, 15, 16, 23, 42]
    captured = model(torch.tensor([ids]), output_hidden_states=True).hidden_states
    aux = torch.cat([captured[i][0] for i in json.loads((out / "config.json").read_text())[
        "eagle_aux_hidden_state_layer_ids"]], dim=-1)  # vLLM: the inputs of those layers, concatenated
    embeds = model.get_input_embeddings().weight[ids[1:] + [0]].detach()
    with torch.no_grad():
        ours = eagle3_head.to_target_logits(eagle3_head.logits(eagle3_head.unroll(
            eagle3_head.fuse(torch.stack([captured[i + 1][0] for i in eagle3_head.config.hidden_layers], 1))[None],
            embeds[None], 1)[0][0]))[0]
        theirs = vllm_eagle3_logits(out, aux, embeds)
    finite = torch.isfinite(ours)
    assert torch.equal(finite, torch.isfinite(theirs))
    torch.testing.assert_close(ours[finite], theirs[finite], atol=1e-4, rtol=1e-4)  # fp32 sums in another order


def test_sglang_export_uses_its_layer_convention(eagle3_head, tmp_path):
    out = export_head(eagle3_head, tmp_path / "sglang", "sglang", VERIFIER, speculative_tokens=4)
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["draft_vocab_size"] == 30
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 3, 4]  # SGLang adds the 1 itself
    assert LlamaConfig(**config).num_hidden_layers == 1
    assert set(load_file(str(out / "model.safetensors"))) == EXPECTED_WEIGHTS


def test_heads_engines_cannot_run_are_refused(model, tmp_path):
    cases = {
        "GRIFFIN": make_head(model, eagle3_default_layers(LAYERS), draft_vocab=30),
        "exactly 3": make_head(model, [1, 3], draft_vocab=30, tgf=False, teh=False),
        "last layer": make_head(model, [1, 3, LAYERS - 1], draft_vocab=30, tgf=False, teh=False),
        "target's LM head": make_head(model, eagle3_default_layers(LAYERS), tgf=False, teh=False),
    }
    for message, head in cases.items():
        with pytest.raises(ExportError, match=message):
            export_head(head, tmp_path / message.replace(" ", "_"), "vllm-speculators", VERIFIER, 4)
    full = export_head(cases["target's LM head"], tmp_path / "full", "vllm-speculators", VERIFIER, 4,
                       target_lm_head=model.get_output_embeddings().weight)
    assert json.loads((full / "config.json").read_text())["draft_vocab_size"] == 96
    assert "d2t" not in load_file(str(full / "model.safetensors"))


def test_cli_exports_a_bundle(model, eagle3_head, tmp_path):
    from specops.drafters.aligned_head.model import save_head

    target = target_from_model(model, tiny_tokenizer(), name="tiny-eight")
    bundle = write_bundle(tmp_path / "bundle", drafter_dir=save_head(eagle3_head, tmp_path / "head"),
                          drafter_kind="aligned_head", serving={"draft_tokens": 5}, target_source="in-memory",
                          target_dtype="float32", fingerprint=target.fingerprint, metrics={})
    assert main(["export", "--format", "vllm-speculators", str(bundle), str(tmp_path / "out"),
                 "--verifier", "org/tiny"]) == 0
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 5
    assert config["speculators_config"]["verifier"]["name_or_path"] == "org/tiny"
    assert main(["export", "--format", "sglang", str(bundle), str(tmp_path / "out")]) == 2  # no HF verifier known
    export_action = next(a for a in build_parser()._subparsers._group_actions[0].choices["export"]._actions
                         if a.dest == "format")
    assert list(export_action.choices) == list(EXPORT_FORMATS)
