"""The engine's one owner: a thread that adds, steps and aborts through a Driver, while HTTP
handlers (on the event loop) submit requests and read their outputs (continuous batching across
clients).

Handlers never touch the engine. They put commands in the worker's inbox; the worker applies
them between steps, so a request joins the running batch at the next step and an abort frees its
row before the next one. The Driver delivers each step's outputs, which go back to each handler's
asyncio queue with `call_soon_threadsafe`. A step that raises fails the requests in it (the
Driver's rule, Engine.fail: the request at fault gets the error, the others a retryable
StepFailed), empties the caches, and the worker goes on serving.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from dataclasses import dataclass, field

from specdecode.engine.driver import Driver
from specdecode.engine.engine import Engine, StepFailed, StepOutput
from specdecode.engine.request import Request
from specdecode.engine.threads import ComputeThread


log = logging.getLogger("specdecode.serve")


class QueueFull(Exception):
    """More requests are waiting than the server takes (HTTP 429)."""


class ShuttingDown(Exception):
    """The server is stopping: no new requests, and in-flight ones end (HTTP 503)."""


@dataclass
class Handle:
    """A submitted request, as its handler sees it: `queue` yields StepOutputs, then an Exception
    or None (finished)."""

    request: Request
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    request_id: int | None = None
    submitted: float = field(default_factory=time.perf_counter)


class EngineWorker:
    """Runs `engine` in a thread.

    Args:
        engine: the engine it owns from now on.
        max_queue: requests that may wait for a free row; one more is refused (QueueFull).
        on_step: called in the worker thread with each step's outputs and wall seconds (metrics).
    """

    def __init__(self, engine: Engine, max_queue: int, on_step=None):
        self.engine, self.max_queue, self.on_step = engine, max_queue, on_step
        self.driver = Driver(engine, deliver=self._route)
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._handles: dict[int, Handle] = {}
        self._pending = 0            # submitted, not yet added (read by handlers for 429)
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = False
        self._thread = ComputeThread(self._run, name="specdecode-engine")

    def start(self) -> None:
        self._thread.start()

    @property
    def num_waiting(self) -> int:
        return self._pending + len(self.engine.waiting)

    @property
    def num_running(self) -> int:
        return len(self.engine.running)

    def submit(self, *handles: Handle) -> None:
        """Queue requests (from the event loop): all of them (a request's n choices) or none.

        Raises:
            QueueFull: there is no room for them all (max_queue requests may wait for a row).
            ShuttingDown: the server is stopping.
        """
        with self._lock:
            if self._stop:
                raise ShuttingDown("the server is shutting down")
            capacity = self.engine.capacity
            free = max(0, capacity - self.num_running) if capacity is not None else 1 << 30
            if self.num_waiting + len(handles) > self.max_queue + free:
                needs = f"; this request needs {len(handles)} rows (n, prompts)" if len(handles) > 1 else ""
                raise QueueFull(f"{self.num_waiting} requests are waiting (--max-queue {self.max_queue}){needs}")
            self._pending += len(handles)
            # under the lock: a submit that passed the check is in the inbox before shutdown()
            # can set _stop, so the thread's last drain sees it and answers it
            for handle in handles:
                self._inbox.put(("add", handle))
        self._wake.set()

    def abort(self, handle: Handle) -> None:
        """Abort a request (client gone); a no-op once it finished."""
        self._inbox.put(("abort", handle))
        self._wake.set()

    def shutdown(self) -> None:
        """Refuse new requests and end every in-flight one with ShuttingDown (any thread; returns at once)."""
        with self._lock:
            self._stop = True
        self._wake.set()

    def stop(self, timeout: float = 30.0) -> None:
        """shutdown(), then wait for the thread to end."""
        self.shutdown()
        if self._thread.is_alive():
            self._thread.join(timeout)

    def _run(self) -> None:
        while True:
            self._apply_inbox()
            if self._stop:
                self._apply_inbox()  # what was submitted before _stop was set: answered below
                self._shut_down()
                return
            if not self.engine.has_work:
                self._wake.wait(0.5)
                self._wake.clear()
                continue
            start = time.perf_counter()
            try:
                outputs = self.driver.step()
            except Exception:  # one bad step must not stop the server (its requests got their errors)
                log.exception("an engine step failed; every request in it got an error")
                continue
            if self.on_step is not None and outputs:
                self.on_step(outputs, time.perf_counter() - start)

    def _apply_inbox(self) -> None:
        while True:
            try:
                command, handle = self._inbox.get_nowait()
            except queue.Empty:
                return
            if command == "add":
                with self._lock:
                    self._pending -= 1
                try:
                    handle.request_id = self.driver.submit(handle.request)
                except Exception as err:
                    self._send(handle, err)
                    continue
                self._handles[handle.request_id] = handle
            elif handle.request_id in self._handles:
                del self._handles[handle.request_id]
                self.driver.abort(handle.request_id)

    def _route(self, request_id: int, item: StepOutput | BaseException) -> None:
        """The Driver's delivery: a StepOutput (then None once finished) or a failure, to the handler."""
        handle = self._handles.get(request_id)
        if handle is None:
            return
        if isinstance(item, BaseException):
            if not isinstance(item, StepFailed):
                log.warning("request %d failed its step: %s: %s", request_id, type(item).__name__, item)
            del self._handles[request_id]
            self._send(handle, item)
            return
        self._send(handle, item)
        if item.result is not None:
            del self._handles[request_id]
            self._send(handle, None)

    def _shut_down(self) -> None:
        """Every request in the engine ends with ShuttingDown."""
        for request_id, handle in list(self._handles.items()):
            self.driver.abort(request_id)
            self._send(handle, ShuttingDown("the server is shutting down"))
        self._handles.clear()

    @staticmethod
    def _send(handle: Handle, item) -> None:
        try:
            handle.loop.call_soon_threadsafe(handle.queue.put_nowait, item)
        except RuntimeError:  # the handler's loop is closed: nobody is listening
            pass
