"""The library under misuse and races: a failing or interrupted request fails alone, the facade is
safe from several threads, an abandoned stream is freed, and the server's worker answers every
request submitted while it shuts down. Tiny float32 models (greedy output is exact)."""

import asyncio
import contextlib
import gc
import threading
import time

import pytest

from specdecode import SamplingParams, SpeculativeDecoder

GREEDY = SamplingParams(temperature=0)
ENDLESS = SamplingParams(temperature=0, ignore_eos=True)  # runs to max_new_tokens
PROMPTS = ["abc", "hhh a", "the cafe", "bad bed", "ace", "dead beef"]


@pytest.fixture(scope="module")
def decoder(model_dirs):
    return SpeculativeDecoder(model_dirs["target"], model_dirs["draft"], dtype="float32", guard=False,
                              num_speculative_tokens=3)


@pytest.fixture(scope="module")
def expected(decoder):
    return {p: decoder.generate(p, max_new_tokens=16, sampling=GREEDY, chat=False).token_ids for p in PROMPTS}


def failing_after(n, error):
    """A logits processor that raises `error` once the output holds n tokens."""
    def processor(input_ids, scores):
        if input_ids.shape[1] >= 3 + n:  # the prompt "abc" is 3 tokens
            raise error
        return scores
    return processor


@pytest.mark.parametrize("error", [ValueError("bad processor"), KeyboardInterrupt()])
def test_a_failing_or_interrupted_request_fails_alone_and_the_next_call_is_clean(decoder, expected, error):
    with pytest.raises(type(error)):
        decoder.generate("abc", max_new_tokens=16, sampling=GREEDY, chat=False,
                         logits_processors=[failing_after(6, error)])
    assert not decoder.engine.has_work  # its row left; its cache slots are free
    assert decoder.generate("abc", max_new_tokens=16, sampling=GREEDY, chat=False).token_ids == expected["abc"]
    # the same in a batch: the whole call fails, the decoder stays usable
    with pytest.raises(type(error)):
        decoder.generate(["abc", "ace"], max_new_tokens=16, sampling=GREEDY, chat=False,
                         logits_processors=[failing_after(6, error)])
    assert not decoder.engine.has_work
    assert [r.token_ids for r in decoder.generate(PROMPTS, max_new_tokens=16, sampling=GREEDY, chat=False)] == \
        [expected[p] for p in PROMPTS]


def test_a_stream_that_fails_in_another_callers_step_raises_and_leaves_nothing(decoder, expected):
    stream = decoder.generate("ace", max_new_tokens=16, sampling=GREEDY, chat=False, stream=True)
    with pytest.raises(ValueError):  # this call's step also runs the stream's row
        decoder.generate("abc", max_new_tokens=16, sampling=GREEDY, chat=False,
                         logits_processors=[failing_after(2, ValueError("bad"))])
    with pytest.raises(RuntimeError, match="a decoding step failed"):
        list(stream)
    assert not decoder.engine.has_work
    assert decoder.generate("ace", max_new_tokens=16, sampling=GREEDY, chat=False).token_ids == expected["ace"]


def test_the_request_whose_processor_raises_gets_its_error_and_the_thread_that_stepped_a_runtime_error(
        decoder, expected):
    """The failing step runs in the innocent caller's thread (the raiser's stream has not been
    iterated yet): the raiser still gets its own error, the innocent one a RuntimeError naming it."""
    outcome = {}
    joined = threading.Event()

    def innocent():
        while not joined.is_set():
            time.sleep(0.001)
        try:
            outcome["innocent"] = decoder.generate("dead beef", max_new_tokens=200, sampling=ENDLESS, chat=False)
        except Exception as err:  # noqa: BLE001 - checked below
            outcome["innocent"] = err

    thread = threading.Thread(target=innocent)
    thread.start()
    raiser = decoder.generate("abc", max_new_tokens=200, sampling=GREEDY, chat=False, stream=True,
                              logits_processors=[failing_after(3, ValueError("boom"))])
    joined.set()  # the innocent thread steps both rows from now on
    thread.join(120)
    with pytest.raises(ValueError, match="boom"):
        list(raiser)
    assert isinstance(outcome["innocent"], RuntimeError) and "ValueError: boom" in str(outcome["innocent"])
    assert not decoder.engine.has_work and not decoder.driver.failed
    assert decoder.generate("abc", max_new_tokens=16, sampling=GREEDY, chat=False).token_ids == expected["abc"]


