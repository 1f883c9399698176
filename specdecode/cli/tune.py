"""`specdecode tune`: time this machine's kernels for the pair now, cache the choice, print the table."""

from __future__ import annotations

import sys

from specdecode.cli.common import add_model_flags, decoder_config, error, stderr_progress


def add_parser(sub) -> None:
    tune = sub.add_parser(
        "tune", help="time this machine's kernels for the pair now and print what dtype=auto chooses",
        description="Time every candidate kernel of the target and the draft on this machine (what --dtype auto "
                    "does once per machine and pair where no prior for the CPU class covers it), replace the "
                    "cached choice or the prior, and print the table and the choice. Run it on an idle machine: "
                    "a choice timed beside other work is provisional.")
    add_model_flags(tune)


def run(args, parser) -> int:
    from specdecode import tune
    from specdecode.tune import cache

    config = decoder_config(args, parser)
    if config.dtype not in ("auto", "gguf"):
        parser.error(f"--dtype {config.dtype} times nothing: tune times --dtype auto (or gguf)")
    progress = stderr_progress(args)
    try:
        cache.cache_path(tune.choice_key(config)).unlink(missing_ok=True)  # whatever the timing finds
        plan = tune.plan(config, progress, measure_now=True)
    except (ValueError, OSError, ImportError) as err:
        return error(err)
    choice = plan.choice
    if choice is None:
        print("nothing timed: the target is too small or not on the CPU (bfloat16 as given)")
        return 0
    for line in choice.notes:
        print(line)
    print(f"chose: {choice.describe()}" + (" (provisional)" if choice.provisional else ""))
    sys.stdout.flush()
    return 0
