"""Loading models at the boundary: names, paths and hub ids → (model, tokenizer), checked before
anything heavy happens; dtypes and devices parsed; the pair's tokenizers compared (rule 6)."""

from __future__ import annotations

import os
import socket
from typing import Callable

import torch

from specdecode.models import zoo

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16, "float64": torch.float64}


def parse_dtype(dtype) -> torch.dtype:
    """None or "auto" → bfloat16, where dtype="auto" starts (SpeculativeDecoder may then choose
    float32 after timing this machine's kernels: specdecode.tune)."""
    if dtype is None or dtype == "auto":
        return torch.bfloat16
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; use one of {', '.join(DTYPES)}")
    return DTYPES[dtype]


def _hub_reachable(host: str = "huggingface.co") -> bool:
    if os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false", "False"):
        return False
    try:
        socket.getaddrinfo(host, 443)
        return True
    except OSError:
        return False


def check_model_spec(spec) -> None:
    """Fail fast, before any model is loaded, on a spec that cannot load here.

    Raises:
        ValueError: not a zoo name, not an existing directory, and (for a hub id) no local copy
            in the Hugging Face cache while the hub is unreachable.
    """
    if isinstance(spec, torch.nn.Module):
        return
    if spec in zoo.ZOO:
        try:
            zoo.check_installed(spec)
        except FileNotFoundError as err:
            raise ValueError(str(err)) from None
        return
    if not isinstance(spec, str) or not spec:
        raise ValueError(f"model must be a zoo name, a local path, a GGUF file or a hub id, got {spec!r}")
    path = os.path.expanduser(spec)
    if os.path.isdir(path):
        return
    if is_gguf(spec) and os.path.isfile(path):
        from specdecode.models.gguf_files import check_gguf_header

        check_gguf_header(path)
        return
    if is_gguf(spec):
        raise ValueError(f"GGUF file {spec!r} does not exist")
    if os.path.exists(path):
        raise ValueError(f"{spec!r} is a file but not a model: give a directory saved with save_pretrained, or a "
                         "GGUF file named *.gguf")
    looks_like_path = spec.startswith((".", "/", "~")) or spec.count("/") > 1 or os.sep + os.sep in spec
    if looks_like_path:
        raise ValueError(f"model path {spec!r} does not exist. Known offline models: {', '.join(zoo.ZOO)}")
    from huggingface_hub import try_to_load_from_cache

    if not isinstance(try_to_load_from_cache(spec, "config.json"), str) and not _hub_reachable():
        raise ValueError(
            f"cannot load model {spec!r}: it is not in the local Hugging Face cache and the hub is "
            f"unreachable from here. Known offline models: {', '.join(zoo.ZOO)}; or pass a local "
            "directory saved with save_pretrained.")


def is_gguf(spec) -> bool:
    """Whether a model spec names a GGUF file (by its extension)."""
    return isinstance(spec, str) and spec.lower().endswith(".gguf")


def gguf_source(spec, progress: Callable[[str], None] | None = None):
    """The GGUF file a model spec stands for (a zoo name's, assembled if needed, or a .gguf
    path), or None (a directory, a hub id or a model object: no GGUF for llama.cpp to run)."""
    from pathlib import Path

    if isinstance(spec, str) and spec in zoo.ZOO:
        return zoo.gguf_file(spec, progress)
    return Path(spec).expanduser() if is_gguf(spec) else None


