"""A GGUF file's own K-quant weights as a batch-invariant target: dtype="gguf" computed by
specdecode's kernels (specdecode.native, kquants.cpp) instead of llama.cpp's.

Why. llama.cpp computes a Q4_K_M file fast one token at a time, but its multi-token products on
CPUs without AMX cost several steps (r(9) ≈ 7.6 on a Zen 4), which leaves speculation nothing to
gain (paper §3.4: the verify's cost c is what the speedup divides by), and its k-token verify
rounds differently from its one-token step. Here every product reads the file's Q4_K and Q6_K
blocks as stored (memory-mapped, never dequantized to a copy), once per call for all rows, and
computes each row as a one-token step does (the same int8 activations and integer sums per
block): a verify costs about a step and a half, and greedy speculative output equals plain greedy
output token for token.

The numbers. As in llama.cpp, each product quantizes its input rows to int8 per block of 256
(docs/exactness.md says how this model differs from llama.cpp's and from the bfloat16 one); the
rest of the forward is the bfloat16 one of models/invariant.py (bfloat16 hidden states, RMSNorm,
rotary tables, attention over a bfloat16 cache), the token embeddings are the file's rows
dequantized and rounded to bfloat16, the norms and biases the file's float32 values.

Coverage: the Qwen2 architecture (the zoo's files) with every matrix, the LM head included, in
Q4_K or Q6_K blocks of inputs a multiple of 256. Llama files are not run here yet: llama.cpp's
converter stores their q/k rows permuted and Llama 3's rotary scaling as a tensor, and neither is
covered by a test. `unsupported(path)` says why a file is not run here.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from specdecode import native
from specdecode.models.gguf_files import TensorTable, gguf_config, tensor_table

ARCHITECTURES = ("qwen2",)


class _KQuant:
    """A product on one or more K-quant tensors side by side (native.linear_kq), with a float32 bias."""

    def __init__(self, parts: list, inputs: int, bias: torch.Tensor | None):
        self.bias = bias
        self.weights = native.KQuantWeights(parts, inputs)

    def __call__(self, x: torch.Tensor, out_float32: bool = False) -> torch.Tensor:
        return native.linear_kq(x, self.weights, self.bias, out_float32)


class _Embedding:
    """Token ids [B, T] long → the file's embedding rows dequantized (gguf's reading of the
    format), rounded to bfloat16 [B, T, hidden], read only for the ids asked."""

    def __init__(self, table: TensorTable, name: str):
        from gguf import GGMLQuantizationType

        self.blocks, self.kind = table.blocks(name), GGMLQuantizationType(table.tensors[name][0])
        self.hidden, self.num_embeddings = table.tensors[name][1][:2]

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        from gguf import quants

        flat = ids.reshape(-1).numpy()
        rows = quants.dequantize(np.ascontiguousarray(self.blocks[flat]), self.kind).reshape(len(flat), self.hidden)
        return torch.from_numpy(rows).to(torch.bfloat16).view(*ids.shape, self.hidden)


def unsupported(path) -> str | None:
    """Why this GGUF file's target cannot run on the K-quant kernels, or None where it can
    (reads only the file's header)."""
    try:
        table = tensor_table(path)
    except (OSError, ValueError) as err:
        return f"cannot read {Path(path).name}: {err}"
    if table.architecture not in ARCHITECTURES:
        return f"architecture {table.architecture!r} (the K-quant kernels run {', '.join(ARCHITECTURES)})"
    head = "output.weight" if "output.weight" in table.tensors else "token_embd.weight"
    for name, (_, shape, _) in table.tensors.items():
        if len(shape) < 2 or (name == "token_embd.weight" and head != name):
            continue  # norms and biases are read as floats; the embedding's rows are dequantized
        kind = table.type_name(name)
        if kind not in native.KQUANT_TYPES:
            return f"{name} is {kind} (the K-quant kernels read {', '.join(native.KQUANT_TYPES)})"
        if shape[0] % 256:
            return f"{name} has {shape[0]} inputs, not a multiple of 256"
    return None


def describe(path) -> str:
    """What the file's numbers are, for reports: its architecture and its matrices' block types
    (e.g. "qwen2 Q4_K+Q6_K")."""
    table = tensor_table(path)
    kinds = sorted({table.type_name(name) for name, (_, shape, _) in table.tensors.items() if len(shape) > 1})
    return f"{table.architecture} {'+'.join(kinds)}"


def _floats(table: TensorTable, name: str) -> torch.Tensor:
    if table.type_name(name) != "F32":
        raise ValueError(f"{table.path.name}: {name} is {table.type_name(name)}; float32 expected")
    return torch.from_numpy(np.asarray(table.blocks(name)).view(np.float32).reshape(-1).copy())


def kquant_decoder(path, config=None):
    """The InvariantDecoder of a GGUF file's target on its own K-quant blocks.

    Args:
        path: the GGUF file.  config: its transformers config (read from the file when None).
    Returns:
        (models.invariant.InvariantDecoder, config).
    Raises:
        ValueError: a file `unsupported` rejects (the message says why).
        native.NativeUnavailable: no kernels here.
    """
    from specdecode.models.invariant import InvariantDecoder, _Layer

    reason = unsupported(path)
    if reason is not None:
        raise ValueError(f"the K-quant kernels cannot run {Path(path).name}: {reason}")
    config = config or gguf_config(path)
    table = tensor_table(path)
    tensors = table.tensors

    def blocks(name: str) -> tuple[np.ndarray, str]:
        return table.blocks(name), table.type_name(name)

    def outputs(name: str) -> int:
        return tensors[f"{name}.weight"][1][1]

    def bias(names: list[str]) -> torch.Tensor | None:
        if not any(f"{name}.bias" in tensors for name in names):
            return None
        return torch.cat([_floats(table, f"{name}.bias") if f"{name}.bias" in tensors else torch.zeros(outputs(name))
                          for name in names]).contiguous()

    def product(names: list[str]) -> _KQuant:  # inputs: the matrices' own width
        return _KQuant([blocks(f"{name}.weight") for name in names], tensors[f"{names[0]}.weight"][1][0], bias(names))

    eps = config.rms_norm_eps
    layers = []
    for i in range(config.num_hidden_layers):
        block = f"blk.{i}"
        qkv = [f"{block}.attn_q", f"{block}.attn_k", f"{block}.attn_v"]
        layers.append(_Layer(product(qkv), product([f"{block}.attn_output"]),
                             product([f"{block}.ffn_gate", f"{block}.ffn_up"]), product([f"{block}.ffn_down"]),
                             _floats(table, f"{block}.attn_norm.weight").bfloat16(),
                             _floats(table, f"{block}.ffn_norm.weight").bfloat16(), eps, eps))
    head_name = "output.weight" if "output.weight" in tensors else "token_embd.weight"
    head = _KQuant([blocks(head_name)], config.hidden_size, None)
    norm = _floats(table, "output_norm.weight").bfloat16()
    return InvariantDecoder.of_parts(config, _Embedding(table, "token_embd.weight"), layers, norm, eps, head), config


def kquant_model(path, eos_token_ids=()):
    """The engine backend (models.hf.HFCausalLM) of a GGUF file's target whose every forward runs
    on the file's K-quant blocks. The transformers model inside is a skeleton on the "meta"
    device (config, cache layout; no weights): the decoder holds the file's tensors.

    Raises:
        as kquant_decoder.
    """
    from transformers import AutoModelForCausalLM

    from specdecode.models.hf import HFCausalLM

    decoder, config = kquant_decoder(path)
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    if eos_token_ids:
        skeleton.generation_config.eos_token_id = list(eos_token_ids)
    backend = HFCausalLM(skeleton, device=torch.device("cpu"))
    backend.use_decoder(decoder)
    return backend
