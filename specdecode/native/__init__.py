"""Batch-invariant CPU kernels for decoders: bfloat16 (rows.cpp) and a GGUF file's K-quant blocks
(kquants.cpp), built on first use (build.py).

Each function computes every row of its output with the same arithmetic whatever the number of
rows in the call, the other rows and the thread count (see rows.cpp), so a k-token verify equals
k one-token steps bit for bit. Shapes and dtypes are checked by the caller's construction (the
decoder in specdecode.models.invariant); these wrappers only make inputs contiguous where the
kernels need it and pass pointers.
"""

from __future__ import annotations

import contextlib
import ctypes

import numpy as np
import torch

from specdecode.native.build import NativeUnavailable, available, isa, load

__all__ = ["NativeUnavailable", "available", "isa", "linear", "linear_q4", "KQuantWeights", "linear_kq", "rms_norm",
           "silu_mul", "rope_split", "attention"]

# GGML type ids of the blocks linear_kq reads
KQUANT_TYPES = {"Q4_K": 12, "Q6_K": 14}


def _threads() -> int:
    return torch.get_num_threads()


def _rows_and_output(x: torch.Tensor, n: int, out_float32: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """x as rows [M, K] with unit stride along K (a view where it already is one), and an empty
    output [M, n] for them."""
    rows = x.reshape(-1, x.shape[-1])
    if rows.stride(-1) != 1 or (rows.shape[0] > 1 and rows.stride(0) < rows.shape[1]):
        rows = rows.contiguous()
    return rows, torch.empty((rows.shape[0], n), dtype=torch.float32 if out_float32 else torch.bfloat16)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           out_float32: bool = False) -> torch.Tensor:
    """x Wᵀ (+ bias): x [..., K] bfloat16, weight [N, K] bfloat16 contiguous, bias [N] float32
    contiguous or None → [..., N] bfloat16 (float32 where out_float32: an LM head's logits).
    Each weight is read once per call for up to 64 rows."""
    rows, out = _rows_and_output(x, weight.shape[0], out_float32)
    m, k = rows.shape
    n = weight.shape[0]
    load().sd_linear(rows.data_ptr(), m, k, rows.stride(0), weight.data_ptr(), n,
                     None if bias is None else bias.data_ptr(), out.data_ptr(), n, int(out_float32), _threads())
    return out.view(*x.shape[:-1], n)


def linear_q4(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, corrections: torch.Tensor,
              bias: torch.Tensor | None = None, out_float32: bool = False) -> torch.Tensor:
    """x Wᵀ (+ bias) with 4-bit weights W = c·s + t per group of 32 inputs, x in bfloat16
    (rows.cpp: a draft's products; its numbers are free). x [..., K] bfloat16 (K a
    multiple of 64); codes [N, K/2] uint8 in rows.cpp's block layout (models.invariant.q4_layout);
    scales, corrections [N, K/32] float32; bias [N] float32 or None → [..., N] bfloat16 (float32
    where out_float32)."""
    rows, out = _rows_and_output(x, codes.shape[0], out_float32)
    m, k = rows.shape
    n = codes.shape[0]
    load().sd_linear_q4(rows.data_ptr(), m, k, rows.stride(0), codes.data_ptr(), scales.data_ptr(),
                        corrections.data_ptr(), n, None if bias is None else bias.data_ptr(), out.data_ptr(), n,
                        int(out_float32), _threads())
    return out.view(*x.shape[:-1], n)


class KQuantWeights:
    """Weight matrices in a GGUF file's own K-quant blocks, read by linear_kq side by side as one
    product (e.g. a layer's q, k and v, whatever type each is stored in), never copied.

    Args:
        parts: [(blocks, type)]: blocks a uint8 array [N, K/256 · block bytes] (numpy, e.g. a
            memory map of the file, or torch; C-contiguous), type "Q4_K" or "Q6_K".
        inputs: K, a multiple of 256.
    Raises:
        ValueError: another type, a K that is not a multiple of 256, rows of the wrong length.
        NativeUnavailable: no kernels here.
    """

    def __init__(self, parts: list, inputs: int):
        lib = load()
        self.inputs, self._keep = inputs, []
        pointers, types, rows = [], [], []
        for blocks, kind in parts:
            if kind not in KQUANT_TYPES:
                raise ValueError(f"the K-quant kernels read {', '.join(KQUANT_TYPES)} blocks, not {kind}")
            row_bytes = lib.sd_kq_row_bytes(KQUANT_TYPES[kind], inputs)
            array = blocks.numpy() if isinstance(blocks, torch.Tensor) else np.asarray(blocks)
            if row_bytes < 0 or array.dtype != np.uint8 or array.ndim != 2 or array.shape[1] != row_bytes \
                    or not array.flags.c_contiguous:
                raise ValueError(f"{kind} rows of {inputs} inputs: expected a C-contiguous uint8 array [N, {row_bytes}], "
                                 f"got {array.dtype} {list(array.shape)}")
            self._keep.append(array)
            pointers.append(array.ctypes.data)
            types.append(KQUANT_TYPES[kind])
            rows.append(array.shape[0])
        self.outputs = sum(rows)
        self._pointers = (ctypes.c_void_p * len(parts))(*pointers)
        self._types = (ctypes.c_int * len(parts))(*types)
        self._rows = (ctypes.c_int64 * len(parts))(*rows)
        self.parts = len(parts)


