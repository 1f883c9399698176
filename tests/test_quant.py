"""The int8 draft: close to the float layer it replaces, and the output stays the target's."""

import copy

import pytest
import torch

from specdecode import SamplingParams
from specdecode.decoding import DecodeConfig, run
from specdecode.models import HFCausalLM
from specdecode.models.quant import Int8Linear, quantize_int8
from specdecode.proposers import DraftModelProposer
from tests.test_transformers import PROMPT, VOCAB, greedy, tiny_llama


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_linear_is_close_to_the_float_layer(dtype):
    torch.manual_seed(0)
    layer = torch.nn.Linear(64, 48, bias=True).to(dtype)
    x = torch.randn(3, 5, 64, dtype=dtype)
    q = Int8Linear(layer.weight, layer.bias)
    out = q(x)
    assert out.shape == (3, 5, 48) and out.dtype == dtype
    ref = layer(x).float()
    # absmax rounding error per weight ≤ scale/2; relative to the output scale that is ~1%
    assert (out.float() - ref).abs().max() < 0.03 * ref.abs().max()
    assert torch.equal(q.first_rows(10)(x), out[..., :10])


def test_quantize_replaces_every_linear_and_keeps_greedy_output():
    target, draft = tiny_llama(0), tiny_llama(0)
    with torch.no_grad():
        for param in draft.parameters():
            param.add_(0.005 * torch.randn_like(param))
    quantized = quantize_int8(copy.deepcopy(draft))
    assert not any(isinstance(m, torch.nn.Linear) for m in quantized.modules())
    plain = run(HFCausalLM(target), None, PROMPT, greedy(48))
    for limit in (None, 64):
        spec = run(HFCausalLM(target), DraftModelProposer(HFCausalLM(quantized, vocab_limit=limit)), PROMPT,
                   DecodeConfig(max_new_tokens=48, sampling=SamplingParams(temperature=0), num_speculative_tokens=4))
        assert spec.token_ids == plain.token_ids
        assert 0 < spec.stats.num_accepted < spec.stats.num_drafted
    assert HFCausalLM(quantized, vocab_limit=64).vocab_size == 64 and HFCausalLM(quantized).vocab_size == VOCAB


def test_many_rows_take_the_dequantized_gemm_and_agree_with_the_int8_kernel():
    from specdecode.models import quant

    torch.manual_seed(1)
    layer = Int8Linear(torch.randn(32, 24), torch.randn(32))
    x = torch.randn(quant.DEQUANTIZE_ABOVE_ROWS + 4, 24)
    many = layer(x)  # one call above the threshold
    rows = torch.cat([layer(x[i:i + 1]) for i in range(len(x))])  # the int8 kernel, row by row
    assert torch.allclose(many, rows, atol=1e-4)
