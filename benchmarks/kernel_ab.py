"""Two or more versions of a native kernel source, built side by side and timed interleaved in one
process on the default pair's products: how a kernel change is measured before it is kept.

Each VERSION is a source file (e.g. the committed one, `git show HEAD:specdecode/native/kquants.cpp
> /tmp/old.cpp`, against the working copy), built with specdecode's own flags into its own library.
Per row count, the versions take turns over every product of one forward (best of --repeats), and
the outputs are compared (the same bits or not: a layout change may keep them, a new summation
order does not).

    python benchmarks/kernel_ab.py kquants /tmp/old.cpp specdecode/native/kquants.cpp --rows 1 5 9
    python benchmarks/kernel_ab.py bf16 /tmp/old.cpp specdecode/native/rows.cpp
    python benchmarks/kernel_ab.py int4 /tmp/old.cpp specdecode/native/rows.cpp
    python benchmarks/kernel_ab.py attention /tmp/old.cpp specdecode/native/rows.cpp --rows 1 9 840

kquants: the target's Q4_K_M file's own blocks (sd_linear_kq); bf16: the target's shapes in
bfloat16, distinct random weights (sd_linear); int4: the draft's shapes in the int4 draft layout,
random codes (sd_linear_q4); attention: the target's 28 layers of attention (12 query heads, 2
KV heads of 128) for M query rows at the end of an 800-token cache (M ≥ 800: a prompt of M tokens).
"""
import argparse
import ctypes
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from specdecode import native
from specdecode.native import build
from specdecode.tune.hardware import cpu_report

TARGET = dict(layers=28, hidden=1536, inter=8960, qkv=2048, vocab=151936)
DRAFT = dict(layers=24, hidden=896, inter=4864, qkv=1152, vocab=32768)  # the draft's head: draft_vocab_limit


def shapes(model: dict) -> list[tuple[int, int]]:
    """(outputs, inputs) of every product of one forward, the LM head last."""
    h, i = model["hidden"], model["inter"]
    return [(model["qkv"], h), (h, h), (2 * i, h), (h, i)] * model["layers"] + [(model["vocab"], h)]


def kquant_products():
    """[(inputs, call(lib, x, out))] over the Q4_K_M file's products (q|k|v, o, gate|up, down, head)."""
    from specdecode.models import zoo
    from specdecode.models.gguf_files import TensorTable

    table = TensorTable(zoo.gguf_file(zoo.DEFAULT_TARGET))
    groups = [["attn_q", "attn_k", "attn_v"], ["attn_output"], ["ffn_gate", "ffn_up"], ["ffn_down"]]
    weights = [native.KQuantWeights([(table.blocks(f"blk.{layer}.{n}.weight"), table.type_name(f"blk.{layer}.{n}.weight"))
                                     for n in names], TARGET["inter"] if names == ["ffn_down"] else TARGET["hidden"])
               for layer in range(TARGET["layers"]) for names in groups]
    weights.append(native.KQuantWeights([(table.blocks("output.weight"), table.type_name("output.weight"))],
                                        TARGET["hidden"]))

    def call(w):
        return lambda lib, x, out, threads: lib.sd_linear_kq(
            ctypes.c_void_p(x.data_ptr()), ctypes.c_int64(x.shape[0]), ctypes.c_int64(w.inputs),
            ctypes.c_int64(w.inputs), ctypes.c_int(w.parts), w._pointers, w._types, w._rows, None,
            ctypes.c_void_p(out.data_ptr()), ctypes.c_int64(w.outputs), ctypes.c_int(1), ctypes.c_int(threads))

    return [(w.inputs, w.outputs, call(w)) for w in weights]


def bf16_products():
    products = []
    for n, k in shapes(TARGET):
        w = torch.empty(n, k, dtype=torch.bfloat16).uniform_(-0.05, 0.05)
        products.append((k, n, lambda lib, x, out, threads, w=w: lib.sd_linear(
            ctypes.c_void_p(x.data_ptr()), ctypes.c_int64(x.shape[0]), ctypes.c_int64(w.shape[1]),
            ctypes.c_int64(w.shape[1]), ctypes.c_void_p(w.data_ptr()), ctypes.c_int64(w.shape[0]), None,
            ctypes.c_void_p(out.data_ptr()), ctypes.c_int64(w.shape[0]), ctypes.c_int(1), ctypes.c_int(threads))))
    return products


