"""Export an aligned head to the EAGLE-3 layouts that vLLM and SGLang serve.

Weights (one model.safetensors; LAYER is the draft decoder layer's prefix, which differs by format):
    fc.weight [H, 3H]; LAYER.{input_layernorm, hidden_norm, post_attention_layernorm}.weight;
    LAYER.self_attn.{q,k,v}_proj.weight [*, 2H]; LAYER.self_attn.o_proj.weight;
    LAYER.mlp.{gate,up,down}_proj.weight; norm.weight; lm_head.weight [N, H]; d2t [N] int64 (draft id
    + d2t = target id); t2d [V] bool. No embed_tokens: the engines then share the target's.

Formats (EXPORT_FORMATS):
  vllm-speculators  the `speculators` checkpoint (vllm-project/speculators Eagle3SpeculatorConfig and
                    Eagle3DraftModel, release SPECULATORS_VERSION): LAYER is `layers.0`, speculators' own
                    name (vLLM's `llama_eagle3.py` reads it and `midlayer`); the config has
                    speculators_model_type "eagle3", speculators_version, transformer_layer_config (a
                    one-layer Llama config), draft_vocab_size, norm_before_residual,
                    eagle_aux_hidden_state_layer_ids and speculators_config {algorithm, proposal_methods,
                    default_proposal_method, verifier}.
  sglang            a Hugging Face Llama config with architectures ["LlamaForCausalLMEagle3"] and
                    eagle_config.eagle_aux_hidden_state_layer_ids, as SGLang's `llama_eagle3.py` reads it;
                    LAYER is `midlayer`, its name.

Hidden-layer convention. specops stores entry i = the output of decoder layer i (HF
`hidden_states[i + 1]`, see specops.data.traces). vLLM's `eagle_aux_hidden_state_layer_ids` name the layer
whose *input* is captured (vLLM appends `hidden_states + residual` before running layer i), so it is
i + 1; SGLang adds that 1 itself (`layers_to_capture = [i + 1 for i in ids]`), so its ids are i.
EAGLE-3's default taps, the inputs of layers 2, L//2 and L-3, are specops layers [1, L//2 - 1, L - 4]
(`eagle3_default_layers`). Engines capture the residual stream before any final norm, so a head
trained on the last layer (which HF returns after the final norm) cannot be exported.

Only a plain EAGLE-3 head exports: these engines have no GRIFFIN token-guided fusion (a module before
the layer) or token-enhanced head (a second down projection whose output feeds the next step), and
their `fc` reads exactly three layers.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import transformers
from safetensors.torch import save_file

from specops.drafters.aligned_head.model import AlignedHead

EAGLE3_LAYERS = 3
# The speculators release the vllm-speculators layout follows; the tests load each export with its classes.
SPECULATORS_VERSION = "0.9.0"
SMOLLM2_VERIFIER = "HuggingFaceTB/SmolLM2-135M-Instruct"  # the model the shipped GGUF quantizes
LAYER_PREFIX = "midlayer."  # AlignedHead's name for its decoder layer


class ExportError(ValueError):
    """The bundle cannot be exported in the asked format; the message says why and what to change."""


def eagle3_default_layers(num_layers: int) -> list[int]:
    """EAGLE-3's default taps (inputs of layers 2, L//2, L-3) in specops' output-of-layer convention."""
    return [2 - 1, num_layers // 2 - 1, num_layers - 3 - 1]


def vllm_layer_ids(layers: list[int]) -> list[int]:
    """specops output-of-layer indices -> vLLM's eagle_aux_hidden_state_layer_ids (input-of-layer)."""
    return [layer + 1 for layer in layers]


def check_exportable(head: AlignedHead) -> None:
    cfg = head.config
    griffin = [name for name, on in (("token_guided_fusion", cfg.token_guided_fusion),
                                     ("token_enhanced_head", cfg.token_enhanced_head)) if on]
    if griffin:
        settings = " and ".join(f"train_aligned.{name}: false" for name in griffin)
        raise ExportError(f"This head uses GRIFFIN's {' and '.join(griffin)}, which the EAGLE-3 models of vLLM, "
                          f"speculators and SGLang lack. To export, set {settings} in params.yaml and retrain "
                          "the head.")
    if len(cfg.hidden_layers) != EAGLE3_LAYERS:
        raise ExportError(f"EAGLE-3 engines fuse exactly {EAGLE3_LAYERS} target layers; this head reads "
                          f"{len(cfg.hidden_layers)} ({cfg.hidden_layers}). Collect with collect.hidden_layers: "
                          f"{eagle3_default_layers(cfg.num_target_layers)}.")
    if cfg.num_target_layers - 1 in cfg.hidden_layers:
        raise ExportError(f"This head reads the target's last layer ({cfg.num_target_layers - 1}), which Hugging Face "
                          "returns after the final norm; EAGLE-3 engines capture the residual stream before it. "
                          f"Use layers below {cfg.num_target_layers - 1}.")


def export_weights(head: AlignedHead, target_lm_head: torch.Tensor | None,
                   layer_prefix: str) -> dict[str, torch.Tensor]:
    """The head's tensors under EAGLE-3's names, its layer's under `layer_prefix`; a head without a draft
    vocabulary gets the target's LM head."""
    state = {rename_layer(name, layer_prefix): tensor.detach().cpu().contiguous()
             for name, tensor in head.state_dict().items()}
    if head.lm_head is None:
        if target_lm_head is None:
            raise ExportError("This head uses the target's LM head: export needs the target's LM head weight.")
        state["lm_head.weight"] = target_lm_head.detach().float().cpu().contiguous()
    return state


