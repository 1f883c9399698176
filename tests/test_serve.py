"""`specdecode serve`, started the way users start it (a subprocess on 127.0.0.1), driven with the
official `openai` client and raw HTTP: OpenAI wire format, continuous batching, streaming, errors,
metrics, shutdown. Tiny float32 models, so speculative greedy equals plain greedy token for token."""

import concurrent.futures
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections import Counter

import httpx
import pytest
import torch

from helpers import (UniformQFreeDrafts, greedy_continuation, model_sequence_probs, pooled_chi2_pvalue,
                     tiny_llama)

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")

CHAT_TEMPLATE = ("{% for m in messages %}{{ m['content'] }}.{% endfor %}"
                 "{% if add_generation_prompt %} {% endif %}")
PROMPTS = ["abc", "hhh a", "the cafe", "bad bed", "ace", "dead beef", "gag", "fade"]
STARTUP_S = 120


@pytest.fixture(scope="module")
def chat_model_dirs(tmp_path_factory, char_tokenizer):
    """A tiny target and a draft close to it (the target plus noise), with a chat template."""
    root = tmp_path_factory.mktemp("serve_models")
    tokenizer = char_tokenizer.__class__(tokenizer_object=char_tokenizer.backend_tokenizer, eos_token="<eos>",
                                         pad_token="<pad>", unk_token="<unk>", bos_token="<bos>")
    tokenizer.chat_template = CHAT_TEMPLATE
    target = tiny_llama(0, layers=2, vocab=len(tokenizer))
    draft = tiny_llama(0, layers=2, vocab=len(tokenizer))
    with torch.no_grad():
        for param in draft.parameters():
            param.add_(0.01 * torch.randn_like(param))
        for model in (target, draft):  # EOS scores 0, below the top of 13 random logits: long greedy outputs
            model.lm_head.weight[tokenizer.eos_token_id] = 0
    dirs = {}
    for name, model in (("target", target), ("draft", draft)):
        model.save_pretrained(root / name)
        tokenizer.save_pretrained(root / name)
        dirs[name] = str(root / name)
    return dirs


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """`specdecode serve ...` in a subprocess; stop() sends SIGTERM and returns the exit status."""

    def __init__(self, dirs, *extra):
        """dirs: {"target", "draft"} model folders, or None for the default pair."""
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        models = [] if dirs is None else ["--target", dirs["target"]]
        if dirs is not None and "--draft" not in extra:
            models += ["--draft", dirs["draft"]]
        self.process = subprocess.Popen(
            [sys.executable, "-m", "specdecode.cli", "serve", *models, "--dtype", "float32",
             "--port", str(self.port), "--served-model-name", "tiny", "--quiet", "--no-guard", *extra],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + STARTUP_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"server exited {self.process.returncode}: {self.process.stderr.read()}")
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                time.sleep(0.2)
        self.process.kill()
        raise RuntimeError("server did not start")

    def client(self, **kw):
        return openai.OpenAI(base_url=self.url + "/v1", api_key=kw.pop("api_key", "none"), max_retries=0,
                             timeout=kw.pop("timeout", 120), **kw)

    def stop(self) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.process.kill()
            return -9


@pytest.fixture(scope="module")
def server(chat_model_dirs):
    s = Server(chat_model_dirs, "--max-batch-size", "4", "--max-queue", "16", "-k", "4")
    yield s
    assert s.stop() == 0


@pytest.fixture(scope="module")
def plain_server(chat_model_dirs):
    s = Server(chat_model_dirs, "--draft", "none")
    yield s
    assert s.stop() == 0


def complete(server, prompt, **kw):
    args = dict(model="tiny", prompt=prompt, max_tokens=24, temperature=0)
    args.update(kw)
    return server.client().completions.create(**args)


def chat(server, content, **kw):
    args = dict(model="tiny", messages=[{"role": "system", "content": "be brief"}, {"role": "user", "content": content}],
                max_tokens=24, temperature=0)
    args.update(kw)
    return server.client().chat.completions.create(**args)


