"""The FastAPI app: OpenAI-style endpoints, metrics, health and the live page, over one
EngineWorker. Handlers validate, build an engine Request, submit it and relay its step outputs."""

from __future__ import annotations

import asyncio
import hmac
import json
import time
from contextlib import asynccontextmanager
from importlib import resources

from fastapi import FastAPI, Request as HttpRequest
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect

from specdecode.engine.engine import StepFailed
from specdecode.engine.output import HeldTokens
from specdecode.frontend import responses as protocol
from specdecode.frontend.schema import ApiError, ChatRequest, CompletionRequest, check_model, parse
from specdecode.serve.metrics import Metrics
from specdecode.serve.security import RequestGuard
from specdecode.serve.worker import EngineWorker, Handle, QueueFull, ShuttingDown

DISCONNECT_POLL_S = 0.5
MAX_BODY_BYTES = 8 << 20               # a larger body is refused before it is read


def create_app(decoder, *, model_name: str, max_queue: int = 64, api_key: str | None = None,
               host: str = "127.0.0.1", port: int = 8000, allowed_hosts=(), allowed_origins=()) -> FastAPI:
    """The server for a loaded SpeculativeDecoder; its engine is owned by the app's worker from now on.

    Args:
        decoder: a SpeculativeDecoder (models loaded).  model_name: the id clients send as `model`.
        max_queue: requests that may wait for a free row before 429.  api_key: if set, /v1/*
            needs `Authorization: Bearer <api_key>`.
        host, port: where the server listens; with allowed_hosts and allowed_origins, what
            serve.security.RequestGuard accepts (other sites' pages and rebound names are refused).
    """
    metrics_box: list[Metrics] = []
    worker = EngineWorker(decoder.engine, max_queue,
                          on_step=lambda outputs, seconds: metrics_box[0].observe_step(outputs, seconds))
    metrics = Metrics((lambda: worker.num_waiting, lambda: worker.num_running))
    metrics_box.append(metrics)

    @asynccontextmanager
    async def lifespan(app):
        worker.start()
        yield
        worker.stop()  # in-flight requests end (their streams close), then the thread exits

    app = FastAPI(title="specdecode", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.worker, app.state.metrics, app.state.decoder = worker, metrics, decoder
    app.add_middleware(RequestGuard, bound_host=host, port=port, allowed_hosts=tuple(allowed_hosts),
                       allowed_origins=tuple(allowed_origins))

    @app.exception_handler(ApiError)
    async def api_error(_, err: ApiError):
        metrics.requests.labels(status=str(err.status)).inc()
        headers = {"Retry-After": "1"} if err.status in (429, 503) else None
        return JSONResponse(err.body(), status_code=err.status, headers=headers)

    @app.exception_handler(HTTPException)
    async def http_error(_, err: HTTPException):  # unknown routes, wrong methods: the same error shape
        return JSONResponse(ApiError(err.status_code, str(err.detail)).body(), status_code=err.status_code,
                            headers=getattr(err, "headers", None))

    @app.exception_handler(ClientDisconnect)
    async def client_gone(_, err: ClientDisconnect):  # it left while sending its body: nobody reads this
        metrics.requests.labels(status="aborted").inc()
        return Response(status_code=499)

    @app.exception_handler(Exception)
    async def server_error(_, err: Exception):
        metrics.requests.labels(status="500").inc()
        return JSONResponse(ApiError(500, f"internal error ({type(err).__name__})").body(), status_code=500)

    def check_key(http: HttpRequest) -> None:
        if api_key is None:
            return
        scheme, _, given = http.headers.get("authorization", "").strip().partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), api_key.encode()):
            raise ApiError(401, "missing or wrong API key: send 'Authorization: Bearer <key>'", code="invalid_api_key")

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics_endpoint():
        return Response(metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/", response_class=HTMLResponse)
    async def page():
        return resources.files("specdecode.serve").joinpath("static/index.html").read_text("utf-8")

    model_card = {"id": model_name, "object": "model", "created": 0, "owned_by": "specdecode",
                  "specdecode": decoder.configuration()}

    @app.get("/v1/models")
    async def models(http: HttpRequest):
        check_key(http)
        return {"object": "list", "data": [model_card]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str, http: HttpRequest):
        check_key(http)
        if model_id != model_name:
            raise ApiError(404, f"model {model_id!r} does not exist; this server has {model_name!r}", "model",
                           "model_not_found")
        return model_card

    @app.post("/v1/completions")
    async def completions(http: HttpRequest):
        return await generate(http, CompletionRequest, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(http: HttpRequest):
        return await generate(http, ChatRequest, chat=True)

    async def generate(http: HttpRequest, kind, chat: bool):
        check_key(http)
        body = await read_json(http)
        req = parse(kind, body)
        check_model(req, model_name)
        # Tokenizing a long prompt takes a while: off the event loop, so other streams flow meanwhile.
        wire = await asyncio.to_thread(decoder.requests.from_wire, req)
        loop = asyncio.get_running_loop()
        handles = [Handle(request, loop) for request in wire.requests]  # one per completion
        room = worker.max_queue + (decoder.engine.capacity or len(handles))
        if len(handles) > room:
            raise ApiError(400, f"this request asks for {len(handles)} completions; this server holds at most {room} "
                                "at once (--max-queue and --max-batch-size): send fewer prompts or a smaller n",
                           "prompt" if len(wire.prompt_ids) > 1 else "n")
        try:
            worker.submit(*handles)
        except QueueFull as err:
            raise ApiError(429, f"server busy: {err}; retry later") from None
        except ShuttingDown as err:
            raise ApiError(503, str(err)) from None
        ids = protocol.ResponseIds(chat, model_name)
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return StreamingResponse(stream(handles, ids, wire, include_usage),
                                     media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        results = await wait(http, handles)
        if results is None:  # the client left; nobody reads this
            return Response(status_code=499)
        metrics.requests.labels(status="200").inc()
        return protocol.full_response(ids, results, wire.prompt_tokens, decoder.tokenizer, wire)

    async def read_json(http: HttpRequest):
        declared = http.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > MAX_BODY_BYTES:
            raise ApiError(413, f"the request body is larger than {MAX_BODY_BYTES >> 20} MiB")
        raw = await http.body()
        if len(raw) > MAX_BODY_BYTES:
            raise ApiError(413, f"the request body is larger than {MAX_BODY_BYTES >> 20} MiB")
        try:
            return json.loads(raw)
        except (ValueError, RecursionError):  # bad JSON, bad UTF-8, 5000-digit integers, deep nesting
            raise ApiError(400, "the request body is not valid JSON") from None

    def observe(handle: Handle, state: dict, output) -> None:
        now = time.perf_counter()
        tokens = len(output.events)
        if not tokens:
            return
        if state.get("last") is None:
            metrics.ttft.observe(now - handle.submitted)
        else:
            for _ in range(tokens):
                metrics.itl.observe((now - state["last"]) / tokens)
        state["last"] = now

    async def own_error(inbox: asyncio.Queue, failed: StepFailed) -> Exception:
        """Of the errors a failed step sent this request's choices (all at once), a choice's own
        error where one came, else `failed`."""
        for _ in range(3):  # the step's other items reach the inbox within a few loop turns
            await asyncio.sleep(0)
        while not inbox.empty():
            _, item = inbox.get_nowait()
            if isinstance(item, Exception) and not isinstance(item, StepFailed):
                return item
        return failed

    async def wait(http: HttpRequest, handles: list[Handle]):
        """The finished results (one per choice), or None after aborting the rows if the client
        went away first."""
        states, results = [{} for _ in handles], [None] * len(handles)
        inbox, tasks = merge(handles)
        running = len(handles)
        checked = float("-inf")  # check at once, then on a clock
        try:
            while running:
                try:
                    index, item = await asyncio.wait_for(inbox.get(), DISCONNECT_POLL_S)
                except asyncio.TimeoutError:
                    index, item = None, ...
                # A running row delivers every step, so the client is checked on a clock, not on silence.
                if time.perf_counter() - checked >= DISCONNECT_POLL_S:
                    checked = time.perf_counter()
                    if await http.is_disconnected():
                        for handle in handles:
                            worker.abort(handle)
                        metrics.requests.labels(status="aborted").inc()
                        return None
                if item is None:
                    running -= 1
                elif isinstance(item, Exception):
                    if isinstance(item, StepFailed):  # a sibling choice's own error, from the same step, is
                        item = await own_error(inbox, item)  # this request's: answer that one (500)
                    for handle in handles:
                        worker.abort(handle)
                    raise failure(item)
                elif item is not ...:
                    observe(handles[index], states[index], item)
                    results[index] = item.result or results[index]
        finally:
            for task in tasks:
                task.cancel()
        for result in results:
            count_tokens(result)
        return results

    def count_tokens(result) -> None:
        metrics.generation_tokens.inc(protocol.completion_tokens(result))

    async def stream(handles: list[Handle], ids, wire, include_usage: bool):
        outcome = "aborted"  # until the stream ends on its own
        echoes = [None if wire.echo is None else wire.echo[i // wire.n] for i in range(len(handles))]
        choices = [_ChoiceStream(ids, handle.request.config.logprobs is not None, decoder.tokenizer,
                                 len(echo or "")) for handle, echo in zip(handles, echoes)]
        states, results = [{} for _ in handles], [None] * len(handles)
        inbox, tasks = merge(handles)
        running = len(handles)
        try:
            if ids.chat:
                for index in range(len(handles)):
                    yield sse(protocol.chunk(ids, "", [], role=True, index=index))
            echoed = [echo is None for echo in echoes]
            while running:
                index, item = await inbox.get()
                if item is None:
                    running -= 1
                    continue
                if isinstance(item, Exception):
                    error = failure(item)
                    outcome = str(error.status)
                    yield sse(error.body())
                    break
                if not echoed[index]:  # a choice's first output: the prompt (and its logprobs) first
                    echoed[index] = True
                    prompt_ids = wire.prompt_ids[index // wire.n]
                    logprobs = (protocol.echo_logprobs(prompt_ids, item.prompt_logprobs, decoder.tokenizer)
                                if choices[index].logprobs else None)
                    yield sse(protocol.chunk(ids, echoes[index], [], logprobs=logprobs, index=index))
                observe(handles[index], states[index], item)
                tokens = [{"id": e.token_id, "text": e.text, "origin": e.origin} for e in item.events]
                text = "".join(e.text for e in item.events)
                if item.result is None:
                    if tokens:
                        yield sse(protocol.chunk(ids, text, tokens, stats=item.stats, index=index,
                                                 logprobs=choices[index].logprobs_of(item.events)))
                    continue
                results[index] = result = item.result
                count_tokens(result)
                yield sse(protocol.chunk(ids, text, tokens, protocol.finish_reason(result.finish_reason),
                                         stats=result.stats, index=index,
                                         logprobs=choices[index].logprobs_of(item.events, result)))
            else:
                outcome = "200"
                if include_usage:
                    completion = sum(protocol.completion_tokens(r) for r in results)
                    yield sse({**ids.base(chunk=True), "choices": [],
                               "usage": protocol.usage(wire.prompt_tokens, completion)})
            yield "data: [DONE]\n\n"
        finally:
            for task in tasks:
                task.cancel()
            if outcome != "200":  # the client went away or a choice failed: free the rows
                for handle in handles:
                    worker.abort(handle)
            metrics.requests.labels(status=outcome).inc()

    return app


def merge(handles: list[Handle]) -> tuple[asyncio.Queue, list[asyncio.Task]]:
    """One queue of (choice index, item) fed from every handle's queue as items come (each
    handle's items end with None or an Exception), and the tasks feeding it (cancel them)."""
    inbox: asyncio.Queue = asyncio.Queue()

    async def forward(index: int, handle: Handle):
        while True:
            item = await handle.queue.get()
            inbox.put_nowait((index, item))
            if item is None or isinstance(item, Exception):
                return

    return inbox, [asyncio.create_task(forward(i, h)) for i, h in enumerate(handles)]


class _ChoiceStream:
    """One streamed choice's logprobs bookkeeping: a token's logprobs are sent once its text has
    started reaching the client (a stop string may cut the text inside it: HeldTokens)."""

    def __init__(self, ids, logprobs: bool, tokenizer, shift: int = 0):
        self.ids, self.logprobs, self.tokenizer, self.shift = ids, logprobs, tokenizer, shift  # shift: echo's length
        self.held = HeldTokens()

    def logprobs_of(self, events, result=None) -> dict | None:
        """The chunk's logprobs for these events (result: the choice's last chunk)."""
        if not self.logprobs:
            return None
        entries = self.held.push(events)
        if result is not None:  # the output's last tokens: those with text in it
            entries += self.held.finish(result.num_returned_tokens)[0]
        return protocol.logprobs_body(self.ids.chat, [e.logprob for e in entries],
                                      [self.shift + e.text_offset for e in entries], self.tokenizer)


def failure(err: Exception) -> ApiError:
    """The error a request's client gets when its generation could not finish: 503 (retry) when the
    server is shutting down or another request's failure ended the step, 500 for its own."""
    if isinstance(err, (ShuttingDown, StepFailed)):
        return ApiError(503, str(err))
    return ApiError(500, f"generation failed ({type(err).__name__}); the server goes on")


def sse(body: dict) -> str:
    return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"
