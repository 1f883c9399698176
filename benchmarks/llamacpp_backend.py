"""llama.cpp under the engine, side by side with llama.cpp's own plain decoding, in one process:

- raw:  llama.cpp's plain greedy decoding through llama-cpp-python's low-level API (the baseline:
        one llama_decode per token, argmax of its logits), in a context of its own;
- plain: our engine with the llama.cpp backend (specdecode.models.llamacpp), no drafts;
- spec:  our engine, llama.cpp target and llama.cpp draft model, γ drafts per step.

Greedy, equal token counts (EOS ignored), on HumanEval prompts (raw completion) and Spec-Bench
questions (through the chat template), one request at a time, the three interleaved per prompt.
Reported: medians over prompts of tokens/s and time to first token, whether raw, plain and spec
emitted the same tokens, and the target's costs, raw and through the backend: one-token step,
r(k) = a k-token llama_decode (logits at all k) over one step, prompt read per token.

    python benchmarks/llamacpp_backend.py --tiny /tmp/tiny --out /tmp/llamacpp_tiny     # random tiny GGUFs
    python benchmarks/llamacpp_backend.py --out docs/results/llamacpp_backend           # the zoo pair, Q4_K_M
    python benchmarks/llamacpp_backend.py --target-bf16 --out docs/results/llamacpp_bf16  # the target's bf16 weights
    python benchmarks/llamacpp_backend.py --costs-only --target-bf16                    # step and r(k) only

--out PATH writes PATH.json and PATH.md. --tiny DIR builds (once) a random 2-layer Qwen2-architecture
pair with a byte-level BPE tokenizer in DIR (specdecode.models.tiny_gguf, the tests' builder too).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import torch

# --- llama.cpp's own plain decoding (the baseline) ------------------------------------------------------

class RawLlama:
    """A model and a one-sequence context, driven the way llama.cpp's simple example does."""

    def __init__(self, path: Path, n_ctx: int, threads: int, repack: bool = True):
        from specdecode.models.llamacpp import library

        lib = self.lib = library()
        model_params = lib.llama_model_default_params()
        model_params.use_extra_bufts = repack
        self.model = lib.llama_model_load_from_file(str(path).encode(), model_params)
        params = lib.llama_context_default_params()
        params.n_ctx, params.n_batch = n_ctx, 2048
        params.n_threads = params.n_threads_batch = threads
        self.ctx = lib.llama_init_from_model(self.model, params)
        if not self.model or not self.ctx:
            raise RuntimeError(f"llama.cpp could not load {path}")
        self.memory = lib.llama_get_memory(self.ctx)
        self.vocab = lib.llama_vocab_n_tokens(lib.llama_model_get_vocab(self.model))
        self.batch = lib.llama_batch_init(64, 0, 1)

    def decode(self, ids: list[int], first: int, logits: str = "last") -> None:
        """ids at positions first.. in sequence 0; logits at the last token or at all of them."""
        if logits == "last" and len(ids) > 64:
            array = (self.lib.llama_token * len(ids))(*ids)
            code = self.lib.llama_decode(self.ctx, self.lib.llama_batch_get_one(array, len(ids)))
        else:
            batch = self.batch
            for i, token in enumerate(ids):
                batch.token[i], batch.pos[i], batch.n_seq_id[i] = token, first + i, 1
                batch.seq_id[i][0] = 0
                batch.logits[i] = logits == "all" or i == len(ids) - 1
            batch.n_tokens = len(ids)
            code = self.lib.llama_decode(self.ctx, batch)
        if code != 0:
            raise RuntimeError(f"llama_decode returned {code}")

    def last_argmax(self) -> int:
        logits = np.ctypeslib.as_array(self.lib.llama_get_logits_ith(self.ctx, -1), shape=(self.vocab,))
        return int(logits.argmax())

    def rollback(self, length: int) -> None:
        if not self.lib.llama_memory_seq_rm(self.memory, 0, length, -1):
            raise RuntimeError("llama_memory_seq_rm failed")

    def greedy(self, prompt: list[int], new_tokens: int) -> tuple[list[int], float, float]:
        """(tokens, seconds to the first token, seconds in all)."""
        self.lib.llama_memory_clear(self.memory, True)
        start = time.perf_counter()
        self.decode(prompt, 0)
        tokens = [self.last_argmax()]
        first = time.perf_counter() - start
        while len(tokens) < new_tokens:
            self.decode(tokens[-1:], len(prompt) + len(tokens) - 1)
            tokens.append(self.last_argmax())
        return tokens, first, time.perf_counter() - start

    def close(self) -> None:
        self.lib.llama_batch_free(self.batch)
        self.lib.llama_free(self.ctx)
        self.lib.llama_model_free(self.model)


