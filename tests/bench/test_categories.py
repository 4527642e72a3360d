"""Per prompt category: each bench row's prompts grouped by their category, with AR's row of the same category and
temperature as the speedup's base; categories read from a mixed prompt set or a JSONL file's rows."""

from __future__ import annotations

import json

import pytest

from bench.decoding import bench_prompt_categories, category_rows
from bench.display import format_category_table
from data_gen.chat_prompts import shared_data_dir


def _prompt(i: int, tokens: int, seconds: float, passes: int) -> dict:
    return {"prompt": i, "repeat": 0, "new_tokens": tokens, "wall_seconds": seconds, "target_passes": passes,
            "decode_tokens": tokens - 1, "decode_seconds": seconds - 0.5}


def test_rows_are_split_by_category_with_ar_of_the_same_category_as_base():
    rows = [{"method": "ar", "temperature": 1.0, "per_prompt": [_prompt(0, 10, 10.0, 10), _prompt(1, 10, 5.0, 10)]},
            {"method": "traversal@1,2,0", "temperature": 1.0,
             "per_prompt": [_prompt(0, 10, 5.0, 4), _prompt(1, 10, 10.0, 8)]}]
    out = {(r["category"], r["method"]): r for r in category_rows(rows, ["coding", "writing"])}
    assert out["coding", "ar"]["tokens_per_s"] == 1.0 and out["writing", "ar"]["tokens_per_s"] == 2.0
    assert out["coding", "traversal@1,2,0"]["speedup"] == 2.0 and out["writing", "traversal@1,2,0"]["speedup"] == 0.5
    assert out["coding", "traversal@1,2,0"]["mean_acceptance_length"] == 2.5
    table = format_category_table(list(out.values()))
    assert "| 1.0 | coding | 1 | traversal@1,2,0 | 2.00 |" in table


def test_categories_come_from_files_whose_rows_have_them(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text("\n".join(json.dumps({"prompt": "x", "category": c}) for c in ("math", "qa", "rag")) + "\n")
    assert bench_prompt_categories(str(path), 2, skip=1) == ["qa", "rag"]
    bare = tmp_path / "bare.jsonl"
    bare.write_text(json.dumps({"prompt": "x"}) + "\n")
    assert bench_prompt_categories(str(bare), 1) is None and bench_prompt_categories("builtin:heldout", 3) is None


@pytest.mark.skipif(not shared_data_dir().is_dir(), reason="../shared/data is not beside the checkout")
def test_the_mixed_sets_name_each_prompt_s_category():
    categories = bench_prompt_categories(None, 13, default="mixed:heldout")
    assert len(set(categories)) == 13
