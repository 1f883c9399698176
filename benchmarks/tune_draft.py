"""Which draft quantization (int8 or int4), confidence stop and γ schedule pay: our variants
against transformers assisted generation (heuristic schedule, given our int8 and int4 drafts),
interleaved in one process, on HumanEval prompts 20-24 (held out from the 20 prompts of
docs/results/bench_code_t0). Prompt lookup is on throughout (it won with and without the adaptive
schedule in docs/results/tune_schedule).

    python benchmarks/tune_draft.py   # writes docs/results/tune_draft.{md,json}; ~25 min on 2 cores
"""

import copy
import dataclasses

from specdecode import SamplingParams, SpeculativeDecoder
from specdecode.measure.bench import (
    BASELINE,
    NoEOS,
    _hf_runner,
    _our_runner,
    run_configs,
    summarize,
)
from specdecode.measure.data import load_prompts
from specdecode.models import HFCausalLM
from specdecode.models.quant import prepare_draft
from specdecode.proposers import DraftModelProposer, FallbackProposer, PromptLookupProposer
from specdecode.measure.report import environment, fmt, markdown_table, write
from specdecode.tune.timing import measure_costs

NEW_TOKENS = 128
decoder = SpeculativeDecoder(quantize_draft="none", guard=False)  # float draft; quantized copies below
greedy = SamplingParams(temperature=0)
eos = decoder.eos_token_ids
target = NoEOS(decoder.target.backend, eos)
model, pad = decoder.target.backend.model, decoder.tokenizer.eos_token_id
float_draft = decoder.draft.backend.model
limit = decoder.draft.backend.vocab_size
drafts = {f"int{bits}": prepare_draft(copy.deepcopy(float_draft), bits) for bits in (8, 4)}  # as the decoder does
backends = {kind: NoEOS(HFCausalLM(m, vocab_limit=limit), eos) for kind, m in drafts.items()}
# the guard's (c, slope) per draft and γ, as SpeculativeDecoder measures them at load
costs = {kind: measure_costs(decoder.target.backend, b.backend, list(range(100, 164)), [9, 17], repeats=3)
         for kind, b in backends.items()}
prompts = [("code", decoder.requests.encode(p.text, chat=False)) for p in load_prompts("code", 25)[20:]]


def ours(kind, gamma, schedule, confidence):
    def make():
        return FallbackProposer(PromptLookupProposer(target.vocab_size), DraftModelProposer(backends[kind], confidence))
    guard_costs = costs[kind]["c"], max(costs[kind]["r"][gamma + 1] - 1, 0) / gamma
    return _our_runner(target, make, gamma, NEW_TOKENS, greedy, guard_costs, gamma_schedule=schedule)


configs = {BASELINE: _hf_runner(model, NEW_TOKENS, greedy, pad, eos)}
for kind in drafts:
    for gamma, schedule in ((8, "fixed"), (16, "adaptive")):
        for confidence in (0.4, 0.2):
            configs[f"specdecode {kind}, γ≤{gamma} {schedule}, confidence {confidence}"] = \
                ours(kind, gamma, schedule, confidence)
    configs[f"transformers assisted, heuristic, our {kind} draft"] = _hf_runner(
        model, NEW_TOKENS, greedy, pad, eos, drafts[kind], "heuristic", 4)
timings = run_configs(configs, prompts, repeats=1, progress=lambda d, t, m: print(f"[{d}/{t}] {m}", flush=True))
rows = summarize(timings, {"r": {}}, ["code"])
meta = environment(prompts="HumanEval 20-24", new_tokens=NEW_TOKENS, repeats=1, dtype="bfloat16", temperature=0)
meta["command"] = "python benchmarks/tune_draft.py"
meta.update({f"c {kind}": f"{cost['c']:.3f}" for kind, cost in costs.items()})
body = markdown_table(["configuration", "tokens/s", "speedup", "α̂", "tokens/call", "draft share"],
                      [[r["config"], fmt(r["tokens_per_s"]["all"]), f"{r['speedup']['all']:.2f}x", fmt(r.get("alpha_hat")),
                        fmt(r.get("tokens_per_call")),
                        f"{r['draft_share_of_time']:.0%}" if "draft_share_of_time" in r else "–"] for r in rows])
write("docs/results/tune_draft", "Draft quantization, confidence stop and γ schedule (held-out HumanEval prompts)",
      meta, body, {"rows": [dataclasses.asdict(r) if dataclasses.is_dataclass(r) else r for r in rows]})
print("\n".join(body))
