"""The prompts a request gives, in every form clients send them: a completion's prompt as a string, a list of token
ids, a list of strings or a list of token-id lists (several prompts: one choice each); a chat's messages with their
content as a string or as a list of text parts, and the ``developer`` role (OpenAI's newer name for ``system``).

Every problem is a :class:`~ddte.serve.errors.RequestError` naming the field.
"""

from __future__ import annotations

from dataclasses import dataclass

from ddte.serve.errors import RequestError


@dataclass(frozen=True)
class Prompt:
    """One prompt: its token ids, and its text where the client gave text (None: it gave token ids)."""

    ids: tuple[int, ...]
    text: str | None = None

    def shown(self, tokenizer) -> str:
        """The prompt as text (what ``echo`` answers): the text given, or the ids decoded."""
        return self.text if self.text is not None else tokenizer.decode(list(self.ids), skip_special_tokens=True)


def completion_prompts(prompt, tokenizer) -> list[Prompt]:
    """The prompts of a completion request's ``prompt``: one for a string or a list of token ids, one per item of a
    list of strings or of token-id lists."""
    if isinstance(prompt, str) or _is_ids(prompt):
        return [_one(prompt, tokenizer, "prompt")]
    if isinstance(prompt, list) and prompt and (all(isinstance(p, str) for p in prompt)
                                                or all(_is_ids(p) for p in prompt)):
        return [_one(p, tokenizer, f"prompt[{i}]") for i, p in enumerate(prompt)]
    raise RequestError("prompt must be a non-empty string, a non-empty list of token ids, or a non-empty list of "
                       "either (several prompts)", "prompt")


def _is_ids(value) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(t, int) and not isinstance(t, bool)
                                                           for t in value)


def _one(prompt: str | list[int], tokenizer, where: str) -> Prompt:
    if isinstance(prompt, list):
        return Prompt(tuple(prompt))
    if not prompt:
        raise RequestError(f"{where} is empty", "prompt")
    return Prompt(tuple(tokenizer(prompt)["input_ids"]), prompt)


def chat_prompt(messages, tokenizer) -> Prompt:
    """The prompt of a chat request: its messages (content parts joined, ``developer`` read as ``system``) through
    the pair's chat template."""
    from decode.pair import check_messages, render_chat

    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise RequestError("this server's pair has no chat template: use /v1/completions, or serve a pair with one "
                           "(e.g. ddte serve --pair qwen-coder)", "messages")
    if not isinstance(messages, list):
        raise RequestError("messages must be a non-empty list of {role, content} objects", "messages")
    turns = [_turn(i, message) for i, message in enumerate(messages)]
    try:
        check_messages(turns)
        text = render_chat(tokenizer, turns)
    except ValueError as err:
        raise RequestError(str(err), "messages") from err
    return Prompt(tuple(tokenizer(text)["input_ids"]), text)


def _turn(i: int, message) -> dict:
    """One message as the chat template reads it: ``{role, content}`` with a string content (other keys, such as
    ``name``, are dropped); what it cannot be is left for ``check_messages`` to name."""
    if not isinstance(message, dict):
        return {"role": None, "content": None}
    role = "system" if message.get("role") == "developer" else message.get("role")
    content = message.get("content")
    if isinstance(content, list):
        content = "\n".join(_text_part(i, j, part) for j, part in enumerate(content))  # as vLLM joins them
    return {"role": role, "content": content}


def _text_part(i: int, j: int, part) -> str:
    kind = part.get("type") if isinstance(part, dict) else None
    if kind != "text" or not isinstance(part.get("text"), str):
        got = f"type {kind!r}" if isinstance(kind, str) else repr(part)[:40]
        raise RequestError(f"messages[{i}].content[{j}]: only text parts ({{\"type\": \"text\", \"text\": ...}}) "
                           f"are served, got {got}", "messages")
    return part["text"]
