"""Running the engine for callers that wait on their own requests: single calls, streams, lists
and tools. Every one of them only adds requests and routes what `Engine.step` returns."""

from __future__ import annotations

import itertools
import threading
from collections import deque
from typing import Callable, Iterable, Iterator

from specdecode.engine.engine import Engine, StepFailed, StepOutput
from specdecode.engine.request import DecodeConfig, GenerationResult, Request, TokenEvent


class Driver:
    """Steps one engine on behalf of several waiting callers, from any number of threads.

    Events of a request submitted with keep_events are queued until its stream reads them;
    results wait in `results` until taken. One lock guards the engine: callers in several threads
    take turns stepping it, and each step serves every caller's rows.

    A step that raises fails every request in the engine, and the engine starts clean (its caches
    may hold half a step). The request at fault gets the error itself, whichever caller's thread
    stepped: the one whose logits processor (or grammar) raised it, or, for an error that is no one
    request's (a backend's, Ctrl-C), the caller that stepped. Every other request gets a StepFailed
    (a RuntimeError) naming the error. The next call is clean. A caller interrupted between steps
    aborts its own request.

    With `deliver` (the server's worker, which steps in its own thread for callers waiting
    elsewhere), nothing is kept: deliver(request_id, item) gets each request's StepOutputs as
    they come and, if a step fails it, its error (an exception).
    """

    def __init__(self, engine: Engine, deliver: Callable[[int, object], None] | None = None):
        self.engine, self.deliver = engine, deliver
        self.events: dict[int, deque[TokenEvent]] = {}
        self.results: dict[int, GenerationResult] = {}
        self.failed: dict[int, BaseException] = {}
        self._lock = threading.RLock()
        self._abandoned: deque[int] = deque()  # streams garbage-collected unfinished (any thread)
        # Callers waiting to add a request. The lock is not fair: a thread that steps in a loop
        # takes it back at once, so a caller in another thread could wait until every running
        # request has finished; a step waits (briefly) until they are in.
        self._submitting = 0
        self._submitted = threading.Condition()

    def submit(self, request: Request, keep_events: bool = False) -> int:
        with self._submitted:
            self._submitting += 1
        try:
            with self._lock:
                request_id = self.engine.add(request)
                if keep_events:
                    self.events[request_id] = deque()
                return request_id
        finally:
            with self._submitted:
                self._submitting -= 1
                self._submitted.notify_all()

    def step(self) -> list[StepOutput]:
        """One engine step; its outputs, routed (none where it failed)."""
        with self._submitted:  # a request being added joins this step (bounded: never a hang)
            self._submitted.wait_for(lambda: self._submitting == 0, timeout=1.0)
        with self._lock:
            while self._abandoned:
                self.abort(self._abandoned.popleft())
            try:
                outputs = self.engine.step()
            except BaseException as err:
                failures = self.engine.fail(err)
                if self.deliver is None:
                    self.failed.update(failures)  # each caller finds its request's failure in _take
                else:
                    for request_id, error in failures.items():
                        self.deliver(request_id, error)
                if err not in failures.values():  # nobody's request in particular: the caller that stepped
                    raise
                return []
            for output in outputs:
                if self.deliver is not None:
                    self.deliver(output.request_id, output)
                    continue
                queue = self.events.get(output.request_id)
                if queue is not None:
                    queue.extend(output.events)
                if output.result is not None:
                    self.results[output.request_id] = output.result
            return outputs

    def _take(self, request_id: int) -> GenerationResult | None:
        """The request's result once finished (None before); raises its failure."""
        with self._lock:
            if request_id in self.failed:
                self.events.pop(request_id, None)
                raise self.failed.pop(request_id)
            if request_id in self.results:
                self.events.pop(request_id, None)
                return self.results.pop(request_id)
            return None

    def _failure(self, request_ids: Iterable[int]) -> BaseException | None:
        """The error to raise for a call holding these requests, if a step failed them: a
        request's own error before a StepFailed."""
        with self._lock:
            errors = [self.failed[rid] for rid in request_ids if rid in self.failed]
        return next((e for e in errors if not isinstance(e, StepFailed)), errors[0] if errors else None)

    def result(self, request_id: int) -> GenerationResult:
        """Step until the request finishes; its result."""
        try:
            while (result := self._take(request_id)) is None:
                self.step()
            return result
        except BaseException:
            self.abort(request_id)  # e.g. Ctrl-C between steps: the row must not run on
            raise

    def stream(self, request_id: int) -> Iterator[TokenEvent]:
        """The request's TokenEvents as they come; the generator's return value is its result.
        Closing it early (or an exception in the caller) aborts the request."""
        queue = self.events[request_id]
        finished = False
        try:
            while True:
                while queue:
                    yield queue.popleft()
                result = self._take(request_id)
                if result is not None:
                    finished = True
                    return result
                self.step()
        finally:
            if not finished:  # (from a finalizer too, perhaps mid-step in another thread: deferred)
                self.abandon(request_id)

    def abandon(self, request_id: int) -> None:
        """Abort the request at the next step (safe from any thread, also a finalizer)."""
        self._abandoned.append(request_id)

    def run_all(self, requests: list, batch_size: int) -> list:
        """The GenerationResult of each request, in order, with at most batch_size of them in the
        engine at once (a new one joins as one finishes)."""
        results = [None] * len(requests)

        def finish(index, done, _):
            results[index] = done[0]

        self.decode_all(range(len(requests)), lambda i: ([requests[i]], None), finish, batch_size)
        return results

    def decode_all(self, items: Iterable, build: Callable, finish: Callable, batch_size: int) -> None:
        """Decode many items with at most batch_size requests in the engine; the next item joins
        as room frees. build(item) → (list of Requests, context), or None to skip the item (the
        caller has answered it); finish(item, [GenerationResult per request], context) once all
        of an item's requests finished. On an exception (a failed step, Ctrl-C) the requests
        still running are aborted."""
        waiting, active = deque(items), {}   # active: item key → [item, context, {request id: result}]
        running, keys = 0, itertools.count()
        try:
            while waiting or active:
                while waiting and running < batch_size:
                    item = waiting.popleft()
                    built = build(item)
                    if built is not None:
                        requests, context = built
                        active[next(keys)] = [item, context, {self.submit(r): None for r in requests}]
                        running += len(requests)
                if not active:
                    continue
                self.step()
                error = self._failure(rid for _, _, results in active.values() for rid in results)
                if error is not None:
                    raise error
                for key, (item, context, results) in list(active.items()):
                    for request_id, result in results.items():
                        if result is None and (result := self._take(request_id)) is not None:
                            results[request_id] = result
                            running -= 1
                    if all(r is not None for r in results.values()):
                        del active[key]
                        finish(item, list(results.values()), context)
        except BaseException:
            for _, _, results in active.values():
                for request_id, result in results.items():
                    if result is None:
                        self.abort(request_id)
            raise

    def abort(self, request_id: int) -> None:
        with self._lock:
            self.engine.abort(request_id)
            self.events.pop(request_id, None)
            self.results.pop(request_id, None)
            self.failed.pop(request_id, None)


def run_all(target, proposer, requests: list[Request], tokenizer=None, max_batch_size: int | None = None,
            batch_guard: bool = False, **engine_options) -> list[GenerationResult]:
    """Decode every request through one engine (a continuous batch; engine_options: Engine's
    other arguments); results in order."""
    driver = Driver(Engine(target, proposer, tokenizer, max_batch_size, batch_guard, **engine_options))
    ids = [driver.submit(request) for request in requests]
    return [driver.result(request_id) for request_id in ids]


def run(target, proposer, prompt_ids: list[int], config: DecodeConfig, tokenizer=None,
        **engine_options) -> GenerationResult:
    """Decode one prompt to the end (a batch of one)."""
    return run_all(target, proposer, [Request(prompt_ids, config)], tokenizer, **engine_options)[0]
