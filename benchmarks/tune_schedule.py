"""Which γ schedule and whether prompt lookup pays with the int8 draft: our variants against
transformers assisted generation (heuristic schedule, given our int8 draft), interleaved in one
process, on HumanEval prompts 20-24 (held out from the 20 prompts of docs/results/bench_code_t0).

    python benchmarks/tune_schedule.py   # writes docs/results/tune_schedule.{md,json}
"""

import dataclasses

from specdecode import SamplingParams, SpeculativeDecoder
from specdecode.measure.bench import BASELINE, NoEOS, _hf_runner, _our_runner, run_configs, summarize
from specdecode.measure.data import load_prompts
from specdecode.proposers import DraftModelProposer, FallbackProposer, PromptLookupProposer
from specdecode.measure.report import environment, fmt, markdown_table, write

NEW_TOKENS = 128
decoder = SpeculativeDecoder(quantize_draft="int8")  # draft vocab 32768, guard costs measured at load
greedy = SamplingParams(temperature=0)
eos = decoder.eos_token_ids
target, draft = NoEOS(decoder.target.backend, eos), NoEOS(decoder.draft.backend, eos)
model, pad = decoder.target.backend.model, decoder.tokenizer.eos_token_id
prompts = [("code", decoder.requests.encode(p.text, chat=False)) for p in load_prompts("code", 25)[20:]]


def ours(gamma, schedule, lookup):
    def make():
        proposer = DraftModelProposer(draft, 0.4)
        return FallbackProposer(PromptLookupProposer(target.vocab_size), proposer) if lookup else proposer
    return _our_runner(target, make, gamma, NEW_TOKENS, greedy, decoder.guard_costs, gamma_schedule=schedule)


configs = {BASELINE: _hf_runner(model, NEW_TOKENS, greedy, pad, eos)}
for gamma, schedule in ((8, "fixed"), (16, "adaptive")):
    for lookup in (True, False):
        configs[f"specdecode γ≤{gamma} {schedule}, confidence 0.4, lookup {'on' if lookup else 'off'}"] = \
            ours(gamma, schedule, lookup)
configs["transformers assisted, heuristic, ours draft"] = _hf_runner(
    model, NEW_TOKENS, greedy, pad, eos, decoder.draft.backend.model, "heuristic", 4)
timings = run_configs(configs, prompts, repeats=1, progress=lambda d, t, m: print(f"[{d}/{t}] {m}", flush=True))
rows = summarize(timings, {"r": {}}, ["code"])
meta = environment(prompts="HumanEval 20-24", new_tokens=NEW_TOKENS, repeats=1, dtype="bfloat16", temperature=0)
meta["command"] = "python benchmarks/tune_schedule.py"
body = markdown_table(["configuration", "tokens/s", "speedup", "α̂", "tokens/call", "draft share"],
                      [[r["config"], fmt(r["tokens_per_s"]["all"]), f"{r['speedup']['all']:.2f}x", fmt(r.get("alpha_hat")),
                        fmt(r.get("tokens_per_call")),
                        f"{r['draft_share_of_time']:.0%}" if "draft_share_of_time" in r else "–"] for r in rows])
write("docs/results/tune_schedule", "γ schedule and prompt lookup with the int8 draft", meta, body,
      {"rows": [dataclasses.asdict(r) if dataclasses.is_dataclass(r) else r for r in rows]})
print("\n".join(body))
