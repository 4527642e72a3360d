"""ddte_core/paths.py: shipped configs resolve from any working folder."""

from __future__ import annotations

from pathlib import Path


def test_shipped_configs_resolve_from_any_working_folder(tmp_path, monkeypatch):
    """A shipped config path, and the pair named inside it, resolve under ddte's own folder wherever the command
    runs; a file of the same relative path in the working folder wins."""
    from data_gen.config import load_collect_config
    from ddte_core.paths import INSTALL_ROOT, bundled
    from decode.pair_spec import resolve_pair_path

    monkeypatch.chdir(tmp_path)
    config = load_collect_config("configs/collect/default.yaml")
    assert resolve_pair_path(config.pair) == INSTALL_ROOT / "configs" / "pair" / "shipped.yaml"
    assert bundled("configs/pipeline/default.yaml") == INSTALL_ROOT / "configs" / "pipeline" / "default.yaml"
    own = tmp_path / "configs" / "collect" / "default.yaml"
    own.parent.mkdir(parents=True)
    own.write_text("pair: smollm2\n", encoding="utf-8")
    assert bundled("configs/collect/default.yaml") == Path("configs/collect/default.yaml")
    assert load_collect_config("configs/collect/default.yaml").pair == "smollm2"
    assert bundled("no/such/file.yaml") == Path("no/such/file.yaml")  # reported as missing by its reader


def test_a_deprecation_warned_from_our_own_code_fails_the_suite():
    """pyproject's filterwarnings: a DeprecationWarning or FutureWarning issued from a ddte package is an error in
    the suite; one issued from a third-party module stays a warning."""
    import warnings

    import pytest

    source = compile("import warnings\nwarnings.warn('old', DeprecationWarning)", "<ddte code>", "exec")
    with pytest.raises(DeprecationWarning):
        exec(source, {"__name__": "decode.drafting.rng"})
    with pytest.raises(FutureWarning):
        exec(compile("import warnings\nwarnings.warn('soon', FutureWarning)", "<x>", "exec"),
             {"__name__": "selector.root.train"})
    with warnings.catch_warnings(record=True) as seen:
        exec(source, {"__name__": "transformers.modeling_utils"})
    assert [w.category for w in seen] == [DeprecationWarning]
