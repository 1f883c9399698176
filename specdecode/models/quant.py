"""Weight-only int8 and int4 linear layers for the draft model (a cheaper proposal, still exact).

The verifier needs only the q each draft token was sampled from (paper §3.6: "any M_q keeps the
output distribution exact"), so the draft may be an approximation of its checkpoint. At batch 1
a draft step reads every weight once per token, and on a CPU that read is the cost: int8 weights
halve it and int4 weights halve it again (zoo draft, 2 cores, 32768-id head: 57 ms per step in
bfloat16, 35 in int8, 24 in int4; the matrix products alone 23 → 11 ms). The target is never
quantized: its distribution is the one the output must follow.
"""

from __future__ import annotations

import functools

import torch

from specdecode.models import kernels

# What torch's CPU kernels take (kernels.int8_matmul, kernels.int4_matmul); float64 fails
# inside them at the first draft step, so prepare_draft checks first.
KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
DEFAULT_GROUP_SIZE = 32  # inputs per int4 scale and zero


@functools.cache
def _native_bfloat16() -> bool:
    """Whether this CPU multiplies bfloat16 matrices natively (asked once per process)."""
    return kernels.onednn_bfloat16_supported()


class _QuantizedLinear(torch.nn.Module):
    """Shared forward: the integer kernel for a few rows, a dequantized float GEMM for many."""

    bias: torch.Tensor | None
    # rows (tokens) per call above which dequantizing and a float GEMM beat the integer kernel, by
    # the input's dtype (measured on the draft's linear shapes, 2 cores, torch 2.13: in float32
    # the int4 kernel costs 107 ms at 16 rows where dequantizing and a GEMM cost 82)
    dequantize_above_rows: dict[torch.dtype, int]
    DEQUANTIZE_ABOVE_ROWS = 16  # any other dtype

    # rows above which a bfloat16 input is dequantized to float32 for the product where bfloat16 is
    # emulated (no native kernel: AVX2-only CPUs); there, at 704 rows of a 896x4864 layer, int4:
    # bfloat16 GEMM 251 ms, float32 GEMM 50, kernel 83; near 128-160 rows float32 and the
    # kernels cost about the same (2 cores, torch 2.13, bfloat16 capped by ONEDNN_MAX_CPU_ISA)
    EMULATED_DEQUANTIZE_ABOVE_ROWS = 160

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1]).contiguous()  # the int4 kernel refuses strided rows
        rows = flat.shape[0]
        if flat.dtype == torch.bfloat16 and flat.device.type == "cpu" and not _native_bfloat16():
            if rows > self.EMULATED_DEQUANTIZE_ABOVE_ROWS:
                y = torch.nn.functional.linear(flat.float(), self.dequantize(torch.float32)).to(flat.dtype)
            else:
                y = self._kernel(flat)
        elif rows > self.dequantize_above_rows.get(flat.dtype, self.DEQUANTIZE_ABOVE_ROWS):
            # The integer kernels cost in proportion to the rows; dequantizing costs a fixed
            # pass over the weights, so for a prompt (hundreds of rows) it wins.
            y = torch.nn.functional.linear(flat, self.dequantize(x.dtype))
        else:
            y = self._kernel(flat)
        y = y.reshape(*x.shape[:-1], -1)
        return y if self.bias is None else y + self.bias.to(x.dtype)