def linear_kq(x: torch.Tensor, weights: KQuantWeights, bias: torch.Tensor | None = None,
              out_float32: bool = False) -> torch.Tensor:
    """x Wᵀ (+ bias) on K-quant blocks as stored, x quantized to int8 per row and block of 256
    inputs (kquants.cpp): x [..., K] bfloat16; bias [N] float32 or None → [..., N] bfloat16
    (float32 where out_float32), N = weights.outputs."""
    if x.dtype != torch.bfloat16:
        raise TypeError(f"x must be bfloat16 (the kernels read its bits as such), got {x.dtype}")
    if x.shape[-1] != weights.inputs:
        raise ValueError(f"x has {x.shape[-1]} inputs; the weights take {weights.inputs}")
    if bias is not None and (bias.dtype != torch.float32 or bias.shape != (weights.outputs,)
                             or not bias.is_contiguous()):
        raise ValueError(f"bias must be a contiguous float32 tensor [{weights.outputs}]")
    rows, out = _rows_and_output(x, weights.outputs, out_float32)
    m, k = rows.shape
    load().sd_linear_kq(rows.data_ptr(), m, k, rows.stride(0), weights.parts, weights._pointers, weights._types,
                        weights._rows, None if bias is None else bias.data_ptr(), out.data_ptr(), weights.outputs,
                        int(out_float32), _threads())
    return out.view(*x.shape[:-1], weights.outputs)


@contextlib.contextmanager
def kq_tiling(above_bytes: int):
    """Within the block, K-quant products whose int8 activations (M·K bytes) exceed above_bytes run
    tiled (weight rows 8 at a time, their blocks a span at a time, so that the activations stay in
    L1); the default is 24 KiB. The bits are the same either way: tests and benchmarks compare the
    two paths with it (a huge value turns tiling off). No effect without AVX-512."""
    previous = load().sd_kq_tiled_above(max(0, min(int(above_bytes), 1 << 62)))  # (an int64 in C)
    try:
        yield
    finally:
        if previous >= 0:
            load().sd_kq_tiled_above(previous)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm as transformers rounds it: x [..., H] bfloat16, weight [H] bfloat16 → [..., H] bfloat16."""
    x = x.contiguous()
    out = torch.empty_like(x)
    load().sd_rms_norm(x.data_ptr(), x.numel() // x.shape[-1], x.shape[-1], weight.data_ptr(), eps, out.data_ptr(),
                       _threads())
    return out


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) · up of a fused projection's output: gate_up [..., 2I] bfloat16 (gate first)
    → [..., I] bfloat16."""
    rows = gate_up.reshape(-1, gate_up.shape[-1]).contiguous()
    inner = rows.shape[1] // 2
    out = torch.empty((rows.shape[0], inner), dtype=torch.bfloat16)
    load().sd_silu_mul(rows.data_ptr(), rows.data_ptr() + 2 * inner, rows.shape[1], rows.shape[0], inner,
                       out.data_ptr(), _threads())
    return out.view(*gate_up.shape[:-1], inner)


def rope_split(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int, kv_heads: int,
               dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v of a fused q|k|v product with the rotary embedding applied to q and k, rounded as
    transformers' bfloat16 arithmetic rounds x·cos + rotate_half(x)·sin.

    qkv [B, T, (heads + 2·kv_heads)·dim] bfloat16; cos, sin [B, T, dim] bfloat16 (each token's
    position's) → q [B, T, heads, dim], k and v [B, kv_heads, T, dim] (the cache's layout).
    """
    batch, width = qkv.shape[:2]
    if cos.shape != (batch, width, dim) or sin.shape != (batch, width, dim):
        raise ValueError(f"cos and sin must be [{batch}, {width}, {dim}], got {list(cos.shape)}, {list(sin.shape)}")
    rows = qkv.reshape(batch * width, -1)
    if rows.stride(-1) != 1 or rows.stride(0) < rows.shape[1]:
        rows = rows.contiguous()
    cos, sin = cos.contiguous(), sin.contiguous()
    q = torch.empty((batch, width, heads, dim), dtype=torch.bfloat16)
    k = torch.empty((batch, kv_heads, width, dim), dtype=torch.bfloat16)
    v = torch.empty_like(k)
    load().sd_rope_split(rows.data_ptr(), rows.stride(0), batch, width, heads, kv_heads, dim, cos.data_ptr(),
                         sin.data_ptr(), q.data_ptr(), k.data_ptr(), v.data_ptr(), _threads())
    return q, k, v


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor | None,
              scale: float) -> torch.Tensor:
    """Softmax attention of each query row over the cache slots it may see.

    q [B, T, Hq, D] bfloat16; k, v [B, Hkv, S, D] bfloat16 (Hq a multiple of Hkv); allowed
    [B, T, S] bool or uint8 (nonzero: visible) or None (query t sees slots 0 … S − T + t); scale: the
    scores' factor → [B, T, Hq, D] bfloat16.
    """
    q = q.contiguous()
    k, v = k.contiguous(), v.contiguous()
    batch, width, heads, dim = q.shape
    kv_heads, slots = k.shape[1], k.shape[2]
    mask = None if allowed is None else allowed.to(torch.uint8).contiguous()  # no copy for contiguous bytes
    out = torch.empty_like(q)
    load().sd_attention(q.data_ptr(), batch, width, heads, dim, k.data_ptr(), v.data_ptr(), kv_heads, slots,
                        k.stride(0), k.stride(1), None if mask is None else mask.data_ptr(), scale, out.data_ptr(),
                        _threads())
    return out
