"""Greedy outputs of every driver (the library alone and batched, the server's two endpoints, the
batch job's two line formats) on the default pair in float32, checked against a set recorded
before the request path was rebuilt: refactors must not change a token.

`SPECDECODE_RECORD=1 python -m pytest -q -m slow tests/test_greedy_record.py` writes the set again
(only when a change of output is intended, and say why in the commit)."""

import json
import os
from pathlib import Path

import pytest

RECORD = Path(__file__).parent / "data" / "greedy_default_pair.json"
PROMPTS = ["Write a Python function that reverses a string.",
           "def fibonacci(n):",
           "Explain what a KV cache is in one sentence.",
           "List three prime numbers greater than 100."]
NEW_TOKENS = 32

pytestmark = [pytest.mark.slow, pytest.mark.real_model]


def outputs(tmp_path) -> dict:
    """{path name: [[token ids, text] per prompt]} for every driver."""
    from fastapi.testclient import TestClient

    from specdecode import SamplingParams, SpeculativeDecoder
    from specdecode.scale.batch import run_batch
    from specdecode.scale.rows import RowDefaults
    from specdecode.serve.app import create_app

    greedy = SamplingParams(temperature=0)
    decoder = SpeculativeDecoder(dtype="float32", guard=False)
    out = {"generate_chat": [], "generate_raw_batch": []}
    for prompt in PROMPTS:
        result = decoder.generate(prompt, max_new_tokens=NEW_TOKENS, sampling=greedy)
        out["generate_chat"].append([result.token_ids, result.text])
    for result in decoder.generate(PROMPTS, chat=False, max_new_tokens=NEW_TOKENS, sampling=greedy):
        out["generate_raw_batch"].append([result.token_ids, result.text])

    source = tmp_path / "in.jsonl"
    source.write_text("".join(json.dumps({"id": i, "prompt": p} if i % 2 else
                                         {"id": i, "messages": [{"role": "user", "content": p}]}) + "\n"
                              for i, p in enumerate(PROMPTS)))
    run_batch(decoder, str(source), str(tmp_path / "out.jsonl"), RowDefaults(max_tokens=NEW_TOKENS, temperature=0))
    records = sorted((json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()),
                     key=lambda r: r["id"])
    out["batch_job"] = [r["text"] for r in records]

    app = create_app(decoder, model_name="m")
    out["server_chat"], out["server_completions"] = [], []
    with TestClient(app, base_url="http://127.0.0.1:8000") as client:
        for prompt in PROMPTS:
            body = {"model": "m", "max_tokens": NEW_TOKENS, "temperature": 0}
            chat = client.post("/v1/chat/completions", json=body | {"messages": [{"role": "user", "content": prompt}]})
            out["server_chat"].append(chat.json()["choices"][0]["message"]["content"])
            raw = client.post("/v1/completions", json=body | {"prompt": prompt})
            out["server_completions"].append(raw.json()["choices"][0]["text"])
    return out


def test_greedy_outputs_unchanged(tmp_path):
    got = outputs(tmp_path)
    if os.environ.get("SPECDECODE_RECORD") == "1":
        RECORD.parent.mkdir(exist_ok=True)
        RECORD.write_text(json.dumps(got, indent=1, ensure_ascii=False) + "\n")
    want = json.loads(RECORD.read_text())
    assert got == want
    # the drivers agree with each other where their requests are the same
    assert [t for _, t in got["generate_chat"]] == got["server_chat"]
    assert [t for _, t in got["generate_raw_batch"]] == got["server_completions"]
