"""Per-token cost of a grammar engine's token mask with the default pair's tokenizer.

Walks a fixed JSON document (tokenized by the Qwen tokenizer) through a JSON-schema matcher of
xgrammar and of llguidance, filling the next-token mask before every token, and prints the mean
and median mask time per token, the compile time and whether the engines agree on every mask.

    python benchmarks/grammar_mask_cost.py [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string"}, "age": {"type": "integer"},
    "tags": {"type": "array", "items": {"type": "string"}},
    "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
                "required": ["city", "zip"]}},
    "required": ["name", "age", "tags", "address"]}
DOC = {"name": "Ada Lovelace", "age": 36, "tags": ["math", "engines", "poetry", "notes"],
       "address": {"city": "London", "zip": "W1"}}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    from transformers import AutoTokenizer

    from specdecode.models import zoo

    # the default target's tokenizer, from the warm cache (no model load)
    tokenizer = AutoTokenizer.from_pretrained(zoo.weights_cache(zoo.DEFAULT_TARGET, torch.bfloat16))
    vocab = 151936
    text = json.dumps(DOC)
    ids = tokenizer.encode(text, add_special_tokens=False)
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    masks = {}
    for name, make in (("xgrammar", _xgrammar), ("llguidance", _llguidance)):
        start = time.perf_counter()
        fresh, fill, consume = make(tokenizer, vocab, eos)
        compile_s = time.perf_counter() - start
        times, rows = [], []
        for _ in range(args.repeats):
            state = fresh()
            rows = []
            for token in ids + [eos]:
                t0 = time.perf_counter()
                row = fill(state)
                times.append(time.perf_counter() - t0)
                rows.append(row.clone())
                if not consume(state, token):
                    raise SystemExit(f"{name} refused token {token}")
        masks[name] = torch.stack(rows)
        print(f"{name}: compile+tokenizer {compile_s * 1e3:.0f} ms, mask per token: mean "
              f"{statistics.mean(times) * 1e6:.0f} us, median {statistics.median(times) * 1e6:.0f} us "
              f"over {len(times)} masks")
    print("masks agree on", int((masks["xgrammar"] == masks["llguidance"]).all(-1).sum()), "of", len(ids) + 1, "positions")


def _xgrammar(tokenizer, vocab, eos):
    import xgrammar as xgr

    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab, stop_token_ids=[eos])
    compiled = xgr.GrammarCompiler(info).compile_json_schema(json.dumps(SCHEMA))
    bitmask = xgr.allocate_token_bitmask(1, vocab)

    def fill(matcher):
        matcher.fill_next_token_bitmask(bitmask, 0)
        return bitmask[0]

    return (lambda: xgr.GrammarMatcher(compiled, max_rollback_tokens=16)), fill, lambda m, t: m.accept_token(t)


def _llguidance(tokenizer, vocab, eos):
    import llguidance
    import llguidance.hf
    import llguidance.torch

    lltok = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab, eos_token=eos)
    grammar = llguidance.LLMatcher.grammar_from_json_schema(SCHEMA)
    bitmask = llguidance.torch.allocate_token_bitmask(1, vocab)

    def fill(matcher):
        llguidance.torch.fill_next_token_bitmask(matcher, bitmask, 0)
        return bitmask[0]

    return (lambda: llguidance.LLMatcher(lltok, grammar)), fill, lambda m, t: m.consume_token(t)


if __name__ == "__main__":
    main()
