"""What a client may ask: the OpenAI request bodies of ``/v1/completions`` and ``/v1/chat/completions``, checked into
one typed :class:`CompletionRequest` before anything is queued.

Every refusal is a :class:`~ddte.serve.errors.RequestError` naming the field and what is allowed; the app answers it
as an OpenAI error object (400; 404 for a model not served). A field given as JSON ``null`` is read as absent, every
field alike (one filter, first of all, in :func:`parse_request`). Which fields are read, refused or ignored:
:mod:`ddte.serve.fields`; the prompt's forms: :mod:`ddte.serve.prompts`. A request may ask for several choices (a
list of prompts, ``n`` samples of each): each is its own request of the batch (:meth:`CompletionRequest.choices`).
"""

from __future__ import annotations

from dataclasses import dataclass

from ddte.serve.errors import RequestError
from ddte.serve.fields import check_fields
from ddte.serve.prompts import Prompt, chat_prompt, completion_prompts
from ddte_core.yamlconfig import MAX_SEED
from decode.drafting.sampling import SamplingConfig

MAX_TEMPERATURE = 2.0  # OpenAI's range
MAX_STOPS = 16  # OpenAI takes 4; lm-eval's tasks may send more (a task's own and the tokenizer's EOS text)
MAX_LOGPROBS = 20  # the likeliest tokens listed beside each token's log-probability, as vLLM's default bound
MAX_N = 64


@dataclass(frozen=True)
class Choice:
    """One choice of a request, decoded as a request of its own: its index in the answer, its prompt and its seed
    (None: unseeded)."""

    index: int
    prompt: Prompt
    seed: int | None


@dataclass(frozen=True)
class CompletionRequest:
    """One request, checked: its prompts, the sampling law, and how to answer.

    Attributes:
        max_tokens: new tokens each choice may add; 0 adds none (a completion that only scores its prompt: ``echo``
            with ``logprobs``).
        n: samples of each prompt; choice ``p * n + i`` is sample i of prompt p, seeded ``seed + i``.
        logprobs: k: each returned token's log-probability under the law sampled, with the k likeliest (None: no
            log-probabilities).
        echo: the prompt precedes each choice's text, with its tokens' log-probabilities where ``logprobs`` asks.
        ignore_eos: decode past EOS, up to ``max_tokens``.
    """

    prompts: tuple[Prompt, ...]
    max_tokens: int
    sampling: SamplingConfig
    seed: int | None
    stop: tuple[str, ...]
    stream: bool
    chat: bool
    include_usage: bool
    n: int = 1
    logprobs: int | None = None
    echo: bool = False
    ignore_eos: bool = False

    def choices(self) -> list[Choice]:
        """Every choice, in the answer's order: each prompt's n samples, sample i seeded ``seed + i``."""
        return [Choice(p * self.n + i, prompt, None if self.seed is None else self.seed + i)
                for p, prompt in enumerate(self.prompts) for i in range(self.n)]

    @property
    def prompt_tokens(self) -> int:
        """The usage's prompt tokens: each prompt's once, however many samples it has."""
        return sum(len(prompt.ids) for prompt in self.prompts)


def _number(body: dict, name: str, default: float, low: float, high: float, low_open: bool = False) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float) or value != value:
        raise RequestError(f"{name} must be a number, got {value!r}", name)
    if value > high or value < low or (low_open and value == low):
        side = "(" if low_open else "["
        raise RequestError(f"{name} must be in {side}{low:g}, {high:g}], got {value!r}", name)
    return float(value)


def _integer(body: dict, name: str, low: int, high: int) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise RequestError(f"{name} must be an integer, got {value!r}", name)
    if not low <= value <= high:
        raise RequestError(f"{name} must be in [{low}, {high}], got {value}", name)
    return value


def _flag(body: dict, name: str) -> bool:
    value = body.get(name, False)
    if not isinstance(value, bool):
        raise RequestError(f"{name} must be true or false, got {value!r}", name)
    return value


def _stops(body: dict) -> tuple[str, ...]:
    value = body.get("stop")
    if value is None:
        return ()
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops) or len(stops) > MAX_STOPS:
        raise RequestError(f"stop must be a non-empty string or a list of at most {MAX_STOPS} of them", "stop")
    return tuple(stops)


def _sampling(body: dict) -> SamplingConfig:
    """The law's transform: temperature, top_p, and the vendor fields top_k (-1 or 0: off, as vLLM reads it) and
    min_p."""
    top_k = _integer(body, "top_k", -1, 2**31 - 1)
    return SamplingConfig(_number(body, "temperature", 1.0, 0.0, MAX_TEMPERATURE),
                          _number(body, "top_p", 1.0, 0.0, 1.0, low_open=True), max(top_k or 0, 0),
                          _number(body, "min_p", 0.0, 0.0, 1.0))


