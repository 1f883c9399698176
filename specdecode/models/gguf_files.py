"""What a GGUF file describes besides its tensors, read once and cached: its transformers tokenizer
and config (both slow to build from the file's metadata: the vocabulary is read whole), keyed by
the file's path, size and modification time; its header checked, and its tensor table read."""

from __future__ import annotations

import functools
import hashlib
import os
import shutil
import tempfile
from pathlib import Path


def file_key(path: Path) -> str:
    """A short digest of a file's resolved path, size and modification time: a cache key that
    changes when the file does."""
    stat = path.stat()
    return hashlib.sha256(f"{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:12]


def check_gguf_header(path) -> None:
    """Raises ValueError where path does not start as a GGUF file does (b"GGUF", version 2 or 3):
    an empty, damaged or renamed file is refused before any model loads."""
    with open(path, "rb") as f:
        head = f.read(8)
    if len(head) < 8 or head[:4] != b"GGUF" or int.from_bytes(head[4:], "little") not in (2, 3):
        raise ValueError(f"{str(path)!r} is not a GGUF file (it does not start with a GGUF v2/v3 header)")


def _cached(kind: str, path: Path, build, load):
    """load(folder) of the cached copy, or build(), saved (save_pretrained) into the cache first."""
    from specdecode.models.zoo import cache_dir

    cached = cache_dir() / kind / f"{path.stem}-{file_key(path)}"
    try:
        return load(cached)
    except (OSError, ValueError):
        pass
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # it reports every metadata field it converts
    try:
        built = build()
    finally:
        hf_logging.set_verbosity(verbosity)
    cached.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=cached.parent, prefix=cached.name, suffix=".partial"))
    try:
        built.save_pretrained(tmp)
        os.replace(tmp, cached)
    except OSError:  # a cache we cannot write costs only time on the next load
        shutil.rmtree(tmp, ignore_errors=True)
    return built


def gguf_tokenizer(path):
    """The transformers tokenizer a GGUF file describes (its vocabulary, merges, special tokens and
    chat template), so the engine's detokenizer, chat template and stops work unchanged. Building
    it reads the whole vocabulary (tens of seconds for 150k tokens), so it is saved once in the
    cache folder and loaded from there afterwards."""
    from transformers import AutoTokenizer

    path = Path(path)

    def load(folder):
        if not (folder / "tokenizer_config.json").is_file():
            raise OSError("not cached")
        return AutoTokenizer.from_pretrained(str(folder))

    return _cached("tokenizers", path, lambda: AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name),
                   load)


def gguf_config(path):
    """The transformers config a GGUF file's metadata describes (architecture, sizes, rotary base),
    cached like gguf_tokenizer (about 10 s to read from a 150k-token file)."""
    from transformers import AutoConfig

    path = Path(path)

    def load(folder):
        if not (folder / "config.json").is_file():
            raise OSError("not cached")
        return AutoConfig.from_pretrained(str(folder))

    return _cached("configs", path, lambda: AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name), load)


# GGUF metadata value types (the format's numbering) → struct format of a scalar; 8 is a string,
# 9 an array
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}


