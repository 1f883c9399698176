"""A GGUF file's weights converted to another weight type by llama.cpp's own quantize tool
(llama_model_quantize): a Q4_K_M file as BF16 or F32 for the llama.cpp target kernels, or a test's
F32 file as Q8_0 or Q4_K_M. Converted files are cached, keyed by the source's path, size and
modification time.
"""

from __future__ import annotations

import ctypes
import os
import tempfile
from pathlib import Path
from typing import Callable

import torch

from specdecode.models.gguf_files import file_key
from specdecode.models.llamacpp import library

# llama_ftype of a converted file (1-D tensors, norms and biases, stay F32 in every one)
FTYPES = {"f32": 0, "f16": 1, "q8_0": 7, "q4_k_m": 15, "bf16": 32}


def converted_gguf(source_path, kind: str, progress: Callable[[str], None] | None = None) -> Path:
    """The GGUF file with source_path's weights stored as `kind` ("bf16", "f32", ... : FTYPES),
    converted once by llama.cpp's own quantize tool (llama_model_quantize, requantizing allowed: a
    Q4_K_M file is dequantized and each weight rounded to bfloat16 for "bf16"; 1-D tensors such as
    norms and biases stay float32) into the cache folder, written through a temporary file and an
    atomic rename; later calls return the cached file. Its name carries a digest of the source's
    path, size and modification time, so a changed source is converted again.

    Raises:
        ImportError: llama-cpp-python missing.  FileNotFoundError: no source file.
        ValueError: unknown kind, or llama.cpp failed to convert it (a damaged file, no room on disk).
    """
    if kind not in FTYPES:
        raise ValueError(f"unknown GGUF weight type {kind!r}; use one of {', '.join(FTYPES)}")
    from specdecode.models.zoo import cache_dir

    source = Path(source_path).resolve()
    if not source.is_file():
        raise FileNotFoundError(f"no GGUF file at {str(source)!r}")
    out_dir = cache_dir() / "gguf"
    target = out_dir / f"{source.stem}-{kind}-{file_key(source)}.gguf"
    if target.is_file():
        return target
    out_dir.mkdir(parents=True, exist_ok=True)
    if progress:
        progress(f"converting {source.name} to {kind.upper()} with llama.cpp (first run only)")
    fd, tmp = tempfile.mkstemp(dir=out_dir, prefix=target.name, suffix=".partial")
    os.close(fd)
    try:
        quantize_gguf(source, tmp, kind)
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    return target


def quantize_gguf(source_path, dest_path, kind: str) -> None:
    """Write source_path's model to dest_path with its weights as `kind` (a key of FTYPES: "f32",
    "f16", "bf16", "q8_0", "q4_k_m"), with llama.cpp's own quantize (llama_model_quantize;
    requantizing a quantized source allowed: it is dequantized first).

    Raises:
        ImportError: llama-cpp-python missing.
        ValueError: unknown kind, or llama.cpp failed (its error is on stderr).
    """
    if kind not in FTYPES:
        raise ValueError(f"unknown GGUF weight type {kind!r}; use one of {', '.join(FTYPES)}")
    lib = library()
    params = lib.llama_model_quantize_default_params()
    params.ftype, params.allow_requantize = FTYPES[kind], True
    params.nthread = torch.get_num_threads()
    code = lib.llama_model_quantize(str(source_path).encode(), str(dest_path).encode(), ctypes.byref(params))
    if code != 0:
        raise ValueError(f"llama.cpp could not convert {Path(source_path).name} to {kind} "
                         f"(llama_model_quantize returned {code}: a damaged GGUF file, or no room on disk)")