def _samples(body: dict, max_choices: int, prompts: int) -> tuple[int, int | None]:
    """(n, the seed of sample 0): ``best_of`` may only repeat n; a negative seed means none, as vLLM and llama.cpp
    read -1."""
    n = _integer(body, "n", 1, MAX_N) or 1
    if body.get("best_of") not in (None, n):
        raise RequestError(f"best_of must equal n ({n}) or be left out: ddte returns every sample it draws", "best_of")
    if n * prompts > max_choices:
        raise RequestError(f"{n * prompts} choices ({prompts} prompts x n {n}) do not fit this server's queue of "
                           f"{max_choices} (ddte serve --max-queue): send fewer at once", "n" if n > 1 else "prompt")
    seed = _integer(body, "seed", -(2**63), MAX_SEED - n + 1)
    return n, (seed if seed is not None and seed >= 0 else None)


def _logprobs(body: dict, chat: bool) -> int | None:
    """k, the likeliest tokens listed beside each token's log-probability (None: no log-probabilities): chat's
    ``logprobs`` is a flag with ``top_logprobs`` k, a completion's ``logprobs`` is k itself."""
    if not chat:
        return _integer(body, "logprobs", 0, MAX_LOGPROBS)
    top = _integer(body, "top_logprobs", 0, MAX_LOGPROBS)
    if not _flag(body, "logprobs"):
        if top:
            raise RequestError("top_logprobs needs logprobs: true", "top_logprobs")
        return None
    return top or 0


def parse_request(body, chat: bool, model: str, tokenizer, context_limit: int, vocab_size: int,
                  default_max_tokens: int, max_choices: int = MAX_N) -> CompletionRequest:
    """The checked request, or :class:`RequestError` for the first problem found.

    Args:
        body: the decoded JSON body.
        chat: a chat completion (``messages``) rather than a text completion (``prompt``).
        model: the served model's name; a request for another is refused (404).
        context_limit: positions the pair attends over: each prompt and ``max_tokens`` must fit in it.
        max_choices: the most choices (prompts x n) one request may ask for: the server's queue.
    """
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    body = {name: value for name, value in body.items() if value is not None}  # null means absent, as in OpenAI's
    if not isinstance(body.get("model"), str):
        raise RequestError("model is required: a string (GET /v1/models lists the one served)", "model")
    if body["model"] != model:
        raise RequestError(f"model {body['model']!r} is not served here; this server serves {model!r}", "model",
                           status=404, code="model_not_found")
    check_fields(body, chat)
    sampling, stop, logprobs = _sampling(body), _stops(body), _logprobs(body, chat)
    echo, ignore_eos = (False if chat else _flag(body, "echo")), _flag(body, "ignore_eos")
    stream = _flag(body, "stream")
    options = body.get("stream_options", {})
    if not isinstance(options, dict) or not isinstance(options.get("include_usage"), bool | None):
        raise RequestError("stream_options must be an object like {\"include_usage\": true}", "stream_options")
    name, asked = _max_tokens(body, chat)
    prompts = [chat_prompt(body.get("messages"), tokenizer)] if chat else completion_prompts(body.get("prompt"),
                                                                                           tokenizer)
    n, seed = _samples(body, max_choices, len(prompts))
    longest = max(len(prompt.ids) for prompt in prompts)
    if any(not 0 <= t < vocab_size for prompt in prompts for t in prompt.ids):
        raise RequestError(f"prompt token ids must lie in [0, {vocab_size})", "prompt")
    room = context_limit - longest
    if room < 1:
        raise RequestError(f"the prompt holds {longest} tokens: no room left in the {context_limit}-token context",
                           "messages" if chat else "prompt")
    max_tokens = asked if asked is not None else min(default_max_tokens, room)
    if max_tokens > room:
        raise RequestError(f"{name} {max_tokens} does not fit: the prompt holds {longest} tokens of a "
                           f"{context_limit}-token context, leaving {room}", name)
    return CompletionRequest(tuple(prompts), max_tokens, sampling, seed, stop, stream, chat,
                             bool(options.get("include_usage")), n, logprobs, echo, ignore_eos)


def _max_tokens(body: dict, chat: bool) -> tuple[str, int | None]:
    """The field that bounds the answer and its value (None: neither given). Each given field is checked; a request
    may give ``max_completion_tokens`` (OpenAI's newer name, which some clients send to both endpoints) or
    ``max_tokens``, or both with one value. A completion may ask for 0 new tokens (its prompt scored alone)."""
    low = 1 if chat else 0
    asked = _integer(body, "max_tokens", low, 10**9)
    newer = _integer(body, "max_completion_tokens", low, 10**9)
    if newer is not None and asked is not None and newer != asked:
        raise RequestError(f"max_completion_tokens {newer} and max_tokens {asked} disagree: give one of them",
                           "max_completion_tokens")
    return ("max_completion_tokens", newer) if newer is not None else ("max_tokens", asked)
