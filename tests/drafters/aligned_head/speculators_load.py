"""Load an export the way speculators users do and run speculators' EAGLE-3 forward on it.

test_export.py runs this file with the interpreter of speculators' own environment (`make
speculators-env`: speculators 0.9.0 with the transformers it pins, which specops' own pin excludes), so it
imports nothing from specops.

    python speculators_load.py EXPORT_DIR INPUTS OUT

INPUTS (safetensors): hidden_states [1, T, 3H], the captured target states; input_ids [1, T], the token
each position drafts from; position_ids [1, T]. T is a multiple of 128, the block size of speculators'
default flex attention, whose draft-step masks assume it.
OUT.safetensors: "state.<name>" for every tensor of the loaded model, "logits.<j>" [1, T, N] for TTT
step j. OUT.json: the weight-loading report and what was loaded.
"""

from __future__ import annotations

import json
import sys
from importlib.metadata import version

import torch
import transformers.modeling_utils
from safetensors.torch import load_file, save_file
from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig
from speculators.utils.loading import load_model_layers

TTT_STEPS = 3


def load_with_report(folder: str) -> tuple[Eagle3DraftModel, list[dict]]:
    """speculators' from_pretrained, keeping transformers' loading report (missing, unexpected and
    mismatched keys), which speculators' override cannot return (it drops output_loading_info)."""
    reports: list[dict] = []
    log_report = transformers.modeling_utils.log_state_dict_report

    def keep(*args, **kwargs):
        reports.append({key: sorted(value) for key, value in kwargs["loading_info"].to_dict().items()})
        return log_report(*args, **kwargs)

    transformers.modeling_utils.log_state_dict_report = keep
    try:
        model = Eagle3DraftModel.from_pretrained(folder)
    finally:
        transformers.modeling_utils.log_state_dict_report = log_report
    return model.eval(), reports


def share_target_embeddings(model: Eagle3DraftModel) -> None:
    """The export has no embed_tokens: engines share the target's. speculators copies the verifier's only
    where its own weight reads NaN, and transformers 5.19 may leave that never-loaded weight as whatever
    memory it got (seen without accelerate installed), so take it from the verifier, with speculators'
    loader, as vLLM does."""
    verifier = model.config.speculators_config.verifier.name_or_path
    model.embed_tokens.load_state_dict({"weight": load_model_layers(["embed_tokens.weight"], verifier)["embed_tokens.weight"]})


def draft_logits(model: Eagle3DraftModel, inputs: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    """The draft-vocabulary logits of each TTT step of speculators' forward (it returns only their argmax)."""
    logits: list[torch.Tensor] = []
    hook = model.lm_head.register_forward_hook(lambda _module, _args, output: logits.append(output))
    document_ids = torch.zeros_like(inputs["input_ids"])  # one sequence
    with torch.no_grad():
        model(hidden_states=inputs["hidden_states"], input_ids=inputs["input_ids"], document_ids=document_ids,
              position_ids=inputs["position_ids"], ttt_steps=TTT_STEPS)
    hook.remove()
    return logits


def main(folder: str, inputs_file: str, out: str) -> None:
    config = Eagle3SpeculatorConfig.from_pretrained(folder)
    model, reports = load_with_report(folder)
    share_target_embeddings(model)
    tensors = {f"state.{name}": tensor.contiguous() for name, tensor in model.state_dict().items()}
    logits = draft_logits(model, load_file(inputs_file))
    tensors |= {f"logits.{step}": step_logits.contiguous() for step, step_logits in enumerate(logits)}
    save_file(tensors, f"{out}.safetensors")
    summary = {"reports": reports, "config_class": type(config).__name__, "model_class": type(model).__name__,
               "speculators": version("speculators"), "transformers": version("transformers"),
               "attention": model.config.transformer_layer_config._attn_implementation,
               "aux_layer_ids": model.config.eagle_aux_hidden_state_layer_ids}
    with open(f"{out}.json", "w") as file:
        json.dump(summary, file, indent=2)


if __name__ == "__main__":
    main(*sys.argv[1:])
