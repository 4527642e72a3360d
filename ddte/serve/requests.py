"""What a client may ask: the OpenAI request bodies of ``/v1/completions`` and ``/v1/chat/completions``, checked into
one typed :class:`CompletionRequest` before anything is queued.

Every refusal is a :class:`RequestError` naming the field and what is allowed; the app answers it as an OpenAI error
object with status 400. A field given as JSON ``null`` is read as absent, every field alike (one filter, first of
all, in :func:`parse_request`). A field OpenAI's API does not know is refused, as OpenAI refuses it. OpenAI's fields
that do not change the answer (``user``, ``metadata``, ...) are accepted and ignored; those that would change the law
being sampled (penalties, logit bias, several choices, log-probabilities) are refused unless neutral: ddte reproduces
the target's distribution at the given temperature and top-p, and refuses what it would not honour.
"""

from __future__ import annotations

from dataclasses import dataclass

from ddte_core.yamlconfig import MAX_SEED
from decode.drafting.sampling import SamplingConfig

MAX_TEMPERATURE = 2.0  # OpenAI's range
MAX_STOPS = 4
# The request fields of OpenAI's two endpoints that ddte reads or accepts; any other is refused.
COMMON_FIELDS = {"model", "temperature", "top_p", "max_tokens", "seed", "stop", "stream", "stream_options", "n",
                 "presence_penalty", "frequency_penalty", "logit_bias", "logprobs", "user", "metadata", "store",
                 "service_tier"}
FIELDS = {True: COMMON_FIELDS | {"messages", "max_completion_tokens", "top_logprobs", "parallel_tool_calls",
                                 "response_format", "modalities"},
          False: COMMON_FIELDS | {"prompt", "echo", "best_of", "suffix"}}


class RequestError(ValueError):
    """A request ddte will not serve: the message, the offending field, and the HTTP status (400 by default)."""

    def __init__(self, message: str, param: str | None = None, status: int = 400,
                 code: str = "invalid_request") -> None:
        super().__init__(message)
        self.param, self.status, self.code = param, status, code


@dataclass(frozen=True)
class CompletionRequest:
    """One request, checked: the prompt's token ids, the sampling law, and how to answer."""

    prompt_ids: list[int]
    max_tokens: int
    sampling: SamplingConfig
    seed: int | None
    stop: tuple[str, ...]
    stream: bool
    chat: bool
    include_usage: bool


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


def _stops(body: dict) -> tuple[str, ...]:
    value = body.get("stop")
    if value is None:
        return ()
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops) or len(stops) > MAX_STOPS:
        raise RequestError(f"stop must be a non-empty string or a list of at most {MAX_STOPS} of them", "stop")
    return tuple(stops)


def _refuse_law_changes(body: dict) -> None:
    """Fields that would sample another law than the target's: refused unless they are their neutral value."""
    for name in ("presence_penalty", "frequency_penalty"):
        if body.get(name) not in (None, 0, 0.0):
            raise RequestError(f"{name} is not supported: ddte samples the target's own law (give 0 or leave it "
                               "out)", name)
    if body.get("logit_bias"):
        raise RequestError("logit_bias is not supported: ddte samples the target's own law", "logit_bias")
    if body.get("n") not in (None, 1):
        raise RequestError("n must be 1: one choice per request (send several requests)", "n")
    if body.get("best_of") not in (None, 1):
        raise RequestError("best_of must be 1", "best_of")
    if body.get("logprobs") not in (None, False, 0) or body.get("top_logprobs") not in (None, 0):
        raise RequestError("log-probabilities are not returned by ddte (leave logprobs out)", "logprobs")
    if body.get("echo") not in (None, False) or body.get("suffix") not in (None, ""):
        raise RequestError("echo and suffix are not supported", "echo" if body.get("echo") else "suffix")
    format_ = body.get("response_format")
    if format_ not in (None, {"type": "text"}):
        raise RequestError("response_format must be text: ddte samples the target's own law", "response_format")


