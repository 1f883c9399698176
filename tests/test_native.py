"""specdecode.native's batch-invariant kernels: each against a float64 reference (within bfloat16
output rounding), and each row bit for bit the same whatever else the call holds (every row count
1..16 and a prompt-sized call, other rows, padding slots, one thread or two). The invariance check
itself must fail a kernel whose rounding depends on the row count (the negative control). The
slow tests rerun the file with the AVX2 and portable builds."""

import os
import subprocess
import sys

import pytest
import torch

from specdecode import native

pytestmark = pytest.mark.skipif(not native.available(), reason="no C++ compiler for specdecode.native")

ROWS = list(range(1, 17)) + [70]
SHAPES = [(40, 7), (96, 5), (64, 1), (256, 33), (1536, 12)]  # (K, N): K tails of the 32-wide steps, N tails of 4


def bf16(*shape, seed=0, scale=1.0):
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale).bfloat16()


def rows_alone(fn, x):
    """fn applied to each row of x alone, stacked."""
    return torch.cat([fn(x[i:i + 1]) for i in range(x.shape[0])])


def assert_row_invariant(fn, x):
    """fn(x) equals fn on each row alone, bit for bit."""
    assert torch.equal(fn(x), rows_alone(fn, x))


@pytest.mark.parametrize("k,n", SHAPES)
@pytest.mark.parametrize("bias", [False, True])
def test_linear_matches_float64_and_every_row_count_rounds_alike(k, n, bias):
    weight = bf16(n, k, seed=1)
    b = torch.randn(n, generator=torch.Generator().manual_seed(2)) if bias else None
    x = bf16(max(ROWS), k, seed=3)
    alone = rows_alone(lambda r: native.linear(r, weight, b), x)
    reference = x.double() @ weight.double().T + (b.double() if bias else 0)
    bound = x.double().abs() @ weight.double().abs().T
    for m in ROWS:
        y = native.linear(x[:m], weight, b)
        assert y.dtype == torch.bfloat16 and y.shape == (m, n)
        assert torch.equal(y, alone[:m]), f"{m} rows round differently from one"
        # bfloat16 output rounding (2^-8 relative) plus float32 accumulation
        assert bool(((y.double() - reference[:m]).abs() <= 2 ** -8 * reference[:m].abs() + 1e-5 * bound[:m] + 1e-6).all())


def test_linear_float32_logits_and_strided_rows():
    weight = bf16(50, 96, seed=4)
    x = bf16(9, 2, 96, seed=5)
    y = native.linear(x, weight, out_float32=True)
    assert y.dtype == torch.float32 and y.shape == (9, 2, 50)
    reference = x.double() @ weight.double().T
    torch.testing.assert_close(y.double(), reference, atol=1e-4, rtol=1e-5)
    wide = bf16(9, 200, seed=6)
    assert torch.equal(native.linear(wide[:, 40:136], weight), native.linear(wide[:, 40:136].contiguous(), weight))


def test_linear_same_with_one_thread_or_two():
    weight, x = bf16(37, 256, seed=7), bf16(9, 256, seed=8)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = native.linear(x, weight)
        torch.set_num_threads(2)
        two = native.linear(x, weight)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)


def test_invariance_check_fails_a_row_count_dependent_kernel():
    """The negative control: a float32 product whose summation splits K when it holds several rows
    (as a GEMM's blocking may) is caught by the same check the kernels pass."""
    weight, x = bf16(64, 1536, seed=9).float(), bf16(9, 1536, seed=10).float()

    def blocked(rows):
        if rows.shape[0] == 1:
            return rows @ weight.T
        return rows[:, :768] @ weight[:, :768].T + rows[:, 768:] @ weight[:, 768:].T

    with pytest.raises(AssertionError):
        assert_row_invariant(blocked, x)


def reference_rms_norm(x, weight, eps):
    normed = x.float() * torch.rsqrt(x.double().pow(2).mean(-1, keepdim=True) + eps).float()
    return (weight.float() * normed.bfloat16().float()).bfloat16()


@pytest.mark.parametrize("hidden", [64, 100, 1536])
def test_rms_norm_matches_transformers_rounding_within_one_step(hidden):
    weight, x = bf16(hidden, seed=11), bf16(17, hidden, seed=12, scale=3.0)
    y = native.rms_norm(x, weight, 1e-6)
    reference = reference_rms_norm(x, weight, 1e-6)
    # the mean of squares may differ in its last float32 bit: at most two bfloat16 steps apart
    assert bool(((y.float() - reference.float()).abs() <= 2 ** -6 * reference.float().abs() + 1e-30).all())
    assert_row_invariant(lambda r: native.rms_norm(r, weight, 1e-6), x)


