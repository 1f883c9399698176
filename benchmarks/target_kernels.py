"""Whole-target forward costs per kernel choice on this machine: the one-token step, r(k) for a
k-token call and the prompt read per token, for bfloat16, float32 (torch's default BLAS) and
float32 with oneDNN-packed weights (specdecode.models.packed). Medians of rounds that time every
kind in turn, in one process.

    python benchmarks/target_kernels.py [--out docs/results/target_kernels_NAME.json]
Emulating an AVX2-only CPU on an AVX-512 one:
    ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2
"""
import argparse
import copy
import json
import sys
import time

import torch

from specdecode.tune.hardware import cpu_report
from specdecode.tune.timing import time_interleaved
from specdecode.models import HFCausalLM, zoo
from specdecode.models.packed import pack_linears

parser = argparse.ArgumentParser()
parser.add_argument("--model", default=zoo.DEFAULT_TARGET)
parser.add_argument("--sizes", type=int, nargs="+", default=[1, 2, 5, 9, 17, 128])
parser.add_argument("--repeats", type=int, default=5)
parser.add_argument("--out")
args = parser.parse_args()
report = cpu_report()
print(json.dumps(report))
context = [i % 30000 + 100 for i in range(64)]
bf16, _ = zoo.load_zoo_model(args.model, torch.bfloat16)
fp32, _ = zoo.load_zoo_model(args.model, torch.float32)
packed = copy.deepcopy(fp32)
pack_linears(packed)
kinds = {"bfloat16": bf16, "float32": fp32, "float32-packed": packed}
with torch.inference_mode():
    times = time_interleaved({name: HFCausalLM(model) for name, model in kinds.items()}, context,
                             {name: args.sizes for name in kinds}, repeats=args.repeats)
rows = {}
for name, t in times.items():
    rows[name] = {"step_ms": 1e3 * t[1], "r": {k: t[k] / t[1] for k in args.sizes},
                  "read_ms_per_token": 1e3 * t[max(args.sizes)] / max(args.sizes)}
    print(name, f"step {rows[name]['step_ms']:.0f} ms", " ".join(f"r({k})={v:.2f}" for k, v in rows[name]["r"].items()),
          f"read {rows[name]['read_ms_per_token']:.1f} ms/token", flush=True)
if args.out:
    with open(args.out, "w") as f:
        json.dump({"date": time.strftime("%Y-%m-%d %H:%M"), "model": args.model, "machine": report,
                   "command": "python benchmarks/target_kernels.py " + " ".join(sys.argv[1:]), "kinds": rows},
                  f, indent=1)
