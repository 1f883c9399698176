"""specdecode against what people run on a CPU, side by side in one process: llama.cpp's plain
decoding of the same weights first, transformers' target alone second.

Systems (greedy, the same prompt token ids, exactly --new-tokens tokens each: EOS ignored):
- llama.cpp BF16 plain: llama-cpp-python's low-level loop (one llama_decode per token, argmax) on a
  BF16 GGUF of the default target (llama.cpp's own conversion of the shipped file: the bfloat16
  weights our torch target dequantizes to);
- llama.cpp Q4_K_M plain: the same loop on the shipped Q4_K_M file;
- transformers: the target alone in bfloat16, `model.generate(do_sample=False)`;
- specdecode auto: `SpeculativeDecoder()` as a user builds it (dtype="auto": whatever this
  machine's measured choice is; the bfloat16 model of the weights);
- specdecode torch: `SpeculativeDecoder(dtype="bfloat16")`: the same model on torch's kernels;
- specdecode gguf: `SpeculativeDecoder(dtype="gguf")`: the Q4_K_M file's own numbers.

Workloads: HumanEval prompts (raw completion), Spec-Bench questions (chat template) and code
edits (a HumanEval function to rewrite: an input-grounded task where suffix drafts can copy).
Per prompt the systems run in turn, so a slow spell of the machine hits all of them. Reported:
per workload and system the median tokens/s and time to first token, each system's ratio to the
two llama.cpp baselines and to transformers (median and minimum over prompts), whether outputs
equal their baseline, and at temperature 1 the acceptance of the paper's rule against
sample-and-match on the same positions (E[Σ min(p, q)] against E[Σ p·q], paper §3.2).

    python benchmarks/vs_llamacpp.py --out docs/results/vs_llamacpp
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from llamacpp_backend import RawLlama  # noqa: E402

from specdecode import SamplingParams, SpeculativeDecoder  # noqa: E402
from specdecode.measure.data import humaneval_prompts, load_prompts  # noqa: E402
from specdecode.models import llamacpp, zoo  # noqa: E402
from specdecode.models.gguf_convert import converted_gguf  # noqa: E402
from specdecode.models.repack_probe import repack_works  # noqa: E402
from specdecode.proposers.fallback import find_proposer  # noqa: E402
from specdecode.proposers.suffix import SuffixProposer  # noqa: E402
from specdecode.tune.hardware import cpu_report, describe  # noqa: E402

SYSTEMS = ("llama.cpp BF16 plain", "llama.cpp Q4_K_M plain", "transformers", "specdecode auto", "specdecode torch",
           "specdecode gguf")


def workloads(count: int, tokenizer) -> dict[str, list[list[int]]]:
    """{workload: prompts as token ids}: the same ids go to every system."""
    def chat(text):
        return tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=True,
                                             add_generation_prompt=True, return_dict=False)

    code = [p["prompt"] for p in humaneval_prompts(2 * count)]
    edits = [f"Rewrite this Python function adding type hints. Reply with the code only.\n\n{c}"
             for c in code[count:2 * count]]
    tasks = ["qa", "summarization", "math_reasoning", "translation", "rag", "writing"]
    per_task = {task: load_prompts(task, (count + len(tasks) - 1) // len(tasks)) for task in tasks}
    spec_bench = [per_task[tasks[i % len(tasks)]][i // len(tasks)].text for i in range(count)]
    return {"humaneval": [tokenizer(c, add_special_tokens=False).input_ids for c in code[:count]],
            "spec_bench": [list(chat(t)) for t in spec_bench], "edits": [list(chat(t)) for t in edits]}


def ours(decoder, prompt: list[int], new_tokens: int, forget: bool = False) -> tuple[list[int], float, float, object]:
    """(tokens, seconds to the first token, seconds in all, stats) of one streamed request;
    forget: suffix drafts start without earlier requests' outputs."""
    suffix = find_proposer(decoder.engine.proposer, SuffixProposer)
    if forget and suffix is not None:
        suffix.forget()
    sampling = SamplingParams(temperature=0, ignore_eos=True)
    start = time.perf_counter()
    stream = decoder.generate(prompt, max_new_tokens=new_tokens, sampling=sampling, stream=True)
    first = None
    for _ in stream:
        if first is None:
            first = time.perf_counter() - start
    return list(stream.result.token_ids), first, time.perf_counter() - start, stream.result.stats


