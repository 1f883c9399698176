"""dtype="auto": time the candidate target kernels and draft kernels of this pair on this machine,
choose by Eq. 1 with the measured r(k) (specdecode.measure.choice), and cache the result per
machine, model pair and library version so that a second start measures nothing.

Candidates on a CPU: the target in bfloat16 (torch's kernels; and with one-row calls on torch's
own matrix-vector kernels instead of oneDNN's) and in float32 with oneDNN-packed weights
(specdecode.models.packed); the draft, whose dtype is free (the verifier needs only its q), in
bfloat16 (both ways) and float32, with each of its kernels (int4, int8, its float weights; only the
one asked for when quantize_draft was given). They are timed on models loaded in bfloat16 and
float32 copies of them, a few forwards each, round by round in turn.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import tempfile
from dataclasses import asdict
from pathlib import Path
from typing import Callable

import torch

from specdecode.measure.choice import Choice, DraftCost, TargetCost, choose
from specdecode.measure.hardware import cpu_report
from specdecode.measure.timing import time_interleaved
from specdecode.models import packed
from specdecode.models.hf import HFCausalLM

# k of the timed calls: a plain step, verifies of γ+1 up to 17 and a prompt read of 64 tokens
SIZES = (1, 2, 5, 9, 17, 64)
DRAFT_SIZES = (1, 64)  # a draft step and the draft's prompt read
CACHE_VERSION = 4  # bumped when what is measured or how the choice is made changes
# kernels: bfloat16 as torch runs it; bfloat16 whose one-row calls skip oneDNN for torch's own
# matrix-vector kernels (HFCausalLM.one_row_onednn = False); float32 with packed weights (the
# target's) and float32 as loaded (the draft's: its int4/int8 layers are not torch Linears)
KERNEL_DTYPES = {"bfloat16": torch.bfloat16, "bfloat16-gemv": torch.bfloat16, "float32-packed": torch.float32,
                 "float32": torch.float32}
ONE_ROW_WITHOUT_ONEDNN = {"bfloat16-gemv"}


def cache_key(target_name: str, draft_name: str | None, max_gamma: int) -> str:
    """What a measurement depends on: this machine (CPU, flags, torch, threads, emulation), the
    pair, γ_max and the library's versions."""
    import transformers

    from specdecode.models.quant import kernel_layout

    parts = {"machine": cpu_report(), "target": target_name, "draft": draft_name, "max_gamma": max_gamma,
             "transformers": transformers.__version__, "kernels": kernel_layout(), "version": CACHE_VERSION}
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:20]


def cache_path(key: str) -> Path:
    from specdecode.models.zoo import cache_dir

    return cache_dir() / "choices" / f"{key}.json"


def load_choice(key: str) -> Choice | None:
    """The cached Choice for this key, or None (missing or unreadable: measured again)."""
    try:
        data = json.loads(cache_path(key).read_text(encoding="utf-8"))
        data["notes"] = tuple(data.get("notes", ()))
        return Choice(**data)
    except (OSError, ValueError, TypeError):
        return None


def save_choice(key: str, choice: Choice) -> None:
    """Write atomically; a cache that cannot be written only costs the next start its measurement."""
    path = cache_path(key)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".partial")
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(asdict(choice), f)
        os.replace(tmp, path)
    except OSError:
        pass


def draft_kernel(model) -> str:
    """"int4", "int8" or "none": the draft's linear layers as prepared (models/quant.py)."""
    from specdecode.models.quant import Int4Linear, Int8Linear

    kinds = {type(m) for m in model.modules()}
    return "int4" if Int4Linear in kinds else "int8" if Int8Linear in kinds else "none"


def _float32_copy(model):
    # torch's own Module.float: transformers refuses .float() on a model it loaded from GGUF
    # (a zoo model's first start, before its weights are cached) though its weights are floats
    return torch.nn.Module.float(copy.deepcopy(model))


def measure_and_choose(target_model, drafts: dict, draft_vocab_limit: int | None, max_gamma: int,
                       progress: Callable[[str], None] | None = None) -> Choice:
    """Time each candidate of this pair and return the Choice.

    Args:
        target_model: the target, loaded in bfloat16 on the CPU.
        drafts: {draft kernel ("int4", "int8", "none"): the draft prepared that way, in bfloat16};
            empty for no draft.
        draft_vocab_limit, max_gamma: as the decoder's.
    The models are not changed: the float32 candidates are float32 copies (timing depends on the
    kernels, not on the weights' last bits), freed before returning.
    Raises:
        ValueError: models that are not bfloat16 on the CPU.
    """
    for model in (target_model, *drafts.values()):
        if next(model.parameters()).dtype != torch.bfloat16 or next(model.parameters()).device.type != "cpu":
            raise ValueError("measure_and_choose times bfloat16 CPU models")
    if progress:
        progress("timing this machine's kernels for the target and the draft (once per machine and pair; cached)")
    vocab = target_model.get_input_embeddings().num_embeddings
    context = [(100 + i * 7919) % min(vocab, 30000) for i in range(64)]  # a spread of ordinary ids
    # (kernel, draft kind or None for the target) → model; the gemv variants share the bfloat16 ones
    models = {("bfloat16", None): target_model, **{("bfloat16", kind): model for kind, model in drafts.items()}}
    if packed.available():
        copy32 = _float32_copy(target_model)
        packed.pack_linears(copy32, max_gamma + 1)
        models["float32-packed", None] = copy32
        models.update({("float32", kind): _float32_copy(model) for kind, model in drafts.items()})
    models.update({("bfloat16-gemv", kind): model for (kernel, kind), model in list(models.items())
                   if kernel == "bfloat16"})
    backends, sizes = {}, {}
    for (kernel, kind), model in models.items():
        backend = HFCausalLM(model) if kind is None else HFCausalLM(model, draft_vocab_limit, lean=True)
        backend.one_row_onednn = kernel not in ONE_ROW_WITHOUT_ONEDNN
        backends[kernel, kind] = backend
        # a gemv variant's multi-row calls are bfloat16's own: its one-row step is all it adds
        sizes[kernel, kind] = (1,) if kernel in ONE_ROW_WITHOUT_ONEDNN else SIZES if kind is None else DRAFT_SIZES
    with torch.inference_mode():
        times = time_interleaved(backends, context, sizes)
    del models, backends
    for kernel, kind in list(times):
        if kernel in ONE_ROW_WITHOUT_ONEDNN:
            times[kernel, kind] = {**times["bfloat16", kind], 1: times[kernel, kind][1]}
    read = max(DRAFT_SIZES)
    targets = {kernel: TargetCost(t[1], {k: t[k] / t[1] for k in SIZES if k > 1}, t[max(SIZES)] / max(SIZES))
               for (kernel, kind), t in times.items() if kind is None}
    draft_costs = {(kind, kernel): DraftCost(t[1], t[read] / read) for (kernel, kind), t in times.items()
                   if kind is not None}
    choice = choose(targets, draft_costs, max_gamma=max_gamma)
    notes = tuple(f"{kernel} target: step {1e3 * cost.step_s:.0f} ms, r(9) {cost.ratio(9):.2f}, "
                  f"prompt read {1e3 * cost.read_s_per_token:.1f} ms/token" for kernel, cost in targets.items()) + \
        tuple(f"{kind} {kernel} draft: step {1e3 * cost.step_s:.0f} ms, prompt read "
              f"{1e3 * cost.read_s_per_token:.1f} ms/token" for (kind, kernel), cost in draft_costs.items())
    return Choice(**{**asdict(choice), "notes": notes})
