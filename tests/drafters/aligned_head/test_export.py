"""Export to vLLM (speculators layout) and SGLang: weight names, the layer convention, the vLLM export
loaded by speculators itself (its classes, in its own environment) and an independent
re-implementation of vLLM's EAGLE-3 forward, both of which must reproduce our logits.

speculators 0.9.0 pins transformers<=5.19.0, below ours, so it lives in a venv of its own that `make
test` builds (`make speculators-env`) and names in SPECOPS_SPECULATORS_PYTHON; speculators_load.py runs
there.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig

from specops.cli import build_parser, main
from specops.core.kv import CachedLM
from specops.core.target import target_from_model
from specops.drafters.aligned_head.export import (
    EXPORT_FORMATS,
    SMOLLM2_VERIFIER,
    SPECULATORS_VERSION,
    ExportError,
    eagle3_default_layers,
    export_head,
    verifier_for,
    vllm_layer_ids,
)
from specops.drafters.aligned_head.model import save_head
from specops.drafters.kinds import DecodingConfig
from specops.server.bundle import write_bundle
from tests.conftest import tiny_llama, tiny_tokenizer
from tests.drafters.aligned_head.conftest import make_head

LAYERS = 8
LAYER_WEIGHTS = [
    "input_layernorm.weight", "hidden_norm.weight", "post_attention_layernorm.weight", "self_attn.q_proj.weight",
    "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight", "mlp.gate_proj.weight",
    "mlp.up_proj.weight", "mlp.down_proj.weight",
]


def expected_weights(layer_prefix: str) -> set[str]:
    return {"fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d"} | {layer_prefix + w for w in LAYER_WEIGHTS}


VERIFIER = {"name_or_path": "org/tiny-verifier", "architectures": ["LlamaForCausalLM"]}
SPECULATORS_LOAD = Path(__file__).with_name("speculators_load.py")
SPECULATORS_PYTHON = "SPECOPS_SPECULATORS_PYTHON"  # make test sets it to speculators' venv
FLEX_BLOCK = 128  # speculators' default flex attention masks its draft steps in whole blocks of this many tokens


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


def test_vllm_speculators_export_layout(eagle3_head, tmp_path):
    out = export_head(eagle3_head, tmp_path / "vllm", "vllm-speculators", VERIFIER, speculative_tokens=4)
    config = json.loads((out / "config.json").read_text())
    assert config["speculators_model_type"] == "eagle3" and config["speculators_version"] == SPECULATORS_VERSION
    assert config["transformers_version"] and config["dtype"] == "float32" and "torch_dtype" not in config
    assert config["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5] and config["draft_vocab_size"] == 30
    assert config["norm_before_residual"] is False  # vLLM would assume True without it
    assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 4
    assert LlamaConfig(**config["transformer_layer_config"]).num_hidden_layers == 1
    weights = load_file(str(out / "model.safetensors"))
    assert set(weights) == expected_weights("layers.0.")  # speculators' names; it ignores midlayer.*
    assert weights["fc.weight"].shape == (32, 3 * 32) and weights["layers.0.self_attn.q_proj.weight"].shape[1] == 64
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
    x = torch.cat([rms(embeds, w["layers.0.input_layernorm.weight"]), rms(hidden, w["layers.0.hidden_norm.weight"])], -1)
    q = (x @ w["layers.0.self_attn.q_proj.weight"].T).view(T, heads, hd)
    k = (x @ w["layers.0.self_attn.k_proj.weight"].T).view(T, kv_heads, hd)
    v = (x @ w["layers.0.self_attn.v_proj.weight"].T).view(T, kv_heads, hd)
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
    residual = attn @ w["layers.0.self_attn.o_proj.weight"].T + residual
    m = rms(residual, w["layers.0.post_attention_layernorm.weight"])
    mlp = (torch.nn.functional.silu(m @ w["layers.0.mlp.gate_proj.weight"].T) * (m @ w["layers.0.mlp.up_proj.weight"].T))
    prenorm = mlp @ w["layers.0.mlp.down_proj.weight"].T + residual
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


def speculators_python() -> str:
    """The interpreter of speculators' venv: make test builds it and names it; a bare pytest run without
    it skips the test."""
    python = os.environ.get(SPECULATORS_PYTHON)
    if python is None:
        pytest.skip(f"speculators' environment is not named: run make test, or make speculators-env and set "
                    f"{SPECULATORS_PYTHON}=.cache/speculators-venv/bin/python")
    assert Path(python).is_file(), f"{SPECULATORS_PYTHON}={python} does not exist: run make speculators-env"
    return python


def run_speculators(export: Path, inputs: dict[str, torch.Tensor], work: Path) -> tuple[dict, dict]:
    """speculators_load.py in speculators' venv: (its summary, its tensors)."""
    save_file(inputs, str(work / "inputs.safetensors"))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    done = subprocess.run([speculators_python(), str(SPECULATORS_LOAD), str(export), str(work / "inputs.safetensors"),
                           str(work / "result")], cwd=work, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads((work / "result.json").read_text()), load_file(str(work / "result.safetensors"))


@pytest.mark.slow
def test_speculators_loads_the_export_and_reproduces_our_head(model, eagle3_head, tmp_path):
    """speculators' own Eagle3SpeculatorConfig and Eagle3DraftModel.from_pretrained load every tensor
    (none missing, unexpected or random), and its forward, three TTT steps, gives our logits."""
    model.save_pretrained(tmp_path / "verifier")  # speculators reads the target's depth and embeddings here
    out = export_head(eagle3_head, tmp_path / "export", "vllm-speculators",
                      verifier_for("in-memory", str(tmp_path / "verifier")), speculative_tokens=3)
    ids = torch.randint(0, 96, (FLEX_BLOCK + 1,), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        captured = model(ids[None, :-1], output_hidden_states=True).hidden_states
        features = torch.stack([captured[i + 1][0] for i in eagle3_head.config.hidden_layers], 1)  # [T, 3, H]
        steps = eagle3_head.unroll(eagle3_head.fuse(features)[None], model.get_input_embeddings().weight[ids[1:]][None], 3)
        ours = [eagle3_head.logits(token) for token, _ in steps]  # [1, T, N] each
    # Position t drafts from the token after it: speculators pairs hidden_states[t] with input_ids[t].
    inputs = {"hidden_states": features.flatten(1)[None].contiguous(), "input_ids": ids[None, 1:].contiguous(),
              "position_ids": torch.arange(FLEX_BLOCK)[None]}
    summary, theirs = run_speculators(out, inputs, tmp_path)
    assert (summary["config_class"], summary["model_class"]) == ("Eagle3SpeculatorConfig", "Eagle3DraftModel")
    assert summary["speculators"] == SPECULATORS_VERSION and summary["aux_layer_ids"] == [2, 4, 5]
    assert len(summary["reports"]) == 1 and not any(summary["reports"][0].values()), summary["reports"]
    for name, tensor in load_file(str(out / "model.safetensors")).items():
        assert torch.equal(theirs[f"state.{name}"], tensor), name
    for step, logits in enumerate(ours):
        # speculators' step j at position t continues the draft our step j computes at t + j.
        torch.testing.assert_close(theirs[f"logits.{step}"][:, : FLEX_BLOCK - step], logits[:, step:],
                                   atol=1e-5, rtol=1e-5)  # fp32, sums in another order (measured 2e-6)


def test_sglang_export_uses_its_layer_convention(eagle3_head, tmp_path):
    out = export_head(eagle3_head, tmp_path / "sglang", "sglang", VERIFIER, speculative_tokens=4)
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["draft_vocab_size"] == 30
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 3, 4]  # SGLang adds the 1 itself
    assert LlamaConfig(**config).num_hidden_layers == 1
    assert set(load_file(str(out / "model.safetensors"))) == expected_weights("midlayer.")  # SGLang's names


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


def test_verifier_entry_reads_the_folder_and_always_lists_architectures(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": None}))  # as a config taken from a GGUF
    assert verifier_for("smollm2", str(tmp_path)) == {"name_or_path": str(tmp_path), "architectures": []}
    assert verifier_for("smollm2", None) == {"name_or_path": SMOLLM2_VERIFIER, "architectures": ["LlamaForCausalLM"]}


def test_cli_exports_a_bundle(model, eagle3_head, tmp_path):
    target = target_from_model(model, tiny_tokenizer(), name="tiny-eight")
    bundle = write_bundle(tmp_path / "bundle", drafter_dir=save_head(eagle3_head, tmp_path / "head"),
                          drafter_kind="aligned_head", serving={"draft_tokens": 5}, target_source="in-memory",
                          target_dtype="float32", fingerprint=target.fingerprint, metrics={})
    assert main(["export", str(bundle), "--format", "vllm-speculators", "--out", str(tmp_path / "out"),
                 "--verifier", "org/tiny"]) == 0
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 5
    assert config["speculators_config"]["verifier"]["name_or_path"] == "org/tiny"
    assert main(["export", str(bundle), "--format", "sglang", "--out", str(tmp_path / "sg")]) == 2  # no HF verifier
    assert main(["export", str(bundle), "--format", "sglang", "--out", str(tmp_path / "sg"), "--target", "x"]) == 2
    export_action = next(a for a in build_parser()._subparsers._group_actions[0].choices["export"]._actions
                         if a.dest == "format")
    assert list(export_action.choices) == list(EXPORT_FORMATS)


def test_cli_exports_a_trained_head_folder(eagle3_head, tmp_path, capsys):
    """A head that is in no bundle (models/aligned_head) exports too; the draft length defaults to serving's."""
    head = save_head(eagle3_head, tmp_path / "head")
    assert main(["export", str(head), "--format", "vllm-speculators", "--out", str(tmp_path / "out")]) == 0
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["speculators_config"]["verifier"]["name_or_path"] == SMOLLM2_VERIFIER  # the default target's
    assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == DecodingConfig.draft_tokens
    assert main(["export", str(head), "--format", "vllm-speculators", "--out", str(tmp_path / "out"),
                 "--overwrite", "--draft-tokens", "2"]) == 0
    assert json.loads((tmp_path / "out" / "config.json").read_text())[
        "speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 2
    assert main(["export", str(tmp_path), "--format", "sglang", "--out", str(tmp_path / "x")]) == 2
    assert "neither a bundle" in capsys.readouterr().err


def test_cli_names_the_settings_that_make_the_default_head_exportable(model, tmp_path, capsys):
    """The quickstart head has GRIFFIN's fusion and token-enhanced head on: the error names both settings."""
    head = save_head(make_head(model, eagle3_default_layers(LAYERS), draft_vocab=30), tmp_path / "griffin")
    assert main(["export", str(head), "--format", "vllm-speculators", "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "train_aligned.token_guided_fusion: false and train_aligned.token_enhanced_head: false" in err
    assert not (tmp_path / "out").exists()
    fused_only = save_head(make_head(model, eagle3_default_layers(LAYERS), draft_vocab=30, teh=False), tmp_path / "tgf")
    assert main(["export", str(fused_only), "--format", "sglang", "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "train_aligned.token_guided_fusion: false in" in err and "token_enhanced_head" not in err
