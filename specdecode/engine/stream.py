"""GenerationStream: one request's TokenEvents as the engine accepts them (generate(stream=True))."""

from __future__ import annotations

import dataclasses
import weakref
from typing import Iterator

from specdecode.engine.driver import Driver
from specdecode.engine.output import HeldTokens
from specdecode.engine.request import GenerationResult, TokenEvent


class GenerationStream:
    """Iterate (once) for TokenEvents as tokens are accepted; `.result` is set when it ends.
    Other calls on the same decoder may run meanwhile (from any thread): their rows share the
    engine's batch. `close()` aborts the request if it has not finished; so does dropping the
    stream unfinished (its row leaves at the engine's next step).

    Raises (while iterating):
        RuntimeError: iterated a second time, or the batch's step failed in another caller.
    """

    def __init__(self, driver: Driver, request_id: int):
        self._driver, self._request_id = driver, request_id
        self._started = False
        self.result: GenerationResult | None = None
        self._finalizer = weakref.finalize(self, driver.abandon, request_id)

    def __iter__(self) -> Iterator[TokenEvent]:
        if self._started:
            raise RuntimeError("a GenerationStream can be iterated only once")
        self._started = True
        # A token whose text a possible stop string holds back waits until its text is released:
        # if a stop cuts the output before it, it is past the cut and its logprob is dropped, as
        # result.logprobs and the server drop it (its id and any text it releases still come).
        held = HeldTokens()
        events = self._driver.stream(self._request_id)
        try:
            while True:
                try:
                    event = next(events)
                except StopIteration as end:
                    self.result = end.value
                    break
                yield from held.push([event])
        finally:
            events.close()  # stopped early: the request is aborted now
        self._finalizer.detach()
        kept, past = held.finish(self.result.num_returned_tokens)
        yield from kept
        yield from (dataclasses.replace(event, logprob=None) for event in past)

    def close(self) -> None:
        """Abort the request if it has not finished (its row leaves the batch)."""
        if self.result is None:
            self._finalizer.detach()
            self._driver.abort(self._request_id)
