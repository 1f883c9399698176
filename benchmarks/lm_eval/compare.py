"""lm-evaluation-harness against `specdecode serve`, beside lm-eval's own `hf` backend on the same
target: the same tasks (a 32-question multiple-choice task scored by loglikelihood and a 12-question
generate-until task, in tasks/), the same scores expected, sample by sample.

    pip install -e '.[models,eval]'
    python benchmarks/lm_eval/compare.py                      # the default pair, float32
    python benchmarks/lm_eval/compare.py --tiny /tmp/tiny     # random tiny models (a minute; the test's)
    python benchmarks/lm_eval/compare.py --output docs/results/lm_eval.md

The server is started as users start it (127.0.0.1, a free port) and driven by lm-eval's
`local-completions` model: loglikelihood requests send token-id prompts (a list of them per
request with --batch-size > 1) with `echo: true, logprobs: 1, max_tokens: 1` and read the prompt
tokens' logprobs; generate-until requests send `stop` and `max_tokens`. Both runs are offline.
Exit status 1 when a score or a sample differs beyond --tolerance (loglikelihoods) or at all
(accuracy, greedy generations).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

import httpx

TASKS = Path(__file__).resolve().parent / "tasks"
TASK_NAMES = ["specdecode_mc", "specdecode_gen"]
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "TOKENIZERS_PARALLELISM": "false"}


def build_tiny(root: Path) -> tuple[str, str]:
    """A random tiny Llama target and a draft near it (the target plus noise), with a
    character-level tokenizer over printable ASCII, saved under root. Returns (target, draft)."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2}
    vocab.update({chr(c): i + 3 for i, c in enumerate(range(32, 127))})
    vocab["\n"] = len(vocab)
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    backend.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<eos>", pad_token="<pad>",
                                        unk_token="<unk>")
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(vocab), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         eos_token_id=1, bos_token_id=None, pad_token_id=0, tie_word_embeddings=False)
    target = LlamaForCausalLM(config).eval()
    draft = LlamaForCausalLM(config).eval()
    draft.load_state_dict(target.state_dict())
    with torch.no_grad():
        for param in draft.parameters():
            param.add_(0.02 * torch.randn_like(param))
    paths = []
    for name, model in (("target", target), ("draft", draft)):
        model.save_pretrained(root / name)
        tokenizer.save_pretrained(root / name)
        paths.append(str(root / name))
    return paths[0], paths[1]


