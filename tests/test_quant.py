"""The int8 and int4 drafts: close to the float layers they replace, and the output stays the target's."""

import copy

import pytest
import torch

from specdecode import SamplingParams
from specdecode.engine.driver import run, run_all
from specdecode.engine.request import DecodeConfig, Request
from specdecode.models import HFCausalLM
from specdecode.models.quant import Int4Linear, Int8Linear, quantize
from specdecode.proposers import DraftModelProposer

from helpers import PROMPT, VOCAB, greedy, tiny_llama


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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_int4_linear_is_close_to_the_float_layer_and_to_its_own_dequantization(dtype):
    torch.manual_seed(0)
    layer = torch.nn.Linear(128, 96, bias=True).to(dtype)
    x = torch.randn(3, 5, 128, dtype=dtype)
    q = Int4Linear(layer.weight, layer.bias)
    out = q(x)  # 15 rows: the int4 kernel
    assert out.shape == (3, 5, 96) and out.dtype == dtype
    ref = layer(x).float()
    # 16 levels per group of 32: rounding error ≤ (max−min)/30 per weight, ~8% of the output scale
    assert (out.float() - ref).abs().max() < 0.12 * ref.abs().max()
    # the kernel and the plain-layout dequantization describe the same weights
    exact = x.float() @ q.dequantize(torch.float32).t() + layer.bias.float()
    tolerance = {torch.float32: 1e-4, torch.bfloat16: 0.02, torch.float16: 0.005}[dtype]
    assert (out.float() - exact).abs().max() < tolerance * exact.abs().max()
    for n in (32, 40):  # a whole block of 16 rows, and a part of one
        assert torch.allclose(q.first_rows(n)(x), out[..., :n], atol=1e-5 if dtype == torch.float32 else 0.05)
    last = x[:, -1:]  # a batch's last positions: strided rows, which the kernel itself refuses
    assert torch.allclose(q(last), out[:, -1:], atol=1e-5 if dtype == torch.float32 else 0.05)


def test_int4_codes_round_trip_and_bad_shapes_are_refused():
    torch.manual_seed(2)
    weight = torch.randn(48, 64)
    q = Int4Linear(weight)
    assert q.codes().shape == (48, 64) and int(q.codes().max()) <= 15
    err = (q.dequantize(torch.float32) - weight).abs().view(48, 2, 32)
    span = weight.view(48, 2, 32).amax(-1) - weight.view(48, 2, 32).amin(-1)
    assert (err.amax(-1) <= span / 30 + 1e-5).all()  # half a step of each group
    assert not Int4Linear.supports(torch.randn(40, 64)) and not Int4Linear.supports(torch.randn(48, 40))
    with pytest.raises(ValueError, match="int4 needs"):
        Int4Linear(torch.randn(40, 64))
    with pytest.raises(ValueError, match="group_size"):
        Int4Linear(torch.randn(48, 64), group_size=48)
    with pytest.raises(ValueError, match="bits"):
        quantize(torch.nn.Linear(4, 4), bits=3)


@pytest.mark.parametrize("bits", [8, 4])
def test_quantize_replaces_every_linear_and_keeps_greedy_output(bits):
    target, draft = tiny_llama(0), tiny_llama(0)
    with torch.no_grad():
        for param in draft.parameters():
            param.add_(0.005 * torch.randn_like(param))
    num_linear = sum(isinstance(m, torch.nn.Linear) for m in draft.modules())
    quantized = quantize(copy.deepcopy(draft), bits)
    assert not any(isinstance(m, torch.nn.Linear) for m in quantized.modules())
    kind = Int4Linear if bits == 4 else Int8Linear  # every tiny-Llama shape suits the int4 kernel
    assert sum(isinstance(m, kind) for m in quantized.modules()) == num_linear
    plain = run(HFCausalLM(target), None, PROMPT, greedy(48))
    for limit in (None, 64):
        spec = run(HFCausalLM(target), DraftModelProposer(HFCausalLM(quantized, vocab_limit=limit)), PROMPT,
                   DecodeConfig(max_new_tokens=48, sampling=SamplingParams(temperature=0), num_speculative_tokens=4))
        assert spec.token_ids == plain.token_ids
        assert 0 < spec.stats.num_accepted < spec.stats.num_drafted
    assert HFCausalLM(quantized, vocab_limit=64).vocab_size == 64 and HFCausalLM(quantized).vocab_size == VOCAB


@pytest.mark.parametrize("kind", [Int8Linear, Int4Linear])
def test_many_rows_take_the_dequantized_gemm_and_agree_with_the_integer_kernel(kind):
    torch.manual_seed(1)
    layer = kind(torch.randn(32, 64), torch.randn(32))
    x = torch.randn(kind.DEQUANTIZE_ABOVE_ROWS + 4, 64)  # float32
    many = layer(x)  # one call above the threshold
    rows = torch.cat([layer(x[i:i + 1]) for i in range(len(x))])  # the integer kernel, row by row
    assert torch.allclose(many, rows, atol=1e-4)


@pytest.mark.parametrize("kind", [Int8Linear, Int4Linear])
def test_without_native_bfloat16_many_bfloat16_rows_take_a_float32_gemm(kind, monkeypatch):
    torch.manual_seed(1)
    layer = kind(torch.randn(32, 64), torch.randn(32))
    x = torch.randn(kind.EMULATED_DEQUANTIZE_ABOVE_ROWS + 4, 64).bfloat16()
    expected = (torch.nn.functional.linear(x.float(), layer.dequantize(torch.float32)) + layer.bias.float())
    monkeypatch.setattr("specdecode.models.quant._native_bfloat16", lambda: False)
    emulated = layer(x)
    assert emulated.dtype == torch.bfloat16
    assert torch.equal(emulated, expected.bfloat16()) or torch.allclose(emulated.float(), expected, atol=0.1, rtol=0.02)
    # the bfloat16 GEMM a native CPU takes gives a differently rounded result
    monkeypatch.setattr("specdecode.models.quant._native_bfloat16", lambda: True)
    native = layer(x)
    assert not torch.equal(native, emulated)
    rows = torch.cat([layer(x[i:i + 1]) for i in range(len(x))])  # a few rows: the integer kernel either way
    assert torch.allclose(emulated.float(), rows.float(), atol=0.1, rtol=0.02)


def test_a_batch_with_an_int4_draft_equals_its_rows_alone():
    target, draft = tiny_llama(0), tiny_llama(0)
    with torch.no_grad():
        for param in draft.parameters():
            param.add_(0.005 * torch.randn_like(param))
    quantize(draft, 4)
    assert isinstance(draft.lm_head, Int4Linear)  # its logits rows are strided in a batch
    prompts = [[5, 17, 33, 2], [9, 3], [60, 61, 62, 1, 2, 3]]
    configs = [DecodeConfig(max_new_tokens=24, sampling=SamplingParams(temperature=0), num_speculative_tokens=4)] * 3
    batch = run_all(HFCausalLM(target), DraftModelProposer(HFCausalLM(draft)),
                    [Request(prompt, config) for prompt, config in zip(prompts, configs)])
    for prompt, got in zip(prompts, batch):
        assert got.token_ids == run(HFCausalLM(target), None, prompt, greedy(24)).token_ids
