"""The kernels a target runs on (TargetKernel, the one name for each), and every private torch op
the package calls, each behind one small function: the int8/int4
weight-only matrix products of a quantized draft (models/quant.py), oneDNN's prepacked float32
linear (models/packed.py), oneDNN's bfloat16 capability check (tune/hardware.py), and turning
oneDNN off around a one-row forward (models/hf.py).

Why here: private ops change between torch releases without notice. With all of them in one
module, `missing()` says which this torch lacks, and tests/test_kernels.py checks each against a
plain-torch reference under the pinned torch (2.13.0). Nothing else in the package calls one.
"""

from __future__ import annotations

import contextlib
from enum import Enum
from typing import Iterator

import torch

# function here → (owner, private name) it calls
PRIVATE_OPS = {
    "int8_matmul": (torch, "_weight_int8pack_mm"),
    "int4_pack": (torch, "_convert_weight_to_int4pack_for_cpu"),
    "int4_matmul": (torch, "_weight_int4pack_mm_for_cpu"),
    "onednn_pack_weight": (torch.ops.mkldnn, "_reorder_linear_weight"),
    "onednn_linear": (torch.ops.mkldnn, "_linear_pointwise"),
    "onednn_bfloat16_supported": (torch.ops.mkldnn, "_is_mkldnn_bf16_supported"),
}


def available(name: str) -> bool:
    """Whether this torch has the private op behind kernel `name` (a key of PRIVATE_OPS).

    Raises:
        ValueError: an unknown name.
    """
    if name not in PRIVATE_OPS:
        raise ValueError(f"no kernel named {name!r}; the kernels are {', '.join(PRIVATE_OPS)}")
    owner, op = PRIVATE_OPS[name]
    return hasattr(owner, op)


def missing() -> list[str]:
    """The kernels whose private op this torch lacks ([] under the pinned torch)."""
    return [name for name in PRIVATE_OPS if not available(name)]


def _op(name: str):
    owner, op = PRIVATE_OPS[name]
    found = getattr(owner, op, None)
    if found is None:
        raise RuntimeError(f"torch {torch.__version__} has no {op} (specdecode.models.kernels.{name}); "
                           "specdecode is tested with torch 2.13.0")
    return found


