"""The `specdecode` command: parses, builds dataclasses, calls the library, prints."""

from __future__ import annotations

import argparse
import json
import os
import sys

from specdecode import zoo
from specdecode.decoder import DEFAULT_DRAFT_CONFIDENCE, DEFAULT_GAMMA
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
    gen.add_argument("prompt", help="the prompt text, '-' to read stdin, or @FILE to read a file")
    gen.add_argument("--target", default="default",
                     help=f"target model: a zoo name ({', '.join(zoo.ZOO)}), a local directory, or a hub id "
                          f"(default: {zoo.DEFAULT_TARGET})")
    gen.add_argument("--draft", default="default",
                     help=f"draft model, same forms as --target, or 'none' for plain decoding (default: {zoo.DEFAULT_DRAFT})")
    gen.add_argument("-k", "--num-speculative-tokens", type=int, default=DEFAULT_GAMMA,
                     help=f"γ: the most draft tokens proposed per target call (default: {DEFAULT_GAMMA})")
    gen.add_argument("--draft-confidence", type=float, default=DEFAULT_DRAFT_CONFIDENCE,
                     help="dynamic γ: stop drafting once the draft's probability of its own token falls "
                          "below this, in [0, 1); exact either way; 0 always drafts γ tokens "
                          f"(default: {DEFAULT_DRAFT_CONFIDENCE})")
    gen.add_argument("--draft-vocab-limit", type=int, default=None, metavar="N",
                     help="the draft scores only token ids below N: a cheaper LM head, still exact "
                          "(default: 32768 for the zoo's draft, the whole vocabulary for others)")
    gen.add_argument("--prompt-lookup", action=argparse.BooleanOptionalAction, default=None,
                     help="first copy what followed an earlier occurrence of the last tokens (free drafts); "
                          "the draft model serves the other steps (default: on when there is a draft model; "
                          "--draft none --prompt-lookup uses lookup alone)")
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
    gen.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "float16"],
                     help="weights and activations dtype; bfloat16 (default) is fastest on CPU, float32 for "
                          "bit-exact comparisons")
    gen.add_argument("--raw", action="store_true",
                     help="send the prompt as raw text; by default an instruct model's chat template is applied")
    gen.add_argument("--show-tokens", action="store_true",
                     help="colour each token by origin: green = accepted draft, blue = target correction, "
                          "yellow = bonus token (paper Figure 1)")
    gen.add_argument("--json", action="store_true",
                     help="print one JSON object (text, token_ids, finish_reason, stats) instead of streaming")
    gen.add_argument("--quiet", action="store_true",
                     help="no progress messages, progress bars or summary on stderr (errors still print)")
    return parser


def _generate(args, parser) -> int:
    from specdecode import SamplingParams, SpeculativeDecoder

    try:
        sampling = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                                  min_p=args.min_p, seed=args.seed)
    except ValueError as err:
        parser.error(str(err))
    if args.num_speculative_tokens < 1:
        parser.error(f"-k/--num-speculative-tokens must be >= 1, got {args.num_speculative_tokens}")
    if not 0 <= args.draft_confidence < 1:
        parser.error(f"--draft-confidence must be in [0, 1), got {args.draft_confidence}")
    if args.draft_vocab_limit is not None and args.draft_vocab_limit < 1:
        parser.error(f"--draft-vocab-limit must be >= 1, got {args.draft_vocab_limit}")
    if not 0 < args.lenience <= 1:
        parser.error(f"--lenience must be in (0, 1] (1 = exact), got {args.lenience}")
    if args.max_new_tokens < 1:
        parser.error(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    if any(not s for s in args.stop):
        parser.error("--stop takes non-empty text")
    try:
        prompt = _read_prompt(args.prompt)
    except (OSError, UnicodeDecodeError) as err:
        parser.error(f"cannot read the prompt: {err}")
    if not prompt:
        parser.error("the prompt is empty")

    progress = None if args.quiet else (lambda msg: print(msg, file=sys.stderr, flush=True))
    if args.quiet:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        hf_logging.set_verbosity_error()
    try:
        decoder = SpeculativeDecoder(args.target, None if args.draft == "none" else args.draft,
                                     num_speculative_tokens=args.num_speculative_tokens,
                                     draft_confidence=args.draft_confidence,
                                     draft_vocab_limit=args.draft_vocab_limit or "auto",
                                     prompt_lookup=args.prompt_lookup,
                                     dtype=args.dtype, progress=progress)
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
    except (ValueError, FileNotFoundError, ImportError) as err:
        print(f"specdecode: error: {err}", file=sys.stderr)
        return 2
    result = stream.result
    if args.json:
        print(json.dumps(result.to_dict(), ensure_ascii=False))
    else:
        sys.stdout.write("\n")
    if not args.quiet:
        s = result.stats
        line = f"{s.num_generated} tokens in {s.wall_time_s:.2f} s ({s.tokens_per_second:.2f} tokens/s), " \
               f"finish: {result.finish_reason}, target calls: {s.num_target_calls}, " \
               f"mean tokens per target call: {s.mean_tokens_per_call:.2f}"
        if s.num_drafted:
            line += f", acceptance rate: {s.acceptance_rate:.3f} ({s.num_accepted}/{s.num_drafted})"
        print(line, file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "generate":
        try:
            return _generate(args, parser)
        except BrokenPipeError:  # e.g. `specdecode generate ... | head`: the reader left
            sys.stdout = open(os.devnull, "w")
            return 0
    return 2


if __name__ == "__main__":
    sys.exit(main())
