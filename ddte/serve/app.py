"""The HTTP app: OpenAI's ``/v1/completions`` and ``/v1/chat/completions`` (plain and server-sent events),
``/v1/models``, ``/health`` and ``/metrics``, over one loaded pair and one policy (:class:`Served`).

Every request is read and decoded in one place (:mod:`ddte.serve.body`) and checked whole, off the event loop, before
it is queued (:mod:`ddte.serve.requests`); a refusal is an OpenAI error object with status 400 (413 for a body over
the limit), a full queue 429, a server shutting down 503. A client that disconnects, streamed or not, cancels its job:
the generation ends at its next step and the worker takes the next request. ``/metrics`` counts each request once by
what happened to it: 200, its refusal's status, 499 for a client that left, 500, 503.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from ddte.serve.batching import BatchRunner
from ddte.serve.body import ClientLeft, decode_json, read_body
from ddte.serve.metrics import ServerMetrics
from ddte.serve.requests import CompletionRequest, RequestError, parse_request
from ddte.serve.server import DEFAULT_MAX_BODY_BYTES
from ddte.serve.worker import Job, Worker

if TYPE_CHECKING:
    from decode.batch import BatchDecoder
    from decode.pair import LoadedPair
    from decode.policies.base import PolicySource
    from decode.verifiers.base import Verifier

logger = logging.getLogger(__name__)
WORKER_JOIN_SECONDS = 10.0  # at shutdown, after the drain: the running generation ends at its next step


@dataclass
class Served:
    """What the server runs: the pair, the one decoding step over it, the policy, and how requests are bounded.

    Attributes:
        model: the name clients give as ``model`` (``GET /v1/models`` lists it).
        decoder: the step every request decodes on, up to ``max_batch`` of them together (1: one at a time).
        policy: the policy source each request starts its runner from.
        method: the decoding method as ``ddte bench`` spells it (reported in every response's ``ddte`` object).
        verifier: what each request verifies its trees with.
    """

    model: str
    pair: LoadedPair
    decoder: BatchDecoder
    policy: PolicySource
    method: str
    max_queue: int = 16
    default_max_tokens: int = 256
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    max_batch: int = 1
    verifier: Verifier | None = None


def error_body(message: str, status: int, param: str | None = None, code: str | None = None) -> dict:
    kind = {429: "rate_limit_error", 503: "server_error", 500: "server_error"}.get(status, "invalid_request_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def create_app(served: Served):
    """The FastAPI app. Its lifespan starts the worker thread; at shutdown it fails what is still queued (503),
    cancels the running generations and waits for the thread at most :data:`WORKER_JOIN_SECONDS`."""
    metrics = ServerMetrics(lambda: worker.depth())
    worker = Worker(served.max_queue, BatchRunner(served, metrics, served.max_batch))

    @asynccontextmanager
    async def lifespan(_app):
        worker.start()
        try:
            yield
        finally:
            await asyncio.to_thread(worker.stop, WORKER_JOIN_SECONDS)

    app = FastAPI(title="ddte", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    _add_routes(app, served, worker, metrics)
    app.state.worker, app.state.metrics = worker, metrics
    return app


def _add_routes(app, served: Served, worker: Worker, metrics: ServerMetrics) -> None:
    @app.get("/health")
    async def health():
        return {"status": "ok", "model": served.model, "method": served.method, "queue_depth": worker.depth()}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": served.model, "object": "model", "created": 0,
                                            "owned_by": "ddte"}]}

    @app.get("/metrics")
    async def prometheus():
        return PlainTextResponse(metrics.render(), media_type="text/plain; version=0.0.4")

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await _answer(request, False, served, worker, metrics)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await _answer(request, True, served, worker, metrics)


async def _answer(request: Request, chat: bool, served: Served, worker: Worker, metrics: ServerMetrics):
    """One completion request, start to end; every outcome counted once in ``/metrics`` by its status (499: the
    client left; a stream's outcome is counted when it ends)."""
    endpoint = "chat" if chat else "completions"

    def count(outcome: str) -> None:
        metrics.request(endpoint, outcome)

    def refuse(message: str, status: int, param: str | None = None, code: str | None = None):
        count(str(status))
        return JSONResponse(error_body(message, status, param, code), status_code=status)

    try:
        raw = await read_body(request, served.max_body_bytes)
        parsed = await asyncio.to_thread(_checked_request, raw, chat, served)  # tokenizing can take seconds
    except ClientLeft:
        count("499")
        return Response(status_code=499)
    except RequestError as err:
        return refuse(str(err), err.status, err.param, err.code)
    except Exception:  # a bug: logged with its traceback, answered as OpenAI's error object
        logger.exception("ddte serve: a request failed")
        return refuse("the server failed to read the request", 500)
    job = Job(parsed, served.pair.tokenizer, asyncio.get_running_loop())
    if not worker.submit(job):
        if worker.closing:
            return refuse("the server is shutting down", 503)
        return refuse(f"the queue is full ({served.max_queue} requests waiting); retry later", 429, code="queue_full")
    ident = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
    reply = _Reply(job, request, parsed, ident, served.model, count, lambda: worker.closing)
    if parsed.stream:
        return StreamingResponse(_stream(reply), media_type="text/event-stream")
    return await _whole(reply)


def _checked_request(raw: bytes, chat: bool, served: Served) -> CompletionRequest:
    """The body decoded and checked, the prompt tokenized (off the event loop: a long prompt takes a while)."""
    pair = served.pair
    return parse_request(decode_json(raw), chat, served.model, pair.tokenizer, pair.context_limit,
                         served.decoder.vocab, served.default_max_tokens)


@dataclass
class _Reply:
    """A queued request on its way back: its job, the HTTP request, the checked request, the response's id, and how
    to count its outcome."""

    job: Job
    http: Request
    parsed: CompletionRequest
    ident: str
    model: str
    count: Callable[[str], None]
    closing: Callable[[], bool]

    def left(self) -> None:
        """The client left: its job is cancelled."""
        self.job.cancel()
        self.count("499")

    def cut(self) -> None:
        """The handler was cancelled: by uvicorn, when an answer outlasts a stop (503), or as its client left (499)."""
        self.job.cancel()
        self.count("503" if self.closing() else "499")


def _usage(request: CompletionRequest, completion_tokens: int) -> dict:
    prompt = len(request.prompt_ids)
    return {"prompt_tokens": prompt, "completion_tokens": completion_tokens, "total_tokens": prompt + completion_tokens}


async def _next_event(reply: _Reply) -> object | None:
    """The job's next event, or None once the client has disconnected (the job is then cancelled and counted)."""
    while True:
        try:
            return await asyncio.wait_for(reply.job.events.get(), timeout=0.25)
        except TimeoutError:
            if await reply.http.is_disconnected():
                reply.left()
                return None


async def _whole(reply: _Reply):
    try:
        event = await _next_event(reply)  # a whole answer's only event: done, or an error
    except asyncio.CancelledError:
        reply.cut()
        raise
    if event is None:
        return JSONResponse(error_body("client closed the request", 499), status_code=499)
    reply.count("200" if event.kind == "done" else str(event.status))
    if event.kind == "error":
        return JSONResponse(error_body(event.text, event.status), status_code=event.status)
    parsed, result, text = reply.parsed, event.result, event.result["text"]
    choice = ({"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": result["finish_reason"]}
              if parsed.chat else
              {"index": 0, "text": text, "logprobs": None, "finish_reason": result["finish_reason"]})
    return JSONResponse({"id": reply.ident, "object": "chat.completion" if parsed.chat else "text_completion",
                         "created": int(time.time()), "model": reply.model, "choices": [choice],
                         "usage": _usage(parsed, result["completion_tokens"]), "ddte": result["ddte"]})


async def _stream(reply: _Reply) -> AsyncIterator[str]:
    """Server-sent events in OpenAI's chunk format, ``data: [DONE]`` last; the job is cancelled if the client goes.
    The outcome is counted when the stream ends: 200 done, the error's status, or 499 for a client that left."""
    parsed, created = reply.parsed, int(time.time())
    kind = "chat.completion.chunk" if parsed.chat else "text_completion"

    def chunk(text: str | None, finish: str | None, first: bool = False, **extra) -> str:
        if parsed.chat:
            delta = {"role": "assistant", "content": ""} if first else ({"content": text} if text is not None else {})
            choice = {"index": 0, "delta": delta, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
        body = {"id": reply.ident, "object": kind, "created": created, "model": reply.model, "choices": [choice],
                **extra}
        return f"data: {json.dumps(body)}\n\n"

    try:
        if parsed.chat:
            yield chunk(None, None, first=True)
        while (event := await _next_event(reply)) is not None and event.kind == "text":
            yield chunk(event.text, None)
    except (asyncio.CancelledError, GeneratorExit):
        reply.cut()
        raise
    if event is None:
        return
    reply.count("200" if event.kind == "done" else str(event.status))
    if event.kind == "error":
        yield f"data: {json.dumps(error_body(event.text, event.status))}\n\n"
        return
    result = event.result
    yield chunk(None if parsed.chat else "", result["finish_reason"], ddte=result["ddte"])
    if parsed.include_usage:
        usage = {"id": reply.ident, "object": kind, "created": created, "model": reply.model, "choices": [],
                 "usage": _usage(parsed, result["completion_tokens"])}
        yield f"data: {json.dumps(usage)}\n\n"
    yield "data: [DONE]\n\n"
