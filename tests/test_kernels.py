"""specdecode.models.kernels: every private torch op the package calls exists in the pinned torch
and computes what its plain-torch reference computes, on small inputs."""

import pytest
import torch

from specdecode.models import kernels

pytestmark = pytest.mark.skipif(torch.__version__.split("+")[0] != "2.13.0",
                                reason="the private ops are checked against the pinned torch 2.13.0")


def test_every_private_op_exists_in_the_pinned_torch():
    assert kernels.missing() == []
    assert all(kernels.available(name) for name in kernels.PRIVATE_OPS)


def test_an_unknown_kernel_name_is_a_clear_error():
    with pytest.raises(ValueError, match="no kernel named 'int3_matmul'"):
        kernels.available("int3_matmul")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_matmul_computes_x_times_the_scaled_int8_weight(dtype):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 64, generator=g).to(dtype)
    weight = torch.randint(-127, 128, (32, 64), generator=g, dtype=torch.int8)
    scale = (torch.rand(32, generator=g) * 0.01 + 0.001).to(dtype)
    reference = x.float() @ (weight.float() * scale.float()[:, None]).T
    got = kernels.int8_matmul(x, weight, scale)
    assert got.shape == (3, 32) and got.dtype == dtype
    torch.testing.assert_close(got.float(), reference, rtol=2e-2 if dtype == torch.bfloat16 else 1e-5, atol=1e-3)


@pytest.mark.parametrize("group_size", [32, 64])
def test_int4_matmul_of_packed_codes_computes_x_times_the_dequantized_weight(group_size):
    # W[n, i] = (code[n, i] − 8) · scale[g, n] + zero[g, n] with g = i // group_size
    g = torch.Generator().manual_seed(1)
    out, inp = 32, 128
    codes = torch.randint(0, 16, (out, inp), generator=g, dtype=torch.int32)
    scale_zero = torch.stack([torch.rand(inp // group_size, out, generator=g) * 0.1,
                              torch.randn(inp // group_size, out, generator=g) * 0.1], -1)
    weight = ((codes.float() - 8).view(out, inp // group_size, group_size) * scale_zero[..., 0].T[..., None]
              + scale_zero[..., 1].T[..., None]).view(out, inp)
    x = torch.randn(5, inp, generator=g)
    got = kernels.int4_matmul(x, kernels.int4_pack(codes), group_size, scale_zero)
    assert got.shape == (5, out)
    torch.testing.assert_close(got, x @ weight.T, rtol=1e-4, atol=1e-4)


def test_int4_pack_of_more_codes_differs():
    # a check that the packed copy depends on the codes (a constant layout would pass the test above only by luck)
    codes = torch.zeros(32, 64, dtype=torch.int32)
    other = codes.clone()
    other[3, 5] = 9
    assert not torch.equal(kernels.int4_pack(codes), kernels.int4_pack(other))


@pytest.mark.parametrize("bias", [True, False])
def test_onednn_linear_with_a_packed_weight_computes_the_float32_linear(bias):
    g = torch.Generator().manual_seed(2)
    weight, x = torch.randn(48, 32, generator=g), torch.randn(7, 32, generator=g)
    b = torch.randn(48, generator=g) if bias else None
    got = kernels.onednn_linear(x, kernels.onednn_pack_weight(weight, rows_hint=9), b)
    torch.testing.assert_close(got, torch.nn.functional.linear(x, weight, b), rtol=1e-5, atol=1e-5)


def test_without_onednn_turns_onednn_off_inside_only_and_computes_the_same_product():
    g = torch.Generator().manual_seed(3)
    weight, x = torch.randn(64, 32, generator=g).bfloat16(), torch.randn(1, 32, generator=g).bfloat16()
    assert torch.backends.mkldnn.enabled
    with kernels.without_onednn():
        assert not torch.backends.mkldnn.enabled
        inside = torch.nn.functional.linear(x, weight)
    assert torch.backends.mkldnn.enabled
    torch.testing.assert_close(inside, torch.nn.functional.linear(x, weight), rtol=1e-2, atol=1e-2)
    with pytest.raises(KeyError), kernels.without_onednn():  # restored on an error too
        raise KeyError
    assert torch.backends.mkldnn.enabled


def test_onednn_bfloat16_support_is_a_bool_true_on_a_cpu_with_native_bfloat16():
    import os

    supported = kernels.onednn_bfloat16_supported()
    assert isinstance(supported, bool)
    with open("/proc/cpuinfo") as f:
        flags = set(next((line for line in f if line.startswith("flags")), "").split())
    if flags & {"avx512_bf16", "amx_bf16"} and not os.environ.get("ONEDNN_MAX_CPU_ISA"):
        assert supported  # (an ISA cap makes such a CPU act as an older one)
