"""The defaults by name against transformers `generate` with the target alone, in bfloat16 and in
float32 (stock models), side by side in one process: greedy, HumanEval and Spec-Bench prompts,
equal token counts on both sides (EOS does not stop either), interleaved per prompt. Also the
time to first token: ours (streamed, defaults) against transformers' target alone (one token).

    python benchmarks/cpu_class.py --out docs/results/cpu_class_NAME [--prompts-per-task 2 --new-tokens 64]
Emulating an AVX2-only CPU on an AVX-512 one:
    ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2
"""
import argparse
import dataclasses
import shlex
import statistics
import sys
import time

import torch

from specdecode import SamplingParams, SpeculativeDecoder
from specdecode.engine.request import Request
from specdecode.measure.data import load_prompts
from specdecode.measure.report import environment, markdown_table, write
from specdecode.models import zoo

parser = argparse.ArgumentParser()
parser.add_argument("--tasks", nargs="+", default=["code", "qa", "summarization", "math_reasoning"])
parser.add_argument("--prompts-per-task", type=int, default=2)
parser.add_argument("--new-tokens", type=int, default=64)
parser.add_argument("--out", required=True)
args = parser.parse_args()

decoder = SpeculativeDecoder(progress=lambda m: print(m, file=sys.stderr, flush=True))
config = decoder.configuration()
print(config, file=sys.stderr)
baselines = {name: zoo.load_zoo_model(zoo.DEFAULT_TARGET, dtype)[0] for name, dtype in
             (("bfloat16", torch.bfloat16), ("float32", torch.float32))}
prompts = [p for task in args.tasks for p in load_prompts(task, args.prompts_per_task)]
greedy = SamplingParams(temperature=0)
no_eos = dataclasses.replace(decoder.requests.config(args.new_tokens, greedy), eos_token_ids=frozenset())


def ours(ids):
    start = time.perf_counter()
    request_id = decoder.driver.submit(Request(ids, no_eos), keep_events=True)
    stream = decoder.driver.stream(request_id)
    next(stream)
    first = time.perf_counter() - start
    tokens = 1 + sum(1 for _ in stream)
    return time.perf_counter() - start, first, tokens


def hf(model, ids, new_tokens):
    inputs = torch.tensor([ids])
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(inputs, attention_mask=torch.ones_like(inputs), do_sample=False,
                             max_new_tokens=new_tokens, min_new_tokens=new_tokens, pad_token_id=0)
    return time.perf_counter() - start, out.shape[1] - len(ids)


rows, results = [], []
for prompt in prompts:
    ids = decoder.requests.encode(prompt.text, chat=prompt.chat)
    record = {"prompt": prompt.id, "prompt_tokens": len(ids)}
    record["ours_s"], record["ours_first_token_s"], record["ours_tokens"] = ours(ids)
    for name, model in baselines.items():
        record[f"hf_{name}_s"], record[f"hf_{name}_tokens"] = hf(model, ids, args.new_tokens)
        record[f"hf_{name}_first_token_s"], _ = hf(model, ids, 1)
    fastest = min(baselines, key=lambda name: record[f"hf_{name}_s"])
    record["speedup"] = record[f"hf_{fastest}_s"] / record["ours_s"]
    record["ttft_ratio"] = record["ours_first_token_s"] / record[f"hf_{fastest}_first_token_s"]
    results.append(record)
    print(record, file=sys.stderr, flush=True)
    rows.append([prompt.id, len(ids), f"{record['ours_s']:.1f}", f"{record['hf_bfloat16_s']:.1f}",
                 f"{record['hf_float32_s']:.1f}", f"{record['speedup']:.2f}",
                 f"{record['ours_first_token_s']:.2f}", f"{record[f'hf_{fastest}_first_token_s']:.2f}"])

tokens = sum(r["ours_tokens"] for r in results)
totals = {name: sum(r[f"hf_{name}_s"] for r in results) for name in baselines}
best = min(totals, key=totals.get)
summary = {"tokens_each_side": tokens, "ours_tokens_per_s": tokens / sum(r["ours_s"] for r in results),
           **{f"hf_{name}_tokens_per_s": tokens / t for name, t in totals.items()},
           "speedup_over_faster_target_alone": totals[best] / sum(r["ours_s"] for r in results),
           "faster_target_alone": best,
           "median_speedup": statistics.median(r["speedup"] for r in results),
           "min_speedup": min(r["speedup"] for r in results),
           "median_ttft_ratio": statistics.median(r["ttft_ratio"] for r in results),
           "max_ttft_ratio": max(r["ttft_ratio"] for r in results)}
body = [f"Our configuration (dtype auto): {config['choice']['summary'] if config['choice'] else config['dtype']}",
        "", *[f"- measured at load: {n}" for n in (config["choice"] or {}).get("measured", [])], "",
        f"**{summary['speedup_over_faster_target_alone']:.2f}x** the tokens/s of transformers `generate` with the "
        f"target alone in {best} (the faster of bfloat16 and float32 here): {summary['ours_tokens_per_s']:.2f} vs "
        f"{summary[f'hf_{best}_tokens_per_s']:.2f} tokens/s over {tokens} tokens each side "
        f"(per prompt: median {summary['median_speedup']:.2f}x, lowest {summary['min_speedup']:.2f}x). "
        f"Time to first token: median {summary['median_ttft_ratio']:.2f}x, at most {summary['max_ttft_ratio']:.2f}x "
        "the target alone's.", "",
        *markdown_table(["prompt", "prompt tokens", "ours s", "hf bf16 s", "hf fp32 s", "speedup",
                         "ours first token s", "target alone first token s"], rows)]
meta = environment(command=shlex.join(["python", "benchmarks/cpu_class.py", *sys.argv[1:]]),
                   new_tokens=args.new_tokens, temperature=0, chosen=config["target_kernel"])
write(args.out, "Defaults vs transformers target alone on this CPU class", meta, body,
      {"configuration": config, "summary": summary, "prompts": results})
print("\n".join(body))