def int8_matmul(x: torch.Tensor, weight_int8: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x (weight_int8 · scale)ᵀ: x [M, K] float32/bfloat16/float16 (contiguous), weight_int8
    [N, K] int8, scale [N] in x's dtype → [M, N] in x's dtype (torch._weight_int8pack_mm)."""
    return _op("int8_matmul")(x, weight_int8, scale)


def int4_pack(codes: torch.Tensor) -> torch.Tensor:
    """The int4 kernel's copy of codes [N, K] int32 in 0..15 (N % 16 == 0): a uint8 tensor in a
    layout that depends on the CPU's vector width and the torch release
    (torch._convert_weight_to_int4pack_for_cpu, two codes per byte)."""
    return _op("int4_pack")(codes, 1)


def int4_matmul(x: torch.Tensor, packed: torch.Tensor, group_size: int, scale_zero: torch.Tensor) -> torch.Tensor:
    """x Wᵀ with W[n, i] = (code[n, i] − 8) · scale[g, n] + zero[g, n], g = i // group_size:
    x [M, K] float32/bfloat16/float16 (contiguous), packed = int4_pack(codes), group_size 32, 64,
    128 or 256, scale_zero [K / group_size, N, 2] in x's dtype → [M, N] in x's dtype
    (torch._weight_int4pack_mm_for_cpu, the kernel gpt-fast uses)."""
    return _op("int4_matmul")(x, packed, group_size, scale_zero)


def onednn_pack_weight(weight: torch.Tensor, rows_hint: int) -> torch.Tensor:
    """weight [N, K] float32 reordered into oneDNN's blocked layout, tuned for products of about
    rows_hint rows; only onednn_linear reads it (torch.ops.mkldnn._reorder_linear_weight)."""
    return _op("onednn_pack_weight")(weight, rows_hint)


def onednn_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x Wᵀ + bias: x [M, K] float32 contiguous, packed = onednn_pack_weight(W), bias [N] or None
    → [M, N] float32, IEEE float32 arithmetic (torch.ops.mkldnn._linear_pointwise, no fused op)."""
    return _op("onednn_linear")(x, packed, bias, "none", [], "")


def onednn_bfloat16_supported() -> bool:
    """Whether oneDNN has a native bfloat16 path on this CPU (AVX-512 or AMX on x86; it honours
    ONEDNN_MAX_CPU_ISA); False where torch cannot say (torch.ops.mkldnn._is_mkldnn_bf16_supported)."""
    try:
        return bool(_op("onednn_bfloat16_supported")())
    except RuntimeError:
        return False


@contextlib.contextmanager
def without_onednn() -> Iterator[None]:
    """torch's own CPU kernels instead of oneDNN's for the calls inside, restored on exit (an
    error included), through torch's public switch `torch.backends.mkldnn.enabled`.

    The switch is process-wide, not per thread. That is safe here because an engine runs its
    forwards one at a time, on one thread (the server's worker thread; the Driver's lock for
    callers on several threads), so no other forward of its models can see the switch off. (A
    second decoder stepping on another thread at that moment would get torch's kernels too: the
    same arithmetic, perhaps rounded in another order.)"""
    enabled = torch.backends.mkldnn.enabled
    torch.backends.mkldnn.enabled = False
    try:
        yield
    finally:
        torch.backends.mkldnn.enabled = enabled


class TargetKernel(str, Enum):
    """How the target's products run: a backend, a numeric model and the kernels behind it."""

    BFLOAT16 = "bfloat16"              # torch bfloat16 (oneDNN where torch picks it)
    BFLOAT16_GEMV = "bfloat16-gemv"    # the same, one-row calls on torch's own matrix-vector kernels
    BFLOAT16_INVARIANT = "bfloat16-invariant"  # bfloat16 on specdecode.native's batch-invariant kernels
    FLOAT32_PACKED = "float32-packed"  # float32; Llama/Qwen2 Linears prepacked for oneDNN where possible
    FLOAT16 = "float16"
    FLOAT64 = "float64"
    LLAMA_BF16 = "llama.cpp-bf16"      # llama.cpp on a BF16 GGUF of the weights (the bfloat16 model)
    LLAMA_F32 = "llama.cpp-f32"        # llama.cpp on an F32 GGUF of the weights (the float32 model)
    LLAMA_GGUF = "llama.cpp-gguf"      # llama.cpp on the GGUF file as it is (its own quantization)
    GGUF_INVARIANT = "gguf-invariant"  # the GGUF file's own K-quant blocks on specdecode.native (models/kquant.py)

    @property
    def backend(self) -> str:
        return "llama.cpp" if self.value.startswith("llama.cpp") else "torch"

    @property
    def dtype(self) -> torch.dtype | None:
        """The torch dtype of the numbers (the GGUF file's own quantization: None)."""
        return {"bfloat16": torch.bfloat16, "bfloat16-gemv": torch.bfloat16, "bfloat16-invariant": torch.bfloat16,
                "float32-packed": torch.float32,
                "float16": torch.float16, "float64": torch.float64, "llama.cpp-bf16": torch.bfloat16,
                "llama.cpp-f32": torch.float32, "llama.cpp-gguf": None, "gguf-invariant": None}[self.value]

    @property
    def batch_invariant(self) -> bool:
        """Whether a token's logits are the same bits whatever else its forward holds (models/invariant.py)."""
        return self.value.endswith("-invariant")

    @property
    def reads_gguf(self) -> bool:
        """Whether the target's weights are its GGUF file's (llama.cpp, or the file's own blocks on
        specdecode.native) rather than a transformers model's."""
        return self.backend == "llama.cpp" or self is TargetKernel.GGUF_INVARIANT

    @classmethod
    def of(cls, dtype: str, backend: str) -> "TargetKernel":
        """The kernel a dtype and backend given by name run ("float32" on torch packs where it
        can; "auto" is bfloat16)."""
        if dtype == "gguf":
            return cls.LLAMA_GGUF
        if backend == "llama.cpp":
            return cls.LLAMA_F32 if dtype == "float32" else cls.LLAMA_BF16
        return cls.FLOAT32_PACKED if dtype == "float32" else cls.BFLOAT16 if dtype == "auto" else cls(dtype)
