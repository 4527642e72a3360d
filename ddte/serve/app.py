"""The HTTP app: OpenAI's ``/v1/completions`` and ``/v1/chat/completions`` (plain and server-sent events),
``/v1/models`` and ``/v1/models/{id}``, ``/health`` and ``/metrics``, over one loaded pair and one policy
(:class:`Served`); with ``cors_origins``, CORS for those origins (browser clients; preflight ``OPTIONS`` answered).

Every request is read and decoded in one place (:mod:`ddte.serve.body`) and checked whole, off the event loop, before
it is queued (:mod:`ddte.serve.requests`); a refusal is an OpenAI error object with status 400 (404 for a model not
served, 413 for a body over the limit), a full queue 429 with ``Retry-After``, a server shutting down 503. Each choice
of a request is a job of its own in the queue (:mod:`ddte.serve.job`); the answer gathers them
(:mod:`ddte.serve.reply`). A client that disconnects, streamed or not, cancels its jobs: each generation ends at its
next step and the worker takes the next. ``/metrics`` counts each request once by what happened to it: 200, its
refusal's status, 499 for a client that left, 500, 503. Every response names the server's ``system_fingerprint``
(the pair, its kernels and the policy: :func:`fingerprint`).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from ddte.serve.batching import BatchRunner
from ddte.serve.body import ClientLeft, decode_json, read_body
from ddte.serve.errors import RequestError, error_body
from ddte.serve.job import Event, ServedChoice
from ddte.serve.logprobs import TokenNames
from ddte.serve.metrics import ServerMetrics
from ddte.serve.reply import Reply, stream, whole
from ddte.serve.requests import CompletionRequest, parse_request
from ddte.serve.server import DEFAULT_MAX_BODY_BYTES
from ddte.serve.worker import Worker

if TYPE_CHECKING:
    from decode.batch import BatchDecoder
    from decode.pair import LoadedPair
    from decode.policies.base import PolicySource
    from decode.verifiers.base import Verifier

logger = logging.getLogger(__name__)
WORKER_JOIN_SECONDS = 10.0  # at shutdown, after the drain: the running generation ends at its next step
RETRY_AFTER_SECONDS = 1  # a full queue's 429: a slot frees as soon as any request ends


@dataclass
class Served:
    """What the server runs: the pair, the one decoding step over it, the policy, and how requests are bounded.

    Attributes:
        model: the name clients give as ``model`` (``GET /v1/models`` lists it).
        decoder: the step every request decodes on, up to ``max_batch`` of them together (1: one at a time).
        policy: the policy source each request starts its runner from.
        method: the decoding method as ``ddte bench`` spells it (reported in every response's ``ddte`` object).
        verifier: what each request verifies its trees with.
        cors_origins: the origins browsers may call from (``--cors-origin``; ``*`` any); none: no CORS headers.
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
    cors_origins: tuple[str, ...] = ()


def fingerprint(served: Served) -> str:
    """OpenAI's ``system_fingerprint``: what decides the answers beside the request (the pair's folders, the kernel
    path of each model, the method), hashed short; the same on every restart with the same flags."""
    choice = served.pair.kernel_choice
    kernels = f"{choice.target},{choice.draft}" if choice is not None else "default"
    paths = ",".join(f"{role}={served.pair.paths[role]}" for role in sorted(served.pair.paths))
    return "fp_" + hashlib.sha256(f"{paths}|{kernels}|{served.method}".encode()).hexdigest()[:12]


def create_app(served: Served):
    """The FastAPI app. Its lifespan starts the worker thread; at shutdown it fails what is still queued (503),
    cancels the running generations and waits for the thread at most :data:`WORKER_JOIN_SECONDS`."""
    worker: Worker  # the metrics read its depth: made next, from them
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
    if served.cors_origins:
        from fastapi.middleware.cors import CORSMiddleware

        app.add_middleware(CORSMiddleware, allow_origins=list(served.cors_origins), allow_methods=["GET", "POST"],
                           allow_headers=["*"], max_age=600)
    _add_routes(app, served, worker, metrics)
    app.state.worker, app.state.metrics = worker, metrics
    app.state.fingerprint, app.state.names = fingerprint(served), TokenNames(served.pair.tokenizer)
    return app


def _add_routes(app, served: Served, worker: Worker, metrics: ServerMetrics) -> None:
    @app.get("/health")
    async def health():
        return {"status": "ok", "model": served.model, "method": served.method, "queue_depth": worker.depth()}

    card = {"id": served.model, "object": "model", "created": 0, "owned_by": "ddte",
            "max_model_len": served.pair.context_limit}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [card]}

    @app.get("/v1/models/{name:path}")
    async def model(name: str):
        if name != served.model:
            return JSONResponse(error_body(f"model {name!r} is not served here; this server serves "
                                           f"{served.model!r}", 404, "model", "model_not_found"), status_code=404)
        return card

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

    def refuse(message: str, status: int, param: str | None = None, code: str | None = None, headers=None):
        count(str(status))
        return JSONResponse(error_body(message, status, param, code), status_code=status, headers=headers)

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
    events: asyncio.Queue[Event] = asyncio.Queue()
    loop, tokenizer = asyncio.get_running_loop(), served.pair.tokenizer
    jobs = [ServedChoice(parsed, choice, tokenizer, loop, events) for choice in parsed.choices()]
    for queued, job in enumerate(jobs):
        if not worker.submit(job):  # every choice or none: those queued already leave the queue
            for other in jobs[:queued]:
                other.cancel()
            if worker.closing:
                return refuse("the server is shutting down", 503)
            return refuse(f"the queue is full ({served.max_queue} requests waiting); retry later", 429,
                          code="queue_full", headers={"Retry-After": str(RETRY_AFTER_SECONDS)})
    ident = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
    state = request.app.state
    reply = Reply(jobs, events, request, parsed, ident, served.model, state.fingerprint, state.names, count,
                  lambda: worker.closing)
    if parsed.stream:
        return StreamingResponse(stream(reply), media_type="text/event-stream")
    return await whole(reply)


def _checked_request(raw: bytes, chat: bool, served: Served) -> CompletionRequest:
    """The body decoded and checked, the prompt tokenized (off the event loop: a long prompt takes a while)."""
    pair = served.pair
    return parse_request(decode_json(raw), chat, served.model, pair.tokenizer, pair.context_limit,
                         served.decoder.vocab, served.default_max_tokens, served.max_queue)
