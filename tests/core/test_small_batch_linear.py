"""SmallBatchLinear: the same products as nn.Linear in other kernels, only where they are safe."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from specops.core.loop import SpeculativeGenerator
from specops.core.small_batch_linear import MAX_ROWS, SmallBatchLinear, use_small_batch_linear
from specops.core.target import target_from_model
from specops.drafters.draft_lm import DraftLMDrafter
from tests.conftest import tiny_llama


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 2, 3, MAX_ROWS, MAX_ROWS + 1, 40])
def test_matches_linear(rows, bias):
    torch.manual_seed(rows)
    linear = nn.Linear(64, 200, bias=bias)
    fast = SmallBatchLinear(linear)
    x = torch.randn(1, rows, 64)
    with torch.inference_mode():
        got, want = fast(x), linear(x)
    assert got.shape == want.shape == (1, rows, 200)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_transposed_copy_follows_weight_updates():
    linear = nn.Linear(8, 4, bias=False)
    fast = SmallBatchLinear(linear)
    x = torch.randn(1, 8)
    with torch.inference_mode():
        fast(x)
    with torch.no_grad():
        linear.weight.mul_(-2.0)  # in place: same storage, new version
    with torch.inference_mode():
        torch.testing.assert_close(fast(x), linear(x))


def test_autograd_takes_linear_and_trains_the_shared_weight():
    linear = nn.Linear(8, 4)
    fast = SmallBatchLinear(linear)
    fast(torch.randn(2, 8)).sum().backward()
    assert linear.weight.grad is not None and linear.weight.grad.abs().sum() > 0


def test_swap_keeps_parameters_names_and_ties():
    model = tiny_llama(seed=3)
    model.config.tie_word_embeddings = True
    model.tie_weights()  # lm_head.weight is embed_tokens.weight
    names = list(model.state_dict())
    swapped = use_small_batch_linear(model)
    assert swapped == 2 * 7 + 1  # per layer q, k, v, o, gate, up, down; plus the LM head
    assert list(model.state_dict()) == names
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    assert not any(type(m) is nn.Linear for m in model.modules())


def test_greedy_speculation_stays_identical_on_swapped_models(tokenizer):
    model, draft = tiny_llama(seed=0), tiny_llama(seed=1, layers=1, hidden=32)
    use_small_batch_linear(model)
    use_small_batch_linear(draft)
    target = target_from_model(model, tokenizer)
    generator = SpeculativeGenerator(target, DraftLMDrafter(draft, target.vocab_size), draft_tokens=4)
    for prompt in ([5, 17, 33, 17, 33, 40], list(range(10, 40))):
        want = model.generate(torch.tensor([prompt]), max_new_tokens=30, do_sample=False)[0, len(prompt):].tolist()
        assert generator.generate(prompt, 30).token_ids == want


def test_a_float32_draft_folder_loads_on_the_same_kernels_as_the_target(draft_dir, draft_model):
    from specops.drafters.draft_lm import load_draft_model

    fp32 = load_draft_model(draft_dir)
    linears = [m for m in fp32.modules() if isinstance(m, (nn.Linear, SmallBatchLinear))]
    assert linears and all(isinstance(m, SmallBatchLinear) for m in linears)
    ids = torch.tensor([[5, 17, 33, 40]])
    with torch.no_grad():
        torch.testing.assert_close(fp32(ids).logits, draft_model(ids).logits, atol=1e-5, rtol=1e-5)
    bf16 = load_draft_model(draft_dir, torch.bfloat16)  # the fast paths are float32 only
    assert not any(isinstance(m, SmallBatchLinear) for m in bf16.modules())
