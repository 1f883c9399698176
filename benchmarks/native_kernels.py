"""The batch-invariant kernels (specdecode.native) against torch's, on this machine, in one process.

1. The default target's products alone: every linear layer of Qwen2.5-Coder-1.5B (28 layers of
   q|k|v, o, gate|up, down, and the LM head; distinct random bfloat16 weights, 3.09 GB) applied to
   M rows, for M in --rows: specdecode.native.linear, torch's bfloat16 `linear` (oneDNN where torch
   picks it) and the same without oneDNN (torch's own kernels); the best of --repeats sweeps, the
   kernels interleaved. Beside them the memory line: the weights read once at this machine's
   measured bandwidth.
2. The same products on the shipped Q4_K_M file's own blocks (Q4_K and Q6_K, memory-mapped, 0.99
   GB): specdecode.native.linear_kq, against its memory line.
3. The whole target forward per kernel (the choice's candidates): a one-token step, r(k) = a k-token
   call over a step, and a 64-token prompt read per token; torch bfloat16, bfloat16-invariant and,
   with llama-cpp-python, llama.cpp on a BF16 GGUF of the same weights; then the Q4_K_M file on
   specdecode's K-quant kernels (gguf-invariant) and on llama.cpp (llama.cpp-gguf).

    python benchmarks/native_kernels.py --out docs/results/native_kernels_NAME
Emulating an AVX2-only CPU on an AVX-512 one (torch, oneDNN and specdecode's build capped):
    ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 \
        SPECDECODE_NATIVE_MARCH=haswell python benchmarks/native_kernels.py --no-llama --out ...
"""
import argparse
import json
import sys
import time

import torch

from specdecode import native
from specdecode.models import HFCausalLM, kquant, llamacpp, zoo
from specdecode.models.gguf_convert import converted_gguf
from specdecode.models.gguf_files import TensorTable
from specdecode.models.kernels import without_onednn
from specdecode.tune.candidates import memory_bandwidth_gbs
from specdecode.tune.hardware import cpu_report, describe
from specdecode.tune.timing import time_interleaved

LAYERS, HIDDEN, INTER, QKV, VOCAB = 28, 1536, 8960, 2048, 151936
BANDWIDTH_GIB = 4  # the bandwidth's sum reads this much: more than any cache (an AMX Xeon VM reports 480 MiB of L3)


def products(rows: list[int], repeats: int) -> dict:
    shapes = [(QKV, HIDDEN), (HIDDEN, HIDDEN), (2 * INTER, HIDDEN), (HIDDEN, INTER)] * LAYERS + [(VOCAB, HIDDEN)]
    weights = [torch.empty(n, k, dtype=torch.bfloat16).uniform_(-0.05, 0.05) for n, k in shapes]
    gigabytes = sum(w.numel() * 2 for w in weights) / 1e9

    def torch_plain(x, w):
        with without_onednn():
            return torch.nn.functional.linear(x, w)

    kernels = {"specdecode.native": native.linear, "torch bfloat16": torch.nn.functional.linear,
               "torch without oneDNN": torch_plain}
    best = {}
    for m in rows:
        inputs = {k: torch.randn(m, k).bfloat16() for k in (HIDDEN, INTER)}
        for _ in range(repeats):
            for name, kernel in kernels.items():
                start = time.perf_counter()
                for w in weights:
                    kernel(inputs[w.shape[1]], w)
                best[name, m] = min(best.get((name, m), float("inf")), time.perf_counter() - start)
    bandwidth = memory_bandwidth_gbs(BANDWIDTH_GIB)
    return {"gigabytes": gigabytes, "bandwidth_gbs": bandwidth, "memory_line_ms": 1e3 * gigabytes / bandwidth,
            "ms": {name: {m: 1e3 * best[name, m] for m in rows} for name in kernels}}


def gguf_products(rows: list[int], repeats: int) -> dict:
    table = TensorTable(zoo.gguf_file(zoo.DEFAULT_TARGET))
    products = []
    for i in range(LAYERS):
        for names, inputs in ((["attn_q", "attn_k", "attn_v"], HIDDEN), (["attn_output"], HIDDEN),
                              (["ffn_gate", "ffn_up"], HIDDEN), (["ffn_down"], INTER)):
            parts = [(table.blocks(f"blk.{i}.{n}.weight"), table.type_name(f"blk.{i}.{n}.weight")) for n in names]
            products.append(native.KQuantWeights(parts, inputs))
    products.append(native.KQuantWeights([(table.blocks("output.weight"), table.type_name("output.weight"))], HIDDEN))
    gigabytes = sum(array.nbytes for w in products for array in w._keep) / 1e9
    # tiled (the default: weight rows 8 at a time, spans of blocks whose activations stay in L1)
    # against untiled (one weight row after another over the whole K), interleaved; same bits
    kernels = {"specdecode.native K-quant": 24 << 10, "the same untiled": 1 << 40}
    best = {}
    for m in rows:
        inputs = {k: torch.randn(m, k).bfloat16() for k in (HIDDEN, INTER)}
        for _ in range(repeats):
            for name, above in kernels.items():
                with native.kq_tiling(above):
                    start = time.perf_counter()
                    for w in products:
                        native.linear_kq(inputs[w.inputs], w)
                    best[name, m] = min(best.get((name, m), float("inf")), time.perf_counter() - start)
    bandwidth = memory_bandwidth_gbs(BANDWIDTH_GIB)
    return {"gigabytes": gigabytes, "bandwidth_gbs": bandwidth, "memory_line_ms": 1e3 * gigabytes / bandwidth,
            "ms": {name: {m: 1e3 * best[name, m] for m in rows} for name in kernels}}