@torch.inference_mode()
def transformers_greedy(model, prompt: list[int], new_tokens: int) -> tuple[list[int], float, float]:
    start = time.perf_counter()
    out = model.generate(torch.tensor([prompt]), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                         do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist(), float("nan"), time.perf_counter() - start


@torch.inference_mode()
def acceptance_two_rules(decoder, prompts: list[list[int]], new_tokens: int, seed: int = 0) -> dict:
    """At temperature 1: target text from the exact speculative run, then at every position of it
    the paper's acceptance probability Σ min(p, q) and sample-and-match's Σ p·q (a draft token
    drawn from q kept iff the target's own draw equals it), p and q from one forward of each
    model over the text."""
    paper, match, run_rates = [], [], []
    for i, prompt in enumerate(prompts):
        result = decoder.generate(prompt, max_new_tokens=new_tokens,
                                  sampling=SamplingParams(temperature=1.0, seed=seed + i))
        run_rates.append(result.stats.acceptance_rate)
        ids = list(prompt) + list(result.token_ids)
        p = torch.cat(list(decoder.target.backend.score(ids[:-1])))[len(prompt) - 1:].softmax(-1)
        q = torch.cat(list(decoder.draft.backend.score(ids[:-1])))[len(prompt) - 1:].softmax(-1)
        width = min(p.shape[-1], q.shape[-1])
        p, q = p[:, :width], q[:, :width]
        paper.append(torch.minimum(p, q).sum(-1).mean().item())
        match.append((p * q).sum(-1).mean().item())
    return {"alpha_paper_rule": statistics.mean(paper), "alpha_sample_and_match": statistics.mean(match),
            "run_acceptance_rate": statistics.mean(run_rates), "prompts": len(prompts)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=5, help="prompts per workload")
    parser.add_argument("--new-tokens", type=int, default=96)
    parser.add_argument("--systems", default=",".join(SYSTEMS), help="comma-separated subset of " + ", ".join(SYSTEMS))
    parser.add_argument("--repeats", type=int, default=1,
                        help="runs of each system per prompt, interleaved; a prompt's figures are their medians. "
                             "Above 1 our suffix drafts forget earlier requests before each run (a repeat would "
                             "otherwise copy its own earlier output)")
    parser.add_argument("--out", required=True, help="writes OUT.json and OUT.md")
    args = parser.parse_args()
    systems = args.systems.split(",")
    say = lambda message: print(message, file=sys.stderr, flush=True)  # noqa: E731
    threads = torch.get_num_threads()
    source = zoo.gguf_file(zoo.DEFAULT_TARGET, say)
    bf16 = converted_gguf(source, "bf16", say)
    runners, decoders = {}, {}
    for name, options in (("specdecode auto", {}), ("specdecode torch", dict(dtype="bfloat16")),
                          ("specdecode gguf", dict(dtype="gguf"))):
        if name in systems:
            decoders[name] = SpeculativeDecoder(progress=say, **options)
            runners[name] = lambda p, decoder=decoders[name]: ours(decoder, p, args.new_tokens, args.repeats > 1)
    for name, path in (("llama.cpp BF16 plain", bf16), ("llama.cpp Q4_K_M plain", source)):
        if name in systems:
            raw = RawLlama(path, 4096, threads, repack=repack_works(path))
            runners[name] = lambda p, raw=raw: raw.greedy(p, args.new_tokens)
    if "transformers" in systems:
        model = zoo.load_zoo_model(zoo.DEFAULT_TARGET, torch.bfloat16, say)[0]
        runners["transformers"] = lambda p: transformers_greedy(model, p, args.new_tokens)
    tokenizer = llamacpp.gguf_tokenizer(source)
    results = {}
    for workload, prompts in workloads(args.prompts, tokenizer).items():
        for index, prompt in enumerate(prompts):
            say(f"{workload} {index + 1}/{len(prompts)} ({len(prompt)} prompt tokens)")
            runs = {name: [] for name in runners}
            for _ in range(args.repeats):
                for name, run in runners.items():
                    runs[name].append(run(prompt))
            for name, outcomes in runs.items():
                tokens, _, _, *stats = outcomes[0]
                record = {"tokens": len(tokens), "ids": tokens,
                          "tokens_per_s": statistics.median(len(t) / seconds for t, _, seconds, *_ in outcomes),
                          "ttft_s": statistics.median(first for _, first, *_ in outcomes)}
                if stats:
                    record.update(mean_tokens_per_call=stats[0].mean_tokens_per_call,
                                  acceptance_rate=stats[0].acceptance_rate)
                results.setdefault(workload, {}).setdefault(name, []).append(record)
    report = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "machine": cpu_report(),
              "llama_cpp": {"version": __import__("llama_cpp").__version__, "system_info": llamacpp.system_info(),
                            "repack": {"bf16": repack_works(bf16), "q4_k_m": repack_works(source)}},
              "command": " ".join(sys.argv), "new_tokens": args.new_tokens, "threads": threads,
              "repeats": args.repeats,
              "configurations": {name: decoder.configuration() for name, decoder in decoders.items()},
              "workloads": summarize(results),
              "per_prompt": {workload: {name: [{k: v for k, v in r.items() if k != "ids"} for r in records]
                                        for name, records in by_system.items()}
                             for workload, by_system in results.items()}}
    with_draft = next((d for d in decoders.values() if d.draft is not None), None)
    if with_draft is not None:
        say("temperature 1: the paper's rule against sample-and-match")
        report["temperature_1"] = acceptance_two_rules(with_draft, workloads(args.prompts, tokenizer)["humaneval"],
                                                       args.new_tokens)
        report["temperature_1"]["pair"] = with_draft.configuration()["target_kernel"]
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out + ".json").write_text(json.dumps(report, indent=1, default=str))
    Path(args.out + ".md").write_text(markdown(report))
    print(markdown(report))


