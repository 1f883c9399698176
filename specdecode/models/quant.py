"""Int8 weight-only linear layers for the draft model (a cheaper proposal, still exact).

The verifier needs only the q each draft token was sampled from (paper §3.6: "any M_q keeps the
output distribution exact"), so the draft may be an approximation of its checkpoint. At batch 1
a draft step reads every weight once per token, and on a CPU that read is the cost: int8 weights
halve it (measured on the zoo draft, 2 cores: 57 → 35 ms per step with the 32768-id head). The
target is never quantized: its distribution is the one the output must follow.
"""

from __future__ import annotations

import torch

DEQUANTIZE_ABOVE_ROWS = 16  # rows (tokens) per call above which a float GEMM beats the int8 kernel


class Int8Linear(torch.nn.Module):
    """y = x Wᵀ + b with W stored as int8 rows and one scale per output row (symmetric, absmax).

    Args:
        weight: [out, in] float tensor to quantize.  bias: [out] or None.
    Shapes: forward takes [..., in] (float32/bfloat16/float16) and returns [..., out] in x's dtype.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__()
        w = weight.detach().float()
        scale = w.abs().amax(dim=1).clamp(min=1e-12) / 127.0
        self.register_buffer("weight_int8", torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8))
        self.register_buffer("scale", scale)
        self.bias = None if bias is None else torch.nn.Parameter(bias.detach().clone(), requires_grad=False)

    @property
    def out_features(self) -> int:
        return self.weight_int8.shape[0]

    def first_rows(self, n: int) -> "Int8Linear":
        """A view computing only outputs [0, n) (a vocabulary-limited LM head); no copy."""
        view = Int8Linear.__new__(Int8Linear)
        torch.nn.Module.__init__(view)
        view.register_buffer("weight_int8", self.weight_int8[:n])
        view.register_buffer("scale", self.scale[:n])
        view.bias = None if self.bias is None else self.bias[:n]
        return view

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        if flat.shape[0] > DEQUANTIZE_ABOVE_ROWS:
            # The int8 kernel is built for a few rows; for a prompt (hundreds of rows) it is ~3x
            # slower than a float GEMM, so dequantize this once and use the GEMM.
            weight = self.weight_int8.to(x.dtype) * self.scale.to(x.dtype)[:, None]
            y = torch.nn.functional.linear(flat, weight)
        else:
            y = torch._weight_int8pack_mm(flat, self.weight_int8, self.scale.to(x.dtype))
        y = y.reshape(*x.shape[:-1], -1)
        return y if self.bias is None else y + self.bias.to(x.dtype)


def quantize_int8(model: torch.nn.Module) -> torch.nn.Module:
    """Replace every nn.Linear of `model` (LM head included) by an Int8Linear, in place.

    Only for models the library loaded itself (a draft): a user's model object is never changed.
    Returns the model.
    """
    for name, child in list(model.named_children()):
        if isinstance(child, torch.nn.Linear):
            setattr(model, name, Int8Linear(child.weight, child.bias))
        else:
            quantize_int8(child)
    return model
