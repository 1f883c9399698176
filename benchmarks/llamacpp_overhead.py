"""The engine's own cost per step on a llama.cpp target: dtype="gguf", plain decoding (no draft,
no free drafts, no guard) against llama.cpp's plain loop on the same Q4_K_M file, in one process,
with torch's intra-op threads at 2, 1 and 2 again (torch's OpenMP pool and llama.cpp's share the
cores between steps). Greedy, 40 tokens, 3 runs each, medians (prompt read included on both sides).

    python benchmarks/llamacpp_overhead.py
"""

import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from llamacpp_backend import RawLlama  # noqa: E402

from specdecode import SamplingParams, SpeculativeDecoder  # noqa: E402
from specdecode.models import llamacpp, zoo  # noqa: E402
from specdecode.models.repack_probe import repack_works  # noqa: E402
from specdecode.tune.hardware import cpu_report, describe  # noqa: E402

NEW_TOKENS = 40


def main() -> None:
    print(describe(cpu_report()), "|", llamacpp.system_info())
    source = zoo.gguf_file(zoo.DEFAULT_TARGET)
    decoder = SpeculativeDecoder("default", None, dtype="gguf", free_drafts="off", guard=False)
    ids = decoder.requests.encode("Write a short story about a lighthouse keeper who finds a message in a bottle. " * 3,
                         chat=False)
    raw = RawLlama(source, 4096, torch.get_num_threads(), repack=repack_works(source))
    greedy = SamplingParams(temperature=0, ignore_eos=True)
    for threads in (2, 1, 2):
        torch.set_num_threads(threads)
        ours, theirs = [], []
        for _ in range(3):
            ours.append(decoder.generate(ids, max_new_tokens=NEW_TOKENS, sampling=greedy).stats.wall_time_s)
            theirs.append(raw.greedy(ids, NEW_TOKENS)[2])
        print(f"torch threads {threads}: specdecode {1e3 * statistics.median(ours) / NEW_TOKENS:.1f} ms/token, "
              f"llama.cpp {1e3 * statistics.median(theirs) / NEW_TOKENS:.1f} ms/token, "
              f"ratio {statistics.median(theirs) / statistics.median(ours):.3f}", flush=True)


if __name__ == "__main__":
    main()