def default_target_path() -> str:
    """The default target's float32 weight cache (built on first use), for lm-eval's hf backend."""
    import torch

    from specdecode.models.zoo import DEFAULT_TARGET, load_zoo_model, weights_cache

    load_zoo_model(DEFAULT_TARGET, torch.float32)
    return str(weights_cache(DEFAULT_TARGET, torch.float32))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve(models: list[str], port: int) -> subprocess.Popen:
    """`specdecode serve *models` on 127.0.0.1:port, returned once /health answers."""
    process = subprocess.Popen([sys.executable, "-m", "specdecode.cli", "serve", *models, "--dtype", "float32",
                                "--port", str(port), "--served-model-name", "m", "--quiet"],
                               env=os.environ | OFFLINE, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 900
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"specdecode serve exited {process.returncode}: {process.stderr.read()[-2000:]}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return process
        except httpx.HTTPError:
            time.sleep(0.5)
    process.kill()
    raise RuntimeError("specdecode serve did not start in 15 minutes")


def lm_eval(model: str, model_args: str, out: Path, batch_size: int, limit: int | None) -> list[str]:
    """Run `lm_eval run` (from the tasks folder, where the data files are); returns the command."""
    command = [sys.executable, "-m", "lm_eval", "run", "--model", model, "--model_args", model_args,
               "--tasks", ",".join(TASK_NAMES), "--include_path", str(TASKS), "--batch_size", str(batch_size),
               "--output_path", str(out), "--log_samples", "--seed", "1234"]
    if limit:
        command += ["--limit", str(limit)]
    done = subprocess.run(command, cwd=TASKS, env=os.environ | OFFLINE, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"lm_eval ({model}) exited {done.returncode}:\n{done.stderr[-4000:]}")
    return command


def read_run(out: Path) -> tuple[dict, dict]:
    """({task: {metric: value}}, {task: [per-sample (doc_id, resps)]}) of an lm_eval output folder."""
    results_file = max(out.rglob("results_*.json"), key=lambda p: p.stat().st_mtime)
    results = json.loads(results_file.read_text())["results"]
    metrics = {task: {k: v for k, v in values.items() if k.endswith(",none") or k.endswith(",strip")}
               for task, values in results.items()}
    samples = {}
    for task in TASK_NAMES:
        files = sorted(out.rglob(f"samples_{task}_*.jsonl"), key=lambda p: p.stat().st_mtime)
        records = [json.loads(line) for line in files[-1].read_text().splitlines()]
        samples[task] = sorted(((r["doc_id"], r["resps"]) for r in records), key=lambda x: x[0])
    return metrics, samples


def compare(served: tuple[dict, dict], hf: tuple[dict, dict], tolerance: float) -> list[str]:
    """The differences between the two runs (empty when they agree)."""
    problems = []
    for task in TASK_NAMES:
        for (doc, a), (_, b) in zip(served[1][task], hf[1][task]):
            if task == "specdecode_mc":
                for (ll_a, greedy_a), (ll_b, greedy_b) in zip((x[0] for x in a), (x[0] for x in b)):
                    if abs(float(ll_a) - float(ll_b)) > tolerance or greedy_a != greedy_b:
                        problems.append(f"{task} doc {doc}: loglikelihood {ll_a} vs {ll_b}, greedy {greedy_a} vs "
                                        f"{greedy_b}")
            elif a != b:
                problems.append(f"{task} doc {doc}: generated {a!r} vs {b!r}")
        for metric, value in hf[0][task].items():
            if isinstance(value, (int, float)) and "stderr" not in metric and served[0][task].get(metric) != value:
                problems.append(f"{task} {metric}: {served[0][task].get(metric)} vs {value}")
    return problems


def machine() -> str:
    import torch

    flags = ""
    try:
        flags = next(line for line in open("/proc/cpuinfo") if line.startswith("flags")).split(":")[1]
    except (OSError, StopIteration):
        pass
    wanted = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f" {f} " in f" {flags} "]
    return (f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch "
            f"{torch.__version__} ({torch.backends.cpu.get_cpu_capability()}), flags: {' '.join(wanted)}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", help="target path (default: the default pair's target)")
    parser.add_argument("--draft", help="with --target: a draft path, or none (the default)")
    parser.add_argument("--tiny", metavar="DIR", help="build random tiny models in DIR and use them")
    parser.add_argument("--batch-size", type=int, default=4, help="prompts per request from lm-eval (default 4)")
    parser.add_argument("--limit", type=int, help="only the first N questions of each task")
    parser.add_argument("--tolerance", type=float, default=1e-4, help="loglikelihood difference allowed")
    parser.add_argument("--output", help="write the results as Markdown here (e.g. docs/results/lm_eval.md)")
    args = parser.parse_args(argv)

    if args.tiny:
        target, draft = build_tiny(Path(args.tiny))
        models = ["--target", target, "--draft", draft]
    elif args.target:
        target, draft = args.target, args.draft or "none"
        models = ["--target", target, "--draft", draft]
    else:  # the default pair (its target's weight cache is what lm-eval's hf backend loads)
        target, draft, models = default_target_path(), "the default pair's draft", []
    port = free_port()
    work = Path(tempfile.mkdtemp(prefix="lm_eval_compare_"))
    process = serve(models, port)
    try:
        started = time.perf_counter()
        served_args = (f"model=m,base_url=http://127.0.0.1:{port}/v1/completions,tokenizer_backend=huggingface,"
                       f"tokenizer={target},num_concurrent=1,max_retries=1,tokenized_requests=True")
        served_command = lm_eval("local-completions", served_args, work / "served", args.batch_size, args.limit)
        served_s = time.perf_counter() - started
    finally:
        process.terminate()
        process.wait(60)
    started = time.perf_counter()
    hf_command = lm_eval("hf", f"pretrained={target},dtype=float32", work / "hf", 1, args.limit)
    hf_s = time.perf_counter() - started
    served, hf = read_run(work / "served"), read_run(work / "hf")
    problems = compare(served, hf, args.tolerance)

    rows = [f"| {task} | {metric.split(',')[0]} | {served[0][task].get(metric)} | {value} |"
            for task in TASK_NAMES for metric, value in hf[0][task].items() if "stderr" not in metric]
    report = "\n".join([
        "| task | metric | specdecode serve (local-completions) | transformers (lm-eval hf) |",
        "|---|---|---|---|", *rows, "",
        f"samples compared: {sum(len(s) for s in hf[1].values())}; differences: {len(problems)} "
        f"(loglikelihood tolerance {args.tolerance}); lm-eval wall time: served {served_s:.0f} s (with "
        f"server start outside it), hf {hf_s:.0f} s"])
    print(report)
    for problem in problems[:20]:
        print("DIFF", problem)
    if args.output:
        import lm_eval as lm_eval_package

        Path(args.output).write_text("\n".join([
            "# lm-evaluation-harness: `specdecode serve` against lm-eval's `hf` backend", "",
            f"Date: {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC. Machine: {machine()}. lm-eval "
            f"{lm_eval_package.__version__}. Target: `{target}`; draft: `{draft}` (float32).", "",
            "Command: `python " + " ".join(["benchmarks/lm_eval/compare.py", *(argv or sys.argv[1:])]) + "`", "",
            "It runs, from `benchmarks/lm_eval/tasks/`:", "",
            "```", " ".join(served_command[2:]).replace(str(TASKS), "benchmarks/lm_eval/tasks"),
            " ".join(hf_command[2:]).replace(str(TASKS), "benchmarks/lm_eval/tasks"), "```", "",
            report, ""]))
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