def int4_products():
    products = []
    for n, k in shapes(DRAFT):
        codes = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8)
        s, t = torch.rand(n, k // 32) * 0.01, torch.rand(n, k // 32) * 0.01 - 0.005
        products.append((k, n, lambda lib, x, out, threads, c=codes, s=s, t=t, n=n, k=k: lib.sd_linear_q4(
            ctypes.c_void_p(x.data_ptr()), ctypes.c_int64(x.shape[0]), ctypes.c_int64(k), ctypes.c_int64(k),
            ctypes.c_void_p(c.data_ptr()), ctypes.c_void_p(s.data_ptr()), ctypes.c_void_p(t.data_ptr()),
            ctypes.c_int64(n), None, ctypes.c_void_p(out.data_ptr()), ctypes.c_int64(n), ctypes.c_int(1),
            ctypes.c_int(threads))))
    return products


def attention_calls():
    """[(M, call(lib, out))] factory: the target's attention for M rows over max(M, 800) slots."""
    layers, heads, kv_heads, dim = TARGET["layers"], 12, 2, 128

    def calls(m):
        slots = max(m, 800)
        q = torch.randn(1, m, heads, dim).bfloat16()
        k, v = (torch.randn(1, kv_heads, slots, dim).bfloat16() for _ in range(2))
        out = torch.empty_like(q)

        def call(lib, threads):
            for _ in range(layers):
                lib.sd_attention(ctypes.c_void_p(q.data_ptr()), ctypes.c_int64(1), ctypes.c_int64(m), ctypes.c_int64(heads),
                                 ctypes.c_int64(dim), ctypes.c_void_p(k.data_ptr()), ctypes.c_void_p(v.data_ptr()),
                                 ctypes.c_int64(kv_heads), ctypes.c_int64(slots), ctypes.c_int64(k.stride(0)),
                                 ctypes.c_int64(k.stride(1)), None, ctypes.c_float(dim ** -0.5),
                                 ctypes.c_void_p(out.data_ptr()), ctypes.c_int(threads))
            return out.clone()
        return call
    return calls


def build_version(source: Path, folder: Path, index: int) -> ctypes.CDLL:
    compile_flags, link_flags = build._flags()
    library = folder / f"version{index}.so"
    subprocess.run([build._compiler(), *compile_flags, str(source), "-o", str(library), *link_flags], check=True)
    return ctypes.CDLL(str(library))


def report(m: int, versions: list, best: list, same: bool) -> None:
    print(f"M={m}: " + ", ".join(f"{source} {1e3 * t:.1f} ms" for source, t in zip(versions, best))
          + f"; the same bits: {same}", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("kernel", choices=["kquants", "bf16", "int4", "attention"])
    parser.add_argument("versions", nargs="+", type=Path, help="kernel source files (two or more)")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 5, 9])
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    print(cpu_report(), torch.backends.cpu.get_cpu_capability(), flush=True)
    threads = torch.get_num_threads()
    with tempfile.TemporaryDirectory() as folder:
        libraries = [build_version(source, Path(folder), i) for i, source in enumerate(args.versions)]
        if args.kernel == "attention":
            calls = attention_calls()
            for m in args.rows:
                call, best, outputs = calls(m), [float("inf")] * len(libraries), [None] * len(libraries)
                for _ in range(args.repeats):
                    for v, library in enumerate(libraries):
                        start = time.perf_counter()
                        outputs[v] = call(library, threads)
                        best[v] = min(best[v], time.perf_counter() - start)
                report(m, args.versions, best, all(torch.equal(outputs[0], o) for o in outputs[1:]))
            return 0
        products = {"kquants": kquant_products, "bf16": bf16_products, "int4": int4_products}[args.kernel]()
        for m in args.rows:
            inputs = {k: torch.randn(m, k).bfloat16() for k in {k for k, _, _ in products}}
            outputs = [[torch.empty(m, n) for _, n, _ in products] for _ in libraries]
            best = [float("inf")] * len(libraries)
            for _ in range(args.repeats):
                for v, library in enumerate(libraries):
                    start = time.perf_counter()
                    for (k, _, call), out in zip(products, outputs[v]):
                        call(library, inputs[k], out, threads)
                    best[v] = min(best[v], time.perf_counter() - start)
            report(m, args.versions, best, all(torch.equal(a, b) for other in outputs[1:] for a, b in zip(outputs[0], other)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