def rename_layer(name: str, layer_prefix: str) -> str:
    """Our `midlayer.*` (the name EAGLE-3's reference code gives its layer) under `layer_prefix`."""
    return layer_prefix + name.removeprefix(LAYER_PREFIX) if name.startswith(LAYER_PREFIX) else name


def transformer_layer_config(head: AlignedHead) -> dict[str, Any]:
    """The head's layer as a one-layer Llama config (LlamaConfig accepts it as is)."""
    cfg = head.config
    return {
        "model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size, "num_hidden_layers": 1,
        "num_attention_heads": cfg.num_attention_heads, "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim, "hidden_act": "silu", "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta, "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "max_position_embeddings": cfg.max_position_embeddings, "vocab_size": cfg.target_vocab_size,
        "attention_bias": False, "mlp_bias": False, "tie_word_embeddings": False,
    }


def _draft_vocab(head: AlignedHead) -> int:
    return head.config.draft_vocab_size or head.config.target_vocab_size


def vllm_speculators_config(head: AlignedHead, verifier: dict[str, Any], speculative_tokens: int) -> dict[str, Any]:
    cfg = head.config
    return {
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": "eagle3",
        "speculators_version": SPECULATORS_VERSION,
        "transformers_version": transformers.__version__,  # what wrote it, as Hugging Face configs record
        "dtype": "float32",
        "transformer_layer_config": transformer_layer_config(head),
        "draft_vocab_size": _draft_vocab(head),
        # Our layer keeps the un-normed feature as the residual; vLLM assumes True when the key is absent.
        "norm_before_residual": False,
        "target_hidden_size": None,
        "eagle_aux_hidden_state_layer_ids": vllm_layer_ids(cfg.hidden_layers),
        "embed_requires_grad": False,
        "speculators_config": {
            "algorithm": "eagle3",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": speculative_tokens,
                                  "verifier_accept_k": 1, "accept_tolerance": 0.0}],
            "default_proposal_method": "greedy",
            "verifier": verifier,
        },
    }


def sglang_config(head: AlignedHead, verifier: dict[str, Any], speculative_tokens: int) -> dict[str, Any]:
    return {
        **transformer_layer_config(head),
        "architectures": ["LlamaForCausalLMEagle3"],
        "draft_vocab_size": _draft_vocab(head),
        "torch_dtype": "float32",
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(head.config.hidden_layers),
                         "use_aux_hidden_state": True},
    }


@dataclass(frozen=True)
class ExportFormat:
    config: Callable[[AlignedHead, dict[str, Any], int], dict[str, Any]]  # (head, verifier, draft tokens)
    layer_prefix: str  # the draft decoder layer's weight names


EXPORT_FORMATS: dict[str, ExportFormat] = {
    # speculators' Eagle3DraftModel loads only `layers.0.*` (it would random-initialize a `midlayer`).
    "vllm-speculators": ExportFormat(vllm_speculators_config, "layers.0."),
    "sglang": ExportFormat(sglang_config, "midlayer."),
}


def verifier_for(target_source: str, name_or_path: str | None) -> dict[str, Any]:
    """The verifier entry: an explicit HF id or folder, else the bundle's target if it is an HF folder."""
    if name_or_path is None:
        if target_source == "smollm2":
            name_or_path = SMOLLM2_VERIFIER
        elif (Path(target_source) / "config.json").is_file():
            name_or_path = str(Path(target_source).resolve())
        else:
            raise ExportError(f"The bundle's target '{target_source}' is not a Hugging Face model that vLLM or "
                              "SGLang can load; pass the verifier's HF id or folder (--verifier).")
    config_file = Path(name_or_path) / "config.json"
    if config_file.is_file():
        # speculators' VerifierConfig needs a list: a config without architectures (one from a GGUF) gives [].
        architectures = json.loads(config_file.read_text()).get("architectures") or []
    else:
        architectures = ["LlamaForCausalLM"]
    return {"name_or_path": name_or_path, "architectures": architectures}


def export_head(head: AlignedHead, out_dir: Path | str, fmt: str, verifier: dict[str, Any], speculative_tokens: int,
                target_lm_head: torch.Tensor | None = None, overwrite: bool = False) -> Path:
    """Write config.json + model.safetensors for `fmt` into out_dir."""
    if fmt not in EXPORT_FORMATS:
        raise ExportError(f"Unknown export format '{fmt}'. Choose one of: {', '.join(EXPORT_FORMATS)}.")
    if speculative_tokens < 1:
        raise ExportError(f"speculative_tokens must be >= 1, got {speculative_tokens}.")
    check_exportable(head)
    out = Path(out_dir)
    if out.exists() and any(out.iterdir()):
        if not overwrite:
            raise ExportError(f"{out} exists and is not empty; remove it or pass overwrite.")
        shutil.rmtree(out)
    out.mkdir(parents=True, exist_ok=True)
    layout = EXPORT_FORMATS[fmt]
    save_file(export_weights(head, target_lm_head, layout.layer_prefix), str(out / "model.safetensors"),
              metadata={"format": "pt"})
    config = layout.config(head, verifier, speculative_tokens)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out