def summarize(results: dict) -> dict:
    """Per workload and system: medians, and ratios to each baseline per prompt (median, min)."""
    out = {}
    for workload, by_system in results.items():
        rows = {}
        for name, records in by_system.items():
            row = {"tokens_per_s": statistics.median(r["tokens_per_s"] for r in records),
                   "ttft_s": statistics.median(r["ttft_s"] for r in records) if records[0]["ttft_s"] == records[0][
                       "ttft_s"] else None}
            for base in ("llama.cpp BF16 plain", "llama.cpp Q4_K_M plain", "transformers"):
                if base in by_system and base != name:
                    ratios = [r["tokens_per_s"] / b["tokens_per_s"] for r, b in zip(records, by_system[base])]
                    row[f"vs {base}"] = {"median": statistics.median(ratios), "min": min(ratios)}
                    if records[0]["ttft_s"] is not None and by_system[base][0]["ttft_s"] == by_system[base][0]["ttft_s"]:
                        row[f"ttft vs {base}"] = statistics.median(r["ttft_s"] / b["ttft_s"]
                                                                    for r, b in zip(records, by_system[base]))
            if "mean_tokens_per_call" in records[0]:
                row["mean_tokens_per_call"] = statistics.median(r["mean_tokens_per_call"] for r in records)
            baseline = {"specdecode auto": "llama.cpp BF16 plain", "specdecode torch": "llama.cpp BF16 plain",
                        "specdecode gguf": "llama.cpp Q4_K_M plain"}.get(name)
            if baseline in by_system:
                row["same_tokens_as_baseline"] = sum(r["ids"] == b["ids"] for r, b in zip(records, by_system[baseline]))
            row["prompts"] = len(records)
            rows[name] = row
        out[workload] = rows
    return out


def markdown(report: dict) -> str:
    lines = [f"# specdecode against llama.cpp and transformers ({report['date']})", "",
             f"Machine: {describe(report['machine'])}; {report['threads']} threads for every system.",
             f"llama-cpp-python {report['llama_cpp']['version']}; llama.cpp: {report['llama_cpp']['system_info']}; "
             f"repacked layouts used: {report['llama_cpp']['repack']}.",
             f"Command: `{report['command']}`. Greedy, {report['new_tokens']} new tokens per prompt (EOS ignored), "
             "the same prompt ids for every system, systems in turn per prompt"
             + (f", {report['repeats']} runs each (a prompt's figures are their medians; our suffix drafts "
                "forget earlier requests before each run)." if report.get("repeats", 1) > 1 else "."), ""]
    for name, configuration in report["configurations"].items():
        choice = configuration.get("choice")
        lines.append(f"- {name}: {configuration['backend']} target ({configuration['target_weights']}), draft "
                     f"{configuration['draft_weights']}, γ ≤ {configuration['num_speculative_tokens']}, free drafts "
                     f"{configuration['free_drafts']}" + (f"; chose: {choice['summary']}" if choice else ""))
    lines.append("")
    for workload, rows in report["workloads"].items():
        lines += [f"## {workload}", "", "| system | tokens/s | TTFT (s) | vs llama.cpp BF16 (median, min) | "
                  "vs llama.cpp Q4_K_M (median, min) | vs transformers (median, min) | tokens/call | same tokens |",
                  "|---|---|---|---|---|---|---|---|"]
        for name, row in rows.items():
            def ratio(base):
                r = row.get(f"vs {base}")
                return f"{r['median']:.2f}x, {r['min']:.2f}x" if r else ""
            ttft = f"{row['ttft_s']:.2f}" if row.get("ttft_s") is not None else ""
            lines.append(f"| {name} | {row['tokens_per_s']:.2f} | {ttft} | {ratio('llama.cpp BF16 plain')} | "
                         f"{ratio('llama.cpp Q4_K_M plain')} | {ratio('transformers')} | "
                         f"{row.get('mean_tokens_per_call', 1.0):.2f} | "
                         f"{row.get('same_tokens_as_baseline', '')}{'/' + str(row['prompts']) if 'same_tokens_as_baseline' in row else ''} |")
        lines.append("")
    if "temperature_1" in report:
        t1 = report["temperature_1"]
        lines += ["## Temperature 1: acceptance of the paper's rule against sample-and-match", "",
                  f"Over the target text of {t1['prompts']} HumanEval prompts ({t1['pair']} target with its draft): "
                  f"E[Σ min(p, q)] = {t1['alpha_paper_rule']:.3f} (the paper's rule), E[Σ p·q] = "
                  f"{t1['alpha_sample_and_match']:.3f} (sample-and-match); the run's own acceptance rate "
                  f"{t1['run_acceptance_rate']:.3f}.", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