class TensorTable:
    """A GGUF file's tensor table and the metadata a loader needs, read from its header without
    building the vocabulary (milliseconds where gguf.GGUFReader takes seconds on a 150k-token file).

    Attributes:
        architecture: general.architecture ("qwen2", "llama", ...).
        tensors: {name: (GGML type id, ggml shape: [inputs, outputs] for a matrix, offset in bytes
            from the file's start)}.
    Raises:
        ValueError: not a GGUF v2/v3 file, or a truncated one.
    """

    def __init__(self, path):
        import struct

        self.path = Path(path)
        data = memoryview(self.path.read_bytes() if self.path.stat().st_size < (1 << 20) else _head(self.path))
        position = 0

        def take(fmt: str):
            nonlocal position
            value = struct.unpack_from("<" + fmt, data, position)
            position += struct.calcsize("<" + fmt)
            return value[0] if len(value) == 1 else value

        def string() -> str:
            nonlocal position
            length = take("Q")
            position += length
            return bytes(data[position - length:position]).decode("utf-8", "replace")

        def value(kind: int):
            nonlocal position
            if kind in _SCALARS:
                return take(_SCALARS[kind])
            if kind == 8:
                return string()
            if kind == 9:
                inner, count = take("I"), take("Q")
                if inner in _SCALARS:  # skipped whole
                    position += count * struct.calcsize("<" + _SCALARS[inner])
                    return None
                for _ in range(count):
                    value(inner)
                return None
            raise ValueError(f"{self.path.name}: unknown GGUF value type {kind}")

        try:
            magic, version, count, pairs = take("4sIQQ")
            if magic != b"GGUF" or version not in (2, 3):
                raise ValueError(f"{self.path.name} is not a GGUF v2/v3 file")
            meta = {}
            for _ in range(pairs):
                key = string()
                meta[key] = value(take("I"))
            infos = []
            for _ in range(count):
                name = string()
                dims = take("I")
                shape = [take("Q") for _ in range(dims)]
                infos.append((name, take("I"), shape, take("Q")))
        except struct.error:
            raise ValueError(f"{self.path.name}: a truncated GGUF header") from None
        alignment = meta.get("general.alignment") or 32
        start = -(-position // alignment) * alignment
        self.architecture = meta.get("general.architecture") or "?"
        self.tensors = {name: (kind, shape, start + offset) for name, kind, shape, offset in infos}

    @functools.cached_property
    def _map(self):
        """The whole file, memory-mapped once (read-only); tensors are views of it."""
        import numpy as np

        return np.memmap(self.path, dtype=np.uint8, mode="r")

    def blocks(self, name: str):
        """A tensor's bytes as a read-only view of the file's memory map [outputs, bytes per row] (uint8)."""
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

        kind, shape, offset = self.tensors[name]
        block, size = GGML_QUANT_SIZES[GGMLQuantizationType(kind)]
        rows = 1
        for dim in shape[1:]:
            rows *= dim
        row_bytes = shape[0] // block * size
        return self._map[offset:offset + rows * row_bytes].reshape(rows, row_bytes)

    def type_name(self, name: str) -> str:
        from gguf import GGMLQuantizationType

        return GGMLQuantizationType(self.tensors[name][0]).name


def tensor_table(path) -> TensorTable:
    """The TensorTable of a GGUF file, read once per file version (start-up asks several times:
    the plan's candidates, the loader, the report).

    Raises:
        as TensorTable; OSError: no such file.
    """
    path = Path(path)
    return _tensor_table(str(path.resolve()), file_key(path))


@functools.lru_cache(maxsize=8)
def _tensor_table(path: str, key: str) -> TensorTable:
    return TensorTable(path)


def _head(path: Path) -> bytes:
    """The file's first bytes, enough for its header (which holds the vocabulary: tens of MB)."""
    with open(path, "rb") as f:
        head = f.read(64 << 20)
    return head


# A Qwen2 file's tensor names → transformers' (per layer: blk.{i}.NAME → model.layers.{i}.NAME)
_QWEN2_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_QWEN2_LAYER_NAMES = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
                      "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
                      "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
                      "ffn_down": "mlp.down_proj"}


def _qwen2_name(name: str) -> str | None:
    stem, _, kind = name.rpartition(".")
    if stem.startswith("blk.") and stem.count(".") >= 2:
        _, layer, part = stem.split(".", 2)
        return f"model.layers.{layer}.{_QWEN2_LAYER_NAMES[part]}.{kind}" if part in _QWEN2_LAYER_NAMES else None
    return f"{_QWEN2_NAMES[stem]}.{kind}" if stem in _QWEN2_NAMES else None


def dequantized_model(path, dtype):
    """A Qwen2 GGUF file's transformers model with its weights dequantized straight to `dtype`,
    one tensor at a time (the gguf package's reading of the format, as transformers' loader uses,
    rounded the same way), or None for another architecture.

    Why: transformers' GGUF loader dequantizes every tensor to float32 first and casts after, so
    a 1.5B model passes through ~6 GB of float32 beside its bfloat16 copy (the first run's peak,
    9.3 GB on a Zen 4); here the peak is the model plus one tensor's float32. A file this reader
    cannot read also gives None (transformers' loader then says what is wrong with it).
    """
    import numpy as np
    import torch
    from gguf import GGMLQuantizationType, quants
    from transformers import AutoModelForCausalLM
    from transformers.initialization import no_init_weights

    from specdecode.models.memory import release

    path = Path(path)
    try:
        # a table of its own: its memory map (the whole file, resident once read) goes with it
        table = TensorTable(path)
    except (OSError, ValueError):  # transformers' loader says what is wrong with the file
        return None
    if table.architecture != "qwen2":
        return None
    with no_init_weights():  # every parameter is overwritten below: no random values first
        model = AutoModelForCausalLM.from_config(gguf_config(path), dtype=dtype)
    # (no_init_weights skips the tying too: a file without an output matrix has tied embeddings,
    # and its LM head is then the embedding's own tensor, listed once below)
    model.tie_weights()
    parameters = dict(model.named_parameters())
    filled = set()
    for name, (kind, _, _) in table.tensors.items():
        hf_name = _qwen2_name(name)
        if hf_name not in parameters:  # a tensor transformers' Qwen2 has no place for: its loader decides
            del model, table
            release()
            return None
        values = quants.dequantize(np.asarray(table.blocks(name)), GGMLQuantizationType(kind))
        if not values.flags.writeable:  # a float32 tensor: a view of the read-only map
            values = values.copy()
        with torch.no_grad():
            parameters[hf_name].copy_(torch.from_numpy(values.reshape(parameters[hf_name].shape)))
        filled.add(hf_name)
    missing = set(parameters) - filled
    if missing:
        raise ValueError(f"{path.name}: no tensor for {sorted(missing)[:3]}")
    del table
    release()  # the map and the float32 temporaries: 1.9 GB of the 1.5B target's first run
    return model.eval()