# --- measurements ---------------------------------------------------------------------------------------

def costs(raw: RawLlama, backend, prompt: list[int], ks: list[int], repeats: int) -> dict:
    """The target's step (ms), r(k) and prompt read (ms per token), raw and through the backend,
    after reading `prompt`; every k-token call asks logits at all k and is rolled back. Raw and
    backend calls alternate, so a change of load on the machine hits both alike; medians of
    `repeats` after a warm-up pass (the first passes over freshly mapped weights are slow)."""
    n = len(prompt)
    token = prompt[-1]
    backend.reset()
    backend.add_row()

    def raw_read():
        raw.rollback(0)
        raw.decode(prompt, 0)

    def backend_read():
        backend.truncate([0])
        backend.fill(0, prompt)

    calls = {"raw": lambda k: (raw.decode([token] * k, n, "all"), raw.rollback(n)),
             "backend": lambda k: (backend.forward([[token] * k], k), backend.truncate([n]))}
    times = {(label, k): [] for label in calls for k in [0, 1, *ks]}  # k = 0: the prompt read
    raw.lib.llama_memory_clear(raw.memory, True)
    for read in (raw_read, backend_read):
        read()
    for _ in range(3):
        for call in calls.values():
            call(1)
    for _ in range(repeats):
        for k in [0, 1, *ks]:
            for label, call in calls.items():
                start = time.perf_counter()
                if k:
                    call(k)
                else:
                    (raw_read if label == "raw" else backend_read)()
                times[label, k].append(time.perf_counter() - start)
    out = {"prompt_tokens": n}
    for label in calls:
        step = statistics.median(times[label, 1])
        out[f"{label}_step_ms"] = 1e3 * step
        out[f"{label}_r"] = {k: statistics.median(times[label, k]) / step for k in ks}
        out[f"{label}_read_ms_per_token"] = 1e3 * statistics.median(times[label, 0]) / n
    return out


def run_engine(driver, request) -> tuple[list[int], float, float, object]:
    """(tokens, seconds to the first token, seconds in all, stats) of one request."""
    start = time.perf_counter()
    request_id = driver.submit(request, keep_events=True)
    first = None
    events = driver.stream(request_id)
    while True:
        try:
            next(events)
        except StopIteration as stop:
            result = stop.value
            break
        if first is None:
            first = time.perf_counter() - start
    return list(result.token_ids), first, time.perf_counter() - start, result.stats