class Int8Linear(_QuantizedLinear):
    """y = x Wᵀ + b with W stored as int8 rows and one scale per output row (symmetric, absmax).

    Args:
        weight: [out, in] float tensor to quantize.  bias: [out] or None.
    Shapes: forward takes [..., in] (float32/bfloat16/float16) and returns [..., out] in x's dtype.
    """

    # bfloat16: kernel 2.95 ms at 32 rows, 5.79 at 64; dequantize + float GEMM 3.85, 4.88
    dequantize_above_rows = {torch.bfloat16: 48}

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__()
        w = weight.detach().float()
        scale = w.abs().amax(dim=1).clamp(min=1e-12) / 127.0
        self.register_buffer("weight_int8", torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8))
        self.register_buffer("scale", scale)
        self.bias = None if bias is None else torch.nn.Parameter(bias.detach().clone(), requires_grad=False)

    @classmethod
    def from_buffers(cls, weight_int8: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None) -> Int8Linear:
        """The layer from its stored tensors (`state()`), without quantizing anything."""
        layer = cls.__new__(cls)
        torch.nn.Module.__init__(layer)
        layer.register_buffer("weight_int8", weight_int8)
        layer.register_buffer("scale", scale)
        layer.bias = bias
        return layer

    def state(self) -> dict[str, torch.Tensor]:
        """The tensors that define the layer (from_buffers takes them back)."""
        return {"weight_int8": self.weight_int8, "scale": self.scale} | ({} if self.bias is None else {"bias": self.bias})

    @property
    def out_features(self) -> int:
        return self.weight_int8.shape[0]

    def first_rows(self, n: int) -> Int8Linear:
        """A view computing only outputs [0, n) (a vocabulary-limited LM head); no copy."""
        return Int8Linear.from_buffers(self.weight_int8[:n], self.scale[:n], None if self.bias is None else self.bias[:n])

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        return self.weight_int8.to(dtype) * self.scale.to(dtype)[:, None]

    def _kernel(self, flat: torch.Tensor) -> torch.Tensor:
        return kernels.int8_matmul(flat, self.weight_int8, self.scale.to(flat.dtype))