def load_model(spec, dtype: torch.dtype, progress: Callable[[str], None] | None = None, device_map=None,
               offload_folder: str | None = None):
    """A zoo name, a local directory or a hub id → (model, tokenizer, name). A config with
    is_encoder_decoder (T5, BART, ...) loads through AutoModelForSeq2SeqLM, others as causal LMs.
    device_map and offload_folder, if not None, go to transformers' from_pretrained (accelerate
    places the layers; "disk" entries of a device_map are offloaded to offload_folder).

    Raises:
        ValueError: the model cannot be found or loaded here (the message says what to do).
    """
    from transformers import (
        AutoConfig,
        AutoModelForCausalLM,
        AutoModelForSeq2SeqLM,
        AutoTokenizer,
    )

    check_model_spec(spec)
    if spec in zoo.ZOO:
        model, tokenizer = zoo.load_zoo_model(spec, dtype, progress, **placement(device_map, offload_folder))
        return model, tokenizer, spec
    if progress:
        progress(f"loading {spec}" + (f" (dequantizing to {str(dtype).removeprefix('torch.')})" if is_gguf(spec)
                                      else ""))
    try:
        if is_gguf(spec):  # dequantized to dtype (a llama.cpp backend runs it as is)
            from transformers.utils import logging as hf_logging

            from specdecode.models.gguf_files import dequantized_model

            folder, name = os.path.split(os.path.abspath(os.path.expanduser(spec)))
            verbosity = hf_logging.get_verbosity()
            # its advice to compute a GGUF in float32 does not apply: the weights are dequantized
            hf_logging.set_verbosity_error()
            hf_logging.disable_progress_bar()
            try:
                # ours where it covers the file (one tensor at a time, never the whole model in
                # float32) and nothing is placed; transformers' loader otherwise
                model = (dequantized_model(os.path.join(folder, name), dtype) if device_map is None else None) \
                    or AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=dtype,
                                                            **placement(device_map, offload_folder))
                tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
            finally:
                hf_logging.set_verbosity(verbosity)
                hf_logging.enable_progress_bar()
            return model.eval(), tokenizer, spec
        seq2seq = getattr(AutoConfig.from_pretrained(spec), "is_encoder_decoder", False)
        auto = AutoModelForSeq2SeqLM if seq2seq else AutoModelForCausalLM
        model = auto.from_pretrained(spec, dtype=dtype, **placement(device_map, offload_folder))
        tokenizer = AutoTokenizer.from_pretrained(spec)
    except (OSError, ValueError) as err:
        raise ValueError(f"cannot load model {spec!r}: {type(err).__name__}: {str(err).splitlines()[0]}") from None
    return model.eval(), tokenizer, spec


def load_tokenizer(spec):
    """A tokenizer by local path or hub id (a draft's own, given apart from its model).

    Raises:
        ValueError: it cannot be loaded here (the message says why).
    """
    from transformers import AutoTokenizer

    if str(spec).startswith((".", "/", "~")) and not os.path.isdir(os.path.expanduser(str(spec))):
        raise ValueError(f"tokenizer path {str(spec)!r} is not a directory")
    try:
        return AutoTokenizer.from_pretrained(os.path.expanduser(str(spec)))
    except (OSError, ValueError) as err:
        raise ValueError(f"cannot load tokenizer {str(spec)!r}: {type(err).__name__}: {str(err).splitlines()[0]}") \
            from None


def placement(device_map, offload_folder: str | None) -> dict:
    """from_pretrained's placement arguments that were given."""
    return {key: value for key, value in (("device_map", device_map), ("offload_folder", offload_folder))
            if value is not None}


def parse_device(device, model=None) -> torch.device:
    """None → where a passed model already is, else the CPU; "cpu", "cuda", "cuda:N", "mps".

    Raises:
        ValueError: an unknown device string or one that is not available here.
    """
    if device is None:
        if isinstance(model, torch.nn.Module):
            return next(model.parameters()).device
        return torch.device("cpu")
    try:
        parsed = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"unknown device {device!r}; use None, 'cpu', 'cuda', 'cuda:N' or 'mps'") from None
    if parsed.type == "cuda" and (not torch.cuda.is_available()
                                  or (parsed.index or 0) >= torch.cuda.device_count()):
        raise ValueError(f"device {device!r} is not available here (torch sees "
                         f"{torch.cuda.device_count()} CUDA devices); use device='cpu'")
    if parsed.type == "mps" and not torch.backends.mps.is_available():
        raise ValueError(f"device {device!r} is not available here; use device='cpu'")
    if parsed.type not in ("cpu", "cuda", "mps"):
        raise ValueError(f"unsupported device {device!r}; use None, 'cpu', 'cuda', 'cuda:N' or 'mps'")
    return parsed


def eos_token_ids(model, tokenizer) -> frozenset[int]:
    """The ids that end generation: the model's generation config's and the tokenizer's."""
    ids = set()
    for value in (getattr(model.generation_config, "eos_token_id", None), tokenizer.eos_token_id):
        if isinstance(value, int):
            ids.add(value)
        elif value:
            ids.update(value)
    return frozenset(ids)