def prompts_for(tokenizer, code: int, questions: int, max_tokens: int) -> list[tuple[str, list[int]]]:
    """[(id, token ids)]: HumanEval prompts raw, Spec-Bench questions through the chat template."""
    from specdecode.measure.data import load_prompts

    chosen = load_prompts("code", code) if code else []
    tasks = ["qa", "summarization", "math_reasoning", "writing"]
    per_task = {task: load_prompts(task, questions) for task in tasks}
    chosen += [per_task[tasks[i % len(tasks)]][i // len(tasks)] for i in range(questions)]
    out = []
    for prompt in chosen:
        text = prompt.text
        if prompt.chat and getattr(tokenizer, "chat_template", None):
            text = tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                                 add_generation_prompt=True)
        out.append((prompt.id, tokenizer(text, add_special_tokens=False).input_ids[-max_tokens:]))
    return out


def resolve(spec: str, bf16: bool, progress) -> Path:
    """A zoo name or a GGUF path → the GGUF file (converted to BF16 first when asked)."""
    from specdecode.models import zoo
    from specdecode.models.gguf_convert import converted_gguf

    if spec in zoo.ZOO:
        info = zoo.ZOO[spec]
        path = zoo.packaged_gguf(info) if info.package_file else zoo.assemble_gguf(info, progress)
    else:
        path = Path(spec)
    return converted_gguf(path, "bf16", progress) if bf16 else path


def markdown(report: dict) -> str:
    lines = [f"# llama.cpp under the engine: {report['target']}", "",
             f"Date: {report['date']}. CPU: {report['cpu']['cpu']}; torch capability {report['cpu']['capability']}, "
             f"flags {' '.join(report['cpu']['flags'])}; {report['threads']} threads; llama.cpp weight repacking "
             f"{'on' if report['repack'] else 'off'}.", "",
             f"llama.cpp: `{report['llama_system_info']}`", "",
             f"Command: `{report['command']}`", ""]
    if report.get("decoding"):
        d = report["decoding"]
        lines += [f"Greedy, {d['new_tokens']} new tokens per prompt (EOS ignored), γ = {d['gamma']}, draft "
                  f"{report['draft']}; medians over {len(d['prompts'])} prompts.", "",
                  "| decoding | tokens/s | time to first token (s) | vs raw |", "|---|---|---|---|"]
        for name in ("raw", "plain", "spec"):
            lines.append(f"| {name} | {d['median_tokens_per_s'][name]:.2f} | {d['median_ttft_s'][name]:.3f} | "
                         f"{d['median_speedup_vs_raw'][name]:.2f} |")
        lines += ["", f"Same tokens: plain = raw on {d['plain_equals_raw']}/{len(d['prompts'])} prompts, "
                  f"spec = plain on {d['spec_equals_plain']}/{len(d['prompts'])}. Spec: "
                  f"{d['spec_tokens_per_call']:.2f} tokens per target call, acceptance {d['spec_acceptance']:.2f}.",
                  "", "| prompt | prompt tokens | raw tok/s | plain tok/s | spec tok/s | tokens per call |",
                  "|---|---|---|---|---|---|"]
        for p in d["prompts"]:
            lines.append(f"| {p['id']} | {p['prompt_tokens']} | {p['raw']['tokens_per_s']:.2f} | "
                         f"{p['plain']['tokens_per_s']:.2f} | {p['spec']['tokens_per_s']:.2f} | "
                         f"{p['spec']['tokens_per_call']:.2f} |")
        lines.append("")
    if report.get("costs"):
        c = report["costs"]
        ks = list(c["raw_r"])
        lines += [f"Target costs after a {c['prompt_tokens']}-token prompt (medians): one-token step, r(k) = a "
                  "k-token call with k logits over one step, prompt read per token.", "",
                  "| path | step (ms) | " + " | ".join(f"r({k})" for k in ks) + " | read (ms/token) |",
                  "|---|---|" + "---|" * len(ks) + "---|"]
        for label in ("raw", "backend"):
            lines.append(f"| {label} | {c[f'{label}_step_ms']:.1f} | "
                         + " | ".join(f"{c[f'{label}_r'][k]:.2f}" for k in ks)
                         + f" | {c[f'{label}_read_ms_per_token']:.2f} |")
        lines.append("")
    return "\n".join(lines)


def main() -> None:
    from specdecode.engine.driver import Driver
    from specdecode.engine.engine import Engine
    from specdecode.engine.request import DecodeConfig, Request
    from specdecode.tune.hardware import cpu_report
    from specdecode.models.llamacpp import load_gguf, system_info
    from specdecode.models.tiny_gguf import build_tiny
    from specdecode.models.zoo import DEFAULT_DRAFT, DEFAULT_TARGET
    from specdecode.proposers import DraftModelProposer
    from specdecode.sampling import SamplingParams

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default=DEFAULT_TARGET, help="zoo name or GGUF path")
    parser.add_argument("--draft", default=DEFAULT_DRAFT, help="zoo name or GGUF path")
    parser.add_argument("--target-bf16", action="store_true", help="convert the target to BF16 first (cached)")
    parser.add_argument("--tiny", metavar="DIR", help="build random tiny GGUFs in DIR and use them")
    parser.add_argument("--code", type=int, default=4, help="HumanEval prompts")
    parser.add_argument("--questions", type=int, default=4, help="Spec-Bench questions")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--gamma", type=int, default=4)
    parser.add_argument("--max-prompt-tokens", type=int, default=1024)
    parser.add_argument("--threads", type=int, default=None, help="default: torch's thread count")
    parser.add_argument("--n-ctx", type=int, default=4096)
    parser.add_argument("--ks", default="2,3,4,5,6,7,8,9,16", help="k of r(k)")
    parser.add_argument("--repeats", type=int, default=7, help="timings per cost median")
    parser.add_argument("--costs-only", action="store_true", help="step and r(k) only, no decoding")
    parser.add_argument("--no-repack", action="store_true",
                        help="keep the files' weight layouts, raw and backend alike (a build whose AMX kernels fault)")
    parser.add_argument("--out", help="write OUT.json and OUT.md")
    args = parser.parse_args()
    progress = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731
    threads = args.threads or torch.get_num_threads()
    if args.tiny:
        tiny = build_tiny(Path(args.tiny))
        target_path, draft_path = tiny["target"], tiny["draft"]
        args.max_prompt_tokens = min(args.max_prompt_tokens, 200)
    else:
        target_path = resolve(args.target, args.target_bf16, progress)
        draft_path = None if args.costs_only else resolve(args.draft, False, progress)
    options = dict(n_ctx=args.n_ctx, n_threads=threads, max_rows=2, repack=not args.no_repack)
    target, tokenizer = load_gguf(target_path, **options)
    raw = RawLlama(target_path, args.n_ctx, threads, repack=not args.no_repack)
    prompts = prompts_for(tokenizer, args.code, args.questions, args.max_prompt_tokens)
    report = {"target": target_path.name, "draft": draft_path.name if draft_path else None,
              "date": f"{datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC", "cpu": cpu_report(),
              "capability": torch.backends.cpu.get_cpu_capability(), "threads": threads,
              "repack": not args.no_repack,
              "llama_system_info": system_info(), "platform": platform.platform(),
              "command": "python benchmarks/llamacpp_backend.py " + " ".join(sys.argv[1:])}
    progress(f"CPU capability {report['capability']}, flags {' '.join(report['cpu']['flags'])}")
    progress(f"llama.cpp: {report['llama_system_info']}")
    ks = [int(k) for k in args.ks.split(",")]
    progress("timing the target's step and r(k)")
    report["costs"] = costs(raw, target, prompts[0][1], ks, args.repeats)
    if not args.costs_only:
        draft, _ = load_gguf(draft_path, **options)
        sampling = SamplingParams(temperature=0, ignore_eos=True)
        plain = Driver(Engine(target, None, tokenizer))
        spec = Driver(Engine(target, DraftModelProposer(draft), tokenizer))
        config = {"plain": DecodeConfig(args.new_tokens, sampling, 0),
                  "spec": DecodeConfig(args.new_tokens, sampling, args.gamma)}
        warm = prompts[0][1][:16]
        raw.greedy(warm, 4)
        for name, driver in (("plain", plain), ("spec", spec)):
            run_engine(driver, Request(warm, config[name]))
        rows = []
        for index, (prompt_id, ids) in enumerate(prompts):
            row = {"id": prompt_id, "prompt_tokens": len(ids)}
            tokens, first, seconds = raw.greedy(ids, args.new_tokens)
            outputs = {"raw": tokens}
            row["raw"] = {"tokens_per_s": len(tokens) / seconds, "ttft_s": first}
            for name, driver in (("plain", plain), ("spec", spec)):
                tokens, first, seconds, stats = run_engine(driver, Request(ids, config[name]))
                outputs[name] = tokens
                row[name] = {"tokens_per_s": len(tokens) / seconds, "ttft_s": first,
                             "tokens_per_call": len(tokens) / stats.num_target_calls,
                             "drafted": stats.num_drafted, "accepted": stats.num_accepted}
            row["plain_equals_raw"] = outputs["plain"] == outputs["raw"]
            row["spec_equals_plain"] = outputs["spec"] == outputs["plain"]
            rows.append(row)
            progress(f"prompt {index + 1}/{len(prompts)}: raw {row['raw']['tokens_per_s']:.1f}, plain "
                     f"{row['plain']['tokens_per_s']:.1f}, spec {row['spec']['tokens_per_s']:.1f} tokens/s")
        names = ("raw", "plain", "spec")
        drafted = sum(r["spec"]["drafted"] for r in rows)
        report["decoding"] = {
            "new_tokens": args.new_tokens, "gamma": args.gamma, "prompts": rows,
            "median_tokens_per_s": {n: statistics.median(r[n]["tokens_per_s"] for r in rows) for n in names},
            "median_ttft_s": {n: statistics.median(r[n]["ttft_s"] for r in rows) for n in names},
            "median_speedup_vs_raw": {n: statistics.median(r[n]["tokens_per_s"] / r["raw"]["tokens_per_s"]
                                                           for r in rows) for n in names},
            "plain_equals_raw": sum(r["plain_equals_raw"] for r in rows),
            "spec_equals_plain": sum(r["spec_equals_plain"] for r in rows),
            "spec_tokens_per_call": statistics.median(r["spec"]["tokens_per_call"] for r in rows),
            "spec_acceptance": sum(r["spec"]["accepted"] for r in rows) / drafted if drafted else 0.0}
    raw.close()
    text = markdown(report)
    print(text)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out + ".json").write_text(json.dumps(report, indent=1, default=str))
        Path(args.out + ".md").write_text(text)


if __name__ == "__main__":
    main()
