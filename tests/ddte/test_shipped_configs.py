"""Every shipped YAML under configs/ loads through its command's typed loader: a key renamed in a dataclass, or a
value a check refuses, fails here rather than on a user's machine. Nothing is run or loaded beyond the configs."""

from __future__ import annotations

from pathlib import Path

import pytest

from data_gen.config import load_collect_config
from ddte.pipeline import load_pipeline
from ddte.train_pair.config import load_config as load_pair_recipe
from distill.config import load_distill_config
from selector.acceptance.acceptance_train import load_acceptance_config
from selector.root.train_config import load_train_config

REPO = Path(__file__).resolve().parents[2]
LOADERS = {"collect": load_collect_config, "train": load_train_config, "distill": load_distill_config,
           "train-pair": load_pair_recipe, "acceptance": load_acceptance_config}


@pytest.mark.parametrize("path", sorted((REPO / "configs").glob("*/*.yaml")), ids=lambda p: f"{p.parent.name}/{p.name}")
def test_a_shipped_config_loads(path, tmp_path, monkeypatch):
    monkeypatch.chdir(REPO)  # configs name each other relative to the repository
    kind = path.parent.name
    if kind == "pipeline":
        plan = load_pipeline(path, [f"output={tmp_path / 'run'}"])
        assert plan.collect.output == str(tmp_path / "run" / "data")
    elif kind == "pair":
        from decode.pair import read_pair_config

        assert read_pair_config(path).target
    else:
        assert LOADERS[kind](path, []) is not None
