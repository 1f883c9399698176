"""Running the engine for callers that wait on their own requests: single calls, streams, lists
and tools. Every one of them only adds requests and routes what `Engine.step` returns."""

from __future__ import annotations

from collections import deque
from typing import Callable, Iterable, Iterator

from specdecode.engine.engine import Engine
from specdecode.engine.request import DecodeConfig, GenerationResult, Request, TokenEvent


class Driver:
    """Steps one engine on behalf of several waiting callers (one thread).

    Events of a request submitted with keep_events are queued until its stream reads them;
    results wait in `results` until taken.
    """

    def __init__(self, engine: Engine):
        self.engine = engine
        self.events: dict[int, deque[TokenEvent]] = {}
        self.results: dict[int, GenerationResult] = {}

    def submit(self, request: Request, keep_events: bool = False) -> int:
        request_id = self.engine.add(request)
        if keep_events:
            self.events[request_id] = deque()
        return request_id

    def step(self) -> None:
        for output in self.engine.step():
            queue = self.events.get(output.request_id)
            if queue is not None:
                queue.extend(output.events)
            if output.result is not None:
                self.results[output.request_id] = output.result

    def result(self, request_id: int) -> GenerationResult:
        """Step until the request finishes; its result."""
        while request_id not in self.results:
            self.step()
        self.events.pop(request_id, None)
        return self.results.pop(request_id)

    def stream(self, request_id: int) -> Iterator[TokenEvent]:
        """The request's TokenEvents as they come; the generator's return value is its result."""
        queue = self.events[request_id]
        while True:
            while queue:
                yield queue.popleft()
            if request_id in self.results:
                del self.events[request_id]
                return self.results.pop(request_id)
            self.step()

    def decode_all(self, items: Iterable, build: Callable, finish: Callable, batch_size: int) -> None:
        """Decode many items with at most batch_size in the engine; the next joins as one finishes.
        build(item) → (Request, context), or None to skip the item (the caller has answered it);
        finish(item, GenerationResult, context) as each request finishes."""
        waiting, active = deque(items), {}
        while waiting or active:
            while waiting and len(active) < batch_size:
                item = waiting.popleft()
                built = build(item)
                if built is not None:
                    active[self.submit(built[0])] = (item, built[1])
            if not active:
                continue
            self.step()
            for request_id in [r for r in active if r in self.results]:
                item, context = active.pop(request_id)
                finish(item, self.results.pop(request_id), context)

    def abort(self, request_id: int) -> None:
        self.engine.abort(request_id)
        self.events.pop(request_id, None)
        self.results.pop(request_id, None)


def run_all(target, proposer, requests: list[Request], tokenizer=None, max_batch_size: int | None = None,
            batch_guard: bool = False) -> list[GenerationResult]:
    """Decode every request through one engine (a continuous batch); results in order."""
    driver = Driver(Engine(target, proposer, tokenizer, max_batch_size, batch_guard))
    ids = [driver.submit(request) for request in requests]
    return [driver.result(request_id) for request_id in ids]


def run(target, proposer, prompt_ids: list[int], config: DecodeConfig, tokenizer=None) -> GenerationResult:
    """Decode one prompt to the end (a batch of one)."""
    return run_all(target, proposer, [Request(prompt_ids, config)], tokenizer)[0]