@pytest.mark.parametrize("inner", [7, 64, 8960])
def test_silu_mul_matches_float64_and_rounds_each_element_alone(inner):
    gate_up = bf16(11, 2 * inner, seed=13, scale=4.0)
    y = native.silu_mul(gate_up)
    gate, up = gate_up[:, :inner].double(), gate_up[:, inner:].double()
    reference = (gate * torch.sigmoid(gate)).bfloat16().double() * up
    assert bool(((y.double() - reference).abs() <= 2 ** -7 * reference.abs() + 1e-30).all())
    assert_row_invariant(native.silu_mul, gate_up)


def reference_attention(q, k, v, allowed, scale):
    """float64 softmax attention: q [B, T, Hq, D], k/v [B, Hkv, S, D], allowed [B, T, S]."""
    group = q.shape[2] // k.shape[1]
    keys = k.double().repeat_interleave(group, 1)            # [B, Hq, S, D]
    values = v.double().repeat_interleave(group, 1)
    scores = torch.einsum("bthd,bhsd->bths", q.double(), keys) * scale
    scores = scores.masked_fill(~allowed[:, :, None, :], float("-inf"))
    return torch.einsum("bths,bhsd->bthd", scores.softmax(-1), values)


def causal(batch, width, slots):
    return (torch.arange(slots)[None, :] <= torch.arange(slots - width, slots)[:, None]).expand(batch, width, slots)


@pytest.mark.parametrize("dim", [16, 40, 128])
def test_attention_matches_float64_with_masks_and_grouped_heads(dim):
    batch, width, slots, heads, kv_heads = 2, 5, 23, 6, 2
    q = bf16(batch, width, heads, dim, seed=14)
    k, v = bf16(batch, kv_heads, slots, dim, seed=15), bf16(batch, kv_heads, slots, dim, seed=16)
    allowed = causal(batch, width, slots).clone()
    allowed[1, :, :7] = False                                  # row 1's padding slots
    allowed[0, 2, 10] = False                                  # a hole (a rejected tree node)
    out = native.attention(q, k, v, allowed, dim ** -0.5)
    reference = reference_attention(q, k, v, allowed, dim ** -0.5)
    torch.testing.assert_close(out.double(), reference, atol=2e-2, rtol=2 ** -7)
    dense = native.attention(q, k, v, None, dim ** -0.5)       # None: dense causal rows
    assert torch.equal(dense, native.attention(q, k, v, causal(batch, width, slots), dim ** -0.5))


def test_attention_row_depends_only_on_the_slots_it_sees():
    """A query gives the same bits alone (one query, cache up to it), among other queries, with
    padding slots spliced in before its keys, and beside another batch row."""
    dim, slots, width = 128, 40, 9
    q = bf16(1, width, 12, dim, seed=17)
    k, v = bf16(1, 2, slots, dim, seed=18), bf16(1, 2, slots, dim, seed=19)
    together = native.attention(q, k, v, None, dim ** -0.5)
    for t in range(width):
        visible = slots - width + t + 1
        alone = native.attention(q[:, t:t + 1], k[:, :, :visible], v[:, :, :visible], None, dim ** -0.5)
        assert torch.equal(alone[:, 0], together[:, t])
    pad = 13
    padded_k = torch.cat([bf16(1, 2, pad, dim, seed=20), k], 2)
    padded_v = torch.cat([bf16(1, 2, pad, dim, seed=21), v], 2)
    allowed = causal(1, width, slots + pad).clone()
    allowed[:, :, :pad] = False
    assert torch.equal(native.attention(q, padded_k, padded_v, allowed, dim ** -0.5), together)
    other = bf16(1, width, 12, dim, seed=22)
    pair = native.attention(torch.cat([q, other]), torch.cat([k, k.flip(2)]), torch.cat([v, v.flip(2)]), None,
                            dim ** -0.5)
    assert torch.equal(pair[:1], together)


@pytest.mark.slow
@pytest.mark.parametrize("march,isa", [("haswell", "avx2-fma"), ("x86-64", "portable")])
def test_other_instruction_sets_pass_the_same_checks(march, isa, tmp_path):
    env = {**os.environ, "SPECDECODE_NATIVE_MARCH": march, "SPECDECODE_CACHE": str(tmp_path)}
    code = "import logging; logging.basicConfig(level=logging.INFO); from specdecode import native; print(native.isa())"
    check = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert check.stdout.strip() == isa, check.stderr
    assert "building the batch-invariant kernels for this CPU (once" in check.stderr  # a first start says so
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, "-m", "not slow"],
                         env=env, capture_output=True, text=True, timeout=600, cwd=os.path.dirname(__file__))
    assert run.returncode == 0, run.stdout[-3000:]


