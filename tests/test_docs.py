"""The README and docs/ stay small enough to read, and every results file they cite exists."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README_MAX_BYTES = 16 * 1024
DOCS_MAX_BYTES = 120 * 1024
RESULTS_PATH = re.compile(r"results/[^\s`)\]]+")


def _docs() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def test_readme_and_docs_fit_their_budgets():
    readme = (ROOT / "README.md").stat().st_size
    docs = sum(path.stat().st_size for path in (ROOT / "docs").glob("*.md"))
    assert readme <= README_MAX_BYTES, f"README.md is {readme} bytes, over {README_MAX_BYTES}"
    assert docs <= DOCS_MAX_BYTES, f"docs/*.md total {docs} bytes, over {DOCS_MAX_BYTES}"


def test_every_cited_results_path_exists():
    missing = []
    for doc in _docs():
        for match in RESULTS_PATH.finditer(doc.read_text(encoding="utf-8")):
            cited = match.group(0).rstrip(".,;:'\"")
            if not (ROOT / cited).exists():
                missing.append(f"{doc.relative_to(ROOT)}: {cited}")
    assert not missing, "cited results paths that do not exist:\n" + "\n".join(missing)
