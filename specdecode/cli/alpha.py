"""`specdecode alpha`: the acceptance rate α of several drafts on benchmark prompts, as a report."""

from __future__ import annotations

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


def add_parser(sub) -> None:
    alpha = sub.add_parser(
        "alpha", help="measure the acceptance rate α of several drafts on benchmark prompts",
        description="Measure α the paper's way (§4.2: mean Σ min(p, q) at every prefix of text the target "
                    "generates) for the draft model, a bigram, a unigram, prompt lookup and the uniform "
                    "distribution, and the empirical way (accepted / verified drafts of the same speculative "
                    "run, fixed γ = -k), per task and temperature, with 95%% bootstrap intervals over prompts. "
                    "Writes OUT.json, OUT.md and OUT_alpha.png.")
    add_task_flags(alpha, default_tasks=["code", "translation", "summarization"], default_prompts=10)
    alpha.add_argument("--max-new-tokens", type=int, default=128, help="tokens the target generates per prompt (default: 128)")
    alpha.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 1.0], metavar="T",
                       help="sampling temperatures; 0 = greedy (default: 0 1)")
    alpha.add_argument("--seed", type=int, default=0, help="seed of prompt i's run is SEED + i (default: 0)")
    alpha.add_argument("--lenience", type=float, nargs="*", default=[], metavar="L",
                       help="also report the draft model's LOSSY α under lenience l (paper A.5, Table 5) for each "
                            "l in (0, 1): Σ min(p/l, q) when sampling, p(x) >= l·max p when greedy")
    add_out_flag(alpha, "alpha")
    alpha.add_argument("--quick", action="store_true",
                       help="a smoke run in a few minutes: tasks code and translation, 2 prompts, 24 tokens")
    add_model_flags(alpha)


def run(args, parser) -> int:
    from specdecode.measure.alpha import alpha_report

    config = decoder_config(args, parser, guard=False)  # α needs no run-time guard (nor its timing)
    if args.quick:
        args.tasks, args.prompts, args.max_new_tokens = ["code", "translation"], 2, 24
    if args.prompts < 1 or args.max_new_tokens < 1:
        parser.error("--prompts and --max-new-tokens must be >= 1")
    if any(t < 0 for t in args.temperatures):
        parser.error("--temperatures must be >= 0")
    if any(not 0 < value < 1 for value in args.lenience):
        parser.error("--lenience values must be in (0, 1)")
    require_bench_extras(parser, args.tasks)
    try:
        out = out_path(args.out, "alpha")
    except FileExistsError as err:
        parser.error(str(err))
    progress = stderr_progress(args)
    try:
        decoder = build_decoder(config, progress)
        alpha_report(decoder, args.tasks, args.prompts, args.temperatures, gamma=args.num_speculative_tokens,
                     max_new_tokens=args.max_new_tokens, out=out, seed=args.seed,
                     lenience=tuple(args.lenience), progress=progress)
    except (ValueError, OSError, ImportError) as err:
        return error(err)
    print(Path(out + ".md").read_text(encoding="utf-8"))
    if progress:
        progress(f"wrote {out}.json, {out}.md and {out}_alpha.png")
    return 0
