"""The one place a request body is read and decoded: bounded in size, bounded in nesting, and text that encodes to
UTF-8.

Every failure is a :class:`~ddte.serve.requests.RequestError` (the app answers it as an OpenAI error object: 413 for
a body over the limit, 400 otherwise); a client that leaves before its body is whole is :class:`ClientLeft` (nobody
to answer; the app counts it as 499 and logs nothing).
"""

from __future__ import annotations

import json

from ddte.serve.errors import RequestError

MAX_NESTING = 32  # OpenAI's bodies nest a few levels (messages -> message -> content parts)


class ClientLeft(Exception):
    """The client closed its connection before its body was whole."""


def too_large(max_bytes: int) -> RequestError:
    return RequestError(f"the request body is over {max_bytes} bytes (the server's --max-body-kib)", status=413,
                        code="request_too_large")


async def read_body(request, max_bytes: int) -> bytes:
    """The whole body of ``request`` (a Starlette request), or :class:`RequestError` (413) once it passes
    ``max_bytes``, or :class:`ClientLeft`. A declared length over the limit is refused before anything is read."""
    from starlette.requests import ClientDisconnect

    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > max_bytes:
        raise too_large(max_bytes)
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > max_bytes:
                raise too_large(max_bytes)
            chunks.append(chunk)
    except ClientDisconnect as err:
        raise ClientLeft from err
    return b"".join(chunks)


def decode_json(raw: bytes) -> object:
    """The JSON value of ``raw``: UTF-8 JSON nested at most :data:`MAX_NESTING` deep whose every string (keys
    included) is text that encodes to UTF-8 (JSON's ``\\ud800`` escape decodes to a lone surrogate, which does not).

    Raises:
        RequestError: for each of these, with status 400.
    """
    try:
        value = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as err:
        raise RequestError("the request body is not UTF-8 text") from err
    except RecursionError as err:
        raise RequestError(f"the request body nests deeper than {MAX_NESTING} levels") from err
    except json.JSONDecodeError as err:
        raise RequestError(f"the request body is not valid JSON ({err.msg} at character {err.pos})") from err
    _check_tree(value)
    return value


def _check_tree(value: object) -> None:
    """RequestError for a value nested over :data:`MAX_NESTING` deep or holding a string that is not UTF-8 text;
    iterative, so no depth reaches Python's recursion limit."""
    pending = [(value, 1)]
    while pending:
        item, depth = pending.pop()
        if isinstance(item, str):
            _check_text(item)
            continue
        if not isinstance(item, dict | list):
            continue
        if depth > MAX_NESTING:
            raise RequestError(f"the request body nests deeper than {MAX_NESTING} levels")
        if isinstance(item, dict):
            for key in item:
                _check_text(key)
            pending.extend((child, depth + 1) for child in item.values())
        else:
            pending.extend((child, depth + 1) for child in item)


def _check_text(text: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        raise RequestError(f"the request body holds a string that is not Unicode text (a lone surrogate "
                           f"{text[err.start]!r} at character {err.start}: JSON's \\uXXXX escapes must pair)") from err
