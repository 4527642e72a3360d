"""Which request fields ddte reads, which it refuses, and which it ignores.

OpenAI's fields of ``/v1/completions`` and ``/v1/chat/completions`` are known; so are the vendor fields that tools
send (vLLM's and llama.cpp's: guidellm's ``ignore_eos``, llama-benchy's ``return_token_ids``, lm-eval's and the
openai client's ``extra_body``). A field that would change the law sampled, or the answer, in a way ddte does not
implement is refused unless it holds its neutral value, with the reason (:data:`REFUSED`); ddte samples the target's
law under temperature, top-p, top-k and min-p only, and shows that its verifiers keep those exact. Any other field is
ignored with a debug log line: a vendor option that changes neither (``cache_prompt``, ``return_token_ids``,
``continuous_usage_stats``, ...) must not fail a tool that sends it by default.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from ddte.serve.errors import RequestError

logger = logging.getLogger("ddte.serve")

# OpenAI's request fields of both endpoints, and ddte's vendor fields (vLLM's spelling), that ddte reads.
COMMON_FIELDS = {"model", "temperature", "top_p", "max_tokens", "max_completion_tokens", "seed", "stop", "stream",
                 "stream_options", "n", "logprobs", "top_k", "min_p", "ignore_eos"}
FIELDS = {True: COMMON_FIELDS | {"messages", "top_logprobs"}, False: COMMON_FIELDS | {"prompt", "echo", "best_of"}}

_PATH = ("a transform that reads the tokens generated so far, whose exactness under speculative decoding ddte does "
         "not show yet")
_NOT_YET = "ddte samples the target's law under temperature, top_p, top_k and min_p only"


def _empty(value) -> bool:
    return value in ({}, [], "", False, None)


def _equals(neutral: float) -> Callable[[object], bool]:
    return lambda value: value == neutral and not isinstance(value, bool)


# field -> (whether a value is neutral, why any other is refused)
REFUSED: dict[str, tuple[Callable[[object], bool], str]] = {
    "presence_penalty": (_equals(0), _PATH),
    "frequency_penalty": (_equals(0), _PATH),
    "repetition_penalty": (_equals(1), _PATH),
    "min_tokens": (_equals(0), "it forbids EOS by the answer's length so far, " + _PATH),
    "logit_bias": (_empty, _NOT_YET),
    "typical_p": (_equals(1), _NOT_YET),
    "top_a": (_equals(0), _NOT_YET),
    "tfs_z": (_equals(1), _NOT_YET),
    "mirostat": (_equals(0), _PATH),
    "dry_multiplier": (_equals(0), _PATH),
    "xtc_probability": (_equals(0), _NOT_YET),
    "use_beam_search": (_empty, "ddte samples; it does not search"),
    "allowed_token_ids": (_empty, _NOT_YET),
    "bad_words": (_empty, _PATH),
    "stop_token_ids": (_empty, "ddte stops at the pair's EOS and at stop strings"),
    "logits_processors": (_empty, _NOT_YET),
    "guided_json": (_empty, "constrained decoding is " + _PATH),
    "guided_regex": (_empty, "constrained decoding is " + _PATH),
    "guided_choice": (_empty, "constrained decoding is " + _PATH),
    "guided_grammar": (_empty, "constrained decoding is " + _PATH),
    "structured_outputs": (_empty, "constrained decoding is " + _PATH),
    "grammar": (_empty, "constrained decoding is " + _PATH),
    "json_schema": (_empty, "constrained decoding is " + _PATH),
    "response_format": (lambda v: v == {"type": "text"}, "constrained decoding is " + _PATH),
    "tools": (_empty, "ddte has no tool calling"),
    "functions": (_empty, "ddte has no tool calling"),
    "tool_choice": (lambda v: v == "none", "ddte has no tool calling"),
    "suffix": (_empty, "ddte completes after the prompt only"),
    "prompt_logprobs": (_empty, "use echo with logprobs on /v1/completions"),
    "include_stop_str_in_output": (_empty, "ddte answers the text before the stop string"),
    "truncate_prompt_tokens": (_empty, "ddte reads the whole prompt"),
    "add_generation_prompt": (lambda v: v is True, "ddte renders the chat template with the generation prompt"),
    "continue_final_message": (_empty, "ddte renders the chat template with the generation prompt"),
    "chat_template": (_empty, "ddte renders the pair's own chat template"),
}
NEUTRAL_HINT = {"presence_penalty": "0", "frequency_penalty": "0", "repetition_penalty": "1", "min_tokens": "0",
                "typical_p": "1", "tfs_z": "1", "response_format": '{"type": "text"}', "tool_choice": '"none"',
                "add_generation_prompt": "true"}


def check_fields(body: dict, chat: bool) -> None:
    """:class:`RequestError` for the first field :data:`REFUSED` holds at a value that is not neutral (or for
    ``echo`` on chat, which OpenAI's chat API does not have); every field ddte neither reads nor refuses is logged
    at debug level and ignored."""
    for name in sorted(set(body) & set(REFUSED)):
        neutral, why = REFUSED[name]
        if not neutral(body[name]):
            hint = NEUTRAL_HINT.get(name)
            leave = f"give {hint} or leave it out" if hint else "leave it out"
            raise RequestError(f"{name} is not supported: {why} ({leave})", name)
    if chat and body.get("echo") not in (None, False):
        raise RequestError("echo is not supported on chat completions: use /v1/completions with echo", "echo")
    ignored = sorted(set(body) - FIELDS[chat] - set(REFUSED))
    if ignored:
        logger.debug("ddte serve: ignoring fields %s (they change neither the law sampled nor the answer)",
                     ", ".join(ignored))