class Int4Linear(_QuantizedLinear):
    """y = x Wᵀ + b with W in groups of `group_size` inputs, each stored as 4-bit codes q with a
    scale s and zero z (asymmetric min/max): W ≈ (q − 8)·s + z, the form of PyTorch's CPU int4
    kernel (`kernels.int4_matmul`, the one gpt-fast uses).

    The kernel's packed layout depends on the CPU's vector width, so the codes are also kept
    nibble-packed in plain row order ([out, in/2] uint8) for dequantizing and slicing; the two
    copies together take the memory of the int8 weights.

    Scales and zeros are stored in the weight's dtype (the kernel's requirement); in bfloat16 a
    zero far from 0 carries a rounding error of up to |zero|/512, which the codes are chosen
    around but cannot always absorb. The output stays exact either way: only q changes.

    Args:
        weight: [out, in] float tensor; out % 16 == 0 and in % group_size == 0 (`supports`).
        bias: [out] or None.  group_size: 32, 64, 128 or 256 inputs per scale and zero.
    Shapes: forward takes [..., in] (float32/bfloat16/float16) and returns [..., out] in x's dtype.
    Raises:
        ValueError: a weight shape or group size the kernel cannot take.
    """

    # bfloat16: kernel 11.5 ms at 128 rows, 16.9 at 192; dequantize + float GEMM 13.8, 15.7
    dequantize_above_rows = {torch.bfloat16: 160}

    GROUP_SIZES = (32, 64, 128, 256)

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, group_size: int = DEFAULT_GROUP_SIZE):
        super().__init__()
        if group_size not in self.GROUP_SIZES:
            raise ValueError(f"group_size must be one of {self.GROUP_SIZES}, got {group_size!r}")
        if not self.supports(weight, group_size):
            raise ValueError(f"int4 needs out % 16 == 0 and in % {group_size} == 0, got {tuple(weight.shape)}")
        out, inp = weight.shape
        groups = weight.detach().float().view(out, inp // group_size, group_size)
        low, high = groups.amin(-1), groups.amax(-1)
        # Round scale and zero to the stored dtype first, then pick codes for the rounded values.
        scale = ((high - low) / 15).clamp(min=1e-8).to(weight.dtype).float()
        zero = (low + 8 * scale).to(weight.dtype).float()
        codes = torch.round((groups - zero[..., None]) / scale[..., None] + 8).clamp(0, 15).to(torch.uint8)
        codes = codes.view(out, inp)
        self.group_size = group_size
        self.register_buffer("nibbles", codes[:, 0::2] | (codes[:, 1::2] << 4))
        self.register_buffer("scale_zero", torch.stack([scale, zero], -1).transpose(0, 1).contiguous().to(weight.dtype))
        self.register_buffer("packed", kernels.int4_pack(codes.to(torch.int32)))
        self.bias = None if bias is None else torch.nn.Parameter(bias.detach().clone(), requires_grad=False)

    @classmethod
    def from_buffers(cls, nibbles: torch.Tensor, scale_zero: torch.Tensor, bias: torch.Tensor | None,
                     group_size: int, packed: torch.Tensor | None = None) -> Int4Linear:
        """The layer from its stored tensors (`state()`), without quantizing anything. `packed`
        is the kernel's copy, valid only under the same kernel_layout(); None repacks the codes."""
        layer = cls.__new__(cls)
        torch.nn.Module.__init__(layer)
        layer.group_size = group_size
        layer.register_buffer("nibbles", nibbles)
        layer.register_buffer("scale_zero", scale_zero)
        if packed is None:
            packed = kernels.int4_pack(layer.codes().to(torch.int32))
        layer.register_buffer("packed", packed)
        layer.bias = bias
        return layer

    def state(self) -> dict[str, torch.Tensor]:
        """The tensors of the layer (from_buffers takes them back); "packed" is valid only under
        the same kernel_layout()."""
        return {"nibbles": self.nibbles, "scale_zero": self.scale_zero, "packed": self.packed} | (
            {} if self.bias is None else {"bias": self.bias})

    @classmethod
    def supports(cls, weight: torch.Tensor, group_size: int = DEFAULT_GROUP_SIZE) -> bool:
        return (group_size in cls.GROUP_SIZES and weight.dim() == 2 and weight.shape[0] % 16 == 0
                and weight.shape[1] % group_size == 0)

    @property
    def out_features(self) -> int:
        return self.nibbles.shape[0]

    def codes(self) -> torch.Tensor:
        """[out, in] uint8 codes 0..15."""
        return torch.stack([self.nibbles & 15, self.nibbles >> 4], -1).view(self.out_features, -1)

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        out, inp = self.out_features, self.nibbles.shape[1] * 2
        groups = self.codes().view(out, inp // self.group_size, self.group_size).to(dtype) - 8
        scale_zero = self.scale_zero.to(dtype).transpose(0, 1)  # [out, groups, 2]
        return (groups * scale_zero[..., :1] + scale_zero[..., 1:]).view(out, inp)

    def first_rows(self, n: int) -> Int4Linear | _Rows:
        """A layer computing only outputs [0, n) (a vocabulary-limited LM head). Repacks those
        rows for the kernel (one copy of n rows, made once)."""
        rows = -(-n // 16) * 16  # the kernel takes whole blocks of 16 outputs
        part = Int4Linear.from_buffers(self.nibbles[:rows], self.scale_zero[:, :rows].contiguous(),
                                       None if self.bias is None else self.bias[:rows], self.group_size)
        return part if rows == n else _Rows(part, n)

    def _kernel(self, flat: torch.Tensor) -> torch.Tensor:
        return kernels.int4_matmul(flat, self.packed, self.group_size, self.scale_zero.to(flat.dtype))


def kernel_layout() -> str:
    """What Int4Linear's packed copy depends on: the int4 kernel picks its layout by the CPU's
    vector width (AVX-512, AVX2 or neither; ATEN_CPU_CAPABILITY can change it), and a torch
    release may change it too."""
    return f"torch {torch.__version__}, {torch.backends.cpu.get_cpu_capability()}"


class _Rows(torch.nn.Module):
    """The first n outputs of a layer that computes a few more."""

    def __init__(self, layer: torch.nn.Module, n: int):
        super().__init__()
        self.layer, self.n = layer, n

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x)[..., :self.n]


QUANTIZED_LINEAR = (Int8Linear, Int4Linear)


def quantize(model: torch.nn.Module, bits: int = 8) -> torch.nn.Module:
    """Replace every nn.Linear of `model` (LM head included), in place, by an Int8Linear
    (bits=8) or an Int4Linear (bits=4; a layer whose shape the int4 kernel cannot take gets
    int8 instead).

    Only for models the library loaded itself (a draft): a user's model object is never changed.
    Returns the model.

    Raises:
        ValueError: bits is not 4 or 8.
    """
    if bits not in (4, 8):
        raise ValueError(f"bits must be 4 or 8, got {bits!r}")
    for name, child in list(model.named_children()):
        if isinstance(child, torch.nn.Linear):
            if bits == 4 and Int4Linear.supports(child.weight, DEFAULT_GROUP_SIZE):
                setattr(model, name, Int4Linear(child.weight, child.bias, DEFAULT_GROUP_SIZE))
            else:
                setattr(model, name, Int8Linear(child.weight, child.bias))
        else:
            quantize(child, bits)
    return model


def quantized_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every quantized layer's tensors, named "<layer path>.<tensor>" (e.g.
    "model.layers.0.mlp.up_proj.nibbles"): what `prepare_draft(model, bits, state)` needs to
    rebuild the layers of another copy of the same float model without quantizing it, under the
    same kernel_layout()."""
    return {f"{name}.{key}": tensor for name, layer in model.named_modules()
            if isinstance(layer, QUANTIZED_LINEAR) for key, tensor in layer.state().items()}


def _layer_from_state(linear: torch.nn.Linear, name: str, state: dict[str, torch.Tensor], group_size: int):
    """The quantized layer stored in `state` for `linear`, checked against its shape and dtype."""
    out, inp = linear.weight.shape
    dtype = linear.weight.dtype
    if f"{name}.nibbles" in state:
        kind, expected = Int4Linear, {"nibbles": ((out, inp // 2), torch.uint8),
                                      "scale_zero": ((inp // group_size, out, 2), dtype),
                                      "packed": ((out, inp // 2), torch.uint8)}
    else:
        kind, expected = Int8Linear, {"weight_int8": ((out, inp), torch.int8), "scale": ((out,), torch.float32)}
    if linear.bias is not None:
        expected["bias"] = ((out,), linear.bias.dtype)
    tensors = {key: state.get(f"{name}.{key}") for key in expected}
    found = {key: None if t is None else (tuple(t.shape), t.dtype) for key, t in tensors.items()}
    if found != expected:
        raise ValueError(f"stored {kind.__name__} {name!r} does not fit the model: {found}, expected {expected}")
    bias = tensors.pop("bias", None)
    bias = None if bias is None else torch.nn.Parameter(bias, requires_grad=False)
    if kind is Int4Linear:
        return Int4Linear.from_buffers(tensors["nibbles"], tensors["scale_zero"], bias, group_size, tensors["packed"])
    return Int8Linear.from_buffers(tensors["weight_int8"], tensors["scale"], bias)


def load_quantized(model: torch.nn.Module, state: dict[str, torch.Tensor],
                   group_size: int = DEFAULT_GROUP_SIZE) -> torch.nn.Module:
    """Replace every nn.Linear of `model`, in place, by the quantized layer stored for it in
    `state` (quantized_state of the same float model, under the same kernel_layout()). Every layer is built and checked before
    any is replaced, so on an error the model is unchanged. Returns the model.

    Raises:
        ValueError: `state` lacks a layer, has one the model does not, or a tensor's shape or
            dtype differs from what the model's layer needs.
    """
    linears = {name: m for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    layers = {name: _layer_from_state(linear, name, state, group_size) for name, linear in linears.items()}
    used = {f"{name}.{key}" for name, layer in layers.items() for key in layer.state()}
    if used != set(state):
        raise ValueError(f"stored layers the model does not have: {sorted(set(state) - used)[:3]}")
    for name, layer in layers.items():
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, layer)
    return model


def check_quantizable(model: torch.nn.Module) -> None:
    """Raises ValueError, naming the dtype, if a linear layer's weights are of a dtype the
    integer kernels cannot take (anything but KERNEL_DTYPES, e.g. float64)."""
    dtypes = {m.weight.dtype for m in model.modules() if isinstance(m, torch.nn.Linear)}
    bad = sorted(str(dtype) for dtype in dtypes if dtype not in KERNEL_DTYPES)
    if bad:
        raise ValueError(
            f"cannot quantize a draft whose linear layers are {', '.join(bad)}: the int8/int4 kernels take "
            "float32, bfloat16 or float16. Convert the draft first (e.g. draft.to(torch.bfloat16)) or pass "
            "quantize_draft='none'")


def prepare_draft(model: torch.nn.Module, bits: int, state: dict[str, torch.Tensor] | None = None,
                  group_size: int = DEFAULT_GROUP_SIZE) -> torch.nn.Module:
    """Make a draft model the library owns cheaper to run, in place: `quantize(model, bits)`
    (or, given `state`, `load_quantized(model, state, group_size)`: the same layers, without
    quantizing), and eager attention instead of SDPA, whose CPU kernel is slow for the one query
    row of a draft step (zoo draft, 2 cores: 40 → 30 ms a step at a 1000-token context, equal at
    300). Returns the model.

    Raises:
        ValueError: weights of a dtype the kernels cannot take (check_quantizable), or a `state`
            that does not fit the model (load_quantized); either before any layer is replaced.
    """
    check_quantizable(model)
    if state is None:
        quantize(model, bits)
    else:
        load_quantized(model, state, group_size)
    if hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation("eager")
    return model
