"""`ddte serve` with the real openai client, a χ² test of exactness through HTTP, 32 concurrent clients, a full
queue, a client that leaves mid-stream, bad inputs and a signal during a request.

The cases (tests/ddte/serve_cases.py) run as one script in a loopback-only network namespace (tests/isolation.py):
the servers listen on 127.0.0.1 there, and no request leaves it.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import pytest

from ddte.cli import main
from tests.isolation import run_loopback_only

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("cases", [
    ["openai_client", "same_as_generate", "stop_strings", "bad_inputs", "signal"],
    ["exact_law", "concurrent_clients", "queue_and_disconnect"],
    ["body_edges", "outcomes", "stop_and_drain"],
], ids=["client", "load", "edges"])
def test_serve_cases(tmp_path, cases):
    """Each case prints ``ok CASE``; no server logs a traceback (an ASGI exception, a client that left mid-body)."""
    code, output = run_loopback_only([sys.executable, "-m", "tests.ddte.serve_cases", str(tmp_path), *cases],
                                     cwd=REPO, timeout=500, env={"OMP_NUM_THREADS": "1"})
    assert code == 0, output[-6000:]
    assert [line.split(" (")[0] for line in output.splitlines() if line.startswith("ok ")] == [f"ok {c}" for c in cases]
    assert "Traceback" not in output and "Exception in ASGI" not in output, output[-6000:]


@pytest.mark.parametrize(("argv", "words"), [
    (["--method", "ar"], "ddte method"),
    (["--method", "traversal@9,9,9"], "--method"),
    (["--method", "traversal@selector=/no/such.onnx"], "does not exist"),
    (["--policy-file", "/no/such.json"], "--policy-file"),
    (["--verifier", "traversal"], "goes with --policy-file"),
    (["--port", "70000"], "--port"),
    (["--max-queue", "0"], "--max-queue"),
    (["--max-batch", "0"], "--max-batch"),
    (["--host", "203.0.113.7"], "cannot listen"),
])
def test_bad_flags_are_one_line_before_any_model_loads(argv, words, capsys):
    assert main(["serve", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert words in err and len(err.splitlines()) == 1, err


@pytest.mark.parametrize("argv", [["--max-body-kib", "0"], ["--cors-origin", "localhost:3000"],
                                  ["--cors-origin", "http://ui.test/app"]])
def test_a_bad_body_limit_or_origin_is_one_line_at_parse_time(argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", *argv])
    err = capsys.readouterr().err.strip()
    assert exit_info.value.code == 2 and len(err.splitlines()) == 1 and argv[0] in err, err


class _Tokenizer:
    """Enough of a tokenizer for parse_request: one id per character, a chat template that joins the contents."""

    chat_template = "{{ messages }}"

    def __call__(self, text: str) -> dict:
        return {"input_ids": [ord(c) % 50 for c in text]}

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=True, **_):
        return "".join(m["content"] for m in messages)


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_null_reads_as_absent_for_every_field(chat):
    """Every field ddte reads or refuses, given as null, is read as absent: no refusal for a field the other endpoint
    owns (echo on chat), no type error for an optional one."""
    from ddte.serve.fields import FIELDS, REFUSED
    from ddte.serve.requests import parse_request

    base = {"model": "m", **({"messages": [{"role": "user", "content": "hi"}]} if chat else {"prompt": "hi"})}
    nulls = {name: None for name in FIELDS[True] | FIELDS[False] | set(REFUSED) if name not in base}
    plain = parse_request(base, chat, "m", _Tokenizer(), 64, 50, 8)
    assert parse_request({**base, **nulls}, chat, "m", _Tokenizer(), 64, 50, 8) == plain
    assert plain.max_tokens == 8 and not plain.stream and plain.seed is None


def test_a_vendor_field_that_changes_nothing_is_ignored_with_a_debug_line(caplog):
    """guidellm's, llama-benchy's and llama.cpp's fields are read as absent, each named in a debug line."""
    from ddte.serve.requests import parse_request

    base = {"model": "m", "prompt": "hi"}
    with caplog.at_level(logging.DEBUG, logger="ddte.serve"):
        extra = parse_request({**base, "return_token_ids": True, "cache_prompt": False}, False, "m", _Tokenizer(), 64,
                              50, 8)
    assert extra == parse_request(base, False, "m", _Tokenizer(), 64, 50, 8)
    assert any("cache_prompt, return_token_ids" in record.getMessage() for record in caplog.records), caplog.text
