"""`specdecode bench`: time speculative decoding against the target alone and transformers, as a report."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

from specdecode.cli.common import (
    add_model_flags,
    add_out_flag,
    add_task_flags,
    build_decoder,
    decoder_config,
    error,
    out_path,
    require_bench_extras,
    stderr_progress,
)
from specdecode.models import zoo


def add_parser(sub) -> None:
    bench = sub.add_parser(
        "bench", help="time speculative decoding against the target alone and transformers, with the theory",
        description="Run, in one process and interleaved: transformers generate with the target alone (the "
                    "baseline), our plain decoding, our speculative decoding for each fixed γ, our configured "
                    "decoder, prompt lookup alone and transformers assisted generation. Measures c and the "
                    "verify cost r(k) on this machine and puts each measured speedup next to Theorem 3.8's "
                    "prediction. Writes OUT.json, OUT.md and plots OUT_*.png.")
    # Defaults sized for ~25 minutes on the zoo pair on 2 cores (13 configurations).
    add_task_flags(bench, default_tasks=["code"], default_prompts=3)
    bench.add_argument("--new-tokens", type=int, default=128,
                       help="tokens per prompt; every run emits exactly this many (EOS does not stop it) (default: 128)")
    bench.add_argument("--repeats", type=int, default=2, help="timed repeats; medians are over these (default: 2)")
    bench.add_argument("--gammas", type=int, nargs="*", default=[1, 2, 3, 4, 6], metavar="G",
                       help="fixed γ values of the sweep; none to skip it (default: 1 2 3 4 6)")
    bench.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default), else exact sampling")
    bench.add_argument("--hf-assisted", nargs="*", default=["heuristic", "constant:4"], metavar="SCHEDULE",
                       help="transformers assisted-generation settings: 'heuristic' or 'constant:N' "
                            "(default: heuristic constant:4; none to skip)")
    bench.add_argument("--hf-draft", nargs="+", choices=["float", "ours"], default=["float"],
                       help="draft objects for transformers assisted generation: 'float' = the draft model as "
                            "loaded, without our int8 weights (the pair as given), 'ours' = the (possibly int8) "
                            "object we use. A schedule runs with the first of these unless it ends in @float or "
                            "@ours, e.g. constant:4@ours (default: float)")
    bench.add_argument("--headline", action="store_true",
                       help="skip our plain decoding and prompt lookup alone (each costs about a target-alone "
                            "run): only the baseline, the γ sweep, the configured decoder and transformers")
    bench.add_argument("--lenience", type=float, nargs="*", default=[], metavar="L",
                       help="also run LOSSY lenient verification (paper A.5) at γ = 4 for each l in (0, 1) "
                            "(e.g. 0.5 0.3 0.1); reported beside the exact runs, never as a speedup of exact decoding")
    bench.add_argument("--compare-verification", action="store_true",
                       help="also run the configured decoder with each other --verification rule, and each γ of "
                            "the sweep with block verification (Sun et al. 2024), beside the token-wise rows")
    bench.add_argument("--tree-widths", type=int, nargs="*", default=[], metavar="W",
                       help="also run the configured decoder drafting token trees of these widths (e.g. 2 3)")
    bench.add_argument("--batch-size", type=int, nargs="*", default=[], metavar="N",
                       help="also time batched plain and speculative decoding (the decoder as configured) at these "
                            "batch sizes, e.g. 1 2 4 8")
    add_out_flag(bench, "bench")
    bench.add_argument("--quick", action="store_true",
                       help="a smoke run in a few minutes: 2 prompts, 24 tokens, 1 repeat, γ 2 and 4")
    add_model_flags(bench)


def run(args, parser) -> int:
    from specdecode.sampling_params import SamplingParams
    from specdecode.measure.bench import bench_report, check_benchable

    schedules = _check(args, parser)
    try:
        sampling = SamplingParams(temperature=args.temperature)
    except ValueError as err:
        parser.error(str(err))
    try:
        out = out_path(args.out, "bench")
    except FileExistsError as err:
        parser.error(str(err))
    progress = stderr_progress(args)
    try:
        decoder = build_decoder(args.decoder_config, progress)
        check_benchable(decoder)  # before transformers' copies of the draft load
        hf_drafts = {}
        for label in args.hf_draft if decoder.draft is not None and schedules else ():
            own = getattr(decoder.draft.backend, "model", None)  # None: a draft on llama.cpp
            if own is not None and (label == "ours" or args.quantize_draft == "none"):  # ours, or ours is float
                hf_drafts[label] = own
            else:
                from specdecode.models.loading import load_model

                spec = zoo.DEFAULT_DRAFT if args.draft == "default" else args.draft
                hf_drafts[label] = load_model(spec, decoder.pair.dtype, progress)[0]
        bench_report(decoder, args.tasks, args.prompts, new_tokens=args.new_tokens, repeats=args.repeats,
                     gammas=args.gammas, sampling=sampling, hf_schedules=schedules, out=out,
                     hf_drafts=hf_drafts, lenience=args.lenience, batch_sizes=args.batch_size,
                     headline=args.headline, compare_verification=args.compare_verification,
                     tree_widths=args.tree_widths, progress=None if args.quiet else _bar())
    except (ValueError, OSError, ImportError) as err:
        return error(err)
    print(Path(out + ".md").read_text(encoding="utf-8"))
    if progress:
        progress(f"wrote {out}.json, {out}.md and {out}_*.png")
    return 0


def _check(args, parser) -> list[str]:
    """Bad flags exit 2 before any model loads; returns the transformers assisted schedules to run."""
    args.decoder_config = decoder_config(args, parser)
    if args.decoder_config.uses_llama_cpp:
        from specdecode.measure.bench import LLAMA_TARGET

        parser.error(LLAMA_TARGET)
    # bench compares with transformers on the same model: the target runs on torch, whatever
    # dtype="auto" would choose for generate (llama.cpp: benchmarks/vs_llamacpp.py)
    args.decoder_config = dataclasses.replace(args.decoder_config, backend="torch")
    if args.quick:
        args.prompts, args.new_tokens, args.repeats, args.gammas = 2, 24, 1, [2, 4]
    if args.prompts < 1 or args.new_tokens < 2 or args.repeats < 1 or any(g < 1 for g in args.gammas):
        parser.error("--prompts, --repeats and --gammas must be >= 1, --new-tokens >= 2")
    if any(not 0 < value < 1 for value in args.lenience):
        parser.error("--lenience values must be in (0, 1); 1 is the exact run, always included")
    if any(w < 1 for w in args.tree_widths):
        parser.error("--tree-widths values must be >= 1")
    if any(b < 1 for b in args.batch_size):
        parser.error("--batch-size values must be >= 1")
    require_bench_extras(parser, args.tasks)
    schedules = [] if args.hf_assisted == ["none"] else args.hf_assisted
    for schedule in schedules:
        schedule_only, _, label = schedule.partition("@")
        kind, _, n = schedule_only.partition(":")
        if not (schedule_only == "heuristic" or (kind == "constant" and n.isdigit() and int(n) >= 1)) \
                or label not in ("", *args.hf_draft):
            parser.error(f"--hf-assisted takes 'heuristic' or 'constant:N', optionally @LABEL with LABEL one of "
                         f"--hf-draft ({' '.join(args.hf_draft)}), got {schedule!r}")
    return schedules


def _bar():
    """A tqdm progress bar on stderr, driven by (done, total, description) calls."""
    from tqdm import tqdm

    state = {}

    def update(done: int, total: int, description: str) -> None:
        if "bar" not in state:
            state["bar"] = tqdm(total=total, unit="run", file=sys.stderr)
        state["bar"].set_description(description[:60])
        state["bar"].update(done - state["bar"].n)
        if done == total:
            state["bar"].close()
    return update
