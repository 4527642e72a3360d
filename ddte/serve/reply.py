"""A queued request's answer, whole or streamed, over all its choices: OpenAI's response and chunk shapes, each
choice by its index, log-probabilities where asked (:mod:`ddte.serve.logprobs`), ``echo``'s prompt first.

A stream tells a choice's first chunk when its first step ran (the chat role goes with the first token), then each
delta as its job makes it final, then the choice's finish; the usage chunk and ``[DONE]`` come once every choice
has finished. Usage counts each prompt once and exactly the tokens each choice answered.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from fastapi import Request
from fastapi.responses import JSONResponse

from ddte.serve.errors import error_body
from ddte.serve.job import Answer, Event, ServedChoice
from ddte.serve.logprobs import TokenNames, chat_logprobs, completion_logprobs
from ddte.serve.requests import CompletionRequest


@dataclass
class Reply:
    """A queued request on its way back: its jobs (one per choice) and their shared event queue, the HTTP request,
    the checked request, the response's id and fingerprint, and how to count its outcome."""

    jobs: list[ServedChoice]
    events: asyncio.Queue[Event]
    http: Request
    parsed: CompletionRequest
    ident: str
    model: str
    fingerprint: str
    names: TokenNames
    count: Callable[[str], None]
    closing: Callable[[], bool]
    created: int = field(default_factory=lambda: int(time.time()))

    def cancel(self) -> None:
        for job in self.jobs:
            job.cancel()

    def left(self) -> None:
        """The client left: its jobs are cancelled."""
        self.cancel()
        self.count("499")

    def cut(self) -> None:
        """The handler was cancelled: by uvicorn, when an answer outlasts a stop (503), or as its client left (499)."""
        self.cancel()
        self.count("503" if self.closing() else "499")

    def body(self, choices: list[dict], **extra) -> dict:
        kind = ("chat.completion" if self.parsed.chat else "text_completion") if not self.parsed.stream else (
            "chat.completion.chunk" if self.parsed.chat else "text_completion")
        return {"id": self.ident, "object": kind, "created": self.created, "model": self.model,
                "system_fingerprint": self.fingerprint, "choices": choices, **extra}

    def usage(self, answers: dict[int, Answer]) -> dict:
        prompt, completion = self.parsed.prompt_tokens, sum(len(a.tokens) for a in answers.values())
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    def prompt_entries(self, job: ServedChoice) -> tuple[list[int], list]:
        """The echoed prompt's tokens and their log-probabilities (the first has none)."""
        ids = list(job.prompt_ids)
        entries = [None, *job.prompt_logprobs][: len(ids)]
        return ids, entries + [None] * (len(ids) - len(entries))


async def next_event(reply: Reply) -> Event | None:
    """The next event of any of the reply's jobs, or None once the client has disconnected (its jobs are then
    cancelled and counted)."""
    while True:
        try:
            return await asyncio.wait_for(reply.events.get(), timeout=0.25)
        except TimeoutError:
            if await reply.http.is_disconnected():
                reply.left()
                return None


async def whole(reply: Reply):
    """Every choice's answer in one response (the first error answers instead, its other choices cancelled)."""
    answers: dict[int, Answer] = {}
    try:
        while len(answers) < len(reply.jobs):
            event = await next_event(reply)
            if event is None:
                return JSONResponse(error_body("client closed the request", 499), status_code=499)
            if event.kind == "error":
                reply.cancel()
                reply.count(str(event.status))
                return JSONResponse(error_body(event.text, event.status), status_code=event.status)
            if event.kind == "done":
                answers[event.index] = event.answered
    except asyncio.CancelledError:
        reply.cut()
        raise
    reply.count("200")
    choices = [_whole_choice(reply, job, answers[job.choice.index]) for job in reply.jobs]
    extra = {"ddte": answers[0].ddte} if len(answers) == 1 else {}  # several choices: each carries its own
    return JSONResponse(reply.body(choices, usage=reply.usage(answers), **extra))