def forwards(sizes: list[int], repeats: int, llama: bool) -> dict:
    model, _ = zoo.load_zoo_model(zoo.DEFAULT_TARGET, torch.bfloat16)
    backends = {"bfloat16": HFCausalLM(model), "bfloat16-invariant": HFCausalLM(model)}
    backends["bfloat16-invariant"].use_invariant_forward(share=True)
    if llama and llamacpp.available():
        bf16_gguf = converted_gguf(zoo.gguf_file(zoo.DEFAULT_TARGET), "bf16")
        backends["llama.cpp-bf16"] = llamacpp.LlamaCppLM(bf16_gguf, max_rows=1)
    context = [(100 + i * 7919) % 30000 for i in range(64)]
    with torch.inference_mode():
        times = time_interleaved(backends, context, {name: sizes for name in backends}, repeats=repeats)
    del backends, model
    source = zoo.gguf_file(zoo.DEFAULT_TARGET)
    files = {"gguf-invariant": kquant.kquant_model(source)}
    if llama and llamacpp.available():
        files["llama.cpp-gguf"] = llamacpp.LlamaCppLM(source, max_rows=1)
    with torch.inference_mode():
        times.update(time_interleaved(files, context, {name: sizes for name in files}, repeats=repeats))
    return {name: {"step_ms": 1e3 * t[1], "r": {k: t[k] / t[1] for k in sizes if k > 1},
                   "read_ms_per_token": 1e3 * t[max(sizes)] / max(sizes)} for name, t in times.items()}


def markdown(result: dict) -> str:
    p = result["products"]
    rows = sorted(next(iter(p["ms"].values())))
    lines = [f"# Batch-invariant kernels against torch's ({result['date']})", "",
             f"Machine: {describe(result['machine'])}. torch {torch.__version__}, specdecode.native build: {result['isa']}. "
             f"Command: `{result['command']}`.", "",
             f"## The default target's products ({p['gigabytes']:.2f} GB of bfloat16 weights)", "",
             f"Memory line: the weights read once at the measured {p['bandwidth_gbs']:.1f} GB/s = "
             f"{p['memory_line_ms']:.0f} ms. Best of the sweeps; r(M) = M rows over one row of the same kernel.", "",
             "| kernel | " + " | ".join(f"M={m}" for m in rows) + " |", "|---|" + "---|" * len(rows)]
    for name, ms in p["ms"].items():
        one = ms[rows[0]]
        lines.append(f"| {name} | " + " | ".join(f"{ms[m]:.0f} ms (r {ms[m] / one:.2f})" for m in rows) + " |")
    g = result["gguf_products"]
    lines += ["", f"## The Q4_K_M file's own blocks ({g['gigabytes']:.2f} GB of Q4_K and Q6_K blocks)", "",
              f"Memory line: {g['memory_line_ms']:.0f} ms at {g['bandwidth_gbs']:.1f} GB/s.", "",
              "| kernel | " + " | ".join(f"M={m}" for m in rows) + " |", "|---|" + "---|" * len(rows)]
    for name, ms in g["ms"].items():
        lines.append(f"| {name} | " + " | ".join(f"{ms[m]:.0f} ms (r {ms[m] / ms[rows[0]]:.2f})" for m in rows) + " |")
    lines += ["", "## The whole target forward", "", "| kernel | step | " +
              " | ".join(f"r({k})" for k in next(iter(result["forwards"].values()))["r"]) + " | prompt read |",
              "|---|---|" + "---|" * (len(next(iter(result["forwards"].values()))["r"]) + 1)]
    for name, f in result["forwards"].items():
        lines.append(f"| {name} | {f['step_ms']:.0f} ms | " + " | ".join(f"{v:.2f}" for v in f["r"].values())
                     + f" | {f['read_ms_per_token']:.1f} ms/token |")
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 5, 9, 17])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 2, 5, 9, 17, 64])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--no-llama", action="store_true",
                        help="leave llama.cpp out (its build's instruction sets cannot be capped like torch's)")
    parser.add_argument("--out", required=True, help="writes OUT.json and OUT.md")
    args = parser.parse_args()
    result = {"date": time.strftime("%Y-%m-%d %H:%M"), "machine": cpu_report(), "isa": native.isa(),
              "cpu_capability": torch.backends.cpu.get_cpu_capability(),
              "command": "python benchmarks/native_kernels.py " + " ".join(sys.argv[1:])}
    print(json.dumps(result["machine"]), result["cpu_capability"], result["isa"], flush=True)
    result["products"] = products(args.rows, args.repeats)
    print(json.dumps(result["products"], indent=1), flush=True)
    result["gguf_products"] = gguf_products(args.rows, args.repeats)
    print(json.dumps(result["gguf_products"], indent=1), flush=True)
    result["forwards"] = forwards(args.sizes, args.repeats, not args.no_llama)
    print(json.dumps(result["forwards"], indent=1), flush=True)
    with open(args.out + ".json", "w") as f:
        json.dump(result, f, indent=1)
    with open(args.out + ".md", "w") as f:
        f.write(markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
