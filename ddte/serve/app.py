"""The HTTP app: OpenAI's ``/v1/completions`` and ``/v1/chat/completions`` (plain and server-sent events),
``/v1/models``, ``/health`` and ``/metrics``, over one loaded pair and one policy (:class:`Served`).

Every request is checked whole before it is queued (:mod:`ddte.serve.requests`); a refusal is an OpenAI error
object with status 400, a full queue 429, a server shutting down 503. A client that disconnects, streamed or not,
cancels its job: the generation ends at its next step and the worker takes the next request.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from ddte.serve.metrics import ServerMetrics
from ddte.serve.requests import CompletionRequest, RequestError, parse_request
from ddte.serve.worker import Job, Worker, new_seed


@dataclass
class Served:
    """What the server runs: the pair, one decoder and its policy, and how requests are bounded.

    Attributes:
        model: the name clients give as ``model`` (``GET /v1/models`` lists it).
        method: the decoding method as ``ddte bench`` spells it (reported in every response's ``ddte`` object).
    """

    model: str
    pair: object  # decode.pair.LoadedPair
    decoder: object  # decode.engine.SpeculativeDecoder
    policy: object  # decode.policies.base.Policy
    method: str
    max_queue: int = 16
    default_max_tokens: int = 256


def error_body(message: str, status: int, param: str | None = None, code: str | None = None) -> dict:
    kind = {429: "rate_limit_error", 503: "server_error", 500: "server_error"}.get(status, "invalid_request_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def create_app(served: Served):
    """The FastAPI app; its lifespan starts the worker thread and, on shutdown, fails what is still queued."""
    from decode.drafting.rng import TorchRandom

    pair = served.pair
    metrics_holder: dict = {}

    def run_job(job: Job) -> None:
        """The worker thread's work for one job: generate, then report."""
        request = job.request
        metrics = metrics_holder["metrics"]
        metrics.started()
        seed = request.seed if request.seed is not None else new_seed()
        generation = None
        try:
            generation = served.decoder.generate(request.prompt_ids, request.max_tokens, served.policy,
                                                 TorchRandom(seed), request.sampling, on_step=job.on_step)
        finally:
            stats = generation.stats if generation is not None else _empty_stats()
            ttft = job.first_token_at - job.enqueued if job.first_token_at is not None else None
            done = time.perf_counter()
            tpot = ((done - job.first_token_at) / (stats.new_tokens - 1)
                    if job.first_token_at is not None and stats.new_tokens > 1 else None)
            metrics.finished(len(request.prompt_ids), stats, ttft, tpot)
        if job.cancelled.is_set() and not job.stop_hit:
            return  # nobody is listening
        reason = "stop" if job.stop_hit or generation.stopped_by == "eos" else "length"
        job.finish({"finish_reason": reason, "completion_tokens": len(generation.tokens),
                    "ddte": _ddte_object(generation, served.method, seed)})

    worker = Worker(run_job, served.max_queue)
    metrics_holder["metrics"] = metrics = ServerMetrics(worker.depth)

    @asynccontextmanager
    async def lifespan(_app):
        worker.start()
        try:
            yield
        finally:
            await asyncio.to_thread(worker.stop, 60.0)

    app = FastAPI(title="ddte", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)

    def refuse(endpoint: str, message: str, status: int, param: str | None = None, code: str | None = None):
        metrics.request(endpoint, str(status))
        return JSONResponse(error_body(message, status, param, code), status_code=status)

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

    async def complete(request: Request, chat: bool):
        endpoint = "chat" if chat else "completions"
        try:
            body = json.loads(await request.body())
        except (json.JSONDecodeError, UnicodeDecodeError):
            return refuse(endpoint, "the request body is not valid JSON", 400)
        try:
            parsed = parse_request(body, chat, served.model, pair.tokenizer, pair.context_limit,
                                   served.decoder.vocab, served.default_max_tokens)
        except RequestError as err:
            return refuse(endpoint, str(err), err.status, err.param, err.code)
        job = Job(parsed, pair.tokenizer, asyncio.get_running_loop())
        if not worker.submit(job):
            if worker.closing:
                return refuse(endpoint, "the server is shutting down", 503)
            return refuse(endpoint, f"the queue is full ({served.max_queue} requests waiting); retry later", 429,
                          code="queue_full")
        ident = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        if parsed.stream:
            metrics.request(endpoint, "200")
            return StreamingResponse(_stream(job, request, parsed, ident, served.model),
                                     media_type="text/event-stream")
        return await _whole(job, request, parsed, ident, served.model, lambda s: metrics.request(endpoint, s))

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await complete(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await complete(request, chat=True)

    app.state.worker, app.state.metrics = worker, metrics
    return app


def _empty_stats():
    from decode.stats import GenerationStats

    return GenerationStats()


def _ddte_object(generation, method: str, seed: int) -> dict:
    """What ddte adds to OpenAI's response: the method, the seed (a request sent again with it gets the same answer),
    steps, mean acceptance length, draft and accepted tokens, the actions the policy chose, and the token ids."""
    stats = generation.stats
    return {"method": method, "seed": seed, "steps": stats.steps,
            "mean_acceptance_length": stats.new_tokens / stats.steps if stats.steps else None,
            "draft_tokens": stats.drafted_depth, "accepted_tokens": stats.accepted_tokens,
            "actions": dict(stats.action_counts), "token_ids": list(generation.tokens)}


def _usage(request: CompletionRequest, completion_tokens: int) -> dict:
    prompt = len(request.prompt_ids)
    return {"prompt_tokens": prompt, "completion_tokens": completion_tokens, "total_tokens": prompt + completion_tokens}


async def _next_event(job: Job, request) -> object | None:
    """The job's next event, or None once the client has disconnected (the job is then cancelled)."""
    while True:
        try:
            return await asyncio.wait_for(job.events.get(), timeout=0.25)
        except TimeoutError:
            if await request.is_disconnected():
                job.cancel()
                return None


async def _whole(job: Job, request, parsed: CompletionRequest, ident: str, model: str, count):
    event = await _next_event(job, request)  # a whole answer's only event: done, or an error
    if event is None:
        count("499")
        return JSONResponse(error_body("client closed the request", 499), status_code=499)
    if event.kind == "error":
        count(str(event.status))
        return JSONResponse(error_body(event.text, event.status), status_code=event.status)
    result, text = event.result, event.result["text"]
    count("200")
    choice = ({"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": result["finish_reason"]}
              if parsed.chat else
              {"index": 0, "text": text, "logprobs": None, "finish_reason": result["finish_reason"]})
    return JSONResponse({"id": ident, "object": "chat.completion" if parsed.chat else "text_completion",
                         "created": int(time.time()), "model": model, "choices": [choice],
                         "usage": _usage(parsed, result["completion_tokens"]), "ddte": result["ddte"]})


async def _stream(job: Job, request, parsed: CompletionRequest, ident: str, model: str) -> AsyncIterator[str]:
    """Server-sent events in OpenAI's chunk format, ``data: [DONE]`` last; the job is cancelled if the client goes."""
    created = int(time.time())
    kind = "chat.completion.chunk" if parsed.chat else "text_completion"

    def chunk(text: str | None, finish: str | None, first: bool = False, **extra) -> str:
        if parsed.chat:
            delta = {"role": "assistant", "content": ""} if first else ({"content": text} if text is not None else {})
            choice = {"index": 0, "delta": delta, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
        body = {"id": ident, "object": kind, "created": created, "model": model, "choices": [choice], **extra}
        return f"data: {json.dumps(body)}\n\n"

    try:
        if parsed.chat:
            yield chunk(None, None, first=True)
        while True:
            event = await _next_event(job, request)
            if event is None:
                return
            if event.kind == "text":
                yield chunk(event.text, None)
            elif event.kind == "error":
                yield f"data: {json.dumps(error_body(event.text, event.status))}\n\n"
                return
            else:
                result = event.result
                yield chunk(None if parsed.chat else "", result["finish_reason"], ddte=result["ddte"])
                if parsed.include_usage:
                    usage = {"id": ident, "object": kind, "created": created, "model": model, "choices": [],
                             "usage": _usage(parsed, result["completion_tokens"])}
                    yield f"data: {json.dumps(usage)}\n\n"
                yield "data: [DONE]\n\n"
                return
    except (asyncio.CancelledError, GeneratorExit):
        job.cancel()
        raise
