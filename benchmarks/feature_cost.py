"""What logprobs, a penalty and a JSON schema cost, plain and speculative.

On HumanEval prompts, greedy, with the default pair: for each feature (none, logprobs=5,
repetition_penalty=1.1, presence+frequency penalties, a JSON schema) it decodes every prompt with
the decoder as configured (speculative) and with the same target alone (plain), interleaved
(prompt i in every configuration before prompt i+1), and reports tokens/s and the speedup
speculative / plain per feature, next to the unconstrained speedup (the issue asks for it to stay
within 10%). A JSON schema output may end early by EOS: tokens/s counts the tokens it emitted.

    python benchmarks/feature_cost.py --prompts 20 --new-tokens 128 --out docs/results/feature_cost.md
    python benchmarks/feature_cost.py --prompts 1 --new-tokens 8        # smoke
"""

from __future__ import annotations

import argparse
import statistics
import sys

from specdecode import SamplingParams, SpeculativeDecoder
from specdecode.measure.data import humaneval_prompts

SCHEMA = {"type": "object", "properties": {"function_name": {"type": "string"}, "code": {"type": "string"},
                                           "uses_recursion": {"type": "boolean"}},
          "required": ["function_name", "code", "uses_recursion"]}
FEATURES = {
    "none": dict(),
    "logprobs=5": dict(logprobs=5),
    "repetition_penalty=1.1": dict(sampling=SamplingParams(temperature=0, repetition_penalty=1.1)),
    "presence=0.5, frequency=0.5": dict(sampling=SamplingParams(temperature=0, presence_penalty=0.5,
                                                                frequency_penalty=0.5)),
    "json_schema": dict(response_format={"type": "json_schema", "json_schema": {"name": "f", "schema": SCHEMA}}),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=20)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--out", default=None, help="write the markdown table here too")
    args = parser.parse_args()
    progress = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731
    spec = SpeculativeDecoder(dtype=args.dtype, progress=progress)
    plain = SpeculativeDecoder(spec.target.backend.model, None, tokenizer=spec.tokenizer)
    prompts = [p["prompt"] for p in humaneval_prompts(args.prompts)]
    rates = {(feature, kind): ([], []) for feature in FEATURES for kind in ("plain", "speculative")}
    for index, prompt in enumerate(prompts):
        for feature, kwargs in FEATURES.items():
            kwargs = {"sampling": SamplingParams(temperature=0), **kwargs}
            # a schema needs the chat form to make sense; the others complete the code as written
            chat = feature == "json_schema"
            text = (prompt + "\nAnswer in JSON.") if chat else prompt
            for kind, decoder in (("plain", plain), ("speculative", spec)):
                result = decoder.generate(text, max_new_tokens=args.new_tokens, chat=chat, **kwargs)
                tokens, seconds = rates[(feature, kind)]
                tokens.append(result.stats.num_generated)
                seconds.append(result.stats.wall_time_s)
        progress(f"prompt {index + 1}/{len(prompts)} done")
    lines = [f"Greedy, HumanEval prompts 1-{len(prompts)}, up to {args.new_tokens} new tokens, {args.dtype}, "
             "the default pair as configured (speculative) vs the target alone (plain), interleaved.", "",
             "| feature | plain tokens/s | speculative tokens/s | speedup | vs unconstrained speedup |",
             "|---|---|---|---|---|"]
    base = None
    for feature in FEATURES:
        plain_rate = sum(rates[(feature, "plain")][0]) / sum(rates[(feature, "plain")][1])
        spec_rate = sum(rates[(feature, "speculative")][0]) / sum(rates[(feature, "speculative")][1])
        speedup = spec_rate / plain_rate
        base = base or speedup
        lines.append(f"| {feature} | {plain_rate:.2f} | {spec_rate:.2f} | {speedup:.2f}x | "
                     f"{(speedup / base - 1) * 100:+.0f}% |")
    per_prompt = [s for s in rates[("none", "speculative")][1]]
    lines.append("")
    lines.append(f"Median speculative seconds per prompt (unconstrained): {statistics.median(per_prompt):.2f}")
    table = "\n".join(lines)
    print(table)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            f.write("# Cost of logprobs, penalties and a JSON schema\n\n" + table + "\n\n"
                    f"Command: `python benchmarks/feature_cost.py --prompts {args.prompts} --new-tokens "
                    f"{args.new_tokens} --dtype {args.dtype} --out {args.out}`\n")


if __name__ == "__main__":
    main()
