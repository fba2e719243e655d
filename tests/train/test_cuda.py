"""The GPU paths of the pipeline: trace collection with `collect.device: cuda` and training with
`accelerator: gpu` (fp32 and bf16-mixed). The same code runs on the CPU in the rest of the suite; these
tests run only where torch sees a GPU (skipped in CI and on the 2-core dev machine), and check the GPU
run against the CPU run of the same code: the same traces up to float rounding, and the same training
trajectory within what bf16 autocast allows."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import AutoModelForCausalLM

from specops.core.loop import SpeculativeGenerator
from specops.data.collect import collect
from specops.data.traces import TraceShards
from specops.drafters.draft_lm import DraftLMDrafter
from specops.train.train_draft import train_draft
from tests.train.conftest import collect_config
from tests.train.test_draft_lm import fit_config

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def test_cuda_collection_writes_the_cpu_traces(tmp_path, prompts_dir, tiny_target):
    cpu = collect(collect_config(tmp_path / "cpu", splits=["train"], max_new_tokens=16, generate_batch_size=4),
                  tiny_target, prompts_dir)
    gpu = collect(collect_config(tmp_path / "gpu", splits=["train"], max_new_tokens=16, generate_batch_size=4,
                                 device="cuda"), tiny_target, prompts_dir)
    tiny_target.model.cpu()  # collect moved the shared fixture's model to the GPU
    assert cpu["train"]["sequences"] == gpu["train"]["sequences"] > 4
    a, b = (TraceShards(tmp_path / d / "train") for d in ("cpu", "gpu"))
    same_tokens = sum(torch.equal(a[i]["input_ids"], b[i]["input_ids"]) for i in range(len(a)))
    assert same_tokens == len(a), f"{len(a) - same_tokens} of {len(a)} GPU replies differ from the CPU's"
    for i in range(len(a)):
        torch.testing.assert_close(a[i]["topk_logprobs"], b[i]["topk_logprobs"], rtol=0, atol=1e-3)
        torch.testing.assert_close(a[i]["hidden_states"], b[i]["hidden_states"], rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_gpu_training_follows_the_cpu_run_and_serves_exactly(precision, tmp_path, tiny_target, traces_dir):
    cpu = train_draft(fit_config(tmp_path / "cpu"), tiny_target, traces_dir)
    gpu = train_draft(fit_config(tmp_path / "gpu", accelerator="gpu", precision=precision), tiny_target, traces_dir)
    tiny_target.model.cpu()
    assert gpu["steps"] == cpu["steps"] == 4
    assert math.isfinite(gpu["final_loss"]) and math.isfinite(gpu["val_loss"])
    tolerance = 1e-3 if precision == "32-true" else 5e-2
    assert gpu["final_loss"] == pytest.approx(cpu["final_loss"], rel=tolerance)
    # Trained on the GPU, served on the CPU runtime: still HF greedy decoding's tokens.
    draft = AutoModelForCausalLM.from_pretrained(tmp_path / "gpu").eval()
    generator = SpeculativeGenerator(tiny_target, DraftLMDrafter(draft, tiny_target.vocab_size), "greedy", 4)
    prompt = tiny_target.tokenizer("question 3: what is 3 + 9?")["input_ids"]
    expected = tiny_target.model.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False)[0, len(prompt):]
    result = generator.generate(prompt, 16)
    assert result.token_ids == expected.tolist()[: len(result.token_ids)]
