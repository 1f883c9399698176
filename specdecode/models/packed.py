"""float32 linear layers with their weights prepacked once for oneDNN: a few-row product at about
one row's cost on any x86 CPU.

Why. torch's float32 `linear` goes to the BLAS library (MKL), whose small-M path on some CPUs
(AMD, measured on Zen 3 and Zen 4) jumps from one row to two: 4.8 → 30.6 ms for the 1536 → 8960
MLP projection on an AVX2-only Zen 3. A k-token verify or a prompt read then costs several
one-token steps, and speculation stops paying (paper §3.3 assumes r(k) ≈ 1). oneDNN's JIT
kernels are chosen by instruction set, not by vendor, and with the weight reordered once into
their blocked layout a 9-row product reads the weights once: r(9) ≈ 1.4 per layer on an AVX2-only
CPU (docs/auto-configuration.md). The arithmetic is IEEE float32 (oneDNN's default strict math mode):
this is the float32 model, not an approximation of it.

Memory: the packed copy replaces each layer's dense weight, except a weight tied to another
module (an LM head tied to the input embeddings), which is kept and packed beside it.
"""

from __future__ import annotations

import torch

from specdecode.models import kernels


def available() -> bool:
    """Whether this torch build has oneDNN's packed linear (x86 CPU builds do)."""
    return (torch.backends.mkldnn.is_available() and kernels.available("onednn_pack_weight")
            and kernels.available("onednn_linear"))


class PackedLinear(torch.nn.Module):
    """A float32 nn.Linear whose weight lives in oneDNN's blocked layout.

    Args:
        linear: a float32 nn.Linear on the CPU; it is not modified.
        rows_hint: the row count oneDNN tunes the layout for (a verify of γ+1 tokens).
    Attributes:
        in_features, out_features: as the nn.Linear's.
    Input [..., in_features] float32 → output [..., out_features] float32.
    """

    def __init__(self, linear: torch.nn.Linear, rows_hint: int = 9):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        # not parameters: model.to() or .half() must not touch a layout only oneDNN reads
        self._packed = kernels.onednn_pack_weight(linear.weight.detach(), rows_hint)
        self._bias = None if linear.bias is None else linear.bias.detach()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        if not flat.is_contiguous():
            flat = flat.contiguous()
        out = kernels.onednn_linear(flat, self._packed, self._bias)
        return out.reshape(*x.shape[:-1], self.out_features)


def pack_linears(model: torch.nn.Module, rows_hint: int = 9) -> int:
    """Replace every float32 nn.Linear of `model` (in place) by a PackedLinear. Returns how many.

    Call it on a model this process loaded (never on a user's object). A weight shared with
    another module (tied embeddings) stays where it is; the layer gets a packed copy.
    Raises:
        ValueError: a model that is not float32 on the CPU, or a torch without oneDNN.
    """
    if not available():
        raise ValueError("this torch build has no oneDNN packed linear")
    first = next(model.parameters())
    if first.device.type != "cpu" or first.dtype != torch.float32:
        raise ValueError(f"packed linears are float32 CPU layers; the model is {first.dtype} on {first.device}")
    def dense(module) -> bool:
        return type(module) is torch.nn.Linear and module.weight.dtype == torch.float32

    # names, not modules: holding every Linear until the end would keep all dense weights beside
    # their packed copies (twice the model at the peak)
    layers = [(parent, name) for parent in model.modules() for name, child in parent.named_children() if dense(child)]
    for parent, name in layers:
        setattr(parent, name, PackedLinear(getattr(parent, name), rows_hint))
    return len(layers)


class WideUpcastLinear(torch.nn.Module):
    """A bfloat16 nn.Linear whose calls of many rows (prompt reads) run as a float32 product of the
    same values: the weight and input converted exactly, float32 accumulation, the output rounded
    to bfloat16, which is what a bfloat16 product computes too (in another order). Calls of fewer
    rows keep the bfloat16 kernels.

    Why: without native bfloat16 (AVX2-only CPUs) torch's bfloat16 product of many rows takes a
    slow converting loop: the 1536 → 8960 projection at 150 rows cost 118 ms against 55-70 ms
    converted on the fly, with no copy kept (an AVX2-capped Zen 4; at 32 rows they are level,
    docs/auto-configuration.md).

    Args:
        linear: a bfloat16 nn.Linear (shared, not copied or modified).  min_rows: rows from which
            a call is upcast.
    """

    def __init__(self, linear: torch.nn.Linear, min_rows: int = 32):
        super().__init__()
        self.linear, self.min_rows = linear, min_rows
        self.in_features, self.out_features = linear.in_features, linear.out_features

    @property
    def weight(self) -> torch.Tensor:
        return self.linear.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.numel() // self.in_features < self.min_rows:
            return self.linear(x)
        bias = None if self.linear.bias is None else self.linear.bias.float()
        return torch.nn.functional.linear(x.float(), self.linear.weight.float(), bias).to(x.dtype)


def upcast_wide_linears(model: torch.nn.Module, min_rows: int = 32) -> int:
    """Wrap every bfloat16 nn.Linear of `model` (in place) in a WideUpcastLinear. Returns how many.
    Call it on a model this process loaded (never on a user's object)."""
    replaced = 0
    for parent in list(model.modules()):
        if isinstance(parent, WideUpcastLinear):
            continue
        for name, child in list(parent.named_children()):
            if type(child) is torch.nn.Linear and child.weight.dtype == torch.bfloat16:
                setattr(parent, name, WideUpcastLinear(child, min_rows))
                replaced += 1
    return replaced
