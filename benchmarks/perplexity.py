"""Perplexity of the default target's three numerics on held-out text, side by side: the bfloat16
model (specdecode's batch-invariant kernels), the shipped Q4_K_M file on specdecode's K-quant
kernels (dtype="gguf", gguf-invariant) and the same file on llama.cpp (its own activation
quantization and float32 hidden states).

Text: HumanEval problems 100..100+N (the speed benchmarks use the first ones), each prompt followed
by its canonical solution; the negative log-likelihood is taken over the solution's tokens given
everything before them, from each backend's `score` (a plain forward of the whole text).

    python benchmarks/perplexity.py --out docs/results/perplexity_NAME
"""
import argparse
import json
import math
import sys
import time

import torch

from specdecode.measure.data import humaneval_prompts
from specdecode.models import HFCausalLM, kquant, llamacpp, zoo
from specdecode.models.gguf_files import gguf_tokenizer
from specdecode.tune.hardware import cpu_report, describe


def nll(backend, ids: list[int], first: int) -> tuple[float, int]:
    """(Σ −log p of ids[first:] given the ids before each, their count)."""
    logits = torch.cat(list(backend.score(ids[:-1]))).float()
    logp = logits.log_softmax(-1)[first - 1:]
    return -float(logp.gather(-1, torch.tensor(ids[first:])[:, None]).sum()), len(ids) - first


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--problems", type=int, default=20)
    parser.add_argument("--out", required=True, help="writes OUT.json and OUT.md")
    args = parser.parse_args()
    source = zoo.gguf_file(zoo.DEFAULT_TARGET)
    tokenizer = gguf_tokenizer(source)
    rows = humaneval_prompts()[100:100 + args.problems]
    texts = [(tokenizer(r["prompt"], add_special_tokens=False).input_ids,
              tokenizer(r["prompt"] + r["canonical_solution"], add_special_tokens=False).input_ids) for r in rows]
    makers = {"bfloat16 (bfloat16-invariant)": lambda: _invariant(),
              "Q4_K_M on specdecode's kernels (gguf-invariant)": lambda: kquant.kquant_model(source)}
    if llamacpp.available():
        makers["Q4_K_M on llama.cpp (llama.cpp-gguf)"] = lambda: llamacpp.LlamaCppLM(source, max_rows=1)
    result = {"date": time.strftime("%Y-%m-%d %H:%M"), "machine": cpu_report(),
              "command": "python benchmarks/perplexity.py " + " ".join(sys.argv[1:]), "problems": len(rows),
              "perplexity": {}}
    for name, make in makers.items():
        backend = make()
        total, count = 0.0, 0
        with torch.inference_mode():
            for prompt, ids in texts:
                value, n = nll(backend, ids, len(prompt))
                total, count = total + value, count + n
        result["perplexity"][name] = {"perplexity": math.exp(total / count), "tokens": count}
        print(name, result["perplexity"][name], flush=True)
        getattr(backend, "close", lambda: None)()
        del backend
    with open(args.out + ".json", "w") as f:
        json.dump(result, f, indent=1)
    lines = [f"# Perplexity of the target's numerics ({result['date']})", "",
             f"Machine: {describe(result['machine'])}. Command: `{result['command']}`. Text: HumanEval problems "
             f"100-{99 + len(rows)}, the canonical solutions' tokens given the prompt and the solution before them.", "",
             "| numerics | perplexity | tokens |", "|---|---|---|"]
    lines += [f"| {name} | {p['perplexity']:.4f} | {p['tokens']} |" for name, p in result["perplexity"].items()]
    with open(args.out + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    return 0


def _invariant():
    model, _ = zoo.load_zoo_model(zoo.DEFAULT_TARGET, torch.bfloat16)
    backend = HFCausalLM(model)
    backend.use_invariant_forward(share=True)
    return backend


if __name__ == "__main__":
    sys.exit(main())
