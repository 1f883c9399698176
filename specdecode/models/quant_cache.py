"""The quantized zoo draft, cached on disk: quantizing the default draft to int4 takes seconds at
every start, so its integer layers are saved once, as safetensors beside the zoo's weight cache,
and loaded at later starts.

Only zoo models loaded by name are cached: their weights have a known identity (the GGUF's
SHA-256 and the float weight cache they were loaded from). A draft given as a model object, a path
or a hub id is quantized in memory, as before. A cache file that cannot be read or does not fit
the model is quantized again and replaced; one that cannot be written only costs the next start
its quantization.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from specdecode.models import quant, zoo

# Bump when the file's layout changes (tensor names, metadata). A change to how quant.py
# quantizes needs no bump: _code_version is part of the key.
FORMAT_VERSION = 1


def prepare_draft_cached(model: torch.nn.Module, bits: int, zoo_name: str | None,
                         progress: Callable[[str], None] | None = None) -> torch.nn.Module:
    """quant.prepare_draft(model, bits), with the quantized layers cached on disk for zoo drafts.

    Args:
        model: the draft as the library loaded it; changed in place.
        bits: 4 or 8 (quant.quantize).
        zoo_name: the zoo name the draft was loaded by; None, or any spec not in the zoo (a path,
            a hub id), quantizes in memory without a cache.
        progress: called with one-line messages: quantizing, loading, cache warnings.
    Returns:
        the model, its layers exactly those quant.prepare_draft(model, bits) would give.
    Raises:
        ValueError: weights of a dtype the kernels cannot take (quant.check_quantizable).
    """
    say = progress or (lambda message: None)
    kind = f"int{bits}"
    if not isinstance(zoo_name, str) or zoo_name not in zoo.ZOO:
        say(f"quantizing the draft to {kind}")
        return quant.prepare_draft(model, bits)
    quant.check_quantizable(model)  # before a cache file is named after its dtype
    path = cache_path(model, zoo_name, bits)
    if path.exists():
        say(f"loading the {kind} draft from {path}")
        try:
            state, group_size = _read(path)
            return quant.prepare_draft(model, bits, state, group_size)
        except (OSError, ValueError, SafetensorError) as err:  # load_quantized left the model as it was
            say(f"warning: cannot use {path} ({err}); quantizing again")
    say(f"quantizing the draft to {kind} (once; cached in {path})")
    quant.prepare_draft(model, bits)
    _write(quant.quantized_state(model), path, kind, say)
    return model


def cache_path(model: torch.nn.Module, zoo_name: str, bits: int) -> Path:
    """The cache file of a zoo draft quantized to `bits`: beside zoo.weights_cache, named
    "<zoo name>-<dtype>-int4-g32-<key>.safetensors" (int8: no group size), where key hashes the
    source weights (the GGUF's SHA-256; name, size and mtime of each cached float weight file),
    the kind, the group size, FORMAT_VERSION, quant.py's source and the int4 kernel's layout
    (stored too, it saves repacking every layer at each start)."""
    dtype = next(m.weight.dtype for m in model.modules() if isinstance(m, torch.nn.Linear))
    kind = f"int{bits}" + (f"-g{quant.DEFAULT_GROUP_SIZE}" if bits == 4 else "")
    float_weights = zoo.weights_cache(zoo_name, dtype)
    source = [zoo.ZOO[zoo_name].sha256] + [f"{p.name}:{p.stat().st_size}:{p.stat().st_mtime_ns}"
                                           for p in sorted(float_weights.glob("*.safetensors"))]
    key = hashlib.sha256("\n".join([*source, kind, f"format {FORMAT_VERSION}", _code_version(),
                                    quant.kernel_layout()]).encode())
    return float_weights.parent / f"{float_weights.name}-{kind}-{key.hexdigest()[:16]}.safetensors"


def _code_version() -> str:
    """A digest of quant.py: any edit there invalidates the cache (costing one quantization),
    so a changed quantization can never load stale layers."""
    return hashlib.sha256(Path(quant.__file__).read_bytes()).hexdigest()[:16]


def _read(path: Path) -> tuple[dict[str, torch.Tensor], int]:
    with safe_open(path, framework="pt") as f:
        metadata = f.metadata() or {}
        if metadata.get("format") != str(FORMAT_VERSION) or \
                metadata.get("group_size") not in [str(size) for size in quant.Int4Linear.GROUP_SIZES]:
            raise ValueError(f"unexpected metadata {metadata}")
        # copied into torch's own (64-byte aligned) memory: tensors read from the file sit at the
        # offsets it gives them (24 mod 64 here), and torch's int8 kernel crashed on such weights
        # at 40 rows (a segfault, torch 2.13)
        tensors = {key: f.get_tensor(key).clone() for key in f.keys()}  # noqa: SIM118 (safe_open is not iterable)
        return tensors, int(metadata["group_size"])


def _write(state: dict[str, torch.Tensor], path: Path, kind: str, say: Callable[[str], None]) -> None:
    """Write through a temporary file and an atomic rename, so that a crash (or another process
    writing the same file) never leaves a half-written file under the final name; then remove
    this draft's older cache files of the same kind."""
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".partial")
        os.close(fd)
        save_file(state, tmp, metadata={"format": str(FORMAT_VERSION), "group_size": str(quant.DEFAULT_GROUP_SIZE)})
        os.replace(tmp, path)
    except (OSError, SafetensorError) as err:  # a cache we cannot write only costs speed next time
        say(f"warning: could not cache the {kind} draft in {path}: {err}")
        return
    finally:
        if tmp is not None and os.path.exists(tmp):
            os.remove(tmp)
    for old in path.parent.glob(path.name.rsplit("-", 1)[0] + "-*.safetensors"):
        if old != path:
            with contextlib.suppress(OSError):  # another process may be reading or removing it
                old.unlink()
