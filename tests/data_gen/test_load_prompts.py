"""load_prompts: JSONL, parquet and datasets specs, and clear ValueErrors for bad input."""

from __future__ import annotations

import json

import pytest

from data_gen.prompts import load_prompts

ROWS = [{"prompt": "def a():\n", "module": "x.py"}, {"prompt": "class B:\n", "module": "y.py"}]


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_jsonl_parquet_and_datasets_specs(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    jsonl = _jsonl(tmp_path / "p.jsonl", ROWS)
    parquet = tmp_path / "p.parquet"
    pq.write_table(pa.Table.from_pylist(ROWS), parquet)
    expected = [r["prompt"] for r in ROWS]
    assert load_prompts(jsonl) == expected
    assert load_prompts(str(parquet)) == expected
    assert load_prompts(f"json:{jsonl}") == expected
    assert load_prompts(f"parquet:{parquet}", field="module") == ["x.py", "y.py"]
    assert load_prompts(jsonl, limit=1) == expected[:1]


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda d: d / "absent.jsonl", "not found"),
        (lambda d: f"json:{d / 'absent.jsonl'}", "not found"),
        (lambda d: _jsonl(d / "e.jsonl", []), "no prompts"),
        (lambda d: _jsonl(d / "f.jsonl", [{"text": "x"}]), "no field 'prompt'"),
        (lambda d: _jsonl(d / "n.jsonl", [{"prompt": 3}]), "not a string"),
        (lambda d: _jsonl(d / "b.jsonl", [{"prompt": "  "}]), "empty"),
        (lambda d: (d / "bad.jsonl").write_text("{oops\n") and d / "bad.jsonl", "not valid JSON"),
        (lambda d: (d / "p.txt").write_text("x") and d / "p.txt", "unknown prompt source format"),
    ],
)
def test_bad_sources_raise_clear_user_errors(tmp_path, make, message):
    with pytest.raises(ValueError, match=message):
        load_prompts(make(tmp_path))


def test_limit_must_be_positive(tmp_path):
    with pytest.raises(ValueError, match="limit"):
        load_prompts(_jsonl(tmp_path / "p.jsonl", ROWS), limit=0)


def test_an_empty_prompt_among_others_is_refused_by_its_row_number(tmp_path):
    """A row whose prompt is empty would decode from nothing but the start token: refused, counted from 1."""
    import json

    import pytest

    from data_gen.prompts import load_prompts

    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": text}) + "\n" for text in ("def f(x):", "", "import os")))
    with pytest.raises(ValueError, match="row 2 has an empty 'prompt'"):
        load_prompts(str(path))


def test_a_file_mixing_plain_and_chat_rows_is_refused(tmp_path):
    path = tmp_path / "mixed.jsonl"
    path.write_text(json.dumps({"prompt": "def f():"}) + "\n"
                    + json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    with pytest.raises(ValueError, match="row 2 is a chat row .* and row 1 a 'prompt' row"):
        load_prompts(path)


def test_a_folder_given_as_the_prompt_file_is_named_as_one(tmp_path):
    with pytest.raises(ValueError, match="is a folder; give a .jsonl"):
        load_prompts(tmp_path)
