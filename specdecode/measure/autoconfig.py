"""dtype="auto": time the candidate target kernels and draft kernels of this pair on this machine,
choose by Eq. 1 with the measured r(k) (specdecode.measure.choice), and cache the result per
machine, model pair and library version so that a second start measures nothing.

Candidates on a CPU: the target in bfloat16 (torch's kernels) and in float32 with oneDNN-packed
weights (specdecode.models.packed); the draft in the same dtype, its layers as prepared (int4 by
default). They are timed
on copies of the models the decoder already loaded in bfloat16 (a float32 copy for the float32
candidate: timing depends on the kernels, not on the weights' last bits), a few forwards each,
interleaved.
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

from specdecode.measure.choice import Choice, TargetCost, choose
from specdecode.measure.hardware import cpu_report
from specdecode.measure.timing import time_forwards
from specdecode.models import packed
from specdecode.models.hf import HFCausalLM

# k of the timed calls: a plain step, verifies of γ+1 up to 17 and a prompt read of 64 tokens
SIZES = (1, 2, 5, 9, 17, 64)
CACHE_VERSION = 1
KERNEL_DTYPES = {"bfloat16": torch.bfloat16, "float32-packed": torch.float32}


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


def _target_cost(model, context: list[int]) -> TargetCost:
    times = time_forwards(HFCausalLM(model), context, list(SIZES), repeats=3)
    step = times[1]
    return TargetCost(step, {k: times[k] / step for k in SIZES if k > 1}, times[max(SIZES)] / max(SIZES))


def draft_kernel(model) -> str:
    """"int4", "int8" or "none": the draft's linear layers as prepared (models/quant.py)."""
    from specdecode.models.quant import Int4Linear, Int8Linear

    kinds = {type(m) for m in model.modules()}
    return "int4" if Int4Linear in kinds else "int8" if Int8Linear in kinds else "none"


def _draft_step(model, vocab_limit: int | None, context: list[int]) -> float:
    return time_forwards(HFCausalLM(model, vocab_limit, lean=True), context, [1], repeats=5)[1]


def measure_and_choose(target_model, draft_model, draft_vocab_limit: int | None, max_gamma: int,
                       progress: Callable[[str], None] | None = None) -> Choice:
    """Time each candidate kernel of this pair (models loaded in bfloat16 on the CPU, the draft
    already prepared with its int4 layers) and return the Choice. The models are not changed:
    the float32 candidates are timed on copies, which are freed before returning.

    Raises:
        ValueError: models that are not bfloat16 on the CPU.
    """
    for model in (target_model, draft_model):
        if model is not None and (next(model.parameters()).dtype != torch.bfloat16
                                  or next(model.parameters()).device.type != "cpu"):
            raise ValueError("measure_and_choose times bfloat16 CPU models")
    if progress:
        progress("timing this machine's kernels for the target and the draft (once per machine; cached)")
    vocab = target_model.get_input_embeddings().num_embeddings
    context = [(i * 7919) % min(vocab, 30000) + 100 for i in range(64)]
    targets, drafts = {}, {}
    with torch.inference_mode():
        targets["bfloat16"] = _target_cost(target_model, context)
        if draft_model is not None:
            kind = draft_kernel(draft_model)
            drafts["bfloat16"] = {kind: _draft_step(draft_model, draft_vocab_limit, context)}
        if packed.available():
            copy32 = copy.deepcopy(target_model).float()
            packed.pack_linears(copy32)
            targets["float32-packed"] = _target_cost(copy32, context)
            del copy32
            if draft_model is not None:
                draft32 = copy.deepcopy(draft_model).float()
                drafts["float32-packed"] = {kind: _draft_step(draft32, draft_vocab_limit, context)}
                del draft32
    choice = choose(targets, drafts, max_gamma=max_gamma)
    notes = tuple(f"{name}: step {1e3 * cost.step_s:.0f} ms, r(9) {cost.ratio(9):.2f}, "
                  f"prompt read {1e3 * cost.read_s_per_token:.1f} ms/token"
                  + "".join(f", {kind} draft step {1e3 * s:.0f} ms" for kind, s in drafts.get(name, {}).items())
                  for name, cost in targets.items())
    return Choice(**{**asdict(choice), "notes": notes})