def _chat_text(body: dict, tokenizer) -> str:
    from decode.pair import check_messages, render_chat

    messages = body.get("messages")
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise RequestError("this server's pair has no chat template: use /v1/completions, or serve a pair with one "
                           "(e.g. ddte serve --pair qwen-coder)", "messages")
    try:
        check_messages(messages)
        return render_chat(tokenizer, [{"role": m["role"], "content": m["content"]} for m in messages])
    except ValueError as err:
        raise RequestError(str(err), "messages") from err


def _completion_ids(body: dict, tokenizer) -> list[int]:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, str):
        if not prompt:
            raise RequestError("prompt is empty", "prompt")
        return list(tokenizer(prompt)["input_ids"])
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return list(prompt)
    raise RequestError("prompt must be a non-empty string, or a non-empty list of token ids", "prompt")


def parse_request(body, chat: bool, model: str, tokenizer, context_limit: int, vocab_size: int,
                  default_max_tokens: int) -> CompletionRequest:
    """The checked request, or :class:`RequestError` for the first problem found.

    Args:
        body: the decoded JSON body.
        chat: a chat completion (``messages``) rather than a text completion (``prompt``).
        model: the served model's name; a request for another is refused.
        context_limit: positions the pair attends over: prompt and ``max_tokens`` must fit in it.
    """
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    body = {name: value for name, value in body.items() if value is not None}  # null means absent, as in OpenAI's
    unknown = sorted(set(body) - FIELDS[chat])
    if unknown:
        raise RequestError(f"unknown field {unknown[0]!r} for {'chat ' if chat else ''}completions", unknown[0])
    if not isinstance(body.get("model"), str):
        raise RequestError("model is required: a string (GET /v1/models lists the one served)", "model")
    if body["model"] != model:
        raise RequestError(f"model {body['model']!r} is not served here; this server serves {model!r}", "model",
                           code="model_not_found")
    _refuse_law_changes(body)
    temperature = _number(body, "temperature", 1.0, 0.0, MAX_TEMPERATURE)
    top_p = _number(body, "top_p", 1.0, 0.0, 1.0, low_open=True)
    seed = _integer(body, "seed", 0, MAX_SEED)
    stop = _stops(body)
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise RequestError(f"stream must be true or false, got {stream!r}", "stream")
    options = body.get("stream_options", {})
    if not isinstance(options, dict) or not isinstance(options.get("include_usage"), bool | None):
        raise RequestError("stream_options must be an object like {\"include_usage\": true}", "stream_options")
    name, asked = _max_tokens(body, chat)
    ids = _completion_ids(body, tokenizer) if not chat else list(tokenizer(_chat_text(body, tokenizer))["input_ids"])
    if any(not 0 <= t < vocab_size for t in ids):
        raise RequestError(f"prompt token ids must lie in [0, {vocab_size})", "prompt")
    room = context_limit - len(ids)
    if room < 1:
        raise RequestError(f"the prompt holds {len(ids)} tokens: no room left in the {context_limit}-token context",
                           "messages" if chat else "prompt")
    max_tokens = asked if asked is not None else min(default_max_tokens, room)
    if max_tokens > room:
        raise RequestError(f"{name} {max_tokens} does not fit: the prompt holds {len(ids)} tokens of a "
                           f"{context_limit}-token context, leaving {room}", name)
    return CompletionRequest(ids, max_tokens, SamplingConfig(temperature, top_p), seed, stop, stream, chat,
                             bool(options.get("include_usage")))


def _max_tokens(body: dict, chat: bool) -> tuple[str, int | None]:
    """The field that bounds the answer and its value (None: neither given). Each given field is checked; a chat
    request may give ``max_completion_tokens`` (OpenAI's newer name) or ``max_tokens``, or both with one value."""
    asked = _integer(body, "max_tokens", 1, 10**9)
    if not chat:
        return "max_tokens", asked
    newer = _integer(body, "max_completion_tokens", 1, 10**9)
    if newer is not None and asked is not None and newer != asked:
        raise RequestError(f"max_completion_tokens {newer} and max_tokens {asked} disagree: give one of them",
                           "max_completion_tokens")
    return ("max_completion_tokens", newer) if newer is not None else ("max_tokens", asked)