def _whole_choice(reply: Reply, job: ServedChoice, answer: Answer) -> dict:
    parsed, index = reply.parsed, job.choice.index
    if parsed.chat:
        logprobs = chat_logprobs(answer.logprobs, reply.names) if parsed.logprobs is not None else None
        return {"index": index, "message": {"role": "assistant", "content": answer.text}, "logprobs": logprobs,
                "finish_reason": answer.finish_reason, "ddte": answer.ddte}
    text, logprobs = answer.text, None
    if parsed.echo:
        text = job.choice.prompt.shown(job.tokenizer) + text
    if parsed.logprobs is not None:
        ids, entries = reply.prompt_entries(job) if parsed.echo else ([], [])
        logprobs, _ = completion_logprobs(ids + answer.tokens, entries + answer.logprobs, reply.names)
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": answer.finish_reason,
            "ddte": answer.ddte}


@dataclass
class _Streamed:
    """What a stream has told of one choice: whether its first chunk went, and its text offset so far."""

    first: bool = True
    offset: int = 0


async def stream(reply: Reply) -> AsyncIterator[str]:
    """Server-sent events in OpenAI's chunk format, ``data: [DONE]`` last; the jobs are cancelled if the client
    goes. The outcome is counted when the stream ends: 200 done, the error's status, or 499 for a client that
    left."""
    told = {job.choice.index: _Streamed() for job in reply.jobs}
    jobs = {job.choice.index: job for job in reply.jobs}
    answers: dict[int, Answer] = {}
    try:
        while len(answers) < len(jobs):
            event = await next_event(reply)
            if event is None:
                return
            if event.kind == "error":
                reply.cancel()
                reply.count(str(event.status))
                yield _sse(error_body(event.text, event.status))
                return
            if event.kind == "text":
                chunk = _delta(reply, jobs[event.index], event, told[event.index])
            else:
                answers[event.index] = event.answered
                chunk = _finish(reply, event.index, event.answered)
            if chunk is not None:
                yield _sse(chunk)
    except (asyncio.CancelledError, GeneratorExit):
        reply.cut()
        raise
    reply.count("200")
    if reply.parsed.include_usage:
        yield _sse(reply.body([], usage=reply.usage(answers)))
    yield "data: [DONE]\n\n"


def _sse(body: dict) -> str:
    return f"data: {json.dumps(body)}\n\n"


def _delta(reply: Reply, job: ServedChoice, event: Event, told: _Streamed) -> dict | None:
    """A text event's chunk (None: nothing to tell): the chat role with a choice's first, ``echo``'s prompt before
    a completion's first delta, each with its tokens' log-probabilities where asked."""
    parsed, first = reply.parsed, told.first
    told.first = False
    asked = parsed.logprobs is not None
    if parsed.chat:
        if not (first or event.text or (asked and event.tokens)):
            return None
        delta = {"role": "assistant", "content": event.text} if first else {"content": event.text}
        logprobs = chat_logprobs(event.logprobs, reply.names) if asked else None
        return reply.body([{"index": event.index, "delta": delta, "logprobs": logprobs, "finish_reason": None}])
    ids, entries, text = list(event.tokens), list(event.logprobs), event.text
    if first and parsed.echo:
        prompt_ids, prompt_entries = reply.prompt_entries(job)
        ids, entries, text = prompt_ids + ids, prompt_entries + entries, job.choice.prompt.shown(job.tokenizer) + text
    if not (text or (asked and ids)):
        return None
    logprobs = None
    if asked:
        logprobs, told.offset = completion_logprobs(ids, entries, reply.names, told.offset)
    return reply.body([{"index": event.index, "text": text, "logprobs": logprobs, "finish_reason": None}])


def _finish(reply: Reply, index: int, answer: Answer) -> dict:
    choice = ({"index": index, "delta": {}, "logprobs": None, "finish_reason": answer.finish_reason}
              if reply.parsed.chat else
              {"index": index, "text": "", "logprobs": None, "finish_reason": answer.finish_reason})
    return reply.body([choice], ddte=answer.ddte)
