"""Shared fixtures: one synthetic data set and one tiny training run per session (the slow parts, done once)."""

from __future__ import annotations

from pathlib import Path

import pytest

from selector.synthetic import write_synthetic_dataset

TINY_CONFIG = Path(__file__).resolve().parents[2] / "configs" / "train" / "tiny.yaml"


@pytest.fixture(scope="session")
def synthetic_dir(tmp_path_factory) -> Path:
    """20 prompts x 12 roots, labels for specinfer, traversal and gbv (NaN on delayed trees), 18 actions."""
    return write_synthetic_dataset(tmp_path_factory.mktemp("data") / "synthetic", n_prompts=20, roots_per_prompt=12,
                                   seed=0, verifiers=("specinfer", "traversal", "gbv"))


@pytest.fixture(scope="session")
def tracking_uri(tmp_path_factory) -> str:
    return f"sqlite:///{tmp_path_factory.mktemp('mlflow') / 'mlflow.db'}"


@pytest.fixture(scope="session")
def trained(synthetic_dir, tracking_uri, tmp_path_factory):
    """One tiny training run (with baselines) on the synthetic set; returns its TrainResult."""
    from selector.train import train_selector

    out = tmp_path_factory.mktemp("runs")
    return train_selector(TINY_CONFIG, [f"data.data_dir={synthetic_dir}", f"run.output_dir={out}",
                                        f"run.tracking_uri={tracking_uri}", "run.baselines=true"], verbose=False)
