"""The stdlib corpus: deterministic, filtered as documented, split by whole module."""

from __future__ import annotations

from pathlib import PurePosixPath

from data_gen import corpus


def test_corpus_is_sorted_deterministic_and_filtered():
    files = corpus.list_corpus()
    again = corpus.list_corpus()
    assert [f.relpath for f in files] == [f.relpath for f in again]
    assert [f.relpath for f in files] == sorted(f.relpath for f in files)
    assert len(files) > 100  # any CPython stdlib has hundreds of modules
    for f in files:
        parts = PurePosixPath(f.relpath).parts
        assert f.relpath.endswith(".py")
        assert not set(parts[:-1]) & corpus.EXCLUDED_DIRS, f.relpath
    relpaths = {f.relpath for f in files}
    assert "enum.py" in relpaths and "json/encoder.py" in relpaths
    assert not any(r.startswith(("test/", "idlelib/idle_test/", "lib2to3/tests/")) for r in relpaths)
    assert "encodings/cp1252.py" not in relpaths  # generated codec table


def test_heldout_split_is_stable_by_module_and_about_ten_percent():
    files = corpus.list_corpus()
    heldout = corpus.select_split(files, "heldout")
    assert 0.05 < len(heldout) / len(files) < 0.15
    for f in files:
        assert f.split == corpus.split_of(f.relpath)
        assert 0.0 <= corpus.heldout_score(f.relpath) < 1.0
    # The rule is a pure function of the path: pinned so a change to it is a visible, deliberate act.
    assert corpus.split_of("enum.py") == "heldout"
    assert corpus.split_of("typing.py") == "train"


def test_subset_keeps_both_splits_and_is_deterministic():
    files = corpus.list_corpus()
    small = corpus.subset(files, 3)
    assert small == corpus.subset(files, 3)
    assert len(corpus.select_split(small, "train")) == 3
    assert len(corpus.select_split(small, "heldout")) == 3
    summary = corpus.corpus_summary(small)
    assert summary["python_version"] == corpus.python_version()
    assert summary["files"] == {"train": 3, "heldout": 3}
