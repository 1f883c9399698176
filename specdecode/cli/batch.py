"""`specdecode batch`: decode a JSONL dataset to a JSONL output, resumable; on Ray Data with --ray."""

from __future__ import annotations

import signal
import sys

from specdecode.cli.common import (add_model_flags, add_served_name_flag, as_flags, build_decoder, decoder_config, error,
                                   served_name, stderr_progress)


def add_parser(sub) -> None:
    batch = sub.add_parser(
        "batch", help="decode a JSONL dataset to a JSONL output (resumable; on Ray Data with --ray)",
        description="Decode every line of INPUT to one line of OUTPUT. Two line formats, detected from the first "
                    "line: OpenAI's batch format ({\"custom_id\", \"method\": \"POST\", \"url\": "
                    "\"/v1/chat/completions\" or \"/v1/completions\", \"body\"}: the output line's "
                    "response.body is what `specdecode serve` answers to that body), or simple lines (a JSON "
                    "object with \"prompt\" or \"messages\", optionally \"id\" (default: the line number) "
                    "and any field of the server's request body; other fields are ignored) giving id, text, "
                    "finish_reason, usage and speculation stats, or {id, error} for a bad line. Rows go "
                    "through the engine as a continuous batch. Each line is written and flushed as its row "
                    "finishes: run the same command again after a crash and it skips the rows already written "
                    "and redoes a half-written last line.")
    batch.add_argument("input", help="the input JSONL file")
    batch.add_argument("--output", required=True, metavar="OUT.jsonl",
                       help="the output JSONL file; appended to, and the ids already there are skipped")
    add_model_flags(batch)
    add_served_name_flag(batch)
    batch.add_argument("--max-batch-size", type=int, default=8,
                       help="the most rows decoded together; the next joins as one finishes (default: 8)")
    batch.add_argument("--max-tokens", type=int, default=256,
                       help="most new tokens for a row without \"max_tokens\" (default: 256)")
    batch.add_argument("--temperature", type=float, default=1.0,
                       help="for rows without \"temperature\"; 0 = greedy (default: 1.0)")
    batch.add_argument("--top-p", type=float, default=1.0, help="for rows without \"top_p\" (default: 1.0, off)")
    batch.add_argument("--seed", type=int, default=None,
                       help="for rows without \"seed\": each row gets its own generator from it, so a row's "
                            "output does not depend on the others (default: none)")
    batch.add_argument("--stop", action="append", default=[], metavar="TEXT",
                       help="for rows without \"stop\": stop when this text appears; repeatable")
    batch.add_argument("--raw", action="store_true",
                       help="send \"prompt\" strings as raw text; by default an instruct model's chat template is "
                            "applied (\"messages\" always go through it)")
    batch.add_argument("--ray", nargs="?", const="local", default=None, metavar="ADDRESS",
                       help="run on Ray Data: ADDRESS of a running cluster (e.g. ray://head:10001 or auto), or no "
                            "value to start a local one; needs the [ray] extra")
    batch.add_argument("--workers", type=int, default=1,
                       help="with --ray: the decoder actors (one decoder each) (default: 1)")
    batch.add_argument("--cpus-per-worker", type=float, default=None,
                       help="with --ray: CPUs each actor reserves, and its torch threads (default: a local "
                            "cluster's CPUs / --workers, else 1)")
    batch.add_argument("--rows-per-task", type=int, default=32,
                       help="with --ray: the rows one actor call decodes as one continuous batch; a crash redoes "
                            "at most this many rows per worker (default: 32)")


