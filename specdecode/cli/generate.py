"""`specdecode generate`: stream one prompt's text to stdout, or decode a prompts file as a batch."""

from __future__ import annotations

import json
import sys

from specdecode.cli.common import (
    add_model_flags,
    as_flags,
    build_decoder,
    decoder_config,
    error,
    read_prompt,
    read_prompts_file,
    stderr_progress,
)

# Colours of the paper's Figure 1: green = accepted draft token, blue = target's correction
# after a rejection; the bonus token (all drafts accepted) gets yellow.
# a token's origin (engine.request: ACCEPTED, CORRECTED, BONUS) → its colour
COLOURS = {"accepted": "\033[32m", "corrected": "\033[34m", "bonus": "\033[33m"}
RESET = "\033[0m"


def add_parser(sub) -> None:
    gen = sub.add_parser(
        "generate", help="generate text from a prompt",
        description="Generate text with the target model, speculating with the draft model. Text streams "
                    "to stdout as it is accepted; a one-line summary goes to stderr. Ctrl-C stops it with "
                    "exit status 130, keeping the text printed so far.")
    gen.add_argument("prompt", nargs="?",
                     help="the prompt text, '-' to read stdin, or @FILE to read a file (or use --prompts-file)")
    gen.add_argument("--prompts-file", metavar="FILE",
                     help="decode many prompts as a batch: one prompt per line, or a .jsonl file of objects "
                          'with a "prompt" field (for prompts with newlines); instead of PROMPT')
    gen.add_argument("--batch-size", type=int, default=None, metavar="N",
                     help="with --prompts-file, decode up to N prompts together; the next joins as one finishes "
                          "(default: all; 1 = one at a time). Each row is what it would be alone")
    add_model_flags(gen)
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
    gen.add_argument("--repetition-penalty", type=float, default=1.0, metavar="P",
                     help="divide the logits of tokens already in the prompt or output by P (in [1e-20, 1e20]; transformers' "
                          "semantics; exact under speculation); 1 = off (default), or the model's "
                          "generation_config value")
    gen.add_argument("--presence-penalty", type=float, default=0.0, metavar="P",
                     help="subtract P from the logits of tokens already generated, in [-2, 2] (OpenAI's; 0 = off)")
    gen.add_argument("--frequency-penalty", type=float, default=0.0, metavar="P",
                     help="subtract P × count from the logits of tokens already generated, in [-2, 2] "
                          "(OpenAI's; 0 = off)")
    gen.add_argument("--min-tokens", type=int, default=0, metavar="N",
                     help="EOS (and only EOS) cannot end the output before N tokens: masked on the target and "
                          "the draft until then (exact: the target's distribution so conditioned); default 0")
    gen.add_argument("--ignore-eos", action="store_true",
                     help="EOS does not end the output: generate --max-new-tokens tokens (EOS may appear among "
                          "them; for benchmarks)")
    gen.add_argument("--logit-bias", action="append", default=[], metavar="ID=BIAS",
                     help="add BIAS in [-100, 100] to token ID's logit before temperature (OpenAI's logit_bias), "
                          "on the target and the draft; repeatable")
    gen.add_argument("--logprobs", type=int, default=None, metavar="N",
                     help="with --json: each token's log-probability under the target's raw distribution "
                          "(before penalties, grammar and temperature) and the N most likely alternatives, "
                          "N in [0, 20]")
    gen.add_argument("--json-schema", metavar="FILE",
                     help="constrain the output to JSON following the JSON schema in FILE (an output that ends "
                          "by EOS parses)")
    gen.add_argument("--grammar", metavar="FILE",
                     help="constrain the output to the EBNF grammar in FILE (GBNF, 'root ::= ...'), or to a "
                          "regex if FILE holds 'regex:PATTERN'")
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


def run(args, parser) -> int:
    sampling, prompt = _parse(args, parser)
    constraint = _constraint(args, parser)
    progress = stderr_progress(args)
    chat = False if args.raw else None
    try:
        decoder = build_decoder(args.decoder_config, progress)
        extra = dict(logprobs=args.logprobs, response_format=constraint.get("response_format"),
                     grammar=constraint.get("grammar"))
        if isinstance(prompt, list):
            results = decoder.generate(prompt, max_new_tokens=args.max_new_tokens, sampling=sampling,
                                       stop=args.stop, chat=chat, batch_size=args.batch_size,
                                       lenience=args.lenience, **extra)
        else:
            stream = decoder.generate(prompt, max_new_tokens=args.max_new_tokens, sampling=sampling,
                                      stop=args.stop, stream=True, chat=chat, lenience=args.lenience, **extra)
            results = [_print_stream(stream, args)]
    except (ValueError, OSError, ImportError) as err:
        return error(err)
    batch = isinstance(prompt, list)
    configuration = decoder.configuration() if args.json else None
    for index, result in enumerate(results):
        if args.json:
            record = ({"index": index} if batch else {}) | result.to_dict() | {"configuration": configuration}
            sys.stdout.write(json.dumps(record, ensure_ascii=False) + "\n")  # one write: no half line
        elif batch:
            print(f"===== prompt {index + 1}/{len(results)} =====\n{result.text}")
        else:
            sys.stdout.write("\n")
        if not args.quiet:
            print((f"prompt {index + 1}: " if batch else "") + summary(result), file=sys.stderr)
    return 0


