"""Load on `specdecode serve`: N concurrent streaming clients on 127.0.0.1, speculative against
`--draft none`, the same prompts, one server at a time.

For each concurrency c, c client threads each send `--requests-per-client` streaming completions
(HumanEval prompts, raw, greedy, `--max-tokens` tokens) one after another. Measured on the client
side: total tokens/s (all tokens received / wall time of the level), time to first token and
inter-token latency (gap between SSE chunks, per token) p50 and p99. Bounded: every request has a
timeout, the number of requests is fixed, and the servers are stopped at the end.

    python benchmarks/serve_load.py --out docs/results/serve_load
"""

import argparse
import concurrent.futures
import json
import signal
import socket
import statistics
import subprocess
import sys
import time

import httpx

from specdecode.measure.data import humaneval_prompts
from specdecode.measure.report import environment, fmt, markdown_table, write


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(extra: list[str], max_batch_size: int) -> tuple[subprocess.Popen, str]:
    port = free_port()
    process = subprocess.Popen([sys.executable, "-m", "specdecode.cli", "serve", "--port", str(port), "--quiet",
                                "--max-batch-size", str(max_batch_size), "--served-model-name", "m", *extra])
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"server exited {process.returncode}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return process, url
        except httpx.HTTPError:
            time.sleep(1)
    process.kill()
    raise RuntimeError("server did not start")


def one_request(url: str, prompt: str, max_tokens: int) -> dict:
    body = {"model": "m", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    start = time.perf_counter()
    arrivals, tokens, spec = [], 0, None
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=600) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(f"the server failed a request: {chunk['error']['message']}")
            n = len(chunk.get("tokens", []))
            if n:
                arrivals.append((time.perf_counter(), n))
                tokens += n
            spec = chunk.get("speculation", spec)
    ttft = arrivals[0][0] - start if arrivals else None
    gaps = [(t - s) / n for (s, _), (t, n) in zip(arrivals, arrivals[1:]) for _ in range(n)]
    return {"tokens": tokens, "ttft": ttft, "gaps": gaps, "speculation": spec}


def level(url: str, prompts: list[str], concurrency: int, per_client: int, max_tokens: int) -> dict:
    jobs = [[prompts[(c * per_client + i) % len(prompts)] for i in range(per_client)] for c in range(concurrency)]

    def client(my_prompts):
        return [one_request(url, p, max_tokens) for p in my_prompts]

    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
        results = [r for rs in pool.map(client, jobs) for r in rs]
    wall = time.perf_counter() - start
    ttfts = sorted(r["ttft"] for r in results if r["ttft"] is not None)
    gaps = sorted(g for r in results for g in r["gaps"])

    def pct(values, q):
        return values[min(len(values) - 1, int(q * len(values)))] if values else None

    tokens = sum(r["tokens"] for r in results)
    return {"concurrency": concurrency, "requests": len(results), "tokens": tokens, "wall_s": wall,
            "tokens_per_s": tokens / wall, "ttft_p50": statistics.median(ttfts), "ttft_p99": pct(ttfts, 0.99),
            "itl_p50": pct(gaps, 0.5), "itl_p99": pct(gaps, 0.99),
            "mean_tokens_per_call": statistics.mean(r["speculation"]["mean_tokens_per_call"] for r in results)}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--requests-per-client", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--llama-cpp", action="store_true",
                        help="a third server: the target's bfloat16 weights on llama.cpp, plain (the CPU baseline)")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    prompts = [p["prompt"] for p in humaneval_prompts(args.prompts)]
    max_batch = max(args.concurrency)
    runs, configurations = {}, {}
    servers = (("speculative (defaults)", []), ("--draft none", ["--draft", "none"]),
               ("llama.cpp BF16 plain", ["--backend", "llama.cpp", "--draft", "none", "--free-drafts", "off"]))
    for name, extra in servers[:None if args.llama_cpp else 2]:
        process, url = start(extra, max_batch)
        try:
            one_request(url, prompts[0], 8)  # warm-up
            configurations[name] = httpx.get(url + "/v1/models", timeout=30).json()["data"][0].get("specdecode")
            runs[name] = [level(url, prompts, c, args.requests_per_client, args.max_tokens) for c in args.concurrency]
            for row in runs[name]:
                print(name, json.dumps(row), flush=True)
        finally:
            process.send_signal(signal.SIGTERM)
            process.wait(timeout=120)
    plain, llama = runs["--draft none"], runs.get("llama.cpp BF16 plain")
    rows = []
    for i, p in enumerate(plain):
        for name in runs:
            r = runs[name][i]
            rows.append([r["concurrency"], name, fmt(r["tokens_per_s"]), f"{fmt(r['tokens_per_s'] / p['tokens_per_s'])}x",
                         f"{fmt(r['tokens_per_s'] / llama[i]['tokens_per_s'])}x" if llama else "",
                         fmt(r["ttft_p50"]), fmt(r["ttft_p99"]), fmt(1000 * r["itl_p50"], 0), fmt(1000 * r["itl_p99"], 0),
                         fmt(r["mean_tokens_per_call"])])
    body = [f"{args.requests_per_client} streaming requests per client, one after another; HumanEval prompts "
            f"(raw completions), greedy, max_tokens {args.max_tokens}; the default pair as `specdecode serve` "
            "loads it (dtype auto: its configuration is in the JSON); "
            f"--max-batch-size {max_batch}. Client-side times.", ""]
    body += markdown_table(["concurrency", "server", "tokens/s (all clients)", "vs --draft none",
                            "vs llama.cpp BF16 plain", "TTFT p50 (s)",
                            "TTFT p99 (s)", "ITL p50 (ms)", "ITL p99 (ms)", "tokens per target call"], rows)
    meta = environment(target="qwen2.5-coder-1.5b-instruct", draft="qwen2.5-coder-0.5b-instruct", dtype="auto")
    meta["command"] = "python benchmarks/serve_load.py " + " ".join(sys.argv[1:])
    write(args.out, "specdecode serve under load", meta, body, {"runs": runs, "configurations": configurations})
    print("\n".join(body))


if __name__ == "__main__":
    main()
