"""Batch-invariant CPU kernels for bfloat16 decoders (rows.cpp, built on first use: build.py).

Each function computes every row of its output with the same arithmetic whatever the number of
rows in the call, the other rows and the thread count (see rows.cpp), so a k-token verify equals
k one-token steps bit for bit. Shapes and dtypes are checked by the caller's construction (the
decoder in specdecode.models.invariant); these wrappers only make inputs contiguous where the
kernels need it and pass pointers.
"""

from __future__ import annotations

import torch

from specdecode.native.build import NativeUnavailable, available, isa, load

__all__ = ["NativeUnavailable", "available", "isa", "linear", "linear_q4", "rms_norm", "silu_mul", "attention"]


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
    """x Wᵀ (+ bias) with 4-bit weights W = c·s + t per group of 32 inputs and x quantized to int8
    per row (rows.cpp: a draft's products; its numbers are free). x [..., K] bfloat16 (K a
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