def test_two_threads_generating_each_get_their_own_outcome_when_one_processor_raises(decoder, expected):
    """Whichever thread steps the failing step: the raiser gets ValueError('boom'), the innocent
    request (started first, long, so both are in that step) a RuntimeError naming it."""
    for _ in range(4):
        outcome, running = {}, threading.Event()

        def call(name, **kw):
            try:
                outcome[name] = decoder.generate(chat=False, sampling=ENDLESS, **kw)
            except Exception as err:  # noqa: BLE001 - checked below
                outcome[name] = err

        def slow(ids, scores):  # 10 ms a position: the innocent runs for seconds, long after the raiser joins
            running.set()
            time.sleep(0.01)
            return scores

        innocent = threading.Thread(target=call, args=("innocent",), kwargs=dict(
            prompt="dead beef", max_new_tokens=200, logits_processors=[slow]))
        raiser = threading.Thread(target=call, args=("raiser",), kwargs=dict(
            prompt="abc", max_new_tokens=16, logits_processors=[failing_after(3, ValueError("boom"))]))
        innocent.start()
        assert running.wait(60)
        raiser.start()
        for t in (innocent, raiser):
            t.join(120)
        assert type(outcome["raiser"]) is ValueError and str(outcome["raiser"]) == "boom"
        assert isinstance(outcome["innocent"], RuntimeError) and "ValueError: boom" in str(outcome["innocent"])
        assert not decoder.engine.has_work and not decoder.driver.failed
    assert decoder.generate("dead beef", max_new_tokens=16, sampling=GREEDY, chat=False).token_ids == \
        expected["dead beef"]


def test_several_threads_may_generate_on_one_decoder_at_once(decoder, expected):
    results, errors = {}, []

    def work(prompt):
        try:
            for _ in range(3):
                results[prompt] = decoder.generate(prompt, max_new_tokens=16, sampling=GREEDY, chat=False).token_ids
        except Exception as err:  # noqa: BLE001 - reported below
            errors.append(err)

    threads = [threading.Thread(target=work, args=(p,)) for p in PROMPTS]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors and all(not t.is_alive() for t in threads)
    assert results == expected
    assert not decoder.engine.has_work


def test_a_dropped_stream_is_aborted_and_freed(decoder, expected):
    stream = decoder.generate("dead beef", max_new_tokens=200, sampling=GREEDY, chat=False, stream=True)
    next(iter(stream))  # one token, then the caller loses interest without close()
    del stream
    gc.collect()
    assert decoder.generate("abc", max_new_tokens=16, sampling=GREEDY, chat=False).token_ids == expected["abc"]
    assert not decoder.engine.has_work  # the dropped row left at that call's first step
    never_read = decoder.generate("gag", max_new_tokens=200, sampling=GREEDY, chat=False, stream=True)
    del never_read
    gc.collect()
    decoder.generate("abc", max_new_tokens=4, sampling=GREEDY, chat=False)
    assert not decoder.engine.has_work