def run(args, parser) -> int:
    config = decoder_config(args, parser, max_batch_size=args.max_batch_size)
    for flag, value in (("--max-batch-size", args.max_batch_size), ("--max-tokens", args.max_tokens),
                        ("--workers", args.workers), ("--rows-per-task", args.rows_per_task)):
        if value < 1:
            parser.error(f"{flag} must be >= 1, got {value}")
    from specdecode.frontend.options import RequestOptions
    from specdecode.sampling_params import SamplingParams

    try:  # the library's rules, as generate and the server apply them
        RequestOptions(args.max_tokens, SamplingParams(temperature=args.temperature, top_p=args.top_p, seed=args.seed),
                       args.stop).validate()
    except ValueError as err:
        parser.error(as_flags(str(err), {"max_new_tokens": "--max-tokens"}))
    if args.cpus_per_worker is not None and args.cpus_per_worker <= 0:
        parser.error(f"--cpus-per-worker must be > 0, got {args.cpus_per_worker}")
    if args.ray is None and (args.workers != 1 or args.cpus_per_worker is not None):
        parser.error("--workers and --cpus-per-worker need --ray")
    from specdecode.scale.rows import RowDefaults

    defaults = RowDefaults(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                           seed=args.seed, stop=tuple(args.stop), raw=args.raw,
                           model=served_name(args))
    from specdecode.frontend.schema import ApiError, CompletionRequest, parse

    try:  # the rows are read with the server's schema: so are the defaults they get (temperature <= 2, ...)
        parse(CompletionRequest, defaults.fill({"prompt": "x"}))
    except ApiError as err:
        parser.error(as_flags(err.message, {"max_new_tokens": "--max-tokens"}))
    from specdecode.scale.batch import Interrupted, read_rows
    from specdecode.scale.journal import scan

    try:  # the whole input and the output checked before any model loads
        read_rows(args.input, defaults)
        scan(args.output)
    except (ValueError, OSError) as err:
        return error(err)
    progress = stderr_progress(args)
    bar = None if args.quiet else ProgressBar()
    # SIGTERM stops the job as Ctrl-C does: the rows written so far stay, and a summary says so
    previous = signal.signal(signal.SIGTERM, _raise_interrupt)
    try:
        if args.ray is not None:
            summary = _run_ray(args, parser, config, defaults, bar)
        else:
            from specdecode.scale.batch import run_batch

            decoder = build_decoder(config, progress)
            summary = run_batch(decoder, args.input, args.output, defaults, args.max_batch_size, bar)
    except (ValueError, OSError, ImportError) as err:
        return error(err)
    except Interrupted as stopped:
        if bar is not None:
            bar.close()
        print(f"specdecode: interrupted; {stopped.summary.line()}; run the same command again to finish",
              file=sys.stderr)
        return 143 if _terminated else 130
    finally:
        signal.signal(signal.SIGTERM, previous)
        if bar is not None:
            bar.close()
    if not args.quiet:
        if summary.cut_bytes:
            print(f"specdecode: {args.output} ended in a half-written line ({summary.cut_bytes} bytes); "
                  "it was removed and its row done again", file=sys.stderr)
        print(f"specdecode: {summary.line()}", file=sys.stderr)
    return 0


_terminated = False


def _raise_interrupt(signum, frame):
    global _terminated
    _terminated = True
    raise KeyboardInterrupt


def _run_ray(args, parser, config, defaults, bar):
    try:
        from specdecode.scale import ray_data
    except ImportError as err:
        parser.error(f"--ray needs the [ray] extra: pip install -e '.[ray]' ({err})")
    return ray_data.run_batch_on_ray(
        config.plain(), args.input, args.output, defaults,
        address=None if args.ray == "local" else args.ray, workers=args.workers,
        cpus_per_worker=args.cpus_per_worker, rows_per_task=args.rows_per_task,
        max_batch_size=args.max_batch_size, on_update=bar, quiet=args.quiet)


class ProgressBar:
    """Rows done, tokens/s and ETA on stderr: one line redrawn on a terminal, else a line per tenth."""

    def __init__(self, stream=None):
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty()
        self.drawn = False
        self.last_tenth = -1

    def __call__(self, summary, todo: int) -> None:
        finished = summary.done + summary.failed
        tenth = finished * 10 // max(todo, 1)
        if not self.tty and tenth == self.last_tenth and finished < todo:
            return
        self.last_tenth = tenth
        rate = summary.tokens_per_second
        # from decoded rows only: a row refused at once (an error record) says nothing of the time
        # the others take
        eta = summary.wall_time_s / summary.done * (todo - finished) if summary.done else float("nan")
        width = 24
        filled = width * finished // max(todo, 1)
        line = (f"rows {finished}/{todo} [{'=' * filled}{' ' * (width - filled)}] {rate:.1f} tokens/s, "
                f"ETA {_duration(eta)}" + (f", {summary.failed} failed" if summary.failed else ""))
        if self.tty:
            self.stream.write("\r\033[K" + line)
            self.drawn = True
        else:
            self.stream.write(line + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self.drawn:
            self.stream.write("\n")
            self.stream.flush()
            self.drawn = False


def _duration(seconds: float) -> str:
    if seconds != seconds:  # NaN: nothing finished yet
        return "?"
    seconds = int(round(seconds))
    return f"{seconds // 60}m{seconds % 60:02d}s" if seconds >= 60 else f"{seconds}s"