def metric(server, name: str) -> float:
    """Sum of a metric's samples (all labels) in /metrics."""
    text = httpx.get(server.url + "/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name) and not line.startswith("#") and line[len(name)] in " {")


def test_models_lists_the_served_model(server):
    models = server.client().models.list()
    assert [m.id for m in models.data] == ["tiny"]
    configuration = models.data[0].to_dict()["specdecode"]  # what runs, on which CPU class
    assert configuration["dtype"] == "float32" and configuration["machine"]["capability"]


def test_speculative_greedy_equals_plain_greedy_for_completions_and_chat(server, plain_server):
    for prompt in PROMPTS[:3]:
        spec, plain = complete(server, prompt), complete(plain_server, prompt)
        assert spec.choices[0].text == plain.choices[0].text
        assert spec.usage.completion_tokens == plain.usage.completion_tokens > 0
        assert spec.choices[0].finish_reason in ("stop", "length")
        spec_extra, plain_extra = spec.model_extra["speculation"], plain.model_extra["speculation"]
        assert spec_extra["num_drafted"] > 0 and plain_extra["num_drafted"] == 0
        assert spec_extra["num_target_calls"] < plain_extra["num_target_calls"]
    spec_chat = chat(server, "abc", max_completion_tokens=20)
    plain_chat = chat(plain_server, "abc", max_completion_tokens=20)
    assert spec_chat.choices[0].message.content == plain_chat.choices[0].message.content
    assert spec_chat.choices[0].message.role == "assistant"
    assert spec_chat.usage.prompt_tokens == plain_chat.usage.prompt_tokens > 3  # system + user through the template


def test_token_id_prompts_and_stop_strings(server):
    ids = complete(server, [5, 6, 7], max_tokens=12)
    assert ids.usage.prompt_tokens == 3 and ids.usage.completion_tokens == 12
    full = complete(server, "abc", max_tokens=24).choices[0].text
    stop = next(c for c in full[1:] if c != " ")
    cut = complete(server, "abc", max_tokens=24, stop=[stop, "zz"])
    assert cut.choices[0].text == full[:full.index(stop)] and cut.choices[0].finish_reason == "stop"


def test_streamed_text_equals_the_non_streamed_text(server):
    whole = complete(server, "the cafe", max_tokens=20)
    chunks = list(complete(server, "the cafe", max_tokens=20, stream=True,
                           stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole.choices[0].text
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens and not chunks[-1].choices
    last = [c for c in chunks if c.choices][-1]
    assert last.choices[0].finish_reason == whole.choices[0].finish_reason
    assert last.model_extra["speculation"]["num_target_calls"] == whole.model_extra["speculation"]["num_target_calls"]
    origins = {t["origin"] for c in chunks for t in (c.model_extra or {}).get("tokens", [])}
    assert origins and origins <= {"accepted", "corrected", "bonus", "target"}

    whole_chat = chat(server, "fade")
    deltas = list(chat(server, "fade", stream=True))
    assert deltas[0].choices[0].delta.role == "assistant"
    assert "".join(d.choices[0].delta.content or "" for d in deltas) == whole_chat.choices[0].message.content


def test_raw_stream_is_server_sent_events_ending_with_done(server):
    body = {"model": "tiny", "prompt": "ace", "max_tokens": 6, "temperature": 0, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        frames = [line for line in response.iter_lines() if line]
    assert all(f.startswith("data: ") for f in frames) and frames[-1] == "data: [DONE]"
    assert json.loads(frames[-2][6:])["choices"][0]["finish_reason"] == "length"


def test_sixteen_concurrent_requests_each_equal_their_solo_result(server):
    prompts = (PROMPTS * 2)[:16]
    kwargs = [dict(max_tokens=16 + i % 5) for i in range(16)]
    kwargs[3] = dict(max_tokens=16, temperature=0.9, seed=7)  # seeded sampling: same alone and in a batch
    solo = [complete(server, p, **kw).choices[0].text for p, kw in zip(prompts, kwargs)]
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        together = list(pool.map(lambda a: complete(server, a[0], **a[1]).choices[0].text, zip(prompts, kwargs)))
    assert together == solo
    assert metric(server, "specdecode:spec_decode_num_accepted_tokens_total") > 0


@pytest.mark.parametrize("body, status, param", [
    ({"prompt": "abc", "temperature": -1}, 400, "temperature"),
    ({"prompt": "abc", "temperature": "hot"}, 400, "temperature"),
    ({"prompt": "abc", "max_tokens": 0}, 400, "max_tokens"),
    ({"prompt": "abc", "max_tokens": 254}, 400, "max_tokens"),     # 3 + 254 > the 256-token context
    ({"prompt": "abc", "top_p": 0}, 400, "top_p"),
    ({"prompt": "abc", "n": 17}, 400, "n"),
    ({"prompt": "abc", "n": 2, "best_of": 3}, 400, "best_of"),
    ({"prompt": "abc", "logit_bias": {"a": 1}}, 400, "logit_bias"),
    ({"prompt": "abc", "logit_bias": {"5": 101}}, 400, "logit_bias"),
    ({"prompt": "abc", "logit_bias": {"05": 1}}, 400, "logit_bias"),
    ({"prompt": "abc", "logit_bias": {"5": "1"}}, 400, "logit_bias"),             # not logit_bias.5
    ({"prompt": "abc", "logit_bias": {"999999": 1}}, 400, "logit_bias"),
    ({"prompt": "abc", "min_tokens": 30, "max_tokens": 20}, 400, "min_tokens"),
    ({"prompt": "abc", "ignore_eos": "yes"}, 400, "ignore_eos"),
    ({"prompt": "abc", "logprobs": 21}, 400, "logprobs"),
    ({"prompt": "abc", "presence_penalty": 2.5}, 400, "presence_penalty"),
    ({"prompt": "abc", "frequency_penalty": -3}, 400, "frequency_penalty"),
    ({"prompt": "abc", "repetition_penalty": 0}, 400, "repetition_penalty"),
    ({"prompt": "abc", "repetition_penalty": 1e-37}, 400, "repetition_penalty"),  # logit / it: +inf in float32
    ({"prompt": "abc", "grammar": "regex:[^\\s\\S]"}, 400, "grammar"),          # no token can start it
    ({"prompt": "abc", "grammar": "regex:a", "min_tokens": 3, "max_tokens": 5}, 400, "min_tokens"),
    ({"prompt": "abc", "response_format": {"type": "xml"}}, 400, "response_format"),
    ({"prompt": "abc", "response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "nope"}}}},
     400, "response_format"),
    ({"prompt": "abc", "grammar": "root ::= ("}, 400, "grammar"),
    ({"prompt": "abc", "stop": ["", "x"]}, 400, "stop"),
    ({"prompt": "abc", "num_speculative_tokens": -1}, 400, "num_speculative_tokens"),
    ({"prompt": ""}, 400, "prompt"),
    ({"prompt": [5, 999999]}, 400, "prompt"),
    ({"prompt": ["abc", ""]}, 400, "prompt.1"),
    ({"prompt": []}, 400, "prompt"),
    ({"prompt": ["abc"] * 20, "n": 16}, 400, "prompt"),
    ({}, 400, "prompt"),
    ({"prompt": "abc", "model": "gpt-4"}, 404, "model"),
])
def test_bad_requests_get_one_clear_error_naming_the_field(server, body, status, param):
    response = httpx.post(server.url + "/v1/completions", json={"model": "tiny", **body}, timeout=30)
    assert response.status_code == status
    error = response.json()["error"]
    assert error["param"] == param and error["message"] and error["type"]


@pytest.mark.parametrize("value", ["NaN", "Infinity", "-Infinity"])
def test_a_number_that_is_not_finite_is_called_so(server, value):
    response = httpx.post(server.url + "/v1/completions", timeout=30, headers={"content-type": "application/json"},
                          content=f'{{"model": "tiny", "prompt": "abc", "temperature": {value}}}')
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "temperature" and "finite" in error["message"], error


def test_malformed_bodies_get_400_and_the_server_still_serves(server):
    for content in (b"{not json", b"[1, 2]", "\xff".encode("latin-1")):
        response = httpx.post(server.url + "/v1/chat/completions", content=content, timeout=30,
                              headers={"content-type": "application/json"})
        assert response.status_code == 400 and response.json()["error"]["message"]
    response = httpx.post(server.url + "/v1/chat/completions", json={"model": "tiny", "messages": []}, timeout=30)
    assert response.status_code == 400 and response.json()["error"]["param"] == "messages"
    with pytest.raises(openai.BadRequestError, match="temperature"):
        complete(server, "abc", temperature=5)
    assert complete(server, "abc", max_tokens=4).usage.completion_tokens == 4


def test_a_client_that_disconnects_mid_stream_aborts_only_its_row(server):
    other_expected = complete(server, "dead beef", max_tokens=40).choices[0].text
    aborted_before = metric(server, "specdecode:requests_total")
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        other = pool.submit(lambda: complete(server, "dead beef", max_tokens=40).choices[0].text)
        body = {"model": "tiny", "prompt": "gag", "max_tokens": 200, "temperature": 0, "stream": True}
        with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as response:
            lines = response.iter_lines()
            assert next(lines).startswith("data: ")  # it is generating; now hang up
        assert other.result(timeout=120) == other_expected
    deadline = time.monotonic() + 30
    while metric(server, "specdecode:num_requests_running") > 0 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert metric(server, "specdecode:num_requests_running") == 0
    assert metric(server, "specdecode:requests_total") > aborted_before


@pytest.mark.slow
def test_a_full_queue_answers_429_with_retry_after_and_recovers(chat_model_dirs):
    server = Server(chat_model_dirs, "--max-batch-size", "1", "--max-queue", "1")
    try:
        body = {"model": "tiny", "prompt": "abc", "max_tokens": 200, "temperature": 0}
        with concurrent.futures.ThreadPoolExecutor(6) as pool:
            responses = list(pool.map(lambda _: httpx.post(server.url + "/v1/completions", json=body, timeout=120),
                                      range(6)))
        codes = sorted(r.status_code for r in responses)
        assert codes.count(200) >= 2 and 429 in codes and set(codes) <= {200, 429}
        busy = next(r for r in responses if r.status_code == 429)
        assert busy.headers["retry-after"] == "1" and busy.json()["error"]["type"] == "rate_limit_error"
        assert complete(server, "abc", max_tokens=3).usage.completion_tokens == 3
    finally:
        assert server.stop() == 0


@pytest.mark.slow
def test_api_key_is_required_when_set(chat_model_dirs):
    server = Server(chat_model_dirs, "--api-key", "s3cret", "--draft", "none")
    try:
        with pytest.raises(openai.AuthenticationError, match="API key"):
            server.client(api_key="wrong").models.list()
        assert [m.id for m in server.client(api_key="s3cret").models.list().data] == ["tiny"]
        assert httpx.get(server.url + "/health", timeout=10).status_code == 200
    finally:
        assert server.stop() == 0


@pytest.mark.slow
def test_sigterm_during_a_stream_ends_it_and_exits_zero(chat_model_dirs):
    server = Server(chat_model_dirs)
    body = {"model": "tiny", "prompt": "abc", "max_tokens": 240, "temperature": 0, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as response:
        lines = response.iter_lines()
        assert next(lines).startswith("data: ")
        server.process.send_signal(signal.SIGTERM)
        rest = list(lines)  # the stream ends (aborted or finished); it does not hang
    assert server.stop() == 0
    assert len(rest) < 240


def test_metrics_expose_speculation_counters_and_latency_histograms(server):
    complete(server, "bad bed", max_tokens=12)
    text = httpx.get(server.url + "/metrics", timeout=10).text
    for name in ("specdecode:spec_decode_num_drafts_total", "specdecode:spec_decode_num_draft_tokens_total",
                 "specdecode:spec_decode_num_accepted_tokens_total",
                 'specdecode:spec_decode_num_accepted_tokens_per_pos_total{position="0"}',
                 "specdecode:generation_tokens_total", "specdecode:num_requests_waiting",
                 "specdecode:num_requests_running", "specdecode:time_to_first_token_seconds_count",
                 "specdecode:inter_token_latency_seconds_count", 'specdecode:requests_total{status="200"}'):
        assert name in text, name
    assert metric(server, "specdecode:spec_decode_num_draft_tokens_total") >= \
        metric(server, "specdecode:spec_decode_num_accepted_tokens_total") > 0
    assert metric(server, "specdecode:time_to_first_token_seconds_count") > 0


def test_the_live_page_colours_streamed_tokens_by_origin_in_headless_chromium(server):
    webdriver = pytest.importorskip("selenium.webdriver")
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    binary = next((p for p in ("/usr/bin/chromium", "/usr/bin/chromium-browser") if os.path.exists(p)), None)
    driver_path = next((p for p in ("/usr/bin/chromedriver",) if os.path.exists(p)), None)
    if binary is None or driver_path is None:
        pytest.skip("Debian's chromium and chromium-driver are not installed (.ci/run installs them)")
    options = webdriver.ChromeOptions()
    options.binary_location = binary
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu"):
        options.add_argument(flag)
    from selenium.webdriver.chrome.service import Service

    browser = webdriver.Chrome(service=Service(driver_path), options=options)
    try:
        browser.get(server.url + "/")
        prompt = browser.find_element(By.ID, "prompt")
        prompt.clear()
        prompt.send_keys("abc")
        browser.find_element(By.ID, "max_tokens").clear()
        browser.find_element(By.ID, "max_tokens").send_keys("30")
        # every text the status line shows, in order (the prompt read is too quick to catch by polling)
        browser.execute_script(
            "window.seen = []; new MutationObserver(() => window.seen.push(document.getElementById('status')"
            ".textContent)).observe(document.getElementById('status'), {childList: true, characterData: true,"
            " subtree: true});")
        browser.find_element(By.ID, "generate").click()
        WebDriverWait(browser, 90).until(lambda b: b.find_element(By.ID, "generate").is_enabled()
                                         and b.find_elements(By.CSS_SELECTOR, "#output span"))
        spans = browser.find_elements(By.CSS_SELECTOR, "#output span")
        classes = {s.get_attribute("class") for s in spans}
        assert len(spans) == 30 and classes <= {"accepted", "corrected", "bonus", "target"}
        assert "accepted" in classes
        expected = chat(server, "abc", max_tokens=30, messages=[{"role": "user", "content": "abc"}])
        assert "".join(s.get_attribute("textContent") for s in spans) == expected.choices[0].message.content
        stats = browser.find_element(By.ID, "stats").text
        assert "acceptance rate" in stats and "–" not in browser.find_element(By.ID, "per_call").text
        assert browser.find_element(By.ID, "error").text == ""
        seen = browser.execute_script("return window.seen")
        assert seen[0] == "reading the prompt…" and seen[1] == "writing…" and seen[-1].startswith("done: 30 tokens")
        counts = [int(b.get_attribute("textContent")) for b in browser.find_elements(By.CSS_SELECTOR, "#bars b")]
        assert counts and browser.find_element(By.ID, "axis_top").text == str(max(counts))  # the bars' scale
        browser.save_screenshot(os.environ.get("SPECDECODE_PAGE_SCREENSHOT", "/tmp/specdecode_page.png"))
    finally:
        browser.quit()


# --- found by trying to break it ---------------------------------------------------------------

@pytest.mark.parametrize("content, param", [
    (b'{"model": "tiny", "prompt": "a", "x": ' + b"[" * 100000 + b"]" * 100000 + b"}", None),   # deep nesting
    (b'{"model": "tiny", "prompt": "a", "max_tokens": ' + b"1" * 5000 + b"}", None),          # 5000 digits
    ('{"model": "tiny", "prompt": "a\\ud800b"}'.encode(), "prompt"),                             # lone surrogate
    (b'{"model": "tiny", "prompt": 1}', "prompt"),
    (b'{"model": "tiny", "prompt": "a", "stop": [1]}', "stop"),
    (b'{"model": "tiny", "prompt": "a", "seed": 18446744073709551616}', "seed"),
    (b'{"model": "tiny", "prompt": "a", "temperature": "0.5"}', "temperature"),
    (b'{"model": "tiny", "prompt": "a", "top_p": true}', "top_p"),
    (b'{"model": "tiny", "prompt": "a", "logit_bias": {"5": "10"}}', "logit_bias"),
    (b'{"model": "tiny", "prompt": "a", "best_of": 2}', "best_of"),
    (b'{"model": "tiny", "prompt": "a", "logprobs": true}', "logprobs"),
    (b'{"model": "tiny", "prompt": "a", "response_format": "json"}', "response_format"),
])
def test_odd_bodies_get_a_400_naming_the_field(server, content, param):
    response = httpx.post(server.url + "/v1/completions", content=content, timeout=60,
                          headers={"content-type": "application/json"})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and (param is None or error["param"].split(".")[0] == param)


def test_nullable_fields_and_text_parts_are_accepted(server):
    body = {"model": "tiny", "max_tokens": 5, "temperature": 0, "n": None, "stream": None, "presence_penalty": None,
            "messages": [{"role": "user", "content": [{"type": "text", "text": "ab"}, {"type": "text", "text": "c"}]}]}
    response = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 200
    assert response.json()["choices"][0]["message"]["content"] == chat(server, "abc", max_tokens=5,
                                                                       messages=[{"role": "user", "content": "abc"}]
                                                                       ).choices[0].message.content


def test_a_body_over_the_limit_is_refused_with_413(server):
    response = httpx.post(server.url + "/v1/completions", timeout=60, headers={"content-type": "application/json"},
                          content=b'{"model": "tiny", "prompt": "' + b"a" * (9 << 20) + b'"}')
    assert response.status_code == 413 and "MiB" in response.json()["error"]["message"]


def test_routes_and_methods_that_do_not_exist_get_the_error_shape(server):
    assert httpx.get(server.url + "/v1/completions", timeout=10).status_code == 405
    missing = httpx.get(server.url + "/v2/nothing", timeout=10)
    assert missing.status_code == 404 and missing.json()["error"]["message"]
    assert server.client().models.retrieve("tiny").id == "tiny"
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        server.client().models.retrieve("other")


def test_a_top_p_that_rounds_to_zero_is_greedy_and_harms_no_other_row(server):
    others = ["dead beef", "fade", "ace"]
    solo = [complete(server, p, max_tokens=30).choices[0].text for p in others]
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        tiny = pool.submit(complete, server, "abc", max_tokens=30, temperature=1, top_p=1e-46)
        together = list(pool.map(lambda p: complete(server, p, max_tokens=30).choices[0].text, others))
        assert tiny.result().choices[0].text == complete(server, "abc", max_tokens=30).choices[0].text
    assert together == solo


def test_a_non_streaming_client_that_hangs_up_frees_its_row(server):
    calls_before = metric(server, "specdecode:num_target_calls_total")
    aborted_before = metric(server, 'specdecode:requests_total{status="aborted"}')
    body = json.dumps({"model": "tiny", "prompt": "a", "max_tokens": 250, "temperature": 0,
                       "num_speculative_tokens": 0}).encode()
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    deadline = time.monotonic() + 30
    while metric(server, "specdecode:num_requests_running") > 0 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert metric(server, "specdecode:num_requests_running") == 0
    assert metric(server, 'specdecode:requests_total{status="aborted"}') == aborted_before + 1
    assert metric(server, "specdecode:num_target_calls_total") - calls_before < 100  # not the whole 250 tokens


def test_streamed_chunks_carry_live_speculation_stats(server):
    chunks = list(complete(server, "hhh a", max_tokens=24, stream=True))
    live = [c.model_extra["speculation"] for c in chunks if c.choices and c.choices[0].finish_reason is None]
    assert live and all(s["mean_tokens_per_call"] > 0 for s in live)
    calls = [s["num_target_calls"] for s in live]
    assert calls == sorted(calls) and len(set(calls)) == len(calls)  # a snapshot per step, not one shared object


@pytest.mark.slow
def test_sigterm_with_queued_work_ends_every_request_cleanly(chat_model_dirs):
    server = Server(chat_model_dirs, "--max-batch-size", "1")
    body = {"model": "tiny", "prompt": "abc", "max_tokens": 250, "temperature": 0}

    def streamed():
        with httpx.stream("POST", server.url + "/v1/completions", json={**body, "stream": True}, timeout=60) as r:
            return [line for line in r.iter_lines() if line]

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        plain = [pool.submit(httpx.post, server.url + "/v1/completions", json=body, timeout=60) for _ in range(2)]
        streams = [pool.submit(streamed) for _ in range(2)]
        time.sleep(2)
        server.process.send_signal(signal.SIGTERM)
        for future in plain:
            response = future.result(timeout=60)
            assert response.status_code in (200, 503) and ("error" in response.json()) == (response.status_code == 503)
        for future in streams:
            frames = future.result(timeout=60)
            assert frames[-1] == "data: [DONE]"
    assert server.stop() == 0


# --- logprobs, penalties and grammars over the wire ------------------------------------

def test_completion_logprobs_are_the_same_with_and_without_speculation(server, plain_server):
    spec, plain = complete(server, "abc", logprobs=3), complete(plain_server, "abc", logprobs=3)
    lp, plain_lp = spec.choices[0].logprobs, plain.choices[0].logprobs
    text = spec.choices[0].text
    assert text == plain.choices[0].text and lp.tokens == plain_lp.tokens
    visible = [t if not (t.startswith("<") and len(t) > 1) else "" for t in lp.tokens]  # special tokens: not in the text
    assert "".join(visible) == text
    assert len(lp.token_logprobs) == spec.usage.completion_tokens
    assert max(abs(a - b) for a, b in zip(lp.token_logprobs, plain_lp.token_logprobs)) <= 1e-5
    assert all(len(top) == 3 and max(top.values()) >= value - 1e-6  # greedy: the chosen token is the top one
               for top, value in zip(lp.top_logprobs, lp.token_logprobs))
    assert lp.text_offset == [sum(len(t) for t in visible[:i]) for i in range(len(lp.tokens))]


def test_logprobs_cover_exactly_the_text_a_stop_string_leaves(server):
    """The char tokenizer gives one character per token: the listed tokens must spell the returned
    text, no more (a stop spanning two tokens cuts both), streamed or not, in both endpoints."""
    def stop_inside(text):  # two characters (tokens) that first occur after the output's start
        return next(text[i:i + 2] for i in range(3, len(text) - 1) if text.index(text[i:i + 2]) == i)

    free = complete(server, "the cafe", max_tokens=24).choices[0].text
    stop = stop_inside(free)
    cut = free[:free.index(stop)]
    full = complete(server, "the cafe", max_tokens=24, logprobs=1, stop=[stop]).choices[0]
    assert full.text == cut and full.finish_reason == "stop"
    assert "".join(full.logprobs.tokens) == cut and full.logprobs.text_offset == list(range(len(cut)))
    streamed_tokens, offsets = [], []
    for part in complete(server, "the cafe", max_tokens=24, logprobs=1, stop=[stop], stream=True):
        if part.choices and part.choices[0].logprobs is not None:
            streamed_tokens += part.choices[0].logprobs.tokens
            offsets += part.choices[0].logprobs.text_offset
    assert "".join(streamed_tokens) == cut and offsets == list(range(len(cut)))
    free_chat = chat(server, "bad bed", max_tokens=24).choices[0].message.content
    stop = stop_inside(free_chat)
    cut = free_chat[:free_chat.index(stop)]
    reply = chat(server, "bad bed", max_tokens=24, logprobs=True, stop=[stop]).choices[0]
    # (this chat model also emits <pad>, a special token with no text: listed, it adds nothing)
    assert reply.message.content == cut
    assert "".join(c.token for c in reply.logprobs.content).replace("<pad>", "") == cut
    streamed = []
    for part in chat(server, "bad bed", max_tokens=24, logprobs=True, stop=[stop], stream=True):
        if part.choices and part.choices[0].logprobs is not None:
            streamed += [c.token for c in part.choices[0].logprobs.content]
    assert "".join(streamed).replace("<pad>", "") == cut


def test_chat_logprobs_stream_and_full_agree(server):
    full = chat(server, "abc", logprobs=True, top_logprobs=2, max_tokens=12)
    content = full.choices[0].logprobs.content
    assert "".join(c.token for c in content if not c.token.startswith("<")) == full.choices[0].message.content
    assert all(len(c.top_logprobs) == 2 and c.bytes == list(c.token.encode()) for c in content)
    streamed = []
    for part in chat(server, "abc", logprobs=True, top_logprobs=2, max_tokens=12, stream=True):
        if part.choices and part.choices[0].logprobs is not None:
            streamed += part.choices[0].logprobs.content
    assert [(c.token, round(c.logprob, 5)) for c in streamed] == [(c.token, round(c.logprob, 5)) for c in content]
    with pytest.raises(openai.BadRequestError, match="top_logprobs"):
        chat(server, "abc", top_logprobs=2)


def test_penalties_change_greedy_output_the_same_way_with_and_without_speculation(server, plain_server):
    kwargs = dict(frequency_penalty=1.5, presence_penalty=0.5, extra_body={"repetition_penalty": 1.3})
    spec, plain = complete(server, "hhh a", **kwargs), complete(plain_server, "hhh a", **kwargs)
    assert spec.choices[0].text == plain.choices[0].text != complete(plain_server, "hhh a").choices[0].text


def test_a_grammar_constrains_the_output(server):
    pattern = "(ab|cd)+[.]"
    import re

    for _ in range(2):
        text = complete(server, "abc", temperature=1.0, max_tokens=40,
                        extra_body={"grammar": "regex:" + pattern}).choices[0]
        assert re.fullmatch(pattern, text.text) or (text.finish_reason == "length" and re.fullmatch("(ab|cd)*a?c?", text.text))


@pytest.mark.real_model
def test_the_default_pair_serves_speculative_greedy_equal_to_plain_greedy():
    # One server with the default pair on the batch-invariant bfloat16 kernels; a request with
    # num_speculative_tokens = 0 is plain decoding on the same target, so the two texts must agree
    # token for token. (In float32 this test failed once in three runs on an AMX Xeon, 2026-12-06,
    # its assertion not captured: oneDNN's float32 products are not promised to round one row as
    # several; only the invariant kernels promise the equality everywhere.)
    from specdecode import native

    if not native.available():
        pytest.skip("no C++ compiler for specdecode's batch-invariant kernels")
    s = Server(None, "--max-batch-size", "2", "--dtype", "bfloat16", "--batch-invariant", "on")
    try:
        prompt = "def fibonacci(n):\n"
        spec = complete(s, prompt, max_tokens=32)
        plain = complete(s, prompt, max_tokens=32, extra_body={"num_speculative_tokens": 0})
        assert spec.choices[0].text == plain.choices[0].text and spec.usage.completion_tokens == 32
        assert spec.model_extra["speculation"]["num_accepted"] > 0
        assert plain.model_extra["speculation"]["num_drafted"] == 0
        question = "Write a Python function that reverses a string."
        spec_chat, plain_chat = chat(s, question), chat(s, question, extra_body={"num_speculative_tokens": 0})
        assert spec_chat.choices[0].message.content == plain_chat.choices[0].message.content != ""
    finally:
        assert s.stop() == 0


def test_batch_in_openai_format_answers_each_line_with_the_servers_body(server, chat_model_dirs, tmp_path):
    """`specdecode batch` on an OpenAI batch file (the format OpenAI's Batch API and vLLM's run-batch
    read): each line's response is what the server answers to the same body, errors included."""
    from specdecode.cli import main

    def messages(text):
        return [{"role": "system", "content": "be brief"}, {"role": "user", "content": text}]

    bodies = {
        "chat-greedy": ("/v1/chat/completions", {"model": "tiny", "messages": messages("abc"), "max_tokens": 12,
                                                 "temperature": 0, "logprobs": True, "top_logprobs": 2}),
        "raw-greedy": ("/v1/completions", {"model": "tiny", "prompt": "the cafe", "max_tokens": 10,
                                           "temperature": 0, "logprobs": 1, "stop": ["e b"]}),
        "raw-seeded": ("/v1/completions", {"model": "tiny", "prompt": "bad bed", "max_tokens": 10,
                                           "temperature": 0.9, "top_k": 8, "seed": 7, "presence_penalty": 0.5}),
        "chat-json": ("/v1/chat/completions", {"model": "tiny", "messages": messages("gag"), "max_tokens": 8,
                                               "temperature": 0, "grammar": "root ::= [a-c]+"}),
        "bad-temperature": ("/v1/completions", {"model": "tiny", "prompt": "ace", "temperature": 5}),
        "wizard": ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "wizard", "content": "x"}]}),
        "other-model": ("/v1/completions", {"model": "gpt-4o-mini", "prompt": "ace"}),
        "too-long": ("/v1/completions", {"model": "tiny", "prompt": "a", "max_tokens": 100000}),
        "raw-n-biased": ("/v1/completions", {"model": "tiny", "prompt": "fade", "max_tokens": 8, "n": 2,
                                             "temperature": 0.8, "seed": 3, "logit_bias": {"5": 3},
                                             "min_tokens": 2}),
        "raw-echo-score": ("/v1/completions", {"model": "tiny", "prompt": "dead beef", "max_tokens": 0,
                                               "echo": True, "logprobs": 2}),
    }
    source = tmp_path / "openai.jsonl"
    source.write_text("".join(json.dumps({"custom_id": cid, "method": "POST", "url": url, "body": body}) + "\n"
                              for cid, (url, body) in bodies.items()))
    out = tmp_path / "out.jsonl"
    assert main(["batch", str(source), "--output", str(out), "--target", chat_model_dirs["target"], "--draft",
                 chat_model_dirs["draft"], "--dtype", "float32", "--no-guard", "-k", "4",
                 "--served-model-name", "tiny", "--max-batch-size", "1", "--quiet"]) == 0
    # one row at a time, as the server answers them here
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert sorted(r["custom_id"] for r in lines) == sorted(bodies)

    def comparable(body):
        """The body without its id and time, and without the speculation counts and the last bits
        of the logprobs: the server's suffix drafts also read earlier requests, so its drafts
        (and the verify calls' shapes) differ from the job's; the text may not."""
        def rounded(value):
            if isinstance(value, float):
                return round(value, 4)
            if isinstance(value, dict):
                return {k: rounded(v) for k, v in value.items()}
            return [rounded(v) for v in value] if isinstance(value, list) else value

        return rounded({k: v for k, v in body.items() if k not in ("id", "created", "speculation")})

    for record in lines:
        url, body = bodies[record["custom_id"]]
        answer = httpx.post(server.url + url, json=body, timeout=60)
        assert record["error"] is None and record["id"].startswith("batch_req_")
        assert record["response"]["status_code"] == answer.status_code, record["custom_id"]
        assert comparable(record["response"]["body"]) == comparable(answer.json()), record["custom_id"]
    statuses = {r["custom_id"]: r["response"]["status_code"] for r in lines}
    assert statuses == {"chat-greedy": 200, "raw-greedy": 200, "raw-seeded": 200, "chat-json": 200,
                        "bad-temperature": 400, "wizard": 400, "other-model": 404, "too-long": 400,
                        "raw-n-biased": 200, "raw-echo-score": 200}
    # resumable: a rerun writes nothing new
    assert main(["batch", str(source), "--output", str(out), "--target", chat_model_dirs["target"], "--draft",
                 chat_model_dirs["draft"], "--dtype", "float32", "--no-guard", "--quiet"]) == 0
    assert len(out.read_text().splitlines()) == len(bodies)


# --- evaluation harness fields: n, logit_bias, echo with prompt logprobs, min_tokens/ignore_eos ----

def streamed_choices(stream) -> dict:
    """{choice index: [text, finish_reason, token_logprobs]} of a streamed completions response."""
    out = {}
    for part in stream:
        for choice in part.choices:
            entry = out.setdefault(choice.index, ["", None, []])
            entry[0] += choice.text
            entry[1] = choice.finish_reason or entry[1]
            if choice.logprobs is not None:
                entry[2] += choice.logprobs.token_logprobs
    return out


def test_n_choices_are_each_the_seeded_request_alone_streamed_or_not(server):
    args = dict(temperature=1.0, seed=11, max_tokens=12)
    both = complete(server, "abc", n=3, **args)
    alone = [complete(server, "abc", **(args | {"seed": 11 + i})) for i in range(3)]
    assert [c.index for c in both.choices] == [0, 1, 2]
    assert [c.text for c in both.choices] == [a.choices[0].text for a in alone]
    assert len({c.text for c in both.choices}) > 1  # the seeds differ, so do the choices
    assert both.usage.completion_tokens == sum(a.usage.completion_tokens for a in alone)
    assert both.usage.prompt_tokens == alone[0].usage.prompt_tokens
    assert complete(server, "abc", n=3, best_of=3, **args).choices[2].text == both.choices[2].text
    streamed = streamed_choices(complete(server, "abc", n=3, stream=True, **args))
    assert [streamed[i][:2] for i in range(3)] == [[c.text, c.finish_reason] for c in both.choices]
    several = complete(server, ["abc", "ace"], n=2, **args)  # a list of prompts: choices prompt-major
    assert [c.text for c in several.choices[:2]] == [c.text for c in both.choices[:2]]
    assert [c.text for c in several.choices[2:]] == [c.text for c in complete(server, "ace", n=2, **args).choices]
    assert several.usage.prompt_tokens == 6
    replies = chat(server, "abc", n=2, temperature=0, max_tokens=10).choices
    assert len(replies) == 2 and replies[0].message.content == replies[1].message.content  # greedy: equal


def test_logit_bias_steers_speculative_and_plain_decoding_alike(server, plain_server, chat_model_dirs):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(chat_model_dirs["target"])
    free = complete(plain_server, "the cafe", max_tokens=12).choices[0].text
    banned = {str(tokenizer.convert_tokens_to_ids(free[0])): -100}  # the first greedy token, never
    pushed = {str(tokenizer.convert_tokens_to_ids("d")): 8.5}         # a strong, not absolute, pull
    for bias in (banned, pushed):
        spec = complete(server, "the cafe", max_tokens=12, logit_bias=bias).choices[0].text
        assert spec == complete(plain_server, "the cafe", max_tokens=12, logit_bias=bias).choices[0].text != free
        assert streamed_choices(complete(server, "the cafe", max_tokens=12, logit_bias=bias, stream=True))[0][0] \
            == spec
    assert not complete(server, "the cafe", max_tokens=12, logit_bias=banned).choices[0].text.startswith(free[0])
    sampled = complete(server, "the cafe", max_tokens=40, temperature=1.0, seed=3, logit_bias=pushed).choices[0].text
    assert sampled.count("d") > 10  # d's logit + 8.5 dominates (a wrong sign or a missing bias would not)


def test_echo_with_logprobs_scores_the_prompt_as_a_plain_forward(server, chat_model_dirs):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    prompt = "bad bed"
    tokenizer = AutoTokenizer.from_pretrained(chat_model_dirs["target"])
    ids = tokenizer.encode(prompt, add_special_tokens=False)
    model = AutoModelForCausalLM.from_pretrained(chat_model_dirs["target"], dtype=torch.float32)
    with torch.no_grad():
        reference = torch.log_softmax(model(torch.tensor([ids])).logits[0], -1)
    scored = complete(server, prompt, echo=True, logprobs=2, max_tokens=0).choices[0]
    assert scored.text == prompt and "".join(scored.logprobs.tokens) == prompt
    assert scored.logprobs.token_logprobs[0] is None and scored.logprobs.top_logprobs[0] is None
    assert scored.logprobs.text_offset == list(range(len(prompt)))
    for j, (value, top) in enumerate(zip(scored.logprobs.token_logprobs[1:], scored.logprobs.top_logprobs[1:]), 1):
        assert value == pytest.approx(float(reference[j - 1, ids[j]]), abs=1e-4)
        assert len(top) == 2 and max(top.values()) == pytest.approx(float(reference[j - 1].max()), abs=1e-4)
    full = complete(server, prompt, echo=True, logprobs=1, max_tokens=6).choices[0]
    alone = complete(server, prompt, logprobs=1, max_tokens=6).choices[0]
    assert full.text == prompt + alone.text
    assert full.logprobs.token_logprobs[len(ids):] == alone.logprobs.token_logprobs
    assert full.logprobs.text_offset[len(ids):] == [len(prompt) + o for o in alone.logprobs.text_offset]
    assert full.logprobs.token_logprobs[1:len(ids)] == pytest.approx(scored.logprobs.token_logprobs[1:], abs=1e-6)
    streamed = streamed_choices(complete(server, prompt, echo=True, logprobs=1, max_tokens=6, stream=True))[0]
    assert streamed[0] == full.text and streamed[2][0] is None
    assert streamed[2][1:] == pytest.approx(full.logprobs.token_logprobs[1:], abs=1e-6)
    assert complete(server, prompt, echo=True, max_tokens=3).choices[0].text.startswith(prompt)
    # lm-evaluation-harness's loglikelihood request: token-id prompts in a list, one token generated
    harness = complete(server, [ids, ids[:4]], echo=True, logprobs=1, max_tokens=1).choices
    assert [len(c.logprobs.tokens) for c in harness] == [len(ids) + 1, 5] and harness[1].text.startswith(prompt[:4])
    assert harness[0].logprobs.token_logprobs[:len(ids)] == full.logprobs.token_logprobs[:len(ids)]
    for body, param in (({"prompt": prompt, "max_tokens": 0}, "max_tokens"),):
        response = httpx.post(server.url + "/v1/completions", json={"model": "tiny", **body}, timeout=30)
        assert response.status_code == 400 and response.json()["error"]["param"] == param
    response = httpx.post(server.url + "/v1/chat/completions", timeout=30, json={
        "model": "tiny", "messages": [{"role": "user", "content": "x"}], "echo": True})
    assert response.status_code == 400 and response.json()["error"]["param"] == "echo"


def test_min_tokens_and_ignore_eos_hold_eos_back_alike_with_and_without_speculation(server, plain_server,
                                                                                    chat_model_dirs):
    from transformers import AutoTokenizer

    eos = str(AutoTokenizer.from_pretrained(chat_model_dirs["target"]).eos_token_id)
    likely_eos = {eos: 30}  # EOS first, unless masked
    for srv in (server, plain_server):
        ended = complete(srv, "abc", max_tokens=10, logit_bias=likely_eos)
        assert ended.choices[0].text == "" and ended.usage.completion_tokens == 1  # the EOS
        held = complete(srv, "abc", max_tokens=10, logit_bias=likely_eos, extra_body={"min_tokens": 4})
        assert held.usage.completion_tokens == 5 and held.choices[0].finish_reason == "stop"  # 4, then EOS
        ignored = complete(srv, "abc", max_tokens=10, logit_bias=likely_eos, extra_body={"ignore_eos": True})
        assert ignored.usage.completion_tokens == 10 and ignored.choices[0].finish_reason == "length"
        streamed = streamed_choices(complete(srv, "abc", max_tokens=10, logit_bias=likely_eos, stream=True,
                                             extra_body={"min_tokens": 4}))
        assert streamed[0][:2] == [held.choices[0].text, "stop"]
    kwargs = dict(max_tokens=10, logit_bias={eos: 2.0}, extra_body={"min_tokens": 5})
    assert complete(server, "abc", **kwargs).choices[0].text == complete(plain_server, "abc", **kwargs).choices[0].text


# --- safe by default against other sites and slow clients --------------------------------------

def test_other_sites_cannot_drive_or_read_the_server(server):
    body = b'{"model": "tiny", "prompt": "abc", "max_tokens": 2}'
    url = server.url + "/v1/completions"
    for content_type in ("text/plain", "application/x-www-form-urlencoded", None):  # "simple" cross-site posts
        headers = {"content-type": content_type} if content_type else {}
        response = httpx.post(url, content=body, headers=headers, timeout=30)
        assert response.status_code == 415 and "application/json" in response.json()["error"]["message"]
    evil = httpx.post(url, content=body, timeout=30,
                      headers={"content-type": "application/json", "origin": "https://evil.example"})
    assert evil.status_code == 403 and evil.json()["error"]["type"] == "permission_error"
    assert "access-control-allow-origin" not in evil.headers
    own = httpx.post(url, content=body, timeout=30,
                     headers={"content-type": "application/json", "origin": f"http://127.0.0.1:{server.port}"})
    assert own.status_code == 200
    rebound = httpx.get(server.url + "/v1/models", headers={"host": f"evil.example:{server.port}"}, timeout=30)
    assert rebound.status_code == 400 and "--allowed-hosts" in rebound.json()["error"]["message"]
    assert httpx.get(server.url + "/v1/models", headers={"host": f"localhost:{server.port}"}, timeout=30).status_code == 200
    page = httpx.get(server.url + "/", timeout=30)
    assert "frame-ancestors 'none'" in page.headers["content-security-policy"]
    assert page.headers["x-content-type-options"] == "nosniff" and page.headers["x-frame-options"] == "DENY"


def test_error_types_and_odd_text_get_clear_answers(server):
    wrong_method = httpx.get(server.url + "/v1/completions", timeout=10)
    assert wrong_method.status_code == 405 and wrong_method.json()["error"]["type"] == "invalid_request_error"
    surrogate = httpx.post(server.url + "/v1/completions", timeout=30, headers={"content-type": "application/json"},
                           content=b'{"model": "tiny", "prompt": "ab\\ud800c"}')
    assert surrogate.status_code == 400 and "Unicode" in surrogate.json()["error"]["message"]
    chat_surrogate = httpx.post(server.url + "/v1/chat/completions", timeout=30,
                                headers={"content-type": "application/json"},
                                content=b'{"model": "tiny", "messages": [{"role": "user", "content": "\\ud800"}]}')
    assert chat_surrogate.status_code == 400 and "Unicode" in chat_surrogate.json()["error"]["message"]


@pytest.mark.slow
def test_slow_clients_are_cut_off_allowed_sites_work_and_ctrl_c_exits_130(chat_model_dirs):
    s = Server(chat_model_dirs, "--timeout-request", "2", "--allowed-origins", "https://app.example",
               "--allowed-hosts", "box.internal")
    try:
        slow = []
        for i in range(40):  # half a request line, half the headers, half a body, or nothing at all
            sock = socket.create_connection(("127.0.0.1", s.port))
            sock.sendall([b"GET /health HT", b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n",
                          b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                          b"Content-Length: 100\r\n\r\n{\"model\": ", b""][i % 4])
            slow.append(sock)
        # others are answered meanwhile
        assert complete(s, "abc", max_tokens=3).choices[0].text is not None
        time.sleep(4)
        for sock in slow:
            sock.settimeout(5)
            try:
                data = sock.recv(1024)
            except ConnectionResetError:
                data = b""
            assert data == b"" or data.startswith(b"HTTP/1.1 4"), data  # closed (or refused) by the server
            sock.close()
        assert complete(s, "abc", max_tokens=3).choices[0].text is not None
        preflight = httpx.options(s.url + "/v1/completions", timeout=30, headers={
            "origin": "https://app.example", "access-control-request-method": "POST"})
        assert preflight.status_code == 204 and preflight.headers["access-control-allow-origin"] == "https://app.example"
        allowed = httpx.post(s.url + "/v1/completions", timeout=60, json={"model": "tiny", "prompt": "a", "max_tokens": 2},
                             headers={"origin": "https://app.example", "host": "box.internal"})
        assert allowed.status_code == 200 and allowed.headers["access-control-allow-origin"] == "https://app.example"
    finally:
        if s.process.poll() is None:
            s.process.send_signal(signal.SIGINT)
        assert s.process.wait(timeout=60) == 130


@pytest.mark.slow
def test_a_client_that_stops_sending_its_body_is_counted_as_aborted_not_as_a_server_error(chat_model_dirs):
    """Headers announcing 1000 bytes, 10 bytes, then silence past --timeout-request: the server
    closes the connection and counts a client abort (as for a client gone while waiting for its
    answer), with no 5xx and no traceback in its log; then it serves on."""
    s = Server(chat_model_dirs, "--timeout-request", "1")
    try:
        with socket.create_connection(("127.0.0.1", s.port), timeout=10) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                         b"Content-Length: 1000\r\n\r\n" + b'{"model": ')
            assert sock.recv(1024) == b""  # closed by the server after --timeout-request
        deadline = time.monotonic() + 10
        while metric(s, 'specdecode:requests_total{status="aborted"}') < 1 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert metric(s, 'specdecode:requests_total{status="aborted"}') == 1
        assert metric(s, 'specdecode:requests_total{status="500"}') == 0
        assert complete(s, "abc", max_tokens=3).choices[0].text is not None
    finally:
        code = s.stop()
    log = s.process.stderr.read()
    assert "Exception in ASGI application" not in log and "Traceback" not in log, log
    assert code == 0


# --- suffix drafts from earlier requests ------------------------------------------------------------

CONTEXT = [11, 10, 9, 8, 7, 6]  # "hgfedc": no token twice, so a request on it finds no match in its own tokens
LENGTH, LATER = 3, 800          # 800 later outputs of 3 tokens, in requests of n=16


def warm_then_sample(post, model, tokenizer):
    """Through post(body) → response body: a first request on CONTEXT (cold cache), 30 whose
    prompts repeat CONTEXT and its greedy continuation 4-6 times, then LATER unseeded
    temperature-1 choices on CONTEXT. Returns (cold's drafts, the later ones', Counter of their
    outputs as token ids)."""
    body = {"model": "tiny", "max_tokens": LENGTH, "temperature": 1, "ignore_eos": True}
    cold = post({**body, "prompt": CONTEXT})["speculation"]["num_drafted"]
    continuation = greedy_continuation(model, CONTEXT, 4)
    for i in range(30):
        post({**body, "prompt": (CONTEXT + continuation) * (4 + i % 3)})
    counts, drafted = Counter(), 0
    for _ in range(LATER // 16):
        answer = post({**body, "prompt": CONTEXT, "n": 16, "logprobs": 0})
        drafted += answer["speculation"]["num_drafted"]
        for choice in answer["choices"]:
            counts[tuple(tokenizer.convert_tokens_to_ids(choice["logprobs"]["tokens"]))] += 1
    return cold, drafted, counts


@pytest.mark.slow
def test_a_servers_earlier_requests_make_a_later_one_draft_and_its_output_stays_exact(peaked, char_tokenizer):
    """`serve --draft none --free-drafts suffix` (suffix drafts alone): a first request drafts nothing;
    after earlier requests, later unseeded ones draft from the server's cache (from their second
    token: a request's first step is plain, and a step leaves room for the target's own token),
    and their outputs follow the target's exact distribution (chi-square over 800, sequences
    expected fewer than 5 times pooled; fails below 1e-3). Negative control: the same requests to
    the same app in-process, its suffix drafts reporting a uniform q, fail it (p < 1e-50 seen)."""
    from fastapi.testclient import TestClient

    from specdecode import SpeculativeDecoder
    from specdecode.serve.app import create_app

    model, path = peaked
    exact = model_sequence_probs(model, CONTEXT, LENGTH)
    s = Server({"target": path}, "--draft", "none", "--free-drafts", "suffix")
    try:
        cold, drafted, counts = warm_then_sample(
            lambda body: httpx.post(s.url + "/v1/completions", json=body, timeout=60).json(), model, char_tokenizer)
    finally:
        assert s.stop() == 0
    pvalue, categories = pooled_chi2_pvalue(counts, exact)
    assert cold == 0 and drafted > LATER // 2
    assert pvalue > 1e-3 and categories >= 10
    decoder = SpeculativeDecoder(path, None, dtype="float32", free_drafts="suffix", guard=False)
    decoder.engine.proposer = UniformQFreeDrafts(decoder.engine.proposer)
    with TestClient(create_app(decoder, model_name="tiny", allowed_hosts=("testserver",))) as client:
        _, drafted, counts = warm_then_sample(lambda body: client.post("/v1/completions", json=body).json(),
                                              model, char_tokenizer)
    assert drafted > LATER // 2 and pooled_chi2_pvalue(counts, exact)[0] < 1e-6


def same_output_alone_beside_others_after_traffic_and_without_drafts(dirs, invariant: str, verification: str
                                                                     ) -> dict[str, list[bool]]:
    """A greedy request's and a seeded sampled request's (text, token logprobs) sent alone to a
    bfloat16 server compared, bit for bit, with: the same request sent with four others at once,
    sent again after that traffic (other verify widths, suffix drafts from earlier requests), and
    from a server with no draft model (plain decoding)."""
    flags = ["--dtype", "bfloat16", "--batch-invariant", invariant, "--verification", verification]
    speculative = Server(dirs, *flags, "--max-batch-size", "4", "-k", "4")
    plain = Server(dirs, *flags, "--draft", "none")
    seeded = {"temperature": 1.0, "seed": 7}
    try:
        def run(server, prompt="the cafe", **sampling):
            choice = complete(server, prompt, max_tokens=40, logprobs=2, **sampling).choices[0]
            return choice.text, choice.logprobs.token_logprobs

        alone = {"greedy": run(speculative), "seeded": run(speculative, **seeded)}
        with concurrent.futures.ThreadPoolExecutor(6) as pool:
            together = [pool.submit(run, speculative, p) for p in ["the cafe", "bad bed", "ace", "fade", "gag"]]
            together.append(pool.submit(run, speculative, "the cafe", **seeded))
            beside = {"greedy": together[0].result(), "seeded": together[-1].result()}
        info = httpx.get(speculative.url + "/v1/models", timeout=10).json()["data"][0]["specdecode"]
        assert info["batch_invariant"] is (invariant == "on")
        report = complete(speculative, "ace").model_extra["speculation"]
        assert report["batch_invariant"] is report["repeatable"] is (invariant == "on")
        assert complete(speculative, "ace", **seeded).model_extra["speculation"]["repeatable"] is (
            invariant == "on" and verification == "drafter-invariant")
        return {kind: [beside[kind] == alone[kind], run(speculative, **sampling) == alone[kind],
                       run(plain, **sampling) == alone[kind]]
                for kind, sampling in (("greedy", {}), ("seeded", seeded))}
    finally:
        assert speculative.stop() == 0 and plain.stop() == 0


def test_bfloat16_server_output_is_the_same_alone_beside_others_after_traffic_and_without_drafts(chat_model_dirs):
    """On the batch-invariant kernels with drafter-invariant verification every comparison holds,
    greedy and seeded sampled; the power checks: on torch's bfloat16 kernels (a verify rounds
    unlike a step) a greedy one does not, and with the paper's rule a seeded request's tokens
    differ from plain decoding's (other random numbers are drawn)."""
    from specdecode import native

    if not native.available():
        pytest.skip("no C++ compiler for the batch-invariant kernels")
    same = same_output_alone_beside_others_after_traffic_and_without_drafts(chat_model_dirs, "on", "drafter-invariant")
    assert all(same["greedy"]) and all(same["seeded"]), same
    same = same_output_alone_beside_others_after_traffic_and_without_drafts(chat_model_dirs, "off", "token")
    assert not all(same["greedy"]) and not same["seeded"][2], same