def test_requests_built_in_many_threads_while_the_engine_decodes(decoder):
    """The server builds requests in worker threads while the engine thread detokenizes: the
    request path has its own tokenizer and locks its grammar compiler."""
    assert decoder.requests.tokenizer is not decoder.engine.tokenizer
    errors = []

    def build(i):
        try:
            for _ in range(20):
                decoder.requests.encode(PROMPTS[i % len(PROMPTS)] * 20, chat=False)
                decoder.requests.grammar(grammar="root ::= [a-c]+" if i % 2 else "regex:[a-h ]{1,8}")
        except Exception as err:  # noqa: BLE001 - reported below
            errors.append(err)

    threads = [threading.Thread(target=build, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    decoder.generate(PROMPTS, max_new_tokens=24, sampling=GREEDY, chat=False)
    for t in threads:
        t.join(120)
    assert not errors


def test_every_request_submitted_while_the_worker_shuts_down_gets_an_answer(decoder):
    pytest.importorskip("fastapi")
    from specdecode.serve.worker import EngineWorker, Handle, ShuttingDown

    loop = asyncio.new_event_loop()
    loop_thread = threading.Thread(target=loop.run_forever, daemon=True)
    loop_thread.start()
    try:
        for attempt in range(5):
            worker = EngineWorker(decoder.engine, max_queue=1000)
            worker._inbox = SlowInbox(worker._inbox)  # widens the window between the check and the put
            worker.start()
            handles, refused = [], 0
            request = decoder.requests.request(decoder.requests.encode("abc", False), decoder.requests.config(4, GREEDY))

            def submit_many():
                nonlocal refused
                for _ in range(50):
                    handle = Handle(request, loop)
                    try:
                        worker.submit(handle)
                    except ShuttingDown:
                        refused += 1
                    else:
                        handles.append(handle)

            submitter = threading.Thread(target=submit_many)
            submitter.start()
            worker.stop(timeout=60)
            submitter.join(60)
            for handle in handles:  # each gets a result or an error, then None or the error: never silence
                future = asyncio.run_coroutine_threadsafe(_last_item(handle), loop)
                future.result(timeout=30)
            assert len(handles) + refused == 50
            decoder.engine.reset()
    finally:
        loop.call_soon_threadsafe(loop.stop)
        loop_thread.join(10)


class SlowInbox:
    def __init__(self, inbox):
        self.inbox = inbox

    def put(self, item):
        time.sleep(0.002)
        self.inbox.put(item)

    def get_nowait(self):
        return self.inbox.get_nowait()


@contextlib.contextmanager
def _worker(decoder):
    """The server's EngineWorker on the decoder's engine, with an event loop in a thread for its
    handles; stopped, and the engine left clean, afterwards."""
    from specdecode.serve.worker import EngineWorker

    loop = asyncio.new_event_loop()
    loop_thread = threading.Thread(target=loop.run_forever, daemon=True)
    loop_thread.start()
    worker = EngineWorker(decoder.engine, max_queue=10)
    try:
        yield worker, loop
    finally:
        worker.stop(timeout=60)
        loop.call_soon_threadsafe(loop.stop)
        loop_thread.join(10)
        decoder.engine.reset()


async def _last_item(handle):
    while True:
        item = await handle.queue.get()
        if item is None or isinstance(item, Exception):
            return item


def test_a_backend_error_ends_every_request_of_the_step_retryably_in_the_server_and_the_library(decoder,
                                                                                             monkeypatch):
    pytest.importorskip("fastapi")
    from specdecode.engine.engine import StepFailed
    from specdecode.serve.app import failure
    from specdecode.serve.worker import Handle

    backend, real = decoder.engine.target, decoder.engine.target.forward
    calls = {"n": 0}

    def forward_failing_once(*args, **kwargs):  # no request's fault: the backend's
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("backend broke")
        return real(*args, **kwargs)

    monkeypatch.setattr(backend, "forward", forward_failing_once)
    with _worker(decoder) as (worker, loop):
        config = decoder.requests.config(16, ENDLESS)
        handles = [Handle(decoder.requests.request(decoder.requests.encode(p, False), config), loop)
                   for p in ("abc", "ace")]
        worker.submit(*handles)
        worker.start()
        items = [asyncio.run_coroutine_threadsafe(_last_item(h), loop).result(timeout=60) for h in handles]
        assert all(isinstance(item, StepFailed) and "backend broke" in str(item) for item in items)
        assert all(failure(item).status == 503 for item in items)  # the same rule as Driver: retryable
    calls["n"] = 0
    with pytest.raises(RuntimeError, match="backend broke"):  # the library's caller that stepped gets it
        decoder.generate("abc", max_new_tokens=16, sampling=ENDLESS, chat=False)
    assert not decoder.engine.has_work and not decoder.driver.failed


def test_a_request_whose_own_numbers_break_sampling_gets_the_error_and_the_others_a_retryable_one(decoder):
    # a processor that leaves no token possible: sampling raises inside that row's verification,
    # not in its pipeline; the row is still the one at fault (500), the others retry (503)
    pytest.importorskip("fastapi")
    from specdecode.engine.engine import StepFailed
    from specdecode.serve.app import failure
    from specdecode.serve.worker import Handle

    def nothing_left(input_ids, scores):
        return scores.fill_(float("-inf")) if input_ids.shape[1] >= 7 else scores

    with _worker(decoder) as (worker, loop):
        config = decoder.requests.config(16, ENDLESS)
        bad = Handle(decoder.requests.request(decoder.requests.encode("abc", False), decoder.requests.config(
            16, SamplingParams(seed=1, ignore_eos=True), logits_processors=[nothing_left])), loop)
        good = Handle(decoder.requests.request(decoder.requests.encode("ace", False), config), loop)
        worker.submit(good, bad)
        worker.start()
        own, other = (asyncio.run_coroutine_threadsafe(_last_item(h), loop).result(timeout=60) for h in (bad, good))
        assert not isinstance(own, StepFailed) and isinstance(other, StepFailed), (own, other)
        assert failure(own).status == 500 and failure(other).status == 503


def test_the_servers_worker_gives_the_failing_request_its_error_and_the_others_a_retryable_one(decoder):
    pytest.importorskip("fastapi")
    import dataclasses

    from specdecode.engine.engine import StepFailed
    from specdecode.serve.app import failure
    from specdecode.serve.worker import Handle

    with _worker(decoder) as (worker, loop):
        config = decoder.requests.config(16, ENDLESS)
        bad = Handle(decoder.requests.request(decoder.requests.encode("abc", False), dataclasses.replace(
            config, logits_processors=[failing_after(4, ValueError("bad"))])), loop)
        good = Handle(decoder.requests.request(decoder.requests.encode("ace", False), config), loop)
        for handle in (good, bad):
            worker.submit(handle)
        worker.start()  # both are admitted to the first step
        own, other = (asyncio.run_coroutine_threadsafe(_last_item(h), loop).result(timeout=60) for h in (bad, good))
        assert isinstance(own, ValueError) and isinstance(other, StepFailed) and "ValueError" in str(other)
        assert failure(own).status == 500 and failure(other).status == 503  # the client may retry the other
        again = Handle(decoder.requests.request(decoder.requests.encode("ace", False), config), loop)
        worker.submit(again)  # the worker goes on, clean
        assert asyncio.run_coroutine_threadsafe(_last_item(again), loop).result(timeout=60) is None