def _parse(args, parser):
    """SamplingParams and the prompt (a string, or a list from --prompts-file); bad input exits 2."""
    from specdecode.sampling_params import SamplingParams
    from specdecode.frontend.options import RequestOptions

    if args.logprobs is not None and not args.json:
        parser.error("--logprobs is printed in the --json output: add --json")
    bias = {}
    for item in args.logit_bias:
        token, _, value = item.partition("=")
        try:
            bias[int(token)] = float(value)
        except ValueError:
            parser.error(f"--logit-bias takes ID=BIAS (e.g. 151643=-100), got {item!r}")
    if args.max_new_tokens < 1:  # (0 scores a prompt in the library: not a command's use)
        parser.error(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    # the library's own checks (SamplingParams, RequestOptions), named by their flags
    try:
        sampling = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                                  min_p=args.min_p, seed=args.seed, repetition_penalty=args.repetition_penalty,
                                  presence_penalty=args.presence_penalty, frequency_penalty=args.frequency_penalty,
                                  logit_bias=bias or None, min_tokens=args.min_tokens, ignore_eos=args.ignore_eos)
    except ValueError as err:
        parser.error(as_flags(str(err)))
    args.decoder_config = decoder_config(args, parser)
    try:
        RequestOptions(args.max_new_tokens, sampling, args.stop, args.lenience, args.logprobs).validate(
            args.decoder_config)
    except ValueError as err:
        parser.error(as_flags(str(err)))
    if (args.prompt is None) == (args.prompts_file is None):
        parser.error("give a PROMPT or --prompts-file FILE, not both" if args.prompt is not None
                     else "give a PROMPT or --prompts-file FILE")
    if args.batch_size is not None and args.batch_size < 1:
        parser.error(f"--batch-size must be >= 1, got {args.batch_size}")
    if args.batch_size is not None and args.prompts_file is None:
        parser.error("--batch-size needs --prompts-file")
    if args.show_tokens and args.prompts_file is not None:
        parser.error("--show-tokens colours a single streamed prompt; it does not apply to --prompts-file")
    try:
        prompt = read_prompt(args.prompt) if args.prompt is not None else read_prompts_file(args.prompts_file)
    except (OSError, UnicodeDecodeError, ValueError) as err:
        parser.error(f"cannot read the prompt{'' if args.prompt is not None else 's'}: {err}")
    if not prompt:
        parser.error("the prompt is empty")
    return sampling, prompt


def _constraint(args, parser) -> dict:
    """{"response_format": ...} from --json-schema, {"grammar": ...} from --grammar, or {}; an
    unreadable file or a schema that is not JSON exits 2 (an invalid one does, after loading)."""
    if args.json_schema and args.grammar:
        parser.error("give --json-schema or --grammar, not both")
    path = args.json_schema or args.grammar
    if path is None:
        return {}
    flag = "--json-schema" if args.json_schema else "--grammar"
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as err:
        parser.error(f"{flag}: cannot read {path}: {err}")
    if args.grammar:
        if not text.strip():
            parser.error(f"--grammar: {path} is empty")
        return {"grammar": text.strip() if text.startswith("regex:") else text}
    try:
        schema = json.loads(text)
    except json.JSONDecodeError as err:
        parser.error(f"--json-schema: {path} is not JSON ({err.msg}, line {err.lineno})")
    if not isinstance(schema, (dict, bool)):
        parser.error(f"--json-schema: {path} must hold a JSON object (a JSON schema)")
    return {"response_format": {"type": "json_schema", "json_schema": {"name": "cli", "schema": schema}}}


def _print_stream(stream, args):
    """Writes each token's text to stdout as it is accepted (nothing with --json); returns the result.

    Ctrl-C ends the line written so far (and any colour) before it propagates.
    """
    line_open = False
    try:
        for event in stream:
            if args.json or not event.text:
                continue
            if args.show_tokens and event.origin in COLOURS:
                sys.stdout.write(COLOURS[event.origin] + event.text + RESET)
            else:
                sys.stdout.write(event.text)
            sys.stdout.flush()
            line_open = True
    except KeyboardInterrupt:
        if line_open:
            sys.stdout.write((RESET if args.show_tokens else "") + "\n")
            sys.stdout.flush()
        raise
    return stream.result


def summary(result) -> str:
    """The one-line stderr summary of a result."""
    s = result.stats
    line = (f"{_count(s.num_generated, 'token')} in {s.wall_time_s:.2f} s ({s.tokens_per_second:.2f} tokens/s), "
            f"finish: {result.finish_reason}, target calls: {s.num_target_calls}, "
            f"mean tokens per target call: {s.mean_tokens_per_call:.2f}")
    if s.num_drafted:
        line += f", acceptance rate: {s.acceptance_rate:.3f} ({s.num_accepted}/{s.num_drafted})"
    return line


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"
