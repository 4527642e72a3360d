"""One choice of a request on its way through the worker (:class:`ServedChoice`), and what it tells the waiting handler
(:class:`Event`).

A job turns the decoding step's reports into text as they come (after each step of the batch): it decodes its
tokens so far, holds back what could still become a stop string or is half a character, sends the rest to the
handler's event queue on the event loop, and asks the step to stop when a stop string appears or the client has
gone. Its first step is always told to a stream (the chat role goes with the first token, not before it ran). It
keeps each token's log-probability where the request asks, and answers exactly the tokens up to the one that
completed a stop string (what usage counts): a step may have accepted more past it.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from ddte.serve.requests import Choice, CompletionRequest
from decode.generation import TokenLogprob


@dataclass
class Answer:
    """A choice's whole answer: why it ended, its text and tokens (up to the stop string), their log-probabilities
    (where asked), its prompt's (with ``echo``), and ddte's own figures (:func:`ddte.serve.outcome.ddte_object`)."""

    finish_reason: str
    text: str
    tokens: list[int]
    logprobs: list[TokenLogprob]
    prompt_logprobs: list[TokenLogprob]
    ddte: dict


@dataclass
class Event:
    """What a job tells the waiting handler: ``text`` (a delta, with the tokens it releases and their
    log-probabilities; a choice's first carries its prompt's), ``done`` (with the :class:`Answer`) or ``error``."""

    kind: str
    index: int = 0
    text: str = ""
    tokens: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob] | None = None
    answer: Answer | None = None
    status: int = 500

    @property
    def answered(self) -> Answer:
        """A ``done`` event's answer."""
        if self.answer is None:
            raise ValueError(f"a {self.kind} event carries no answer")
        return self.answer


class ServedChoice:
    """One choice on its way through the worker. Its events reach the handler's event loop thread-safely, on
    ``events`` (shared by the choices of one request, each event naming its choice)."""

    def __init__(self, request: CompletionRequest, choice: Choice, tokenizer, loop: asyncio.AbstractEventLoop,
                 events: asyncio.Queue[Event] | None = None) -> None:
        self.request, self.choice, self.tokenizer, self.loop = request, choice, tokenizer, loop
        self.events: asyncio.Queue[Event] = events if events is not None else asyncio.Queue()
        self.cancelled = threading.Event()
        self.tokens: list[int] = []
        self.logprobs: list[TokenLogprob] = []  # one per token, where the request asks
        self.prompt_logprobs: list[TokenLogprob] = []
        self.kept: int | None = None  # tokens answered, once a stop string cut them (None: all)
        self.sent = 0  # characters of the text already final (sent, for a stream)
        self.text = ""  # a whole answer's final text, sent once with the result (no wake-up per step)
        self.ends: list[int] = []  # a stream with log-probabilities: the text's length after each token
        self.released = 0  # a stream: tokens sent with their text
        self.told = False  # a stream: whether its first event went
        self.stop_hit = False
        self.enqueued = time.perf_counter()
        self.first_token_at: float | None = None

    @property
    def prompt_ids(self) -> tuple[int, ...]:
        return self.choice.prompt.ids

    @property
    def answered(self) -> list[int]:
        """The tokens answered: up to the one that completed a stop string."""
        return self.tokens if self.kept is None else self.tokens[: self.kept]

    def cancel(self) -> None:
        """The client is gone: the generation ends at its next step, or never starts."""
        self.cancelled.set()

    def _put(self, event: Event) -> None:
        event.index = self.choice.index
        self.loop.call_soon_threadsafe(self.events.put_nowait, event)

    def _text(self, tokens: list[int] | None = None) -> str:
        return self.tokenizer.decode(self.tokens if tokens is None else tokens, skip_special_tokens=True)

    def _send_until(self, text: str, end: int) -> None:
        """The text up to ``end`` is final: a stream hears it (and its first step is told even without text)."""
        if end <= self.sent and (self.told or not self.request.stream):
            return
        if self.request.stream:  # each token goes with the text that holds it all (the last one's end)
            release = (len(self.tokens) if self.request.logprobs is None
                       else max((j + 1 for j, e in enumerate(self.ends) if e <= end), default=0))
            self._tell(text[self.sent:end], max(release, self.released))
        self.text = text[:max(end, self.sent)]
        self.sent = max(end, self.sent)

    def _tell(self, delta: str, release: int) -> None:
        """A stream's text event: ``delta`` and the tokens up to ``release`` not yet sent (with their
        log-probabilities); its first event carries the prompt's."""
        lo, self.released = self.released, release
        first, self.told = not self.told, True
        self._put(Event("text", text=delta, tokens=self.tokens[lo:release], logprobs=self.logprobs[lo:release],
                        prompt_logprobs=self.prompt_logprobs if first else None))

    def on_step(self, tokens: list[int], logprobs: Sequence[TokenLogprob] = (),
                prompt_logprobs: Sequence[TokenLogprob] = ()) -> bool:
        """The step's report for this job (worker thread): its new tokens, their log-probabilities and (its first
        step) its prompt's. Sends what is final; False stops the generation."""
        if self.first_token_at is None:
            self.first_token_at = time.perf_counter()
        self.prompt_logprobs = self.prompt_logprobs or list(prompt_logprobs)
        if self.request.max_tokens == 0:  # the prompt scored alone: no new token is answered
            self.kept = 0
            return False
        start = len(self.tokens)
        self.tokens.extend(tokens)
        self.logprobs.extend(logprobs)
        if not self.request.stream and not self.request.stop:
            return not self.cancelled.is_set()  # nothing to send or match before the end
        if self.request.stream and self.request.logprobs is not None:
            self.ends += [len(self._text(self.tokens[:i])) for i in range(start + 1, len(self.tokens) + 1)]
        text = self._text()
        if any(s in text for s in self.request.stop):
            self._cut_at_stop(start)
            return False
        hold = max((len(s) for s in self.request.stop), default=1) - 1  # a stop string may still complete
        end = len(text) - hold
        while end > self.sent and text[end - 1] == "\ufffd":  # half a multi-byte character so far
            end -= 1
        self._send_until(text, end)
        return not self.cancelled.is_set()

    def _cut_at_stop(self, start: int) -> None:
        """A stop string appeared in this step's tokens (after token ``start``): the answer keeps the tokens up to
        the one that completed the first stop string, and the text before it."""
        for kept in range(start + 1, len(self.tokens) + 1):
            text = self._text(self.tokens[:kept])
            found = [i for i in (text.find(s) for s in self.request.stop) if i >= 0]
            if found:
                self.stop_hit, self.kept = True, kept
                self._send_until(text, min(found))
                return

    def finish(self, finish_reason: str, ddte: dict) -> None:
        """The generation ended: send the rest of the text (unless a stop string cut it) and the answer."""
        if not self.stop_hit:
            text = self._text(self.answered)
            self._send_until(text, len(text))
        if self.request.stream and (self.released < len(self.answered) or not self.told):
            self._tell("", len(self.answered))  # the tokens of the text a stop string cut short
        answer = Answer(finish_reason, self.text, self.answered, self.logprobs[:len(self.answered)],
                        self.prompt_logprobs, ddte)
        self._put(Event("done", answer=answer))

    def fail(self, message: str, status: int = 500) -> None:
        self._put(Event("error", text=message, status=status))