@pytest.mark.parametrize("n,k", [(16, 64), (48, 128), (33, 896)])
def test_4bit_linear_computes_the_dequantized_weights_and_rows_alike(n, k):
    from specdecode.models.invariant import q4_layout
    from specdecode.models.quant import Int4Linear

    weight = torch.randn(-(-n // 16) * 16, k, generator=torch.Generator().manual_seed(23)) * 0.05
    layer = Int4Linear(weight.bfloat16(), None, 32)
    codes, scales, corrections = (part[:n].contiguous() for part in q4_layout(layer))
    dequantized = layer.dequantize(torch.float32)[:n].double()
    x = bf16(max(ROWS), k, seed=24)
    bias = torch.randn(n, generator=torch.Generator().manual_seed(25))
    alone = rows_alone(lambda r: native.linear_q4(r, codes, scales, corrections, bias, out_float32=True), x)
    reference = x.double() @ dequantized.T + bias.double()
    for m in ROWS:
        y = native.linear_q4(x[:m], codes, scales, corrections, bias, out_float32=True)
        assert torch.equal(y, alone[:m])
        torch.testing.assert_close(y.double(), reference[:m], atol=1e-4, rtol=1e-5)
    assert native.linear_q4(x[:3], codes, scales, corrections).dtype == torch.bfloat16


def test_without_a_compiler_the_kernels_are_unavailable_with_a_line_saying_what_to_install(tmp_path):
    env = {**os.environ, "CXX": "", "PATH": str(tmp_path), "SPECDECODE_CACHE": str(tmp_path / "cache")}
    code = ("from specdecode.native import build\n"
            "build.load.cache_clear()\n"
            "try:\n    build.load()\nexcept build.NativeUnavailable as err:\n    print('unavailable:', err)\n")
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert "unavailable: no C++ compiler" in done.stdout and "g++" in done.stdout, done.stderr


# --- K-quant blocks as a GGUF file stores them (kquants.cpp) ----------------------------------

def kquant_blocks(kind: str, n: int, k: int, seed: int):
    """n rows of k inputs in random but valid `kind` blocks (every byte pattern is a valid block
    once its float16 scales are finite), and their dequantization by the gguf package (an
    independent reading of the format) as float64 [n, k]."""
    import numpy as np
    from gguf import GGMLQuantizationType, quants

    rng = np.random.default_rng(seed)
    size = {"Q4_K": 144, "Q6_K": 210}[kind]
    blocks = rng.integers(0, 256, size=(n, k // 256, size), dtype=np.uint8)
    scale = (rng.uniform(0.002, 0.02, size=(n, k // 256)).astype(np.float16)).view(np.uint8).reshape(n, k // 256, 2)
    if kind == "Q4_K":
        blocks[..., 0:2] = scale
        blocks[..., 2:4] = (rng.uniform(0.0, 0.01, size=(n, k // 256)).astype(np.float16)).view(np.uint8).reshape(
            n, k // 256, 2)
    else:
        blocks[..., 208:210] = scale
    blocks = np.ascontiguousarray(blocks.reshape(n, -1))
    dequantized = quants.dequantize(blocks, getattr(GGMLQuantizationType, kind)).astype(np.float64).reshape(n, k)
    return blocks, torch.from_numpy(dequantized)


def int8_rows(x: torch.Tensor) -> torch.Tensor:
    """x [M, K] as the kernels quantize it: per row and block of 256, max|x|/127 · round(x·127/max|x|)
    (float32 arithmetic), as float64."""
    blocks = x.float().view(x.shape[0], -1, 256)
    amax = blocks.abs().amax(-1, keepdim=True)
    # 127/max|x| rounded once (float64 division, then float32), as C's float division rounds it
    inverse = torch.where(amax > 0, (127.0 / amax.double()).float(), torch.zeros_like(amax))
    codes = torch.round(blocks * inverse).clamp(-127, 127)
    return (codes.double() * (amax.double() / 127.0).float().double()).view_as(x)


@pytest.mark.parametrize("kind", ["Q4_K", "Q6_K"])
@pytest.mark.parametrize("n,k", [(5, 256), (37, 1536), (9, 2304)])
def test_kquant_linear_computes_the_files_blocks_and_rows_alike(kind, n, k):
    blocks, dequantized = kquant_blocks(kind, n, k, seed=n + k)
    weights = native.KQuantWeights([(blocks, kind)], k)
    x = bf16(max(ROWS), k, seed=31)
    bias = torch.randn(n, generator=torch.Generator().manual_seed(32))
    alone = rows_alone(lambda r: native.linear_kq(r, weights, bias, out_float32=True), x)
    # exact integers per block, float32 scale products: within float32 accumulation of the int8 rows
    reference = int8_rows(x) @ dequantized.T + bias.double()
    bound = int8_rows(x).abs() @ dequantized.abs().T
    for m in ROWS:
        y = native.linear_kq(x[:m], weights, bias, out_float32=True)
        assert y.shape == (m, n) and torch.equal(y, alone[:m]), f"{m} rows round differently from one"
        assert bool(((y.double() - reference[:m]).abs() <= 1e-5 * bound[:m] + 1e-5).all())
    # and within the activations' 8-bit rounding of the float64 product of the unquantized rows
    exact = x.double() @ dequantized.T + bias.double()
    assert float((alone.double() - exact).abs().max()) <= 0.02 * float((x.double().abs() @ dequantized.abs().T).max())
    assert native.linear_kq(x[:3], weights).dtype == torch.bfloat16


def test_kquant_parts_side_by_side_equal_each_part_alone():
    # 9 rows of 3072 inputs: the tiled path (weight rows 8 at a time, spans of blocks), its tiles
    # within each part; each row as it is alone (the untiled path)
    k = 3072
    q4, _ = kquant_blocks("Q4_K", 12, k, seed=1)
    q6, _ = kquant_blocks("Q6_K", 7, k, seed=2)
    x = bf16(9, k, seed=3)
    both = native.linear_kq(x, native.KQuantWeights([(q4, "Q4_K"), (q6, "Q6_K")], k), out_float32=True)
    assert torch.equal(both[:, :12], native.linear_kq(x, native.KQuantWeights([(q4, "Q4_K")], k), out_float32=True))
    assert torch.equal(both[:, 12:], native.linear_kq(x, native.KQuantWeights([(q6, "Q6_K")], k), out_float32=True))
    assert torch.equal(both, rows_alone(lambda r: native.linear_kq(
        r, native.KQuantWeights([(q4, "Q4_K"), (q6, "Q6_K")], k), out_float32=True), x))
    for above in (0, 1 << 40):  # every product tiled, and none
        with native.kq_tiling(above):
            assert torch.equal(both, native.linear_kq(x, native.KQuantWeights([(q4, "Q4_K"), (q6, "Q6_K")], k),
                                                      out_float32=True))
    previous = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(both, native.linear_kq(x, native.KQuantWeights([(q4, "Q4_K"), (q6, "Q6_K")], k),
                                                  out_float32=True))
    finally:
        torch.set_num_threads(previous)


def test_kquant_refuses_other_shapes_and_types_and_propagates_nan():
    q4, _ = kquant_blocks("Q4_K", 4, 256, seed=4)
    with pytest.raises(ValueError, match="Q4_K, Q6_K"):
        native.KQuantWeights([(q4, "Q8_0")], 256)
    with pytest.raises(ValueError, match=r"\[N, 144\]"):
        native.KQuantWeights([(q4[:, :100], "Q4_K")], 256)
    weights = native.KQuantWeights([(q4, "Q4_K")], 256)
    with pytest.raises(ValueError, match="inputs"):
        native.linear_kq(bf16(1, 512), weights)
    with pytest.raises(TypeError, match="bfloat16"):  # its bits would be read as bfloat16
        native.linear_kq(bf16(1, 256).float(), weights)
    with pytest.raises(ValueError, match="bias"):
        native.linear_kq(bf16(1, 256), weights, torch.zeros(3))
    assert native.linear_kq(bf16(0, 256), weights).shape == (0, 4)  # no rows: nothing computed
    x = bf16(2, 256, seed=5)
    x[1, 7] = float("nan")
    y = native.linear_kq(x, weights, out_float32=True)
    assert bool(y[0].isfinite().all()) and bool(y[1].isnan().all())


@pytest.mark.parametrize("batch,width", [(1, 1), (2, 5), (3, 17)])
def test_rope_split_rounds_as_transformers_bfloat16_rotary(batch, width):
    heads, kv_heads, dim = 4, 2, 64
    qkv = bf16(batch, width, (heads + 2 * kv_heads) * dim, seed=41)
    angles = torch.rand(batch, width, dim // 2, generator=torch.Generator().manual_seed(42)) * 100
    cos, sin = torch.cat([angles, angles], -1).cos().bfloat16(), torch.cat([angles, angles], -1).sin().bfloat16()
    q, k, v = native.rope_split(qkv, cos, sin, heads, kv_heads, dim)

    def rotate(x):  # transformers' apply_rotary_pos_emb in bfloat16
        half = dim // 2
        return x * cos[:, :, None] + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin[:, :, None]

    q_ref, k_ref, v_ref = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    assert torch.equal(q, rotate(q_ref.reshape(batch, width, heads, dim)))
    assert torch.equal(k, rotate(k_ref.reshape(batch, width, kv_heads, dim)).transpose(1, 2))
    assert torch.equal(v, v_ref.reshape(batch, width, kv_heads, dim).transpose(1, 2))
