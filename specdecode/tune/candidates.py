"""dtype="auto" (and "gguf"): time this pair's candidate kernels on this machine, one model at a
time, and choose by Eq. 1 with the measured r(k) (specdecode.tune.costs).

Candidates on a CPU. The target: bfloat16 as torch runs it, bfloat16 whose one-row calls skip
oneDNN for torch's own matrix-vector kernels, float32 with oneDNN-packed weights (without native
bfloat16 only)
(specdecode.models.packed), and, with llama-cpp-python and a GGUF file, llama.cpp on a BF16 GGUF
of the same weights (dtype="gguf": llama.cpp on the file as it is). The draft, whose dtype is free
(the verifier needs only its q): each of its kernels (int4, int8, its float weights; only the one
asked for when quantize_draft is given) in bfloat16 four ways (oneDNN, torch's matrix-vector
kernels, SDPA instead of eager attention in its steps: which is faster differs by CPU, and the
whole forward on specdecode.native, "native"), the integer kernels with float32 activations, and
its GGUF file as it is on llama.cpp.

Memory. Candidates are loaded one target at a time and freed before the next, so the peak is the
largest candidate, not their sum. The float32 target (twice the bfloat16 bytes, plus a packed
copy of a tied LM head) is a candidate only on CPUs without native bfloat16 products, and there
it is timed only when it could win: its step cannot be faster than reading its weights once at
this machine's measured memory bandwidth, nor its verify cheaper than that step, and where even
that bound loses to a measured candidate it is not loaded. (On an AMX Xeon with a 480 MiB L3 the
bandwidth measure, a 1 GiB sum, read partly from cache and let the bound pass: the float32 copy
then set the first run's peak memory, 14.6 GB.)
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import Callable

import torch

from specdecode.models.memory import release
from specdecode.tune.costs import Choice, DraftCost, TargetCost, choose
from specdecode.tune.hardware import native_bfloat16
from specdecode.tune.timing import time_interleaved

# k of the timed calls: a plain step, verifies of γ+1 up to 17 and a prompt read of 64 tokens
SIZES = (1, 2, 5, 9, 17, 64)
DRAFT_SIZES = (1, 64)  # a draft step and the draft's prompt read
# Targets this large are timed; below, a forward's fixed overhead hides the dtype's kernels and
# bfloat16 stays (as for tiny test models).
AUTO_MIN_PARAMETERS = 100_000_000
QUANTIZED_KINDS = ("int4", "int8")
INVARIANT = "bfloat16-invariant"
# target kernels that read the target's GGUF file (loaded by Loaders.file_target)
FILE_KERNELS = ("llama.cpp-bf16", "llama.cpp-f32", "llama.cpp-gguf", "gguf-invariant")

Progress = Callable[[str], None] | None


@dataclass(frozen=True)
class Loaders:
    """How the candidates are loaded (specdecode.models functions, passed in so that this module
    times and chooses without knowing where weights come from).

    target(dtype) -> a transformers causal LM on the CPU, or None where the target is not timed
        (an encoder-decoder model: its kind is known once its config is read).
    draft(kind, dtype) -> the draft prepared with that kernel ("int4", "int8", "none").
    backend(model, is_draft) -> the engine backend over it (specdecode.models.hf.HFCausalLM).
    pack(model, rows_hint) -> None: float32 Linears packed for oneDNN, or raises ValueError.
    file_target(kernel) -> a backend of the target's GGUF file for that TargetKernel value: on
        llama.cpp ("llama.cpp-bf16", "llama.cpp-gguf") or its own blocks on specdecode's kernels
        ("gguf-invariant").
    llama_draft() -> a llama.cpp backend of the draft's GGUF file as it is.
    """

    target: Callable
    draft: Callable
    backend: Callable
    pack: Callable | None
    file_target: Callable | None = None
    llama_draft: Callable | None = None


def memory_bandwidth_gbs(gib: float = 1.0) -> float:
    """GB/s of reading memory here: the best of three sums of a `gib` GiB float32 tensor (large
    enough to leave every cache), on torch's threads."""
    data = torch.ones(int(gib * (1 << 30)) // 4)
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        data.sum()
        best = min(best, time.perf_counter() - start)
    del data
    return gib * (1 << 30) / best / 1e9


def _parameter_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def measure_and_choose(loaders: Loaders, targets: tuple[str, ...], draft_kinds: tuple[str, ...], max_gamma: int,
                       progress: Progress = None, busy: Callable[[], bool] = lambda: False) -> Choice | None:
    """Time each candidate of this pair, one target model at a time, and return the Choice.

    Args:
        loaders: how to load each candidate (Loaders).
        targets: the target kernels to time (TargetKernel values): "bfloat16" (with its gemv
            variant, on one model), "float32-packed" (a candidate only without native bfloat16,
            and timed only where it could win: see the
            module doc), "llama.cpp-bf16", "llama.cpp-gguf", "gguf-invariant".
        draft_kinds: the draft kernels to time ("int4", "int8", "none": torch; "gguf": its GGUF on
            llama.cpp); empty for no draft.
        max_gamma: the decoder's γ_max.
        busy: whether other work ran beside the timings (then a draft that was timed is kept:
            costs.choose(allow_plain=False)).
    Returns:
        the Choice, or None where nothing is timed: an encoder-decoder target, or one with fewer
        than AUTO_MIN_PARAMETERS parameters (bfloat16 stays).
    """
    say = progress or (lambda message: None)
    costs, bf16_bytes, context = {}, None, None
    bf16_kernels = [k for k in ("bfloat16", INVARIANT) if k in targets]
    if bf16_kernels:
        model = loaders.target(torch.bfloat16)
        if model is None or model.num_parameters() < AUTO_MIN_PARAMETERS:
            return None
        say("timing this machine's kernels for the target and the draft (once per machine and pair; cached)")
        context = _context(model.get_input_embeddings().num_embeddings)
        bf16_bytes = _parameter_bytes(model)
        say(f"timing the bfloat16 target ({', '.join(bf16_kernels)})")
        backends, sizes = {}, {}
        if "bfloat16" in targets:
            backends = {"bfloat16": loaders.backend(model, False), "bfloat16-gemv": loaders.backend(model, False)}
            backends["bfloat16-gemv"].one_row_onednn = False
            sizes = {"bfloat16": SIZES, "bfloat16-gemv": (1,)}
        if INVARIANT in targets:
            backends[INVARIANT], sizes[INVARIANT] = loaders.backend(model, False), SIZES
            try:  # the model's fused weights become views: the other kernels read the same memory
                backends[INVARIANT].use_invariant_forward(share=True)
            except (ValueError, RuntimeError) as err:  # another kind of model, or no kernels
                del backends[INVARIANT], sizes[INVARIANT]
                say(f"batch-invariant kernels not timed: {err}")
        with torch.inference_mode():
            times = time_interleaved(backends, context, sizes)
        del backends, model  # (nothing else may hold the model: the draft's timings come next)
        release()
        if "bfloat16-gemv" in times:
            times["bfloat16-gemv"] = {**times["bfloat16"], 1: times["bfloat16-gemv"][1]}
        costs.update({kernel: _target_cost(t) for kernel, t in times.items()})
    file_kernels = [k for k in targets if k in FILE_KERNELS]
    if file_kernels:  # timed side by side: the same file's weights, computed two ways
        say(f"timing the target's GGUF file ({', '.join(file_kernels)})")
        backends, failed = {}, []
        for kernel in file_kernels:
            try:
                backends[kernel] = loaders.file_target(kernel)
            except (ValueError, RuntimeError, OSError) as err:
                # a file, build or disk this kernel cannot run with (llama.cpp's BF16 copy needs 3.6
                # GB of disk for the default target): the other candidates stay, if there are any
                failed.append(err)
                say(f"{kernel} not timed: {err}")
        if failed and not backends and not costs:
            raise failed[0]
        if backends:
            context = context or _context(next(iter(backends.values())).num_embeddings)
            with torch.inference_mode():
                times = time_interleaved(backends, context, {kernel: SIZES for kernel in backends})
            costs.update({kernel: _target_cost(t) for kernel, t in times.items()})
        for backend in backends.values():
            getattr(backend, "close", lambda: None)()  # llama.cpp's model and context, now rather than at collection
        del backends
        release()
    draft_costs = _time_drafts(loaders, draft_kinds, context, say)
    if "float32-packed" in targets and loaders.pack is not None and bf16_bytes is not None:
        bound = _float32_bound(2 * bf16_bytes / (memory_bandwidth_gbs() * 1e9), costs, draft_costs, max_gamma)
        if bound is None:
            say("timing the float32 target (packed weights)")
            model = loaders.target(torch.float32)
            loaders.pack(model, max_gamma + 1)
            with torch.inference_mode():
                measured = time_interleaved({"float32-packed": loaders.backend(model, False)}, context,
                                            {"float32-packed": SIZES})
            del model
            release()
            costs["float32-packed"] = _target_cost(measured["float32-packed"])
        else:
            say(f"float32 target not timed: {bound}")
    release()  # the chosen models load next
    choice = choose(costs, draft_costs, max_gamma=max_gamma, allow_plain=not busy())
    notes = tuple(f"{kernel} target: step {1e3 * cost.step_s:.0f} ms, r(9) {cost.ratio(9):.2f}, "
                  f"prompt read {1e3 * cost.read_s_per_token:.1f} ms/token" for kernel, cost in costs.items()) + \
        tuple(f"{kind} {kernel} draft: step {1e3 * cost.step_s:.0f} ms, prompt read "
              f"{1e3 * cost.read_s_per_token:.1f} ms/token" for (kind, kernel), cost in draft_costs.items())
    return Choice(**{**asdict(choice), "notes": notes})


def _context(vocab: int) -> list[int]:
    return [(100 + i * 7919) % min(vocab, 30000) for i in range(64)]  # a spread of ordinary ids


def _target_cost(t: dict[int, float]) -> TargetCost:
    return TargetCost(t[1], {k: t[k] / t[1] for k in t if k > 1}, t[max(t)] / max(t) if len(t) > 1 else 0.0)


def _time_drafts(loaders: Loaders, kinds: tuple[str, ...], context: list[int], say) -> dict:
    """{(kind, dtype kernel): DraftCost} for every draft kernel, in bfloat16 (both ways) and, for
    the integer kernels on CPUs without native bfloat16 products, with float32 activations. The
    float draft is left out in float32: its int8 form reads a quarter of its bytes, and it would
    hold twice the bfloat16 memory. Where bfloat16 is native, the integer kernels' float32 form
    loses by 10-20x (a Zen 4: int4 366 ms a step against 17 ms on specdecode.native) and its
    timing cost seconds of every first start."""
    if not kinds:
        return {}
    say(f"timing the draft's kernels ({', '.join(kinds)})")
    times, read = {}, max(DRAFT_SIZES)
    for kind in kinds:  # one kind at a time, its dtypes interleaved: the peak is one kind's copies
        backends, sizes = {}, {}
        if kind == "gguf":
            backends[kind, "llama.cpp"] = loaders.llama_draft()
            sizes[kind, "llama.cpp"] = DRAFT_SIZES
        else:
            model = loaders.draft(kind, torch.bfloat16)
            for kernel in ("bfloat16", "bfloat16-gemv", "bfloat16-sdpa", "native"):
                backend = loaders.backend(model, True)
                if kernel == "bfloat16-sdpa" and not getattr(backend, "eager_attention", False):
                    continue  # SDPA already: nothing else to time
                if kernel == "native":
                    try:  # the whole forward on specdecode.native (its own prompt read: timed too)
                        backend.use_invariant_forward()
                    except (ValueError, RuntimeError):  # another kind of model, or no kernels here
                        continue
                backend.one_row_onednn = kernel != "bfloat16-gemv"
                if kernel == "bfloat16-sdpa":
                    backend.eager_attention = False
                backends[kind, kernel] = backend
                sizes[kind, kernel] = DRAFT_SIZES if kernel in ("bfloat16", "native") else (1,)
            if kind in QUANTIZED_KINDS and not native_bfloat16():
                backends[kind, "float32"] = loaders.backend(loaders.draft(kind, torch.float32), True)
                sizes[kind, "float32"] = DRAFT_SIZES
            del model
        with torch.inference_mode():
            times.update(time_interleaved(backends, context, sizes))
        for backend in backends.values():
            getattr(backend, "close", lambda: None)()
        del backends
        release()
        for variant in ("bfloat16-gemv", "bfloat16-sdpa"):  # their prompt reads are bfloat16's own
            if (kind, variant) in times:
                times[kind, variant][read] = times[kind, "bfloat16"][read]
    return {key: DraftCost(t[1], t[read] / read) for key, t in times.items()}


def _float32_bound(step_s: float, targets: dict, drafts: dict, max_gamma: int) -> str | None:
    """Why the float32 target need not be timed (its best case, a step of step_s and a verify as
    cheap as a step, still loses to the best measured choice), or None: time it."""
    best = choose(targets, drafts, max_gamma=max_gamma)
    optimistic = choose({"float32-packed": TargetCost(step_s, {2: 1.0}, 0.0)}, drafts, max_gamma=max_gamma)
    if optimistic.rate >= best.rate:
        return None
    return (f"even reading its weights once per step at this machine's bandwidth ({1e3 * step_s:.0f} ms) it "
            f"would reach {optimistic.rate:.1f} tokens/s against {best.rate:.1f} measured")
